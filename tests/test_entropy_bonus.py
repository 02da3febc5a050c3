"""The entropy bonus (`algo.entropy_coeff`): loss -= coeff * aggregate(H), H the full-vocabulary entropy per token.
Value and gradient of the training pass (`PolicyModule.accumulate_gradients`, tiny HF model, recorded top-p sets)
against a dense reference built from the model's own logits; the loss term by hand; refused values.
The same through the Megatron backbone at TP 2 and CP 2 against one process (one 2-rank gloo spawn)."""

import copy
import importlib.util

import pytest
import torch
from dist_utils import run_distributed
from helpers import compose_cfg, metric_columns
from test_module import TEMP, _module, make_samples, pack

from topp_rl.config import validate_config
from topp_rl.losses import GRPOLoss, LossInputs
from topp_rl.models import build_char_tokenizer, build_tiny_model
from topp_rl.train import train
from topp_rl.trainer.timer import PhaseTimer

COEFF = 0.3


@pytest.fixture(scope="module")
def policy():
    return build_tiny_model(vocab_size=96, hidden=32, layers=2, heads=4, kv_heads=2, seed=3,
                            tokenizer=build_char_tokenizer())


def _dense_loss(model, samples, adv, *, aggregation: str, coeff: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, aggregated entropy) of GRPO at ratio 1 minus coeff * entropy, from whole [T, V] logits per sample:
    log-probs over each recorded set (an empty row: the full vocabulary), entropy over the full vocabulary."""
    terms, ents, masks = [], [], []
    for i, (prompt, response, rows) in enumerate(samples):
        z = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1] / TEMP
        keep = torch.tensor([[not row or v in row for v in range(z.shape[1])] for row in rows])
        lp = torch.log_softmax(z.masked_fill(~keep, float("-inf")), -1)[torch.arange(len(response)), response]
        terms.append(-adv[i] * torch.exp(lp - lp.detach()))
        ents.append(-(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1))
        masks.append(torch.ones(len(response)) - (torch.arange(len(response)) == 0).float() * (i == 0))  # as `pack`

    def agg(values):
        if aggregation == "token-mean":
            return sum((v * m).sum() for v, m in zip(values, masks, strict=True)) / sum(m.sum() for m in masks)
        return sum((v * m).sum() / m.sum() for v, m in zip(values, masks, strict=True)) / len(samples)

    entropy = agg(ents)
    return agg(terms) - coeff * entropy, entropy


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_training_pass_equals_the_dense_reference(policy, aggregation):
    samples = make_samples(policy)
    adv = torch.linspace(-1.0, 1.5, len(samples))
    micro = [pack(samples, idx, advantages=adv) for idx in ([0, 1], [2], [3, 4, 5])]
    module = _module(copy.deepcopy(policy), GRPOLoss(aggregation=aggregation, entropy_coeff=COEFF))
    module.policy.zero_grad(set_to_none=True)
    metrics, _ = module.accumulate_gradients(micro, [None] * 3, old=None, timer=PhaseTimer())
    got = [p.grad.clone() for p in module.policy.parameters()]

    reference = copy.deepcopy(policy)
    loss, entropy = _dense_loss(reference, samples, adv, aggregation=aggregation, coeff=COEFF)
    loss.backward()
    want = [p.grad for p in reference.parameters()]
    assert any(float(g.abs().max()) > 1e-4 for g in want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    total, share = metrics["train/entropy_bonus"]
    assert share == pytest.approx(1.0) and total == pytest.approx(float(entropy.detach()), rel=1e-5)
    assert metrics["train/loss"][0] == pytest.approx(float(loss.detach()), rel=1e-5, abs=1e-6)
    # The bonus changes the gradient: without it the same pass gives the policy term's alone.
    module.loss_fn = GRPOLoss(aggregation=aggregation)
    module.policy.zero_grad(set_to_none=True)
    metrics_off, _ = module.accumulate_gradients(micro, [None] * 3, old=None, timer=PhaseTimer())
    assert "train/entropy_bonus" not in metrics_off
    off = [p.grad for p in module.policy.parameters()]
    assert max(float((a - b).abs().max()) for a, b in zip(got, off, strict=True)) > 1e-4


def test_loss_term_by_hand():
    entropy = torch.tensor([1.0, 2.0, 4.0, 0.5], requires_grad=True)
    inputs = LossInputs(logprobs=torch.zeros(4, requires_grad=True), old_logprobs=torch.zeros(4),
                        advantages=torch.zeros(4), loss_mask=torch.tensor([1.0, 1.0, 0.0, 1.0]),
                        seq_index=torch.tensor([0, 0, 1, 1]), num_loss_tokens_global=6.0, num_sequences_global=3,
                        entropy=entropy)
    loss, metrics = GRPOLoss(entropy_coeff=0.5)(inputs)
    assert float(loss.detach()) == pytest.approx(-0.5 * 3.5 / 6)  # masked sum 1 + 2 + 0.5 over the step's 6 tokens
    (grad,) = torch.autograd.grad(loss, entropy)
    torch.testing.assert_close(grad, torch.tensor([-0.5, -0.5, 0.0, -0.5]) / 6)
    assert metrics["train/entropy_bonus"] == pytest.approx((3.5 / 6, 3 / 6))
    with pytest.raises(ValueError, match=r"entropy_coeff=0.5 needs LossInputs.entropy"):
        GRPOLoss(entropy_coeff=0.5)(LossInputs(**{**inputs.__dict__, "entropy": None}))


def test_short_run_logs_the_bonus(tmp_path):
    train(compose_cfg(tmp_path, "logger=csv", "algo.entropy_coeff=0.01", "trainer.max_steps=1"))
    m = metric_columns(tmp_path)
    # One on-policy epoch, token-mean: the bonus's entropy is the step's entropy over the same tokens.
    assert m["train/entropy_bonus"] == pytest.approx(m["train/entropy"], rel=1e-5)


@pytest.mark.parametrize("value", ["-0.1", "inf"])
def test_bad_coefficients_are_refused_at_start(tmp_path, value):
    with pytest.raises(ValueError, match=rf"algo.entropy_coeff={value}.*: must be a finite number >= 0"):
        validate_config(compose_cfg(tmp_path, f"algo.entropy_coeff={value}"))
    with pytest.raises(ValueError, match=r"entropy_coeff=.* must be a finite number >= 0"):
        GRPOLoss(entropy_coeff=float(value))


LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (tp, cp) on 2 ranks; (1, 1) runs as two data-parallel replicas


def _megatron_cases(rank: int) -> dict:
    """Per (tp, cp): the largest gradient difference to the dense single-process reference (under HF names, TP shards
    gathered, CP partial gradients summed) and this rank's train/entropy_bonus against the reference's entropy."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from topp_rl.megatron import MegatronBackbone, load_hf_into
    from topp_rl.megatron.export import hf_state_dict
    from topp_rl.parallel import ParallelLayout

    torch.manual_seed(0)
    model = build_tiny_model(vocab_size=96, hidden=32, layers=2, heads=4, kv_heads=2, seed=3,
                             tokenizer=build_char_tokenizer())
    samples = make_samples(model)
    adv = torch.linspace(-1.0, 1.5, len(samples))
    reference = copy.deepcopy(model)
    loss, entropy = _dense_loss(reference, samples, adv, aggregation="token-mean", coeff=COEFF)
    loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    out = {}
    for tp, cp in LAYOUTS:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        try:
            layout = ParallelLayout.from_megatron(model.config.vocab_size)
            backbone = MegatronBackbone(model.config, layout=layout)
            load_hf_into(backbone.model, model.state_dict(), model.config, tp_size=tp,
                         tp_rank=ps.get_tensor_model_parallel_rank())
            module = _module(model, GRPOLoss(entropy_coeff=COEFF))
            module.use_backbones(policy=backbone, reference=None, teacher=None)
            micro = [pack(samples, idx, advantages=adv) for idx in ([0, 1], [2], [3, 4, 5])]
            metrics, _ = module.accumulate_gradients(micro, [None] * 3, old=None, timer=PhaseTimer())
            if cp > 1:  # CP ranks hold partial parameter gradients: sum them
                for p in backbone.model.parameters():
                    dist.all_reduce(p.grad, group=layout.cp_group)
            grads = hf_state_dict(backbone, grads=True)
            total, share = metrics["train/entropy_bonus"]
            out[tp, cp] = {"grads": max(float((grads[n] - g).abs().max()) for n, g in ref_grads.items() if n in grads),
                           "names": len(set(grads) & set(ref_grads)),
                           "bonus": abs(total / share - float(entropy.detach()))}
        finally:
            ps.destroy_model_parallel()
    return out


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                    reason="megatron-core (the `megatron` extra) is not installed")
@pytest.mark.distributed
def test_tp2_and_cp2_equal_the_dense_single_process_reference():
    results = run_distributed(_megatron_cases, 2, timeout=600,
                              preload=("megatron.core", "megatron.core.models.gpt", "topp_rl.megatron", "transformers"))
    for rank, per_layout in enumerate(results):
        for layout, r in per_layout.items():
            assert r["names"] >= 10 and r["grads"] <= 1e-5 and r["bonus"] <= 1e-5, (rank, layout, r)
