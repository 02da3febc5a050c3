"""`PolicyModule`: the packed HF forward equals per-sequence forwards, micro-batching equals one big batch
(gradients, for every loss aggregation and with a KL reference), and the on-policy pass matches the ops."""

import copy

import pytest
import torch

from topp_rl.data import PackedBatch
from topp_rl.losses import DrGRPOLoss, GRPOLoss, GSPOLoss, ReinforcePPLoss
from topp_rl.models import build_char_tokenizer, build_tiny_model
from topp_rl.ops import Candidates, sampling_candidates
from topp_rl.trainer.backbone import HFBackbone
from topp_rl.trainer.hook import ToppLogProb
from topp_rl.trainer.module import PolicyModule
from topp_rl.trainer.timer import PhaseTimer

TEMP = 0.8


@pytest.fixture(scope="module")
def policy():
    return build_tiny_model(vocab_size=96, hidden=32, layers=2, heads=4, kv_heads=2, seed=3,
                            tokenizer=build_char_tokenizer())


def make_samples(model, n: int = 6, seed: int = 0):
    """(prompt, response, candidate rows) triples; candidates are the model's own top-p=0.7 sets."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(3, 90, (3 + i % 3,), generator=g).tolist()
        response = torch.randint(3, 90, (2 + (i * 2) % 5,), generator=g).tolist()
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        rows = sampling_candidates(logits, temperature=TEMP, top_p=0.7).to_lists()
        rows = [sorted(set(r) | {t}) for r, t in zip(rows, response, strict=True)]
        if i == 2:
            rows = [[] for _ in rows]  # a sample without candidate data: unrestricted
        out.append((prompt, response, rows))
    return out


def pack(samples, index: list[int], *, advantages: torch.Tensor) -> PackedBatch:
    """Samples `index` as one packed micro-batch; denominators cover ALL samples (the whole step)."""
    chosen = [samples[i] for i in index]
    seq = torch.tensor([len(p) + len(r) for p, r, _ in chosen])
    resp = torch.tensor([len(r) for _, r, _ in chosen])
    cu = torch.zeros(len(chosen) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(seq, 0)
    # The first token of sample 0 is non-trainable (loss mask 0).
    mask = torch.cat([torch.ones(len(samples[i][1])) - (torch.arange(len(samples[i][1])) == 0).float() * (i == 0)
                      for i in index])
    adv = torch.cat([advantages[i].expand(len(samples[i][1])) for i in index])
    total_tokens = sum(len(r) for _, r, _ in samples) - 1
    return PackedBatch(
        tokens=torch.tensor([t for p, r, _ in chosen for t in p + r]), cu_seqlens=cu, seq_lengths=seq,
        response_lengths=resp, position_ids=torch.cat([torch.arange(int(n)) for n in seq]),
        loss_mask=mask, advantages=adv, rollout_log_probs=torch.zeros(int(resp.sum())),
        response_tokens=torch.tensor([t for _, r, _ in chosen for t in r]),
        candidates=Candidates.from_lists([row for _, _, rows in chosen for row in rows]),
        rewards=advantages[index].float(), group_index=torch.zeros(len(index), dtype=torch.long),
        sample_index=torch.tensor(index), num_loss_tokens_global=float(total_tokens),
        num_sequences_global=len(samples),
    )


def test_packed_forward_equals_per_sequence_forward(policy):
    samples = make_samples(policy)
    batch = pack(samples, list(range(len(samples))), advantages=torch.zeros(len(samples)))
    hidden, weight = HFBackbone(policy).forward_hidden(batch)
    assert weight is policy.lm_head.weight
    start = 0
    for prompt, response, _ in samples:
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            ref = policy.get_decoder()(input_ids=ids).last_hidden_state[0]
        torch.testing.assert_close(hidden[start : start + ids.shape[1]].detach(), ref, rtol=1e-5, atol=1e-5)
        start += ids.shape[1]


def _module(policy, loss, *, use_mask=True):
    return PolicyModule(policy=HFBackbone(policy), loss=loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                        hook=ToppLogProb(use_mask=use_mask, temperature=TEMP))


def _grads(module, micro):
    module.policy.zero_grad(set_to_none=True)
    old = [module.onpolicy_pass(mb)[0] for mb in micro]
    metrics, made = module.accumulate_gradients(micro, module.reference_pass(micro), old=old, timer=PhaseTimer())
    assert made == []  # given old log-probs, the gradient pass makes no on-policy records
    return [p.grad.clone() for p in module.policy.parameters()], metrics


@pytest.mark.parametrize(
    "loss",
    [GRPOLoss(), DrGRPOLoss(), GSPOLoss(), GRPOLoss(aggregation="seq-mean-token-mean", kl_coef=0.1),
     ReinforcePPLoss(kl_coef=0.1)],
    ids=["token-mean", "seq-mean-token-sum", "gspo", "kl-ref", "reinforce_pp"],
)
def test_micro_batching_equals_one_big_batch(policy, loss):
    samples = make_samples(policy)
    adv = torch.linspace(-1.0, 1.5, len(samples))
    whole = [pack(samples, list(range(6)), advantages=adv)]
    split = [pack(samples, idx, advantages=adv) for idx in ([0, 1], [2], [3, 4, 5])]
    module = _module(policy, loss)
    g_whole, m_whole = _grads(module, whole)
    g_split, m_split = _grads(module, split)
    assert any(float(g.abs().max()) > 1e-4 for g in g_whole), "the test needs a non-zero gradient"
    for a, b in zip(g_whole, g_split, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    loss_whole = m_whole["train/loss"][0] / m_whole["train/loss"][1]
    loss_split = m_split["train/loss"][0] / m_split["train/loss"][1]
    assert loss_split == pytest.approx(loss_whole, rel=1e-5, abs=1e-7)


def test_onpolicy_record_and_mask_switch(policy):
    samples = make_samples(policy)
    batch = pack(samples, list(range(6)), advantages=torch.zeros(6))
    module = _module(policy, GRPOLoss())
    old, record = module.onpolicy_pass(batch)
    torch.testing.assert_close(old, record.logprobs)
    has = record.support_size > 0
    assert bool(has.any()) and bool((~has).any())
    # Restricted to a candidate set, a token's log-prob is higher; without candidate data it is unchanged.
    assert bool((record.logprobs[has] > record.logprobs_unmasked[has]).all())
    torch.testing.assert_close(record.logprobs[~has], record.logprobs_unmasked[~has])
    assert bool((record.entropy > 0).all())
    off = _module(policy, GRPOLoss(), use_mask=False)
    old_off, _ = off.onpolicy_pass(batch)
    torch.testing.assert_close(old_off, record.logprobs_unmasked)
    with torch.no_grad():
        torch.testing.assert_close(off.score(off.policy, batch, use_mask=False), record.logprobs_unmasked,
                                   rtol=1e-5, atol=1e-6)


def test_reference_is_a_frozen_copy_when_the_loss_needs_it(policy):
    assert _module(policy, GRPOLoss()).reference is None
    module = _module(policy, GRPOLoss(kl_coef=0.1))
    assert module.reference is not None and module.reference is not module.policy
    assert not any(p.requires_grad for p in module.reference.parameters())
    with pytest.raises(ValueError, match="ppo_epochs"):
        PolicyModule(policy=HFBackbone(policy), loss=GRPOLoss(), optimizer=torch.optim.SGD, hook=ToppLogProb(),
                     ppo_epochs=0)
    with pytest.raises(TypeError, match="wrap an HF causal LM as HFBackbone"):
        PolicyModule(policy=policy, loss=GRPOLoss(), optimizer=torch.optim.SGD, hook=ToppLogProb())


def test_gradient_checkpointing_recomputes_layers_with_the_same_gradients(policy):
    samples = make_samples(policy)
    micro = [pack(samples, list(range(6)), advantages=torch.linspace(-1.0, 1.5, 6))]
    plain = _module(policy, GRPOLoss())
    checkpointed = PolicyModule(
        policy=HFBackbone(copy.deepcopy(policy), gradient_checkpointing=True), loss=GRPOLoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), hook=ToppLogProb(temperature=TEMP),
    )
    calls = []
    layer = checkpointed.policy.model.model.layers[0]
    # The layer's first module: the replay in the backward stops once it has what the gradient needs.
    layer.input_layernorm.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    g_plain, m_plain = _grads(plain, micro)
    g_ckpt, m_ckpt = _grads(checkpointed, micro)
    # The no-grad old-log-prob pass, the grad forward, and its replay in the backward: the layer was recomputed.
    assert calls == [False, True, True]
    assert not checkpointed.policy.model.training and not layer.mlp.training  # no dropout switched on
    for a, b in zip(g_plain, g_ckpt, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same float ops, replayed
    assert m_ckpt["train/loss"] == m_plain["train/loss"]


def test_gradient_checkpointing_is_refused_with_the_megatron_backbone():
    from omegaconf import OmegaConf

    from topp_rl.config import validate_parallel

    cfg = OmegaConf.create({
        "parallel": {"tp_size": 2, "cp_size": 1, "ep_size": 1, "pp_size": 1, "cp_mode": "zigzag", "strategy": {"_target_": "topp_rl.megatron.strategy.MegatronStrategy"}},
        "module": {"gradient_checkpointing": True, "moe_aux_loss_coeff": 0.0}, "rollout": {"prompts_per_step": 2},
        "trainer": {"devices": 2, "num_nodes": 1},
    })
    with pytest.raises(ValueError, match=r"module.gradient_checkpointing.*false with the Megatron backbone"):
        validate_parallel(cfg)


def test_one_epoch_step_reuses_the_gradient_forward_with_the_same_result(policy):
    """ppo_epochs=1 scores old log-probs and the on-policy record from the gradient pass's own forward: the
    same gradients, loss and records as a separate no-grad pass (one backbone forward fewer)."""
    samples = make_samples(policy)
    adv = torch.linspace(-1.0, 1.5, len(samples))
    micro = [pack(samples, idx, advantages=adv) for idx in ([0, 1], [2], [3, 4, 5])]
    for loss in (GRPOLoss(), GRPOLoss(kl_coef=0.1)):
        module = _module(policy, loss)
        g_two, m_two = _grads(module, micro)
        records_two = [module.onpolicy_pass(mb)[1] for mb in micro]
        module.policy.zero_grad(set_to_none=True)
        timer = PhaseTimer()
        m_one, records_one = module.accumulate_gradients(micro, module.reference_pass(micro), old=None, timer=timer)
        assert timer.seconds["old_logprob"] > 0 and len(records_one) == len(micro)
        for a, p in zip(g_two, module.policy.parameters(), strict=True):
            torch.testing.assert_close(p.grad, a, rtol=0, atol=0)
        assert m_one == m_two
        for a, b in zip(records_one, records_two, strict=True):
            for field in ("logprobs", "logprobs_unmasked", "entropy", "support_size"):
                torch.testing.assert_close(getattr(a, field), getattr(b, field), rtol=0, atol=0)


def test_phase_timer_counts_a_nested_phase_once_in_itself():
    ticks = iter([0.0, 1.0, 3.0, 4.0, 10.0, 10.5, 11.0, 12.0])
    timer = PhaseTimer(clock=lambda: next(ticks))
    with timer.phase("optim"):  # 0
        with timer.phase("old_logprob"):  # 1 .. 3
            pass
        with timer.phase("old_logprob"):  # 4 .. 10
            pass
        with timer.phase("other"):  # 10.5 .. 11
            pass
    # optim: 0 .. 1, 3 .. 4, 10 .. 10.5, 11 .. 12 (its exit)
    assert dict(timer.seconds) == {"optim": 1.0 + 1.0 + 0.5 + 1.0, "old_logprob": 2.0 + 6.0, "other": 0.5}


def test_backbone_runs_the_micro_batch_schedule_like_a_plain_loop(policy):
    """`forward_backward` calls the step on each micro-batch's forward in order and backpropagates its loss: the
    same gradients, bit for bit, as the loop written out; `forward_only` gives the forward's values without grad."""
    samples = make_samples(policy)
    micro = [pack(samples, idx, advantages=torch.zeros(6)) for idx in ([0, 1], [2], [3, 4, 5])]
    backbone = HFBackbone(policy)

    def step(i, mb, hidden, weight):
        return (hidden @ weight.T).logsumexp(-1).sum() * (i + 1), (i, mb.tokens.numel())

    backbone.zero_grad(set_to_none=True)
    outputs = backbone.forward_backward(micro, step)
    assert outputs == [(i, mb.tokens.numel()) for i, mb in enumerate(micro)]
    scheduled = [p.grad.clone() for p in backbone.parameters()]
    backbone.zero_grad(set_to_none=True)
    for i, mb in enumerate(micro):
        step(i, mb, *backbone.forward_hidden(mb))[0].backward()
    for a, p in zip(scheduled, backbone.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad, rtol=0, atol=0)
    (hidden, weight), = backbone.forward_only(micro[:1], lambda mb, h, w: (h, w))
    assert not hidden.requires_grad
    torch.testing.assert_close(hidden, backbone.forward_hidden(micro[0])[0].detach(), rtol=0, atol=0)
    backbone.zero_grad(set_to_none=True)


def test_optional_capabilities_have_neutral_defaults(policy):
    backbone = HFBackbone(policy)  # a dense model on one rank: no frozen base, nothing sharded, no MoE figures
    assert not backbone.has_frozen_base and not backbone.shards_weights
    assert backbone.drop_base({"policy.x": torch.zeros(1)}, prefix="policy.") is None
    assert backbone.routing_agreement() is None and backbone.moe_stats() == {}
    with backbone.gathered():
        pass
    with pytest.raises(TypeError, match="HFBackbone has no frozen base"):
        backbone.base_weights()
    with pytest.raises(TypeError, match="not a topp_rl.trainer.backbone.Backbone; wrap an HF causal LM"):
        PolicyModule(policy=policy, loss=GRPOLoss(), optimizer=torch.optim.SGD, hook=ToppLogProb())
