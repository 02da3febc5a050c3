"""`PolicyModule`: the RL LightningModule (manual optimisation) wiring policy, hook, loss and optimizer.

One `training_step` per rollout step:
1. old-log-prob pass without grad, with the weights the rollout sampled with (so it is also the on-policy pass
   that the mismatch callbacks read): masked and unmasked log-probs and entropy -> `OnPolicyRecord`;
2. optional reference-model pass (frozen copy) for the KL term;
3. `ppo_epochs` optimizer steps. Each step accumulates gradients over ALL micro-batches of the rollout step
   (one step per epoch, not one per micro-batch): the losses divide by the rollout step's global token / sequence
   counts, so the accumulated gradient equals that of one large batch, whatever the token budget per micro-batch.
   With `ppo_epochs=1` the update is exactly on-policy (ratio 1); more epochs reuse the rollout (PPO-style).

HF attention on CPU does not build block-diagonal masks from packed position_ids, so each packed micro-batch is
unpacked into a right-padded [B, L] batch for the backbone and the final hidden states are re-packed to [T, H]
(exact: causal attention never looks at the right padding). The lm_head weight and those hidden states go to
`ToppLogProb`, which never forms [T, V] logits for rows with candidates. Models with a logit soft-cap or a
biased lm_head are not supported (their logits are not hidden @ weight.T).
"""

import copy
import time
from collections.abc import Callable, Iterable, Iterator

import lightning as L
import torch
import torch.distributed as dist
from torch import nn

from topp_rl.hook import TokenLogProbs, ToppLogProb
from topp_rl.losses import LossInputs
from topp_rl.metrics import SumCount, add_sums
from topp_rl.parallel import ParallelLayout
from topp_rl.records import OnPolicyRecord

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def packed_hidden(model: nn.Module, batch) -> torch.Tensor:
    """Final (normed) hidden states [T, H] of a packed batch, from a padded [B, L] backbone forward."""
    lengths = batch.seq_lengths.to(batch.tokens.device)
    width = int(lengths.max())
    valid = torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]  # [B, L]
    input_ids = torch.zeros(valid.shape, dtype=torch.long, device=lengths.device)
    position_ids = torch.zeros_like(input_ids)
    input_ids[valid] = batch.tokens  # row-major boolean indexing == sequences back to back
    position_ids[valid] = batch.position_ids
    out = model.get_decoder()(
        input_ids=input_ids, attention_mask=valid.long(), position_ids=position_ids, use_cache=False
    )
    return out.last_hidden_state[valid]


def output_weight(model: nn.Module) -> torch.Tensor:
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError(
            f"{type(model).__name__} has an lm_head bias; ToppLogProb assumes logits = hidden @ weight.T. "
            "Use a model without an output bias (Qwen2 / Llama families)"
        )
    return head.weight


