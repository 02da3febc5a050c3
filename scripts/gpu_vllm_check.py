"""rollout=vllm on a GPU: native sampling masks against the top-(k+1) reconstruction, and a weight update with a
tied output head. Run by scripts/gpu_check.sh when TOPP_RL_VLLM_PYTHON is a CUDA vLLM venv
(`scripts/setup_vllm.sh --gpu`); `--cpu` runs the same on vLLM's CPU build (no native masks there: the sets come
from log-probs only), which checks this script without a GPU.

1. One float32 server on GPU 0 started with --return-sampling-mask (vLLM's V2 model runner) and processed
   log-probs: requests ask for both, so every token's native mask is compared with the finite entries of its
   top-(top_k + 1) log-probs from the same forward pass (they must be equal, id for id).
2. `VLLMEngine(urls=[...])` picks the native route by itself (`kept_sets=auto`); its sets equal
   `sampling_candidates(convention="vllm")` of the HF float32 logits, its log-probs within 1e-4 (float32 in two
   engines; TF32 off), for top_p 0.9 / top_k 20, min_p 0.1 / top_k 50 and top_k 5.
3. A weight update (disk reload; the tied head refreshed; prefix cache reset): the same checks against the changed
   model, with a prompt longer than one KV block.
Prints one line per check and exits non-zero on the first failure.
"""

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import requests
import torch

from topp_rl.data.params import SamplingParams
from topp_rl.engines.vllm import VLLMEngine
from topp_rl.engines.vllm.server import VLLMServer
from topp_rl.models import build_tiny_model, save_model
from topp_rl.ops import sampling_candidates

TOL = 1e-4  # float32 forward in two engines (vLLM's kernels vs HF eager), as the CPU tests
SETTINGS = (dict(top_p=0.9, top_k=20), dict(min_p=0.1, top_k=50), dict(top_k=5))
PROMPTS = [[1, 5, 9, 14, 20], [1, 33, 7], list(range(1, 300))]  # the last spans several KV blocks


def tiny_tied_model(device: str):
    model = build_tiny_model("qwen2", vocab_size=512, hidden=64, heads=2, kv_heads=1, layers=2, tie_embeddings=True,
                             max_positions=4096, initializer_range=0.4, seed=3)  # fmt: skip
    return model.float().to(device).eval()


def native_equals_reconstruction(url: str, params: SamplingParams) -> int:
    """Step 1 for one setting: tokens compared; AssertionError at the first that differs."""
    body = {"token_ids": PROMPTS[0], "output_mode": "tokens", "sampling_params": {
        "n": 1, "top_p": params.top_p, "top_k": params.top_k, "min_p": params.min_p, "max_tokens": 32,
        "logprobs": params.top_k + 1, "detokenize": False, "seed": 7, "ignore_eos": True}}  # fmt: skip
    choice = requests.post(f"{url}/inference/v1/generate", json=body, timeout=120).json()["choices"][0]
    masks, content = choice["sampling_mask"], choice["logprobs"]["content"]
    assert len(masks) == len(content) == len(choice["token_ids"]), (len(masks), len(content))
    for i, (mask, token) in enumerate(zip(masks, content, strict=True)):
        finite = {int(e["token_id"]) for e in token["top_logprobs"] if float(e["logprob"]) > -9999.0}
        assert set(mask) == finite, f"{params}: token {i}: native mask {sorted(mask)} vs log-probs {sorted(finite)}"
    return len(masks)


def sets_match_hf(engine: VLLMEngine, model, params: SamplingParams) -> tuple[int, float]:
    """Step 2 for one setting: (tokens checked, worst |log-prob diff|)."""
    samples = engine.generate(PROMPTS, params, seed=5)
    worst, count = 0.0, 0
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids], device=next(model.parameters()).device)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1].float().cpu()
        ref = sampling_candidates(logits, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                  min_p=params.min_p, convention="vllm")  # fmt: skip
        scaled = torch.log_softmax(logits / params.temperature, dim=-1)
        for i, tok in enumerate(s.response_ids):
            kept = s.candidates.ids[s.candidates.offsets[i] : s.candidates.offsets[i + 1]].long()
            want = ref.ids[ref.offsets[i] : ref.offsets[i + 1]]
            assert sorted(kept.tolist()) == sorted(want.tolist()), f"{params}: token {i}: sets differ"
            renorm = float(scaled[i, tok] - torch.logsumexp(scaled[i, kept], 0))
            worst = max(worst, abs(renorm - s.rollout_log_probs[i]))
            count += 1
    assert worst <= TOL, f"{params}: log-prob differs from HF float32 by {worst:.3g} > {TOL}"
    return count, worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="vLLM's CPU build, no native masks (checks the script)")
    args = parser.parse_args()
    device = "cpu" if args.cpu else "cuda"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model = tiny_tied_model(device)
    with tempfile.TemporaryDirectory(prefix="topp_rl-gpu-vllm-") as tmp:
        path = save_model(model.cpu(), None, Path(tmp) / "model")
        model.to(device)
        extra = () if args.cpu else ("--return-sampling-mask", "--gpu-memory-utilization", "0.3")
        with VLLMServer(path, max_logprobs=64, device=device, extra_args=extra, workdir=tmp) as server:
            if not args.cpu:
                for setting in SETTINGS:
                    n = native_equals_reconstruction(server.url, SamplingParams(max_new_tokens=32, **setting))
                    print(f"gpu_vllm_check: native mask == top-(k+1) log-prob sets, {n} tokens, {setting}")
            engine = VLLMEngine(urls=[server.url], model_path=path, max_candidates=63, progress=False,
                                kept_sets="logprobs" if args.cpu else "native")  # fmt: skip
            try:
                for label, reference in (("launch weights", model), ("after a weight update", changed(model))):
                    if reference is not model:
                        stats = engine.update_weights(reference.named_parameters())
                        print(f"gpu_vllm_check: weight update {stats.bytes / 1e6:.1f} MB in {stats.seconds:.2f} s")
                    for setting in SETTINGS:
                        count, worst = sets_match_hf(engine, reference, SamplingParams(max_new_tokens=24, **setting))
                        print(f"gpu_vllm_check: {label}: {count} tokens, sets equal HF float32, max |log-prob diff| "
                              f"{worst:.2g}, {setting}")
            finally:
                engine.close()
    print("gpu_vllm_check: OK")
    return 0


def changed(model):
    """`model` with every parameter moved (0.3 x its std): a reload that misses a layer, or the tied head, shows."""
    new = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in new.parameters():
            p.add_((torch.randn(p.shape, generator=gen) * 0.3 * (float(p.std()) if p.numel() > 1 else 1.0)).to(p))
    return new


if __name__ == "__main__":
    sys.exit(main())
