"""`PolicyModule`: the RL LightningModule (manual optimisation) wiring a `Backbone`, the scorer, a loss and an
optimizer.

One `training_step` per rollout step:
1. old-log-prob pass without grad, with the weights the rollout sampled with (so it is also the on-policy pass
   that the mismatch callbacks read): masked and unmasked log-probs and entropy -> `OnPolicyRecord`; with
   `ppo_epochs=1` it reads the gradient pass's own forward (`accumulate_gradients`: one forward fewer, same
   values);
2. optional reference-model pass (frozen copy) for the KL term;
3. `ppo_epochs` optimizer steps. Each step accumulates gradients over ALL micro-batches of the rollout step
   (one step per epoch, not one per micro-batch): the losses divide by the rollout step's global token / sequence
   counts, so the accumulated gradient equals that of one large batch, whatever the token budget per micro-batch.
   With `ppo_epochs=1` the update is exactly on-policy (ratio 1); more epochs reuse the rollout (PPO-style).

The backbone returns final hidden states and the output weight (`Backbone.forward_hidden`); `ToppLogProb`
never forms [T, V] logits for rows with candidates. The parallel layout is the backbone's: the module never
builds one. The module logs its own `train/*` figures (loss terms from the loss, grad norm, learning rate,
entropy, phase timings), reduced across ranks once per step, through the `StepMetrics` it brings as a callback.
"""

import contextlib
import copy
import dataclasses
import math
import resource
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, runtime_checkable

import lightning as L
import torch
from torch import Tensor, nn

from topp_rl.data import PackedBatch, RolloutBatch
from topp_rl.losses import LossInputs, PolicyLoss
from topp_rl.parallel import ParallelLayout, gather_tokens
from topp_rl.trainer.backbone import (
    Backbone,
    FrozenBase,
    HFBackbone,
    LeavesBaseOut,
    ReportsRouting,
    SyncsGradients,
    local_tensor,
    nonfinite_parameters,
)
from topp_rl.trainer.hook import ToppLogProb
from topp_rl.trainer.lora import BASE_RECORD
from topp_rl.trainer.metrics import SumCount, add_sums, reduce_sums
from topp_rl.trainer.precision import LossScaledFP16
from topp_rl.trainer.records import OnPolicyRecord
from topp_rl.trainer.schedule import LRSchedule
from topp_rl.trainer.step_metrics import StepMetrics
from topp_rl.trainer.timer import PhaseTimer

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@runtime_checkable
class ReportsMoE(Protocol):
    """A backbone that reports its MoE layers' routing after each forward (`MegatronBackbone`)."""

    def moe_stats(self) -> dict[str, Tensor]:
        """`moe_aux_loss` (switch load-balancing loss summed over MoE layers, no coefficient) and
        `expert_load_max_frac` (routed-token share of a layer's busiest expert, max over layers); {} if dense."""
        ...


def _check_backbone(model, slot: str) -> Backbone:
    if not isinstance(model, nn.Module) or not isinstance(model, Backbone):
        hint = " wrap an HF causal LM as HFBackbone(model);" if isinstance(model, nn.Module) else ""
        raise TypeError(
            f"PolicyModule {slot} is a {type(model).__name__}, not a topp_rl.trainer.backbone.Backbone;{hint} "
            "Megatron models come from topp_rl.megatron.MegatronBackbone"
        )
    return model


