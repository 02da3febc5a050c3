"""`PolicyModule`: the RL LightningModule (manual optimisation) wiring a `Backbone`, the scorer, a loss and an
optimizer.

One `training_step` per rollout step:
1. old-log-prob pass without grad, with the weights the rollout sampled with (so it is also the on-policy pass
   that the mismatch callbacks read): masked and unmasked log-probs and entropy -> `OnPolicyRecord`; with
   `ppo_epochs=1` it reads the gradient pass's own forward (`accumulate_gradients`: one forward fewer, same
   values);
2. optional reference-model pass (frozen copy) for the KL term, and teacher pass (a frozen model of another
   checkpoint, `topp_rl.teacher`) for on-policy distillation: both score the same packed micro-batches;
3. `ppo_epochs` optimizer steps. Each step accumulates gradients over ALL micro-batches of the rollout step
   (one step per epoch, not one per micro-batch): the losses divide by the rollout step's global token / sequence
   counts, so the accumulated gradient equals that of one large batch, whatever the token budget per micro-batch.
   With `ppo_epochs=1` the update is exactly on-policy (ratio 1); more epochs reuse the rollout (PPO-style).
   The update itself is guarded (`optim_step`: non-finite gradients and float32 overflows stop the run).

The backbone runs the micro-batch schedule (`Backbone.forward_backward`, and `forward_only` for the no-grad
passes); the module hands it each micro-batch's loss as a function of the forward's output, so a backbone with
its own schedule (pipeline stages) trains through the same seam.

The backbone returns final hidden states and the output weight (`Backbone.forward_hidden`); `ToppLogProb`
never forms [T, V] logits for rows with candidates. The parallel layout is the backbone's: the module never
builds one. The module logs its own `train/*` figures (loss terms from the loss, grad norm, learning rate,
entropy, phase timings), reduced across ranks once per step, through the `StepMetrics` it brings as a callback.
"""

import contextlib
import copy
import dataclasses
import functools
import math
import resource
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

import lightning as L
import torch
from torch import Tensor, nn

from topp_rl.data import PackedBatch, RolloutBatch
from topp_rl.losses import LossInputs, PolicyLoss
from topp_rl.parallel import ParallelLayout, gather_tokens
from topp_rl.trainer.backbone import Backbone, BackboneBase, HFBackbone, nonfinite_parameters
from topp_rl.trainer.hook import ToppLogProb
from topp_rl.trainer.lora import BASE_RECORD
from topp_rl.trainer.metrics import SumCount, add_sums, reduce_sums
from topp_rl.trainer.optim_step import checked_grad_norm, checked_optimizer_step
from topp_rl.trainer.precision import LossScaledFP16
from topp_rl.trainer.records import OnPolicyRecord
from topp_rl.trainer.schedule import LRSchedule
from topp_rl.trainer.step_metrics import StepMetrics
from topp_rl.trainer.timer import PhaseTimer

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class TeacherServer(Protocol):
    """A teacher outside the process (`topp_rl.teacher.SGLangTeacher`): its log-probs [R] of a micro-batch's
    response tokens, in sample order, over the full vocabulary."""

    def logprobs(self, batch: PackedBatch) -> Tensor: ...

    def close(self) -> None: ...


def _check_backbone(model, slot: str) -> Backbone:
    if not isinstance(model, BackboneBase) or not isinstance(model, Backbone):
        hint = " wrap an HF causal LM as HFBackbone(model);" if isinstance(model, nn.Module) else ""
        raise TypeError(
            f"PolicyModule {slot} is a {type(model).__name__}, not a topp_rl.trainer.backbone.Backbone;{hint} "
            "Megatron models come from topp_rl.megatron.MegatronBackbone"
        )
    return model