def hidden_and_weight(model: nn.Module, batch, layout: ParallelLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's final hidden states [T_local, H], output weight [V_local, H]).

    Backbones that shard over TP / CP (topp_rl.megatron.MegatronBackbone) expose `forward_hidden(batch, layout)`;
    an HF causal LM runs whole on this rank.
    """
    if hasattr(model, "forward_hidden"):
        hidden, weight, _ = model.forward_hidden(batch, layout)
        return hidden, weight
    return packed_hidden(model, batch), output_weight(model)


def gather_tokens(values: torch.Tensor, token_index: torch.Tensor, *, num_tokens: int, group) -> torch.Tensor:
    """[R] in sample order from this rank's values [R_local] at `token_index` (CP ranks hold disjoint tokens).

    Other CP ranks' tokens arrive through an all_reduce of a detached copy, so gradient flows only into this
    rank's own tokens: each CP rank computes the same whole-sequence loss, and its parameter gradient covers
    its own rows; summing gradients over CP (not averaging) gives the full gradient.
    """
    full = values.new_zeros(num_tokens).index_put((token_index,), values)
    if group is None:
        return full
    others = full.detach().clone()
    dist.all_reduce(others, group=group)
    return full + (others - full.detach())


class PolicyModule(L.LightningModule):
    """Policy-gradient training over rollout steps (`RolloutBatch`), exact over the rollout's candidate sets.

    `loss` is a `topp_rl.losses.PolicyLoss`; when it needs reference log-probs and no `reference` is given, the
    reference is a frozen copy of the initial policy. `optimizer` is a factory (Hydra `_partial_`).
    """

    def __init__(
        self,
        *,
        policy: nn.Module,
        loss: Callable[[LossInputs], tuple[torch.Tensor, dict[str, SumCount]]],
        optimizer: OptimizerFactory,
        hook: ToppLogProb,
        reference: nn.Module | None = None,
        ppo_epochs: int = 1,
        grad_clip: float | None = 1.0,
        layout: ParallelLayout | None = None,
    ) -> None:
        super().__init__()
        if ppo_epochs < 1:
            raise ValueError(f"ppo_epochs ({ppo_epochs}) must be >= 1; use 1 for plain on-policy updates")
        if grad_clip is not None and not grad_clip > 0:
            raise ValueError(f"grad_clip ({grad_clip}) must be > 0, or null to disable clipping")
        self.automatic_optimization = False
        self.policy = policy
        if reference is None and loss.needs_ref_logprobs:
            reference = copy.deepcopy(policy)
        self.reference = reference.requires_grad_(False).eval() if reference is not None else None
        self.loss_fn = loss
        self.optimizer_factory = optimizer
        self.hook = hook
        self.ppo_epochs = ppo_epochs
        self.grad_clip = grad_clip
        self._layout = layout
        self.last_timings: dict[str, float] = {}

    @property
    def layout(self) -> ParallelLayout:
        if self._layout is None:
            if hasattr(self.policy, "forward_hidden"):
                self._layout = ParallelLayout.from_megatron(self.policy.vocab_size)
            else:
                self._layout = ParallelLayout.single(self.policy.get_output_embeddings().weight.shape[0])
        return self._layout

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer_factory([p for p in self.policy.parameters() if p.requires_grad])

    def _gather(self, values: torch.Tensor, out: TokenLogProbs, batch) -> torch.Tensor:
        return gather_tokens(values, out.token_index, num_tokens=batch.response_tokens.numel(),
                             group=self.layout.cp_group)

    def score(self, model: nn.Module, batch, *, use_mask: bool) -> torch.Tensor:
        """Log-probs [R] of the batch's response tokens in sample order (grad when grad mode is on)."""
        hidden, weight = hidden_and_weight(model, batch, self.layout)
        hook = self.hook if use_mask == self.hook.use_mask else ToppLogProb(
            use_mask=use_mask, temperature=self.hook.temperature
        )
        out = hook(batch, layout=self.layout, hidden=hidden, weight=weight)
        return self._gather(out.logprobs, out, batch)

    @torch.no_grad()
    def onpolicy_pass(self, batch) -> tuple[torch.Tensor, OnPolicyRecord]:
        """(old log-probs [R] for the loss, the on-policy record over this rank's tokens)."""
        hidden, weight = hidden_and_weight(self.policy, batch, self.layout)
        out = self.hook.onpolicy(batch, layout=self.layout, hidden=hidden, weight=weight)
        idx = out.token_index
        record = OnPolicyRecord(
            logprobs=out.logprobs.float(),
            logprobs_unmasked=out.logprobs_unmasked.float(),
            rollout_logprobs=batch.rollout_log_probs[idx].float(),
            loss_mask=batch.loss_mask[idx].float(),
            entropy=out.entropy.float(),
            support_size=out.support_size,
        )
        # The loss's old log-probs honour the use_mask switch; the record always carries both figures.
        old = out.logprobs if self.hook.use_mask else out.logprobs_unmasked
        return self._gather(old, out, batch), record

    def loss_inputs(self, batch, logprobs, old, ref) -> LossInputs:
        seq_index = torch.repeat_interleave(batch.sample_index, batch.response_lengths)
        return LossInputs(
            logprobs=logprobs, old_logprobs=old, advantages=batch.advantages, loss_mask=batch.loss_mask,
            seq_index=seq_index, num_loss_tokens_global=float(batch.num_loss_tokens_global),
            num_sequences_global=int(batch.num_sequences_global), ref_logprobs=ref,
            rollout_logprobs=batch.rollout_log_probs,
        )

    def reference_pass(self, micro: list) -> list[torch.Tensor | None]:
        """Reference log-probs [R] per micro-batch (None without a reference model)."""
        if self.reference is None:
            return [None] * len(micro)
        # KL without the candidate mask scores the reference over the full vocabulary.
        use_mask = self.hook.use_mask and self.loss_fn.kl_use_candidate_mask
        with torch.no_grad():
            return [self.score(self.reference, mb, use_mask=use_mask) for mb in micro]

    def accumulate_gradients(self, micro: list, old: list, refs: list) -> dict[str, SumCount]:
        """Backward of the loss over every micro-batch into .grad: the loss divides by the step's global counts,
        so the accumulated gradient equals that of one batch holding all micro-batches."""
        backward = self.manual_backward if self._trainer is not None else torch.Tensor.backward
        metrics: dict[str, SumCount] = {}
        for mb, o, r in zip(micro, old, refs, strict=True):
            logprobs = self.score(self.policy, mb, use_mask=self.hook.use_mask)
            loss, loss_metrics = self.loss_fn(self.loss_inputs(mb, logprobs, o, r))
            backward(loss)
            add_sums(metrics, loss_metrics)
        return metrics

    def training_step(self, batch, batch_idx: int) -> dict:
        micro = batch.micro_batches
        t0 = time.perf_counter()
        old, records = zip(*(self.onpolicy_pass(mb) for mb in micro), strict=True)
        refs = self.reference_pass(micro)
        t1 = time.perf_counter()
        opt = self.optimizers()
        metrics: dict[str, SumCount] = {}
        for _ in range(self.ppo_epochs):
            opt.zero_grad(set_to_none=True)
            add_sums(metrics, self.accumulate_gradients(micro, list(old), refs))
            add_sums(metrics, {"train/grad_norm": (self.clip_and_norm(), 1.0)})
            opt.step()
        # Wall-clock split of this step (read by benchmarks/bench_train_step.py; not logged).
        self.last_timings = {"old_logprob_s": t1 - t0, "optim_s": time.perf_counter() - t1}
        return {"rollout": batch, "onpolicy": OnPolicyRecord.concat(list(records)), "metrics": metrics}

    def clip_and_norm(self) -> float:
        """Total gradient 2-norm before clipping (clipped in place when `grad_clip` is set).

        A backbone sharded over TP (`clip_grad_norm_` method) computes the norm of the unsharded model.
        """
        max_norm = self.grad_clip if self.grad_clip is not None else float("inf")
        if hasattr(self.policy, "clip_grad_norm_"):
            return float(self.policy.clip_grad_norm_(max_norm))
        params = [p for p in self.policy.parameters() if p.grad is not None]
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def hf_named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) pairs of the policy for `WeightSync` (a sharded backbone gathers its TP shards)."""
        if hasattr(self.policy, "hf_named_tensors"):
            yield from self.policy.hf_named_tensors()
            return
        for name, param in self.policy.named_parameters():
            yield name, param.detach()
