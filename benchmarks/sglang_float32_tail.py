"""How far a real SGLang CPU server's float32 log-probs lie from HF's float32 and float64 forwards over long
responses: the per-token error tail that a fixed bar of 1e-4 does not cover (docs/evidence/sglang.md).

    TOPP_RL_SGLANG_PYTHON=... .venv/bin/python benchmarks/sglang_float32_tail.py [--rounds 3]

The model is the in-flight test's new weights (`perturbed(tiny_model(), seed=1)`), served by one launched server;
each round generates 2 prompts x 2 samples x 200 tokens (top_p 0.9, EOS ignored). Every token's log-prob,
renormalised over its recorded kept set, is compared with HF's on prompt + response; printed: the largest
difference over all tokens, and per 25-token band of the response.
"""

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from sglang_checks import PROMPTS, perturbed, tiny_model  # noqa: E402

from topp_rl.engines.sglang import SGLangEngine  # noqa: E402
from topp_rl.models import save_model  # noqa: E402
from topp_rl.rollout import SamplingParams  # noqa: E402

LENGTH, BAND = 200, 25


def worst_per_position(model, samples) -> torch.Tensor:
    """[LENGTH] float64: per response position, the largest |recorded - reference| renormalised log-prob."""
    worst = torch.zeros(LENGTH, dtype=torch.float64)
    for s in samples:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([s.prompt_ids + s.response_ids])).logits[0].double()
        p = len(s.prompt_ids)
        logp = torch.log_softmax(logits[p - 1: p - 1 + s.response_length], -1)
        for i, tok in enumerate(s.response_ids):
            kept = s.candidates.ids[s.candidates.offsets[i]: s.candidates.offsets[i + 1]]
            renorm = logp[i, tok] - torch.logsumexp(logp[i, kept], 0)
            worst[i] = max(worst[i], abs(float(renorm) - s.rollout_log_probs[i]))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    new = perturbed(tiny_model(), seed=1)
    model_dir = Path(tempfile.mkdtemp())
    save_model(new, None, model_dir)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=LENGTH, n=2)
    with SGLangEngine(model_path=model_dir, progress=False, server_kwargs={"max_total_tokens": 16384},
                      extra_sampling_params={"ignore_eos": True}) as engine:
        samples = [s for _ in range(args.rounds) for s in engine.generate(PROMPTS[:2], params)]
    print(f"{len(samples)} samples x {LENGTH} tokens")
    for dtype in (torch.float32, torch.float64):
        worst = worst_per_position(new.to(dtype), samples)
        bands = " ".join(f"{float(worst[a:a + BAND].max()):.2e}" for a in range(0, LENGTH, BAND))
        print(f"HF {dtype}: largest {float(worst.max()):.3e}; per {BAND}-token band: {bands}")


if __name__ == "__main__":
    main()
