"""GPU checks of the Megatron backbone (marker `gpu`, skipped without CUDA; run by scripts/gpu_check.sh).

One GPU means TP = CP = 1 here (NCCL will not put two ranks on one device); the TP / CP splits are covered on CPU
by test_megatron_equivalence.py. Checked on CUDA: the pure-torch attention path in float32 equals HF exactly
(log-probs and gradients <= 1e-5), and, when transformer-engine is installed, the TE layer spec in bfloat16
agrees with HF bfloat16 within bf16 noise.
"""

import os
import tempfile

import pytest
import torch
from test_megatron_equivalence import TEMPERATURE, hf_model, packed_batch, reference

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def megatron_single_gpu():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    store = tempfile.mktemp(prefix="topp_rl_gpu_store_")
    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    ps.initialize_model_parallel(1, 1)
    yield
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    if os.path.exists(store):
        os.remove(store)


def _to(batch, device):
    for name, value in vars(batch).items():
        if isinstance(value, torch.Tensor):
            setattr(batch, name, value.to(device))
    batch.candidates = batch.candidates.to(device)
    return batch


def _compare(family: str, dtype: torch.dtype, *, force_torch_attention: bool):
    from topp_rl.megatron import backbone as bb_mod
    from topp_rl.megatron.export import hf_state_dict
    from topp_rl.parallel import ParallelLayout
    from topp_rl.trainer.hook import ToppLogProb

    model = hf_model(family).to("cuda", dtype)
    batch = _to(packed_batch(model.config.vocab_size), "cuda")
    _, ref_logprobs, ref_grads = reference(model, batch)
    original = bb_mod.use_transformer_engine
    if force_torch_attention:
        bb_mod.use_transformer_engine = lambda dtype: False
    try:
        layout = ParallelLayout.from_megatron(model.config.vocab_size)
        backbone = bb_mod.MegatronBackbone.from_hf(model, layout=layout).cuda()
    finally:
        bb_mod.use_transformer_engine = original
    hidden, weight = backbone.forward_hidden(batch)
    out = ToppLogProb(temperature=TEMPERATURE)(batch, layout=layout, hidden=hidden.float(), weight=weight.float())
    (batch.weights[out.token_index] * out.logprobs).sum().backward()
    grads = hf_state_dict(backbone, grads=True)
    lp_err = float((out.logprobs.detach() - ref_logprobs[out.token_index].float()).abs().max())
    grad_err = max(float((grads[n].float() - g.float()).abs().max() / (g.float().abs().max() + 1e-6))
                   for n, g in ref_grads.items() if n in grads)
    return lp_err, grad_err


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_torch_attention_on_cuda_is_exact(megatron_single_gpu, family):
    lp_err, grad_rel = _compare(family, torch.float32, force_torch_attention=True)
    assert lp_err <= 1e-5
    assert grad_rel <= 1e-4


def test_transformer_engine_bf16_agrees_with_hf(megatron_single_gpu):
    pytest.importorskip("transformer_engine")
    lp_err, grad_rel = _compare("qwen2", torch.bfloat16, force_torch_attention=False)
    assert lp_err <= 0.1  # bf16 forward of two different kernels: agreement to bf16 noise only
    assert grad_rel <= 0.1