class PolicyModule(L.LightningModule):
    """Policy-gradient training over rollout steps (`RolloutBatch`), exact over the rollout's candidate sets.

    `policy` (and `reference`) are `Backbone`s; a strategy that shards them hands its own versions over
    through `use_backbones`. `loss` is a `topp_rl.losses.PolicyLoss`; when it needs reference log-probs and no
    `reference` is given, the reference is a frozen copy of the initial policy. `optimizer` is a factory
    (Hydra `_partial_`).
    """

    def __init__(
        self,
        *,
        policy: Backbone,
        loss: PolicyLoss,
        optimizer: OptimizerFactory,
        hook: ToppLogProb,
        reference: Backbone | None = None,
        ppo_epochs: int = 1,
        grad_clip: float | None = 1.0,
        lr_schedule: LRSchedule | None = None,
    ) -> None:
        super().__init__()
        if ppo_epochs < 1:
            raise ValueError(f"ppo_epochs ({ppo_epochs}) must be >= 1; use 1 for plain on-policy updates")
        if grad_clip is not None and not grad_clip > 0:
            raise ValueError(f"grad_clip ({grad_clip}) must be > 0, or null to disable clipping")
        self.automatic_optimization = False
        if reference is None and loss.needs_ref_logprobs and not isinstance(policy, FrozenBase):
            reference = copy.deepcopy(policy)  # a FrozenBase (LoRA) is its own reference: its base, adapters off
        self.use_backbones(policy=policy, reference=reference)
        self.loss_fn = loss
        self.optimizer_factory = optimizer
        self.hook = hook
        self.ppo_epochs = ppo_epochs
        self.grad_clip = grad_clip
        self.lr_schedule = lr_schedule or LRSchedule()

    def use_backbones(self, *, policy: Backbone, reference: Backbone | None) -> None:
        """Install the policy (and frozen reference) backbones: the one hand-over point for strategies."""
        self.policy = _check_backbone(policy, "policy")
        self.reference = None
        if reference is not None:
            self.reference = _check_backbone(reference, "reference").requires_grad_(False).eval()
            if reference.layout != policy.layout:
                raise ValueError(
                    f"reference layout {reference.layout} differs from the policy's {policy.layout}; build both "
                    "backbones from the same parallel config"
                )

    @property
    def layout(self) -> ParallelLayout:
        return self.policy.layout

    def on_fit_start(self) -> None:
        if self.trainer.is_global_zero:
            print(f"[topp_rl] layout: {self.layout.describe(world_size=self.trainer.world_size)}", flush=True)

    def on_train_start(self) -> None:
        # After any checkpoint restore: a NaN saved into a checkpoint must not train silently. Every rank checks
        # its own shards and all ranks decide together, so none is left waiting in a collective.
        bad = nonfinite_parameters(self.policy)
        if not self.trainer.strategy.reduce_boolean_decision(not bad, all=True):
            where = f"parameter {bad[0]!r} and {len(bad) - 1} more" if bad else "another rank's parameters"
            raise FloatingPointError(
                f"the policy holds non-finite weights (NaN or inf) at train start ({where}); a resumed checkpoint "
                "may be corrupt: resume from an earlier one, or start over"
            )

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if isinstance(self.policy, LeavesBaseOut):  # the adapters only: the base is rebuilt from the run config
            checkpoint[BASE_RECORD] = self.policy.drop_base(checkpoint["state_dict"], prefix="policy.")

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if isinstance(self.policy, LeavesBaseOut) and BASE_RECORD in checkpoint:
            self.policy.restore_base(checkpoint["state_dict"], checkpoint[BASE_RECORD], prefix="policy.")

    def configure_callbacks(self) -> list[StepMetrics]:
        # The owner of the step's figures, which it logs in one call per step; Lightning runs a module's
        # callbacks after the trainer's, so it comes after every callback that adds figures.
        return [StepMetrics()]

    def configure_optimizers(self):
        optimizer = self.optimizer_factory([p for p in self.policy.parameters() if p.requires_grad])
        # Stepped once per optimizer step in training_step (manual optimisation), so it restores on resume.
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _gather(self, values: torch.Tensor, token_index: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        return gather_tokens(values, token_index, num_tokens=batch.response_tokens.numel(),
                             group=self.layout.cp_group)

    def score(self, model: Backbone, batch: PackedBatch, *, use_mask: bool) -> torch.Tensor:
        """Log-probs [R] of the batch's response tokens in sample order (grad when grad mode is on)."""
        hidden, weight = model.forward_hidden(batch)
        return self.score_hidden(batch, hidden, weight, use_mask=use_mask)

    def score_hidden(self, batch: PackedBatch, hidden: Tensor, weight: Tensor, *, use_mask: bool) -> Tensor:
        hook = self.hook if use_mask == self.hook.use_mask else ToppLogProb(
            use_mask=use_mask, temperature=self.hook.temperature
        )
        out = hook(batch, layout=self.layout, hidden=hidden, weight=weight)
        return self._gather(out.logprobs, out.token_index, batch)

    def onpolicy_pass(self, batch: PackedBatch) -> tuple[torch.Tensor, OnPolicyRecord]:
        """(old log-probs [R] for the loss, the on-policy record over this rank's tokens)."""
        with torch.no_grad():
            hidden, weight = self.policy.forward_hidden(batch)
        return self.onpolicy_from_hidden(batch, hidden, weight)

    @torch.no_grad()
    def onpolicy_from_hidden(self, batch: PackedBatch, hidden: Tensor, weight: Tensor, *,
                             masked: Tensor | None = None) -> tuple[Tensor, OnPolicyRecord]:
        """`onpolicy_pass` from a forward already made (detached here: the record carries no gradient); `masked`:
        this rank's masked log-probs, already scored from it by the hook (see `ToppLogProb.onpolicy`)."""
        hidden, weight = hidden.detach(), weight.detach()
        token_index, record = self.hook.onpolicy(batch, layout=self.layout, hidden=hidden, weight=weight, masked=masked)
        if isinstance(self.policy, ReportsRouting):  # read right after the forward that made `hidden`
            record = dataclasses.replace(record, routing_agreement=self.policy.routing_agreement())
        # The loss's old log-probs honour the use_mask switch; the record always carries both figures.
        old = record.logprobs if self.hook.use_mask else record.logprobs_unmasked
        return self._gather(old, token_index, batch), record

    def loss_inputs(self, batch: PackedBatch, logprobs: Tensor, old: Tensor, ref: Tensor | None) -> LossInputs:
        seq_index = torch.repeat_interleave(batch.sample_index, batch.response_lengths)
        return LossInputs(
            logprobs=logprobs, old_logprobs=old, advantages=batch.advantages, loss_mask=batch.loss_mask,
            seq_index=seq_index, num_loss_tokens_global=float(batch.num_loss_tokens_global),
            num_sequences_global=int(batch.num_sequences_global), ref_logprobs=ref,
            rollout_logprobs=batch.rollout_log_probs,
        )

    def reference_pass(self, micro: list[PackedBatch]) -> list[torch.Tensor | None]:
        """Reference log-probs [R] per micro-batch (None without a reference model): the frozen copy, or a
        `FrozenBase` policy's own base weights."""
        if self.reference is not None:
            model, weights = self.reference, contextlib.nullcontext()
        elif self.loss_fn.needs_ref_logprobs and isinstance(self.policy, FrozenBase):
            model, weights = self.policy, self.policy.base_weights()
        else:
            return [None] * len(micro)
        # KL without the candidate mask scores the reference over the full vocabulary.
        use_mask = self.hook.use_mask and self.loss_fn.kl_use_candidate_mask
        with torch.no_grad(), weights:
            return [self.score(model, mb, use_mask=use_mask) for mb in micro]

    def accumulate_gradients(self, micro: list[PackedBatch], refs: list[Tensor | None], *,
                             old: list[Tensor] | None, timer: PhaseTimer) -> tuple[dict[str, SumCount], list[OnPolicyRecord]]:
        """Backward of the loss over every micro-batch into .grad: the loss divides by the step's global counts,
        so the accumulated gradient equals that of one batch holding all micro-batches. Returns the loss sums and
        the on-policy records made here.

        `old=None` (`ppo_epochs=1`): the weights have not changed since the rollout, so each micro-batch's old
        log-probs and on-policy record come from this forward, detached (the values of a separate no-grad pass,
        one forward fewer; with the mask on, the old log-probs are the loss's own, detached, so the ratio is
        exactly 1); their time is the `old_logprob` phase's."""
        metrics: dict[str, SumCount] = {}
        records = []
        for i, (mb, ref) in enumerate(zip(micro, refs, strict=True)):
            if isinstance(self.policy, SyncsGradients):  # one reduction per step: after the last backward
                self.policy.set_gradient_sync(i == len(micro) - 1)
            hidden, weight = self.policy.forward_hidden(mb)
            scored = self.hook(mb, layout=self.layout, hidden=hidden, weight=weight)
            if old is None:
                with timer.phase("old_logprob"):
                    masked = scored.logprobs if self.hook.use_mask else None
                    mb_old, record = self.onpolicy_from_hidden(mb, hidden, weight, masked=masked)
                records.append(record)
            else:
                mb_old = old[i]
            logprobs = self._gather(scored.logprobs, scored.token_index, mb)
            self.backward_loss(mb, logprobs, old=mb_old, ref=ref, metrics=metrics)
        return metrics, records

    def backward_loss(self, mb: PackedBatch, logprobs: Tensor, *, old: Tensor, ref: Tensor | None, metrics: dict[str, SumCount]) -> None:
        """One micro-batch's loss from its log-probs [R] (with grad), backward into .grad; its sums into `metrics`."""
        loss, loss_metrics = self.loss_fn(self.loss_inputs(mb, logprobs, old, ref))
        (self.manual_backward if self._trainer is not None else torch.Tensor.backward)(loss)
        add_sums(metrics, loss_metrics)
        if isinstance(self.policy, ReportsMoE):  # this micro-batch's routing: averaged over micro-batches and ranks
            add_sums(metrics, {f"train/{k}": (float(v), 1.0) for k, v in self.policy.moe_stats().items()})

    def training_step(self, batch: RolloutBatch, batch_idx: int) -> dict:
        micro = batch.micro_batches
        timer = PhaseTimer()
        fused = self.ppo_epochs == 1  # the gradient pass also makes the old log-probs (`accumulate_gradients`)
        old, records = None, []
        with timer.phase("old_logprob"):
            if not fused:
                old, records = map(list, zip(*(self.onpolicy_pass(mb) for mb in micro), strict=True))
            refs = self.reference_pass(micro)
        opt = self.optimizers()
        lr = float(opt.param_groups[0]["lr"])  # the lr this step's updates use
        metrics: dict[str, SumCount] = {}
        with timer.phase("optim"):
            for _ in range(self.ppo_epochs):
                opt.zero_grad(set_to_none=True)
                sums, made = self.accumulate_gradients(micro, refs, old=old, timer=timer)
                records += made
                add_sums(metrics, sums | {"train/grad_norm": (self.checked_grad_norm(opt), 1.0)})
                self.optimizer_step_checked(opt, step=self.global_step)
                if (scaler := self.loss_scaler()) is not None:  # after the step: halved if it overflowed
                    add_sums(metrics, {"train/loss_scale": (scaler.scaler.get_scale(), 1.0)})
                if self._trainer is not None:
                    self.lr_schedulers().step()
        record = OnPolicyRecord.concat(records)
        keep = record.loss_mask > 0
        metrics["train/entropy"] = (float(record.entropy[keep].double().sum()), float(keep.sum()))
        if record.routing_agreement is not None:
            metrics["train/routing_agreement"] = record.routing_agreement
        tokens = sum(int(mb.tokens.numel()) for mb in micro) * self.ppo_epochs
        old_s, optim_s = timer.seconds["old_logprob"], timer.seconds["optim"]
        metrics["perf/old_logprob_s"] = (old_s, 1.0)
        metrics["perf/optim_s"] = (optim_s, 1.0)
        metrics["perf/train_tokens_per_s"] = (tokens / max(optim_s, 1e-9), 1.0)
        metrics["perf/peak_rss_mb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1.0)
        self.log_step_metrics(metrics, lr=lr, step=self.global_step)
        return {"rollout": batch, "onpolicy": record, "metrics": metrics}

    def loss_scaler(self) -> LossScaledFP16 | None:
        plugin = self.trainer.precision_plugin if self._trainer is not None else None
        return plugin if isinstance(plugin, LossScaledFP16) else None

    def checked_grad_norm(self, opt) -> float:
        """`clip_and_norm` of the true (unscaled) gradient. A non-finite norm stops the run before the update is
        applied, unless a loss scale is in use: then it is an fp16 overflow, whose update the scaler skips."""
        scaler = self.loss_scaler()
        if scaler is not None:
            scaler.unscale(opt.optimizer)  # clip and report the gradient itself, not ~2^16 times it
        grad_norm = self.clip_and_norm()  # of the whole (unsharded, DP-summed) gradient: equal on every rank
        if not math.isfinite(grad_norm) and scaler is None:
            raise FloatingPointError(
                f"step {self.global_step}: train/grad_norm is {grad_norm} (non-finite gradient); the update is not "
                "applied. Common causes: a learning rate too high for the model (optimizer.lr), a NaN in the "
                "weights or data, rewards of extreme size"
            )
        return grad_norm

    def optimizer_step_checked(self, opt, *, step: int) -> None:
        """`opt.step()`; an update that overflows float32 stops the run naming the step and the learning rate.
        The foreach AdamW raises on its overflowing scalar; the fused one leaves inf / NaN weights, found here by
        one min / max reduction per tensor (all ranks decide together, so none is left in a collective)."""
        lr = opt.param_groups[0]["lr"]
        try:
            opt.step()
        except RuntimeError as err:
            if "overflow" not in str(err):
                raise
            raise _overflow(step, lr, str(err)) from err
        params = [local_tensor(p.detach()) for group in opt.param_groups for p in group["params"]]
        params = [p for p in params if p.numel()]  # an FSDP rank may hold an empty shard of a small tensor
        # min and max are finite iff every entry is (they propagate NaN); `aminmax` reads each tensor once at the
        # speed of a sum, where the inf-norm (abs, then max) ran 5x slower on CPU (measured: 0.45 s at SmolLM2)
        finite = not params or bool(torch.isfinite(torch.stack([torch.stack(torch.aminmax(p)) for p in params])).all())
        if self._trainer is not None:
            finite = self.trainer.strategy.reduce_boolean_decision(finite, all=True)
        if not finite:
            raise _overflow(step, lr, "the weights hold inf or NaN after it")

    def log_step_metrics(self, sums: dict[str, SumCount], *, lr: float, step: int) -> dict[str, float]:
        """Reduce the step's (sum, count) pairs across ranks once, stop on a non-finite loss or entropy (the
        reduced values are equal on every rank, so all ranks stop together), and log them with the lr."""
        if self._trainer is None:
            return {}
        values = reduce_sums(self.trainer, sums) | {"train/lr": lr}
        for key in ("train/loss", "train/entropy"):
            if key in values and not math.isfinite(values[key]):
                raise FloatingPointError(
                    f"step {step}: {key} is {values[key]} (non-finite); the run stops rather than train on it. "
                    "Check the weights (a NaN in a resumed checkpoint?), rollout.temperature and the rewards"
                )
        StepMetrics.of(self.trainer).add(self.trainer, values)
        return values

    def clip_and_norm(self) -> float:
        """Total gradient 2-norm of the unsharded model before clipping (clipped in place when `grad_clip`)."""
        max_norm = self.grad_clip if self.grad_clip is not None else float("inf")
        return float(self.policy.clip_grad_norm_(max_norm))

    def hf_named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) pairs of the policy for `WeightSync` (a TP collective for a sharded backbone)."""
        return self.policy.hf_named_tensors()


__all__ = ["Backbone", "HFBackbone", "PolicyModule"]


def _overflow(step: int, lr: float, what: str) -> FloatingPointError:
    return FloatingPointError(
        f"step {step}: the optimizer update overflowed float32 ({what}); optimizer.lr={lr:g} is far too large "
        "for this model: lower it (e.g. 1e-3 for the tiny model, 1e-6 for SmolLM2)"
    )
