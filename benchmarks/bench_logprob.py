"""Benchmark of the restricted log-prob ops against the dense paths (issue 2, Part 3), forward + backward.

    python benchmarks/bench_logprob.py [--quick] [--reps N] [--json PATH]
    python benchmarks/bench_logprob.py --sweep [--reps N] [--json PATH]   # mask on / mask off by set size

Shapes (full): T=4096 rows, H=576, V=49152 (SmolLM2-135M's head), candidate sets of log-normal size with median 2
and mean about 8, every row restricted (response rows); keep_mask on 16384 rows x 75968 vocab. Cases:
  (a) dense       slime's path: full logits, dense bool keep mask, masked_fill, log_softmax, gather
  (b) unrestr.    the unrestricted full-vocab log_softmax + gather
  (c) ours        candidate_head_logprobs (from hidden + weight) / token_logprobs (from the same logits)
each in two groups: "head" (logits formed from hidden @ weight.T inside the timed region, gradients to hidden and
weight) and "logits" (a logits leaf given, gradient to it). keep_mask is compared with a per-row Python loop that
fills the same mask (both allocate and fill the whole output); "zeros floor" only allocates and zeroes a mask of
that shape (1.2 GB), the memory-bound part no builder avoids on a CPU. For scale, sampling_candidates (top_p=0.95) is
timed against one decode step of a sort-based torch sampler on [64, V] logits.

--sweep times candidate_head_logprobs with every row restricted to sets of one size (random ids plus the token)
against the same call with cands=None (the unrestricted path, "mask off"), fwd + bwd, at the tiny model's head
(T=1024, H=128, V=128) and SmolLM2-135M's (T=512, H=576, V=49152), on and off interleaved in every repetition;
it reports the median of the per-repetition ratios (target: <= 1.05 at every size).

Every case runs in a fresh subprocess (--quick: in-process) with the inputs built first; peak memory is the
growth of the peak RSS over the RSS after setup (the peak is reset through /proc/self/clear_refs), time the
median over --reps repetitions. Timings on a shared machine are noisy: compare ratios from one run. On an
oversubscribed machine spinning OpenMP workers stall small ops, so the script sets OMP_WAIT_POLICY=passive
(unless already set) for every case; --threads 1 is the other way out.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Before torch loads OpenMP: idle OpenMP workers sleep instead of spinning. On a shared, oversubscribed machine
# spinning threads stall every parallel op (the same case varied 0.8-3.6 s with spinning, 0.13-0.16 s without);
# it applies to every case alike. Override by setting OMP_WAIT_POLICY yourself.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import torch  # noqa: E402

from topp_rl.ops import (  # noqa: E402
    Candidates,
    candidate_head_logprobs,
    keep_mask,
    sampling_candidates,
    token_logprobs,
)

SHAPES = {
    "full": dict(rows=4096, hidden=576, vocab=49152, mask_rows=16384, mask_vocab=75968, decode_batch=64),
    "quick": dict(rows=256, hidden=64, vocab=4096, mask_rows=1024, mask_vocab=8192, decode_batch=8),
}
TEMPERATURE = 0.9


def candidate_sets(num_rows: int, vocab: int, tokens: torch.Tensor, *, seed: int) -> Candidates:
    """Log-normal set sizes (median 2, mean ~8, at most 4096), each set holding its row's token."""
    g = torch.Generator().manual_seed(seed)
    sigma = math.sqrt(2 * math.log(4.0))  # mean / median = exp(sigma^2 / 2) = 4
    sizes = (
        torch.exp(math.log(2.0) + sigma * torch.randn(num_rows, generator=g)).round().clamp(1, 4096).long()
    )
    ids = torch.randint(0, vocab, (int(sizes.sum()),), generator=g)
    offsets = torch.zeros(num_rows + 1, dtype=torch.int64)
    torch.cumsum(sizes, 0, out=offsets[1:])
    ids[offsets[:-1]] = tokens  # first id of every row is the sampled token
    return Candidates(ids=ids.to(torch.int32), offsets=offsets.to(torch.int32))


def head_inputs(shape: dict) -> dict:
    g = torch.Generator().manual_seed(0)
    t, h, v = shape["rows"], shape["hidden"], shape["vocab"]
    hidden = (torch.randn(t, h, generator=g) * 0.5).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.1).requires_grad_()
    tokens = torch.randint(0, v, (t,), generator=g)
    cands = candidate_sets(t, v, tokens, seed=1)
    return dict(hidden=hidden, weight=weight, tokens=tokens, cands=cands, rows=torch.arange(t))


def logits_inputs(shape: dict) -> dict:
    inp = head_inputs(shape)
    with torch.no_grad():
        logits = inp["hidden"] @ inp["weight"].T
    return dict(inp, logits=logits.requires_grad_())


