"""What a bf16 vLLM server does to the kept sets and log-probs a float32 trainer scores, on SmolLM2-135M-Instruct.

    .venv/bin/python benchmarks/vllm_bf16.py [--prompts 8] [--new-tokens 32] [--json out.json]

One bf16 CPU server (`VLLMServer(dtype="bfloat16")`) samples top_p 0.9 / top_k 20; each answer is read as the engine
reads it (the top-(k+1) processed log-probs; the codec checks the sampled token is inside its set). Reported:
- ties: samples with a set that overflows top_k (every id tied at the k-th value is kept; the engine aborts them);
- against float32 HF logits of the same tokens (what a float32 trainer computes): the fraction of kept sets equal to
  `sampling_candidates(convention="vllm")` of the float32 logits, and |recorded - float32 renormalised log-prob| over
  the recorded set (the masked mismatch a trainer scoring over the recorded sets sees).
"""

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from topp_rl.data.params import SamplingParams
from topp_rl.engines.vllm import VLLMEngine
from topp_rl.engines.vllm.server import VLLMServer
from topp_rl.models import load_smollm2
from topp_rl.ops import sampling_candidates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    model, tokenizer = load_smollm2()
    model = model.float().eval()
    params = SamplingParams(top_p=0.9, top_k=20, max_new_tokens=args.new_tokens)
    prompts = [tokenizer(f"{a}+{b}=", add_special_tokens=False)["input_ids"] for a, b in
               zip(range(1, args.prompts + 1), range(args.prompts, 0, -1), strict=True)]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="topp_rl-vllm-bf16-") as tmp:
        path = Path(tmp) / "model"
        model.save_pretrained(path)
        with VLLMServer(path, max_logprobs=64, dtype="bfloat16", workdir=tmp) as server:
            engine = VLLMEngine(urls=[server.url], model_path=path, max_candidates=63, progress=False)
            try:
                samples = engine.generate(prompts, params, seed=1)
            finally:
                engine.close()
    diffs, same, tokens, overflow = [], 0, 0, 0
    for s in samples:
        if s.metadata.get("candidate_overflow"):
            overflow += 1
            continue
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1].float()
        ref = sampling_candidates(logits, temperature=1.0, top_p=0.9, top_k=20, convention="vllm")
        scaled = torch.log_softmax(logits, dim=-1)
        for i, tok in enumerate(s.response_ids):
            kept = s.candidates.ids[s.candidates.offsets[i] : s.candidates.offsets[i + 1]].long()
            tokens += 1
            same += sorted(kept.tolist()) == sorted(ref.ids[ref.offsets[i] : ref.offsets[i + 1]].tolist())
            diffs.append(abs(float(scaled[i, tok] - torch.logsumexp(scaled[i, kept], 0)) - s.rollout_log_probs[i]))
    figures = {
        "samples": len(samples), "overflowed_samples": overflow, "tokens": tokens,
        "sets_equal_fp32_frac": same / max(tokens, 1),
        "masked_abs_diff_mean": statistics.fmean(diffs) if diffs else None,
        "masked_abs_diff_max": max(diffs, default=None),
    }  # fmt: skip
    print(json.dumps(figures, indent=1))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
