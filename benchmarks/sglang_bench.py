"""Throughput of a real SGLang CPU server through `SGLangEngine`, for `benchmarks/bench_rollout.py` and
`scripts/rollout_sglang.py --bench` (both put `benchmarks/` on sys.path).

Generated tokens per second of wall time for a batch of prompts sent at once (the server batches them
continuously), median over repetitions after one warm-up call; EOS is ignored so every sample generates exactly
`new_tokens`. Candidate recording is on (the patched compact wire format when available), so the figure is what
a rollout step costs, mask transfer included.
"""

import statistics
import time
from pathlib import Path

import torch

from topp_rl.data.params import SamplingParams
from topp_rl.engines.sglang import SGLangEngine


def sglang_tokens_per_s(
    *,
    model_path: str | Path,
    batch: int = 16,
    prompt_len: int = 32,
    new_tokens: int = 64,
    top_p: float = 0.9,
    top_k: int = 0,
    reps: int = 3,
    seed: int = 0,
) -> dict[str, float | list[float]]:
    """Median generated tokens/s at `batch` concurrent prompts on a server it launches (and stops) on
    `model_path`. Returns {"tokens_per_s", "reps", "batch", "new_tokens"}."""
    if batch < 1 or reps < 1 or new_tokens < 1 or prompt_len < 1:
        raise ValueError(
            f"batch ({batch}), reps ({reps}), new_tokens ({new_tokens}), prompt_len ({prompt_len}) must all be >= 1"
        )
    # ignore_eos: every sample runs to new_tokens.
    with SGLangEngine(
        model_path=model_path, progress=False, extra_sampling_params={"ignore_eos": True}
    ) as engine:
        gen = torch.Generator().manual_seed(seed)
        # Distinct prompts, so the radix cache cannot share prefills between them.
        prompts = torch.randint(3, engine.vocab_size, (batch, prompt_len), generator=gen).tolist()
        params = SamplingParams(top_p=top_p, top_k=top_k, max_new_tokens=new_tokens)
        engine.generate(prompts[:2], SamplingParams(top_p=top_p, max_new_tokens=4))  # warm-up
        rates = []
        for _ in range(reps):
            start = time.perf_counter()
            samples = engine.generate(prompts, params)
            rates.append(sum(s.response_length for s in samples) / (time.perf_counter() - start))
    return {"tokens_per_s": statistics.median(rates), "reps": rates, "batch": batch, "new_tokens": new_tokens}