class PolicyModule(L.LightningModule):
    """Policy-gradient training over rollout steps (`RolloutBatch`), exact over the rollout's candidate sets.

    `policy` (and `reference`, `teacher`) are `Backbone`s; a strategy that shards them hands its own versions over
    through `use_backbones`. The teacher is scored over the sampler's kept sets (`teacher_use_mask`, with
    `module.use_mask`) or over the full vocabulary (`topp_rl.losses.distill` states the KL exactly). `loss` is a `topp_rl.losses.PolicyLoss`; when it needs reference log-probs and no
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
        teacher: Backbone | None = None,
        teacher_use_mask: bool = False,
        teacher_server: TeacherServer | None = None,
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
        if reference is None and loss.needs_ref_logprobs and not _check_backbone(policy, "policy").has_frozen_base:
            reference = copy.deepcopy(policy)  # a frozen base (LoRA) is its own reference: its base, adapters off
        if teacher is not None and teacher_server is not None:
            raise ValueError("PolicyModule takes a teacher backbone or a teacher server, not both")
        if loss.needs_teacher_logprobs and teacher is None and teacher_server is None:
            raise ValueError(
                f"the loss {type(loss).__name__} has teacher_kl_coeff={loss.teacher.coef} but no teacher is given; "
                "configure one (teacher=hf_path teacher.path=DIR) or set algo.teacher_kl_coeff=0"
            )
        self.use_backbones(policy=policy, reference=reference, teacher=teacher)
        self.teacher_use_mask = teacher_use_mask
        self.teacher_server = teacher_server
        self.loss_fn = loss
        self.optimizer_factory = optimizer
        self.hook = hook
        self.ppo_epochs = ppo_epochs
        self.grad_clip = grad_clip
        self.lr_schedule = lr_schedule or LRSchedule()

    def use_backbones(self, *, policy: Backbone, reference: Backbone | None, teacher: Backbone | None) -> None:
        """Install the policy (and frozen reference and teacher) backbones: the one hand-over point for strategies."""
        self.policy = _check_backbone(policy, "policy")
        self.reference = _frozen(reference, "reference", policy=policy)
        self.teacher = _frozen(teacher, "teacher", policy=policy)

    @property
    def layout(self) -> ParallelLayout:
        return self.policy.layout

    def on_fit_start(self) -> None:
        if self.trainer.is_global_zero:
            layers = getattr(self.policy.hf_config, "num_hidden_layers", None)
            print(f"[topp_rl] layout: {self.layout.describe(world_size=self.trainer.world_size, num_layers=layers)}",
                  flush=True)

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

    def teardown(self, stage: str) -> None:
        if self.teacher_server is not None:  # its connections and threads; the server itself is not ours
            self.teacher_server.close()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # LoRA: the adapters only, the base is rebuilt from the run config
        if (record := self.policy.drop_base(checkpoint["state_dict"], prefix="policy.")) is not None:
            checkpoint[BASE_RECORD] = record

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if BASE_RECORD in checkpoint:
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
        (out,) = self.policy.forward_only([batch], self.onpolicy_from_hidden)
        return out

    @torch.no_grad()
    def onpolicy_from_hidden(self, batch: PackedBatch, hidden: Tensor, weight: Tensor, *,
                             masked: Tensor | None = None) -> tuple[Tensor, OnPolicyRecord]:
        """`onpolicy_pass` from a forward already made (detached here: the record carries no gradient); `masked`:
        this rank's masked log-probs, already scored from it by the hook (see `ToppLogProb.onpolicy`)."""
        hidden, weight = hidden.detach(), weight.detach()
        token_index, record = self.hook.onpolicy(batch, layout=self.layout, hidden=hidden, weight=weight, masked=masked)
        if (agreement := self.policy.routing_agreement()) is not None:  # of the forward that made `hidden`
            record = dataclasses.replace(record, routing_agreement=agreement)
        # The loss's old log-probs honour the use_mask switch; the record always carries both figures.
        old = record.logprobs if self.hook.use_mask else record.logprobs_unmasked
        return self._gather(old, token_index, batch), record

    def reference_pass(self, micro: list[PackedBatch]) -> list[torch.Tensor | None]:
        """Reference log-probs [R] per micro-batch (None without a reference model): the frozen copy, or the
        policy's own frozen base (`has_frozen_base`)."""
        if self.reference is not None:
            model, weights = self.reference, contextlib.nullcontext()
        elif self.loss_fn.needs_ref_logprobs and self.policy.has_frozen_base:
            model, weights = self.policy, self.policy.base_weights()
        else:
            return [None] * len(micro)
        # KL without the candidate mask scores the reference over the full vocabulary.
        use_mask = self.hook.use_mask and self.loss_fn.kl_use_candidate_mask
        with weights:
            return model.forward_only(micro, functools.partial(self.score_hidden, use_mask=use_mask))

    @torch.no_grad()
    def teacher_pass(self, micro: list[PackedBatch]) -> list[Tensor | None]:
        """Teacher log-probs [R] per micro-batch (None without a teacher), over the kept sets where
        `teacher_use_mask` (and `module.use_mask`) say so, else over the full vocabulary."""
        if self.teacher_server is not None:
            return [self.teacher_server.logprobs(mb).to(mb.tokens.device) for mb in micro]
        if self.teacher is None:
            return [None] * len(micro)
        use_mask = self.hook.use_mask and self.teacher_use_mask
        return self.teacher.forward_only(micro, functools.partial(self.score_hidden, use_mask=use_mask))

    def accumulate_gradients(self, micro: list[PackedBatch], refs: list[Tensor | None], *,
                             old: list[Tensor] | None, timer: PhaseTimer,
                             teachers: list[Tensor | None] | None = None) -> tuple[dict[str, SumCount], list[OnPolicyRecord]]:
        """Backward of the loss over every micro-batch into .grad, in the backbone's schedule
        (`Backbone.forward_backward`): the loss divides by the step's global counts, so the accumulated gradient
        equals that of one batch holding all micro-batches. Returns the loss sums and the on-policy records made here.

        `old=None` (`ppo_epochs=1`): the weights have not changed since the rollout, so each micro-batch's old
        log-probs and on-policy record come from this forward, detached (the values of a separate no-grad pass,
        one forward fewer; with the mask on, the old log-probs are the loss's own, detached, so the ratio is
        exactly 1); their time is the `old_logprob` phase's."""

        def loss_step(i: int, mb: PackedBatch, hidden: Tensor, weight: Tensor):
            scored = self.hook(mb, layout=self.layout, hidden=hidden, weight=weight,
                               return_entropy=self.loss_fn.needs_entropy)
            if old is None:
                with timer.phase("old_logprob"):
                    masked = scored.logprobs if self.hook.use_mask else None
                    mb_old, record = self.onpolicy_from_hidden(mb, hidden, weight, masked=masked)
            else:
                mb_old, record = old[i], None
            logprobs = self._gather(scored.logprobs, scored.token_index, mb)
            entropy = None if scored.entropy is None else self._gather(scored.entropy, scored.token_index, mb)
            teacher = teachers[i] if teachers is not None else None
            loss, sums = self.loss_fn(_loss_inputs(mb, logprobs, mb_old, refs[i], teacher=teacher, entropy=entropy))
            # this micro-batch's MoE routing figures: averaged over micro-batches and ranks
            moe = {f"train/{k}": (float(v), 1.0) for k, v in self.policy.moe_stats().items()}
            return loss, (sums | moe, record)

        backward = self.manual_backward if self._trainer is not None else torch.Tensor.backward
        outputs = self.policy.forward_backward(micro, loss_step, backward=backward)
        metrics: dict[str, SumCount] = {}
        for sums, _ in outputs:
            add_sums(metrics, sums)
        return metrics, [record for _, record in outputs if record is not None]

    def training_step(self, batch: RolloutBatch, batch_idx: int) -> dict:
        micro = batch.micro_batches
        timer = PhaseTimer()
        old, records = None, []
        with timer.phase("old_logprob"):
            if self.ppo_epochs > 1:  # one epoch: the gradient pass makes them (`accumulate_gradients`)
                old, records = map(list, zip(*self.policy.forward_only(micro, self.onpolicy_from_hidden), strict=True))
            refs = self.reference_pass(micro)
        if self.teacher is not None or self.teacher_server is not None:
            with timer.phase("teacher"):
                teachers = self.teacher_pass(micro)
        else:
            teachers = None
        opt = self.optimizers()
        lr = float(opt.param_groups[0]["lr"])  # the lr this step's updates use
        metrics: dict[str, SumCount] = {}
        with timer.phase("optim"):
            for _ in range(self.ppo_epochs):
                opt.zero_grad(set_to_none=True)
                sums, made = self.accumulate_gradients(micro, refs, old=old, timer=timer, teachers=teachers)
                records += made
                add_sums(metrics, sums | self.optimizer_update(opt))
                if self._trainer is not None:
                    self.lr_schedulers().step()
        record = OnPolicyRecord.concat(records)
        tokens = sum(int(mb.tokens.numel()) for mb in micro) * self.ppo_epochs
        metrics |= _record_metrics(record) | _perf_metrics(timer, tokens=tokens)
        self.log_step_metrics(metrics, lr=lr, step=self.global_step)
        return {"rollout": batch, "onpolicy": record, "metrics": metrics}

    def optimizer_update(self, opt) -> dict[str, SumCount]:
        """One guarded update (`optim_step`): clip, step, check; its grad norm, and the loss scale under fp16 (read
        after the step: halved if it overflowed)."""
        plugin = self.trainer.precision_plugin if self._trainer is not None else None
        scaler = plugin if isinstance(plugin, LossScaledFP16) else None
        all_ranks = (functools.partial(self.trainer.strategy.reduce_boolean_decision, all=True)
                     if self._trainer is not None else None)
        grad_norm = checked_grad_norm(self.policy, opt, grad_clip=self.grad_clip, scaler=scaler, step=self.global_step)
        checked_optimizer_step(opt, step=self.global_step, all_ranks=all_ranks)
        update = {"train/grad_norm": (grad_norm, 1.0)}
        if scaler is not None:
            update["train/loss_scale"] = (scaler.scaler.get_scale(), 1.0)
        return update

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

    def hf_named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) pairs of the policy for `WeightSync` (a TP collective for a sharded backbone)."""
        return self.policy.hf_named_tensors()


__all__ = ["Backbone", "HFBackbone", "PolicyModule"]


def _frozen(backbone: Backbone | None, slot: str, *, policy: Backbone) -> Backbone | None:
    """`backbone` frozen in eval mode, checked to share the policy's layout (the scorer's vocabulary split)."""
    if backbone is None:
        return None
    backbone = _check_backbone(backbone, slot).requires_grad_(False).eval()
    if backbone.layout != policy.layout:
        raise ValueError(
            f"{slot} layout {backbone.layout} differs from the policy's {policy.layout}; build both backbones from "
            "the same parallel config (and, for a teacher, the same vocabulary size)"
        )
    return backbone


def _loss_inputs(batch: PackedBatch, logprobs: Tensor, old: Tensor, ref: Tensor | None, *,
                 teacher: Tensor | None = None, entropy: Tensor | None = None) -> LossInputs:
    seq_index = torch.repeat_interleave(batch.sample_index, batch.response_lengths)
    return LossInputs(
        logprobs=logprobs, old_logprobs=old, advantages=batch.advantages, loss_mask=batch.loss_mask,
        seq_index=seq_index, num_loss_tokens_global=float(batch.num_loss_tokens_global),
        num_sequences_global=int(batch.num_sequences_global), ref_logprobs=ref,
        rollout_logprobs=batch.rollout_log_probs, teacher_logprobs=teacher, entropy=entropy,
    )


def _record_metrics(record: OnPolicyRecord) -> dict[str, SumCount]:
    """The step's entropy over trainable tokens, and its MoE routing agreement where routes were recorded."""
    keep = record.loss_mask > 0
    metrics = {"train/entropy": (float(record.entropy[keep].double().sum()), float(keep.sum()))}
    if record.routing_agreement is not None:
        metrics["train/routing_agreement"] = record.routing_agreement
    return metrics


def _perf_metrics(timer: PhaseTimer, *, tokens: int) -> dict[str, SumCount]:
    old_s, optim_s = timer.seconds["old_logprob"], timer.seconds["optim"]
    return {
        "perf/old_logprob_s": (old_s, 1.0),
        "perf/optim_s": (optim_s, 1.0),
        "perf/train_tokens_per_s": (tokens / max(optim_s, 1e-9), 1.0),
        "perf/peak_rss_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1.0),
    } | ({"perf/teacher_s": (timer.seconds["teacher"], 1.0)} if "teacher" in timer.seconds else {})