def dense_logprobs(logits: torch.Tensor, inp: dict) -> torch.Tensor:
    """slime's path: dense bool keep mask (built vectorised here), masked_fill, log_softmax, gather."""
    num_rows, vocab = logits.shape
    cands = inp["cands"]
    mask = torch.zeros(num_rows, vocab, dtype=torch.bool)
    mask[inp["rows"][cands.row_of_ids()], cands.ids.long()] = True
    mask[torch.arange(num_rows), inp["tokens"]] = True
    z = (logits / TEMPERATURE).masked_fill(~mask, float("-inf"))
    return torch.log_softmax(z, dim=-1).gather(1, inp["tokens"][:, None]).squeeze(1)


def unrestricted_logprobs(logits: torch.Tensor, inp: dict) -> torch.Tensor:
    return torch.log_softmax(logits / TEMPERATURE, dim=-1).gather(1, inp["tokens"][:, None]).squeeze(1)


def _backward(out: torch.Tensor, *leaves: torch.Tensor) -> None:
    out.sum().backward()
    for leaf in leaves:
        leaf.grad = None


def run_head_dense(inp):
    _backward(dense_logprobs(inp["hidden"] @ inp["weight"].T, inp), inp["hidden"], inp["weight"])


def run_head_unrestricted(inp):
    _backward(unrestricted_logprobs(inp["hidden"] @ inp["weight"].T, inp), inp["hidden"], inp["weight"])


def run_head_ours(inp):
    out = candidate_head_logprobs(
        inp["hidden"],
        inp["weight"],
        inp["tokens"],
        cands=inp["cands"],
        rows=inp["rows"],
        temperature=TEMPERATURE,
    )
    _backward(out, inp["hidden"], inp["weight"])


def run_logits_dense(inp):
    _backward(dense_logprobs(inp["logits"], inp), inp["logits"])


def run_logits_unrestricted(inp):
    _backward(unrestricted_logprobs(inp["logits"], inp), inp["logits"])


def run_logits_ours(inp):
    out = token_logprobs(
        inp["logits"], inp["tokens"], cands=inp["cands"], rows=inp["rows"], temperature=TEMPERATURE
    )
    _backward(out, inp["logits"])


def mask_inputs(shape: dict) -> dict:
    g = torch.Generator().manual_seed(2)
    n, v = shape["mask_rows"], shape["mask_vocab"]
    tokens = torch.randint(0, v, (n,), generator=g)
    cands = candidate_sets(n, v, tokens, seed=3)
    return dict(cands=cands, rows=torch.arange(n), tokens=tokens, vocab=v, lists=cands.to_lists())


def run_mask_loop(inp):
    """The per-row loop: every listed row cleared, then its candidate ids and token set."""
    n, v = inp["rows"].numel(), inp["vocab"]
    mask = torch.ones(n, v, dtype=torch.bool)
    tokens = inp["tokens"].tolist()
    for r, ids in zip(inp["rows"].tolist(), inp["lists"], strict=True):
        row = mask[r]
        row.fill_(False)
        row[ids] = True
        row[tokens[r]] = True
    return mask


def run_mask_floor(inp):
    """Only allocating and zeroing the output: the memory-bound floor both mask builders pay."""
    return torch.zeros(inp["rows"].numel(), inp["vocab"], dtype=torch.bool)


def run_mask_ours(inp):
    n, v = inp["rows"].numel(), inp["vocab"]
    return keep_mask(inp["cands"], inp["rows"], num_rows=n, vocab_start=0, vocab_end=v, tokens=inp["tokens"])


def sampling_inputs(shape: dict) -> dict:
    """Decode-step logits shaped like an LM's: unit noise plus 16 boosted tokens per row, so that top_p=0.95 at
    T=0.9 keeps sets of median ~3 and mean ~8 (as recorded sets are), with a few wide rows."""
    g = torch.Generator().manual_seed(4)
    n, v, k = shape["decode_batch"], shape["vocab"], 16
    logits = torch.randn(n, v, generator=g)
    boost = torch.rand(n, k, generator=g) * torch.linspace(14, 2, k) + 8 + 2 * torch.randn(n, 1, generator=g)
    return dict(logits=logits.scatter_add_(1, torch.randint(0, v, (n, k), generator=g), boost))


def run_sampler_step(inp):
    """One decode step of a sort-based torch sampler (SGLang's torch path): the cost recording rides on."""
    probs = torch.softmax(inp["logits"] / TEMPERATURE, dim=-1)
    p_sort, idx = probs.sort(dim=-1, descending=True)
    p_sort[(p_sort.cumsum(dim=-1) - p_sort) > 0.95] = 0.0
    return idx.gather(1, torch.multinomial(p_sort, 1))


def run_sampling_candidates(inp):
    return sampling_candidates(inp["logits"], temperature=TEMPERATURE, top_p=0.95)


