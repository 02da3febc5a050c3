"""One-command demo: a rollout against a real SGLang server, printing the recorded candidate sets and log-probs.

    .venv/bin/python scripts/rollout_sglang.py                      # tiny random Qwen2 + char tokenizer
    .venv/bin/python scripts/rollout_sglang.py --top-p 0.8 --top-k 20 --n 2
    .venv/bin/python scripts/rollout_sglang.py --model-path DIR     # any local HF checkpoint dir with a tokenizer
    .venv/bin/python scripts/rollout_sglang.py --url http://127.0.0.1:30000 --model-path DIR   # a running server
    .venv/bin/python scripts/rollout_sglang.py --bench              # tokens/s at batch 16 (benchmark figure)

Builds the SGLang venv first when it is missing (scripts/setup_sglang.sh, a few minutes once), starts the server
on 127.0.0.1 and a free port, and stops it (whole process group) on exit.
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from sglang_bench import sglang_tokens_per_s  # noqa: E402

from topp_rl.data import SamplingParams, number_samples  # noqa: E402
from topp_rl.engines.sglang import SGLangEngine  # noqa: E402
from topp_rl.engines.sglang.server import SGLANG_PYTHON_ENV, sglang_python  # noqa: E402
from topp_rl.models import build_char_tokenizer, build_tiny_model, load_hf, save_model  # noqa: E402

PROMPTS = ["12+7=", "3*4=", "what is 9-5? "]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", type=Path, help="local HF checkpoint dir (default: a tiny random Qwen2)")
    ap.add_argument("--url", action="append", help="use running server(s) instead of launching one")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--n", type=int, default=1)
    ap.add_argument("--show", type=int, default=8, help="candidate ids to print per token")
    ap.add_argument("--bench", action="store_true", help="measure tokens/s at batch 16 instead")
    args = ap.parse_args()

    if not args.url and sglang_python() is None:
        print("[rollout_sglang] building the SGLang venv if needed (scripts/setup_sglang.sh) ...", flush=True)
        done = subprocess.run(
            ["bash", str(ROOT / "scripts" / "setup_sglang.sh")], check=True, stdout=subprocess.PIPE, text=True
        )
        os.environ[SGLANG_PYTHON_ENV] = done.stdout.strip()  # the script prints the venv's python

    with tempfile.TemporaryDirectory(prefix="topp_rl-demo-") as tmp:
        if args.model_path is None:
            tokenizer = build_char_tokenizer()
            # The benchmark uses the shape of NOTES-ENV's figures (vocab 4096); the demo the tokenizer's vocab.
            vocab = 4096 if args.bench else len(tokenizer)
            model = build_tiny_model("qwen2", vocab_size=vocab, hidden=128, layers=2, tokenizer=tokenizer,
                                     tie_embeddings=False, initializer_range=0.3)  # fmt: skip
            model_path = save_model(model, tokenizer, tmp)
        else:
            model_path = args.model_path
            _, tokenizer = load_hf(model_path)
        if args.bench:
            result = sglang_tokens_per_s(model_path=model_path, batch=16, prompt_len=32, new_tokens=64)
            print(f"SGLang CPU server, batch 16, 64 new tokens: {result['tokens_per_s']:.1f} tokens/s "
                  f"(reps {[round(r, 1) for r in result['reps']]})")  # fmt: skip
            return
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                min_p=args.min_p, max_new_tokens=args.max_new_tokens, n=args.n)  # fmt: skip
        with SGLangEngine(urls=args.url, model_path=model_path) as engine:
            wire = (
                "compact base64 (patched server)"
                if engine.patched
                else "nested JSON lists (unpatched server)"
            )
            print(f"server {engine.urls}  vocab {engine.vocab_size}  candidate wire format: {wire}")
            prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
            for s in number_samples(engine.generate(prompts, params), prompts=len(prompts), n=params.n):
                _print_sample(s, tokenizer, show=args.show)


def _print_sample(s, tokenizer, *, show: int) -> None:
    print(f"\nsample {s.index} (prompt {s.group_index}) {s.status.value}: "
          f"{tokenizer.decode(s.prompt_ids)!r} -> {tokenizer.decode(s.response_ids)!r}")  # fmt: skip
    print(f"  {'pos':>3} {'token':>7} {'logp(kept)':>10} {'logp(raw)':>10} {'|set|':>5}  candidates")
    for i, tok in enumerate(s.response_ids):
        raw = s.rollout_raw_log_probs[i] if s.rollout_raw_log_probs else float("nan")
        if s.candidates is None:
            size, shown = "all", "(untruncated: whole vocabulary)"
        else:
            row = s.candidates.ids[s.candidates.offsets[i] : s.candidates.offsets[i + 1]].tolist()
            size = str(len(row))
            shown = " ".join(f"{t}:{tokenizer.decode([t])!r}" for t in row[:show]) + (
                " ..." if len(row) > show else ""
            )
        print(f"  {i:>3} {tok:>7} {s.rollout_log_probs[i]:>10.4f} {raw:>10.4f} {size:>5}  {shown}")


if __name__ == "__main__":
    main()
