"""The per-decode-step sampler alone: `EmbeddedEngine._sample` (kept sets + the draw), no model, 1 thread.

Cases: near-uniform and peaky logits at V = 128 (TRL's tiny config), SmolLM2-like logits at V = 49152, over
top_p / top_k / min_p. `--baseline REV` loads `topp_rl/ops/sampling.py` and `topp_rl/engines/embedded.py` as
they were at git revision REV and times them interleaved with the working tree (A/B, medians); it also
checks that both give the same sets and tokens (and the largest log-prob difference).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_sampler.py [--baseline HEAD] [--reps 7] [--steps 20]
"""

import argparse
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace

import torch

from topp_rl.data.params import SamplingParams
from topp_rl.engines.embedded import EmbeddedEngine

ROOT = Path(__file__).resolve().parents[1]


def _logits(kind: str, batch: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":  # tiny random model (init range 0.02): logits within ~0.1 of each other
        return torch.randn(batch, vocab, generator=g) * 0.05
    if kind == "peaky":
        return torch.randn(batch, vocab, generator=g) * 3
    # SmolLM2-like: a Zipf-shaped head over a random permutation, kept sets of ~100-1300 ids at top_p 0.9
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    scale = torch.empty(batch, 1).uniform_(1.25, 1.5, generator=g)
    z = -scale * ranks.log()[None, :] + torch.randn(batch, vocab, generator=g) * 0.3
    perm = torch.argsort(torch.rand(batch, vocab, generator=g), dim=-1)
    return torch.empty_like(z).scatter_(1, perm, z)


CASES = [
    ("uniform", 128, dict(top_p=0.9)),
    ("uniform", 128, dict(top_p=0.95, top_k=50)),
    ("uniform", 128, dict(top_p=1.0, top_k=50)),
    ("uniform", 128, dict(top_p=0.9, min_p=0.05)),
    ("peaky", 128, dict(top_p=0.9)),
    ("peaky", 128, dict(top_p=1.0, top_k=50)),
    ("uniform", 256, dict(top_p=0.9)),
    ("uniform", 1024, dict(top_p=0.9)),
    ("peaky", 1024, dict(top_p=0.9)),
    ("smollm2", 49152, dict(top_p=0.9)),
    ("smollm2", 49152, dict(top_p=0.95, top_k=50)),
    ("smollm2", 49152, dict(top_p=0.95, min_p=0.01)),
]


def sampler_at(rev: str) -> types.FunctionType:
    """`EmbeddedEngine._sample` with `sampling_candidates`, the draw and the engine as they were at `rev` (each
    module's imports of the others redirected to the `rev` copies, so no arm runs working-tree sampling code)."""
    mods = {}
    for name in ("sampling", "draw", "embedded"):
        path = f"topp_rl/ops/{name}.py" if name != "embedded" else "topp_rl/engines/embedded.py"
        run = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True)
        if run.returncode:  # a revision before this module existed
            continue
        src = run.stdout
        for other in mods:
            src = src.replace(f"from topp_rl.ops.{other} import".encode(), f"from _baseline_{other} import".encode())
        src = src.replace(b"from topp_rl.ops import Candidates, sampling_candidates",
                          b"from topp_rl.ops import Candidates\nfrom _baseline_sampling import sampling_candidates")
        mod = types.ModuleType(f"_baseline_{name}")
        mod.__file__ = str(ROOT / path)
        sys.modules[mod.__name__] = mod
        exec(compile(src, mod.__file__, "exec"), mod.__dict__)
        mods[name] = mod
    return mods["embedded"].EmbeddedEngine._sample


def _time(fn, logits, params, steps: int) -> float:
    """Median-free mean seconds per call over `steps` calls (one decode step each)."""
    engine = SimpleNamespace(record_raw_log_probs=False)
    gen = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for i in range(steps):
        fn(engine, logits[i % len(logits)], params, gen, record=True)
    return (time.perf_counter() - start) / steps


def _compare(fn_a, fn_b, logits, params) -> tuple[bool, float]:
    """(same sets and tokens, max |log-prob difference|) of two samplers on the same logits and seed."""
    engine = SimpleNamespace(record_raw_log_probs=False)
    a = fn_a(engine, logits, params, torch.Generator().manual_seed(5), record=True)
    b = fn_b(engine, logits, params, torch.Generator().manual_seed(5), record=True)
    same = torch.equal(a[0], b[0]) and torch.equal(a[3].ids, b[3].ids) and torch.equal(a[3].offsets, b[3].offsets)
    return same, float((a[1] - b[1]).abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default=None, help="git revision to compare with (A/B, interleaved)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed per rep")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    arms = {"new": EmbeddedEngine._sample}
    if args.baseline:
        arms = {"old": sampler_at(args.baseline), **arms}
    print(f"{'case':<44} {'set':>6} " + " ".join(f"{a + ' us':>10}" for a in arms) + ("   new/old  same   |dlp|" if
          args.baseline else ""))
    with torch.no_grad():
        for kind, vocab, kw in CASES:
            logits = [_logits(kind, args.batch, vocab, seed) for seed in range(4)]
            params = SamplingParams(max_new_tokens=1, **kw)
            cands = EmbeddedEngine._sample(SimpleNamespace(record_raw_log_probs=False), logits[0], params,
                                           torch.Generator(), record=True)[3]
            mean_set = cands.ids.numel() / cands.num_rows
            for fn in arms.values():
                _time(fn, logits, params, 3)  # warm-up
            times = {a: [] for a in arms}
            for _ in range(args.reps):
                for a, fn in arms.items():
                    times[a].append(_time(fn, logits, params, args.steps))
            med = {a: statistics.median(t) * 1e6 for a, t in times.items()}
            label = f"{kind} V={vocab} " + ",".join(f"{k}={v}" for k, v in kw.items())
            line = f"{label:<44} {mean_set:>6.0f} " + " ".join(f"{med[a]:>10.0f}" for a in arms)
            if args.baseline:
                checks = [_compare(arms["old"], arms["new"], lg, params) for lg in logits]
                same, dlp = all(c[0] for c in checks), max(c[1] for c in checks)
                line += f"   {med['new'] / med['old']:>7.2f}  {same!s:<5} {dlp:.1e}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