# name -> (group, role, setup, run)
CASES = {
    "head/dense (a)": ("head", "a", head_inputs, run_head_dense),
    "head/unrestricted (b)": ("head", "b", head_inputs, run_head_unrestricted),
    "head/candidate_head_logprobs (c)": ("head", "c", head_inputs, run_head_ours),
    "logits/dense (a)": ("logits", "a", logits_inputs, run_logits_dense),
    "logits/unrestricted (b)": ("logits", "b", logits_inputs, run_logits_unrestricted),
    "logits/token_logprobs (c)": ("logits", "c", logits_inputs, run_logits_ours),
    "keep_mask/python loop": ("keep_mask", "a", mask_inputs, run_mask_loop),
    "keep_mask/keep_mask": ("keep_mask", "c", mask_inputs, run_mask_ours),
    "keep_mask/zeros floor": ("keep_mask", "floor", mask_inputs, run_mask_floor),
    "sampling/torch sampler step": ("sampling", "a", sampling_inputs, run_sampler_step),
    "sampling/sampling_candidates": ("sampling", "c", sampling_inputs, run_sampling_candidates),
}


# each group's ratios are times relative to this case
RATIO_BASE = {
    "head": "head/unrestricted (b)",
    "logits": "logits/unrestricted (b)",
    "keep_mask": "keep_mask/python loop",
    "sampling": "sampling/torch sampler step",
}


SWEEP = {
    "tiny": dict(rows=1024, hidden=128, vocab=128, sizes=(1, 2, 4, 8, 16, 32, 64, 110, 128)),
    "smollm2": dict(rows=512, hidden=576, vocab=49152, sizes=(1, 8, 64, 512, 1536, 4096, 16384, 49152)),
}


def fixed_size_sets(num_rows: int, vocab: int, size: int, tokens: torch.Tensor, *, seed: int) -> Candidates:
    """Every row: `size` distinct random ids, the first one its token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(num_rows, vocab, generator=g).argsort(dim=1)[:, :size]
    hit = (ids == tokens[:, None]).any(dim=1)
    ids[~hit, 0] = tokens[~hit]
    return Candidates(ids=ids.flatten().to(torch.int32), offsets=(torch.arange(num_rows + 1) * size).to(torch.int32))


def sweep(reps: int, *, shapes: list[str] | None = None, min_size: int = 1) -> list[dict]:
    """Median over `reps` of time(mask on) / time(mask off), interleaved, per head shape and set size
    (`shapes`: a subset of SWEEP's names; sizes below `min_size` skipped)."""
    rows = []
    for name, sh in SWEEP.items():
        if shapes and name not in shapes:
            continue
        g = torch.Generator().manual_seed(0)
        hidden = (torch.randn(sh["rows"], sh["hidden"], generator=g) * 0.5).requires_grad_()
        weight = (torch.randn(sh["vocab"], sh["hidden"], generator=g) * 0.1).requires_grad_()
        tokens = torch.randint(0, sh["vocab"], (sh["rows"],), generator=g)
        timed = functools.partial(_timed_head, hidden, weight, tokens)

        for size in (s for s in sh["sizes"] if s >= min_size):
            cands = fixed_size_sets(sh["rows"], sh["vocab"], size, tokens, seed=size)
            timed(cands), timed(None)  # warm-up
            on, off = [], []
            for _ in range(reps):
                on.append(timed(cands))
                off.append(timed(None))
            ratio = statistics.median(a / b for a, b in zip(on, off, strict=True))
            rows.append(dict(shape=name, **{k: sh[k] for k in ("rows", "hidden", "vocab")}, size=size,
                             on_ms=statistics.median(on), off_ms=statistics.median(off), on_over_off=ratio))
            print(f"{name:8s} set size {size:6d}: on {rows[-1]['on_ms']:9.1f} ms  off {rows[-1]['off_ms']:9.1f} ms"
                  f"  on/off {ratio:5.2f}  {'met' if ratio <= 1.05 else 'NOT met'} (<= 1.05)", flush=True)
    return rows


def _timed_head(hidden, weight, tokens, cands) -> float:
    """Milliseconds of one candidate_head_logprobs forward + backward (every row restricted, or none)."""
    start = time.perf_counter()
    rows = None if cands is None else torch.arange(hidden.shape[0])
    out = candidate_head_logprobs(hidden, weight, tokens, cands=cands, rows=rows, temperature=TEMPERATURE)
    _backward(out, hidden, weight)
    return (time.perf_counter() - start) * 1e3


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (peak RSS) to the current RSS
        return True
    except OSError:
        return False


def measure(name: str, shape: dict, reps: int) -> dict:
    """Median ms over `reps` and the peak RSS growth (MB) of the first repetition, after building the inputs."""
    _, _, setup, run = CASES[name]
    inp = setup(shape)
    base_kb = _status_kb("VmRSS")
    exact_peak = _reset_peak()
    times = []
    peak_mb = None
    for _ in range(reps):
        start = time.perf_counter()
        result = run(inp)
        times.append((time.perf_counter() - start) * 1e3)
        del result
        if peak_mb is None:
            peak_mb = max(0.0, (_status_kb("VmHWM") - base_kb) / 1024)
    return dict(name=name, ms=statistics.median(times), ms_all=times, peak_mb=peak_mb, peak_exact=exact_peak)


def _run_case(name: str, shape_name: str, reps: int, in_process: bool) -> dict:
    if in_process:
        return measure(name, SHAPES[shape_name], reps)
    cmd = [sys.executable, __file__, "--case", name, "--shape", shape_name, "--reps", str(reps)]
    cmd += ["--threads", str(torch.get_num_threads())]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"case {name!r} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _targets(by_name: dict) -> list[dict]:
    def t(name):
        return by_name[name]["ms"]

    def m(name):
        return by_name[name]["peak_mb"]

    head_c, logit_c = "head/candidate_head_logprobs (c)", "logits/token_logprobs (c)"
    return [
        dict(
            name="head: speed-up of (c) over dense (a)", value=t("head/dense (a)") / t(head_c), target=">= 10"
        ),
        dict(
            name="head: peak-memory cut of (c) vs dense (a)",
            value=m("head/dense (a)") / max(m(head_c), 1.0),
            target=">= 10",
        ),
        dict(
            name="head: speed-up of (c) over unrestricted (b)",
            value=t("head/unrestricted (b)") / t(head_c),
            target="> 1",
        ),
        dict(
            name="logits: time of (c) / unrestricted (b)",
            value=t(logit_c) / t("logits/unrestricted (b)"),
            target="<= 1.3",
        ),
        dict(
            name="keep_mask: speed-up over the Python loop",
            value=t("keep_mask/python loop") / t("keep_mask/keep_mask"),
            target=">= 50",
        ),
    ]


def _meets(value: float, target: str) -> bool:
    op, bound = target.split()
    return {">=": value >= float(bound), ">": value > float(bound), "<=": value <= float(bound)}[op]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small shapes, in-process: a smoke run")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per case (default 3, quick 1)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads in every case (default: torch's)"
    )
    parser.add_argument("--sweep", action="store_true", help="mask on / mask off of the head by set size")
    parser.add_argument(
        "--sweep-shapes", default=None, help=f"comma-separated subset of {sorted(SWEEP)} (default: all)"
    )
    parser.add_argument("--sweep-min-size", type=int, default=1, help="skip sweep set sizes below this")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--shape", default="full", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.case:  # child process: one case, one JSON line
        print(json.dumps(measure(args.case, SHAPES[args.shape], args.reps or 3)))
        return []
    if args.sweep:
        shapes = args.sweep_shapes.split(",") if args.sweep_shapes else None
        unknown = sorted(set(shapes or []) - set(SWEEP))
        if unknown:
            parser.error(f"--sweep-shapes {unknown} unknown; choose from {sorted(SWEEP)}")
        rows = sweep(args.reps or 7, shapes=shapes, min_size=args.sweep_min_size)
        if args.json:
            args.json.write_text(json.dumps(dict(sweep=rows, threads=torch.get_num_threads()), indent=1))
        return rows
    shape_name = "quick" if args.quick else "full"
    reps = args.reps or (1 if args.quick else 3)
    results = [_run_case(name, shape_name, reps, in_process=args.quick) for name in CASES]
    by_name = {r["name"]: r for r in results}
    for r in results:
        r["ratio_to"] = RATIO_BASE[CASES[r["name"]][0]]
        r["ratio"] = r["ms"] / by_name[r["ratio_to"]]["ms"]
    targets = _targets(by_name)
    for tg in targets:
        tg["met"] = _meets(tg["value"], tg["target"])
    omp = os.environ.get("OMP_WAIT_POLICY")
    print(
        f"shape={shape_name} {SHAPES[shape_name]} reps={reps} threads={torch.get_num_threads()} OMP_WAIT_POLICY={omp}"
    )
    print(f"{'case':36s} {'ms':>10s} {'peak MB':>9s} {'ratio':>7s}  (ratio = ms / ms of)")
    for r in results:
        print(f"{r['name']:36s} {r['ms']:10.1f} {r['peak_mb']:9.1f} {r['ratio']:7.3f}  {r['ratio_to']}")
    for tg in targets:
        print(
            f"{tg['name']:48s} {tg['value']:8.2f}  target {tg['target']:7s} {'met' if tg['met'] else 'NOT met'}"
        )
    if args.json:
        args.json.write_text(
            json.dumps(dict(shape=shape_name, reps=reps, cases=results, targets=targets), indent=1)
        )
    return results


if __name__ == "__main__":
    main()
