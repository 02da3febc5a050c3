"""`RolloutDataModule`: rollout steps as Lightning batches, generated on-policy right before `training_step`.

Lightning fetches one batch ahead, so the dataloader yields only cheap `RolloutTicket`s (step index, this DP
rank's prompt records, a generation seed). `on_before_batch_transfer` - called for the current batch after the
previous step's weights reached the engine (`WeightSync`) - runs the rollout step (`rollout_step`, a
`topp_rl.rollout.step.RolloutStep`: generate, number, score), computes advantages, optionally drops
zero-variance groups and packs a `RolloutBatch` (`topp_rl.rollout.packing.pack_samples`).

Data parallel: `prompts_per_step` counts prompts per step over ALL DP ranks; DP rank r takes the r-th slice
of each step's prompts (`topp_rl.rollout.tickets`). The DP rank and size default to the trainer's global rank
and world size (the data-parallel ones under a model-parallel strategy); pass `dp_rank` / `dp_size` to fix them. The loss denominators (`num_loss_tokens_global`,
`num_sequences_global`) are summed over DP ranks, by `collectives` (`topp_rl.parallel.collectives`).

Tensor / context parallel: a strategy that `SharesRollouts` (MegatronStrategy) names each rank's TP x CP peers;
only their source rank creates the engine (`engine` may be a factory `dp_rank -> RolloutEngine`, called in
`setup`, after the process groups exist), generates and scores, and `share_samples` hands the scored samples
to the peers, so they hold byte-identical rollouts.

Rollouts ahead (`max_staleness=K`, 0 by default; `overlap=True` means K = 1): the generations of up to K steps
run on background threads while a step trains (`topp_rl.rollout.scheduler`); every token records the weight
version that sampled it, a group with a token more than K updates older than the trained weights is dropped, and
`rollout/staleness_*` log the gap. `partial_rollouts=True`: responses in flight continue across a weight update
(an `InFlightUpdates` engine). A checkpoint also holds the generations in flight (their samples and the
engine's weight version), so a resumed run trains no sample twice and loses none.

Dynamic sampling (`refill=True`, with `drop_zero_variance_groups`): after the step's own generation, refill
rounds on the next prompts until each DP rank holds its share of groups whose rewards differ, or generated
`max_refill_factor` times that share (`topp_rl.rollout.refill`); on-policy only (K = 0).

Overlong samples (`overlong`, `topp_rl.rollout.overlong`): DAPO's filtering of truncated samples out of the loss
and its soft length penalty, applied to the selected samples before their advantages.

State (`state_dict`): the next step to generate, the seed and the prompts refill rounds drew (they move the data
position on); prompts and generation seeds are functions of (seed, step, DP rank, that count), so a resumed run
continues identically. Aborted samples are kept in
`RolloutBatch.samples` (for stats) but never trained on.
"""

import contextlib
import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import lightning as L
import torch
from torch.utils.data import DataLoader

from topp_rl.data import PackedBatch, RolloutBatch
from topp_rl.data.params import SamplingParams
from topp_rl.data.sample import Sample, SampleStatus
from topp_rl.engines.base import ReleasesMemory, RolloutEngine
from topp_rl.engines.shared import SharedWorkersEngine
from topp_rl.parallel.collectives import DataParallelCollectives
from topp_rl.parallel.peers import RolloutPeers
from topp_rl.rollout.advantages import (
    AdvantageEstimator,
    GroupAdvantage,
    GroupSelection,
    informative_groups,
    trajectory_advantages,
)
from topp_rl.rollout.broadcast import share_object, share_samples
from topp_rl.rollout.overlong import Overlong
from topp_rl.rollout.packing import pack_samples
from topp_rl.rollout.record import RolloutRecorder
from topp_rl.rollout.refill import RefillPlan, check_refill, continue_indices
from topp_rl.rollout.replay import ReplaysRollouts
from topp_rl.rollout.scheduler import (
    RolloutScheduler,
    check_staleness_key,
    drop_stale_groups,
    staleness_stats,
    versioned,
)
from topp_rl.rollout.sharing import shared_workers
from topp_rl.rollout.stats import ahead_stats, group_stats, share_stats, step_stats
from topp_rl.rollout.step import RolloutStep, SingleTurnStep
from topp_rl.rollout.tickets import (
    RolloutTicket,
    TicketStream,
    local_prompt_count,
    make_ticket,
    refill_ticket,
)
from topp_rl.tasks import Task

__all__ = ["EngineFactory", "RolloutDataModule", "RolloutTicket", "SharesRollouts"]

EngineFactory = Callable[[int], RolloutEngine]  # dp_rank -> engine


@runtime_checkable
class SharesRollouts(Protocol):
    """A strategy whose ranks come in groups that train on one rollout (TP x CP peers of a DP rank)."""

    def rollout_peers(self) -> RolloutPeers: ...


class RolloutDataModule(L.LightningDataModule):
    def __init__(
        self,
        *,
        engine: RolloutEngine | EngineFactory,
        task: Task,
        tokenizer: Any,
        params: SamplingParams,
        prompts_per_step: int,
        max_tokens_per_micro_batch: int = 2048,
        advantage: AdvantageEstimator | None = None,
        drop_zero_variance_groups: bool = False,
        refill: bool = False,
        max_refill_factor: float = 4.0,
        seed: int = 0,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        overlap: bool = False,
        max_staleness: int = 0,
        partial_rollouts: bool = False,
        rollout_step: RolloutStep | None = None,
        recorder: RolloutRecorder | None = None,
        overlong: Overlong | None = None,
    ) -> None:
        super().__init__()
        if prompts_per_step < 1:
            raise ValueError(f"prompts_per_step ({prompts_per_step}) must be >= 1")
        if max_tokens_per_micro_batch < 1:
            raise ValueError(f"max_tokens_per_micro_batch ({max_tokens_per_micro_batch}) must be >= 1")
        self.max_staleness = check_staleness_key(max_staleness, overlap=overlap)
        if partial_rollouts and not self.max_staleness:
            raise ValueError("config rollout.partial_rollouts=true: needs rollout.max_staleness >= 1 (at 0 every "
                             "step is generated with the weights it trains, so no update meets a response); set "
                             "rollout.max_staleness=1 or more, or rollout.partial_rollouts=false")
        self.partial_rollouts = partial_rollouts
        check_refill(refill=refill, drop_zero_variance_groups=drop_zero_variance_groups,
                     max_refill_factor=max_refill_factor, max_staleness=self.max_staleness)
        if not (isinstance(engine, RolloutEngine) or callable(engine)):
            raise TypeError(
                f"engine is a {type(engine).__name__}; pass a RolloutEngine or a factory dp_rank -> RolloutEngine"
            )
        # None: on-policy, each step generated in place
        self._ahead = RolloutScheduler(self.max_staleness) if self.max_staleness else None
        self.engine: RolloutEngine | None = (
            self._for_schedule(engine) if isinstance(engine, RolloutEngine) else None
        )
        self._engine_factory = None if isinstance(engine, RolloutEngine) else engine
        self._shared: dict[str, Any] | None = None  # SharedWorkersEngine's settings, set at setup
        self.peers = RolloutPeers()  # alone until `setup` asks the strategy
        task.check_tokenizer(tokenizer)  # chat_template=true without a template: now, not at the first rollout
        self.task, self.tokenizer, self.params = task, tokenizer, params
        self.prompts_per_step = prompts_per_step
        self.max_tokens = max_tokens_per_micro_batch
        if advantage is not None and not callable(advantage):
            raise TypeError(
                f"advantage is a {type(advantage).__name__}; pass an estimator such as "
                "topp_rl.rollout.advantages.GroupAdvantage() (in config: algo.advantage._target_)"
            )
        self.advantage = advantage if advantage is not None else GroupAdvantage()
        if rollout_step is not None and not isinstance(rollout_step, RolloutStep):
            raise TypeError(
                f"rollout_step is a {type(rollout_step).__name__}; pass a topp_rl.rollout.step.RolloutStep such as "
                "SingleTurnStep() (in config: rollout.step._target_)"
            )
        self.rollout_step: RolloutStep = rollout_step if rollout_step is not None else SingleTurnStep()
        self.recorder = recorder  # rollout.record=true: every generation call's scored samples to disk
        self.overlong = overlong if overlong is not None else Overlong()
        self.overlong.check(max_new_tokens=params.max_new_tokens)
        self.drop_zero_variance_groups = drop_zero_variance_groups
        self.refill, self.max_refill_factor = refill, max_refill_factor
        self.seed = seed
        self._dp = (dp_rank, dp_size)
        self._collectives: DataParallelCollectives | None = None  # built at setup, or at first use without one
        self.min_micro_batches = 1  # the fewest a step packs: the strategy's (megatron's interleaved schedule), at setup
        self.step = 0  # next rollout step to generate
        self.refill_prompts = 0  # prompts refill rounds drew before `step`: they move its data position on
        self.last_generate_s = 0.0  # the engine time of the latest step's samples (wherever it ran)
        self._decoded = (0, 0)  # the engine's decode counts (rows, steps) at the previous step

    # ----- data parallel layout -----
    @property
    def dp_size(self) -> int:
        return self._dp[1] if self._dp[1] is not None else self._sampler_kwargs().get("num_replicas", 1)

    @property
    def dp_rank(self) -> int:
        return self._dp[0] if self._dp[0] is not None else self._sampler_kwargs().get("rank", 0)

    def _sampler_kwargs(self) -> dict:
        # Lightning's data-parallel coordinates: the global rank / world size under DDP, the data-parallel rank /
        # size under a model-parallel strategy (MegatronStrategy), so TP / CP peers draw the same prompts.
        kwargs = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        return kwargs or {}

    @property
    def collectives(self) -> DataParallelCollectives:
        """Sums, maxima and gathers over this rank's data-parallel group (built at `setup`, else at first use)."""
        if self._collectives is None:
            self._collectives = DataParallelCollectives.build(dp_rank=self.dp_rank, dp_size=self.dp_size,
                                                              peers=self.peers)
        return self._collectives

    # ----- engine: on the source rank of each TP x CP group only -----
    def setup(self, stage: str) -> None:
        strategy = self.trainer.strategy if self.trainer is not None else None
        self.peers = strategy.rollout_peers() if isinstance(strategy, SharesRollouts) else RolloutPeers()
        self.min_micro_batches = getattr(strategy, "min_micro_batches", 1)  # MegatronStrategy with virtual stages
        if self.peers.is_source:
            self.ensure_engine()
            if strategy is not None:  # a reward model scores on the trainer's device (it runs on this rank)
                self.task.reward_set.to_device(strategy.root_device)
        else:  # a TP x CP peer never generates: let go of the factory and the full HF model it holds
            self._engine_factory = None
        self._share_workers()
        # The DP group follows these peers; building it is a collective, so here, where every rank is.
        self._collectives = DataParallelCollectives.build(dp_rank=self.dp_rank, dp_size=self.dp_size, peers=self.peers)

    def ensure_engine(self) -> RolloutEngine:
        if self.engine is None:
            engine = self._engine_factory(self.dp_rank)
            if self._shared is not None:  # rebuilt after close_engine: the same sources share its workers
                engine = SharedWorkersEngine(engine, **self._shared)
            self.engine = self._for_schedule(engine)
        return self.engine

    def _share_workers(self) -> None:
        """Every rank (a collective): engines reaching the same workers push weights once (`sharing`)."""
        self._shared = shared_workers(self.engine, self.peers, max_staleness=self.max_staleness)
        if self._shared is not None:
            self.engine = SharedWorkersEngine(self.engine, **self._shared)

    def _for_schedule(self, engine: RolloutEngine) -> RolloutEngine:
        return engine if self._ahead is None else versioned(engine, partial=self.partial_rollouts)

    def close_engine(self) -> None:
        """Release a factory-built engine (servers, work dirs); idempotent, rebuilt on next use. An engine passed
        in as an instance belongs to the caller, who closes it. The generations in flight finish first."""
        if self._ahead is not None:
            self._ahead.wait()
        if self.engine is not None and self._engine_factory is not None:
            self.engine.close()
            self.engine, self._decoded = None, (0, 0)

    # ----- tickets -----
    def ticket(self, step: int) -> RolloutTicket:
        return make_ticket(self.task, self.tokenizer, step=step, prompts_per_step=self.prompts_per_step,
                           dp_rank=self.dp_rank, dp_size=self.dp_size, seed=self.seed, offset=self.refill_prompts)

    def train_dataloader(self) -> DataLoader:
        local_prompt_count(self.prompts_per_step, self.dp_size)  # fail at start on a bad split
        return DataLoader(TicketStream(self), batch_size=None, num_workers=0)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return self.rollout(batch) if isinstance(batch, RolloutTicket) else batch

    # ----- one rollout step -----
    def generate(self, ticket: RolloutTicket) -> list[Sample]:
        """This DP rank's scored samples of one step (on the source rank: the engine and the reward run here).
        With rollouts ahead the following steps' generations start first, so they run while this step's rewards
        are computed (the same weights either way: no update comes in between)."""
        ahead = self._ahead.take(ticket.step) if self._ahead is not None else None
        if ahead is not None:
            samples, self.last_generate_s = ahead
        else:
            start = time.perf_counter()
            samples = self._sample(ticket)
            self.last_generate_s = time.perf_counter() - start
        if self._ahead is not None:  # also after the last step: the final checkpoint holds them (extensible runs)
            self._ahead.start_ahead(ticket.step, lambda step: self._sample(self.ticket(step)),
                                    concurrent=self.ensure_engine().concurrent)
        scored = self.rollout_step.score(samples, ticket.records, self.params, task=self.task,
                                         tokenizer=self.tokenizer, first_group=ticket.first_group)
        if self.recorder is not None:
            self.recorder.write(scored, prompts=[r.prompt_ids for r in ticket.records], step=ticket.step,
                                seed=ticket.seed, dp_rank=self.dp_rank, dp_size=self.dp_size)
        return scored

    def _sample(self, ticket: RolloutTicket) -> list[Sample]:
        engine = self.ensure_engine()
        if isinstance(engine, ReplaysRollouts):  # rollout=replay: the recorded samples instead of a generation
            return engine.replay(ticket)
        return self.rollout_step.generate(engine, ticket.records, self.params, seed=ticket.seed,
                                          tokenizer=self.tokenizer)

    def rollout(self, ticket: RolloutTicket) -> RolloutBatch:
        if self.refill:  # the step's prompts follow the previous step's refill rounds: known now, not when the
            ticket = self.ticket(ticket.step)  # dataloader made this ticket (one step ahead)
        start = time.perf_counter()
        own, samples, share_seconds, shared_bytes = self._gather(ticket)
        ahead = own is not None and self._ahead is not None  # `generate` started the following steps
        rounds = drawn = 0
        if self.refill:
            samples, rounds, drawn, more_s, more_bytes = self._refill(ticket, samples)
            share_seconds, shared_bytes = share_seconds + more_s, shared_bytes + more_bytes
        gen_seconds = time.perf_counter() - start  # on a peer: the wait for its source's samples
        trained_version = self._trained_version()
        micro, selection, groups, ahead_figures, overlong_figures = self._pack(
            ticket.step, samples, trained_version=trained_version, most=len(ticket.records) if self.refill else None)
        self.step, self.refill_prompts = ticket.step + 1, self.refill_prompts + drawn
        # Ahead: the generation's own time (it ran beside earlier steps), not the wait for it.
        stats = step_stats(samples, micro, generate_s=self.last_generate_s if ahead else gen_seconds,
                           dropped=selection.filtered, groups=selection.groups) | self.rollout_step.stats(samples)
        stats["rollout/trained_tokens"] = (groups["loss_tokens"], 1.0)  # DP-global: the throughput benchmarks' count
        stats |= overlong_figures
        stats["perf/decode_batch_mean"] = self._decode_batch()
        if self.drop_zero_variance_groups:
            stats |= group_stats(groups, refill_rounds=rounds if self.refill else None)
        if self._ahead is not None:  # on every rank (peers count 0): all ranks reduce the same metric keys
            stats |= ahead_stats(own, self.engine, wait_s=gen_seconds) | ahead_figures
        if self.peers.size > 1:
            stats |= share_stats(self.peers, share_s=share_seconds, shared_bytes=shared_bytes)
        if isinstance(self.engine, ReleasesMemory):  # colocated: the step's generations are done, training starts
            self.engine.release_memory()
        return RolloutBatch(micro_batches=micro, samples=samples, step=ticket.step, stats=stats)

    def _decode_batch(self) -> tuple[float, float]:
        """(responses that sampled a token, decode steps) since the previous step: their ratio is the mean decode
        batch. (0, 0) on a peer and for an engine that does not count (the key is then left out)."""
        counts = self.engine.decode_counts if self.peers.is_source and self.engine is not None else None
        if counts is None:
            return 0.0, 0.0
        rows, steps = counts.rows - self._decoded[0], counts.steps - self._decoded[1]
        self._decoded = (counts.rows, counts.steps)
        return float(rows), float(steps)

    def _trained_version(self) -> int | None:
        """The weight version this step trains (every push so far is in the engine), the source's on every peer;
        None when on-policy."""
        if self._ahead is None:
            return None
        return share_object(self.engine.version if self.peers.is_source else None, self.peers)

    def _gather(self, ticket: RolloutTicket) -> tuple[list[Sample] | None, list[Sample], float, int]:
        """One generation: on the source, handed to its peers, checked on every rank. (The source's own samples
        or None, this rank's samples, seconds and bytes the hand-over took.)"""
        own = self.generate(ticket) if self.peers.is_source else None
        generated = time.perf_counter()
        samples, shared_bytes = share_samples(own, self.peers)
        share_seconds = time.perf_counter() - generated
        self.rollout_step.check(samples, reduce_sum=self.collectives.sum)  # every rank: all raise alike
        return own, samples, share_seconds, shared_bytes

    def _refill(self, ticket: RolloutTicket, samples: list[Sample]) -> tuple[list[Sample], int, int, float, int]:
        """Refill rounds after the step's own generation `samples` (`topp_rl.rollout.refill`): (the step's samples,
        rounds, prompts drawn over all DP ranks, hand-over seconds and bytes)."""
        plan = RefillPlan(target=len(ticket.records), max_factor=self.max_refill_factor)
        generated, rounds, drawn, share_seconds, shared_bytes = len(ticket.records), 0, 0, 0.0, 0
        with contextlib.ExitStack() as held:
            while any(sizes := self._round_sizes(plan.next_round(informative=_informative(samples),
                                                                 generated=generated))):
                if rounds == 0 and self.peers.is_source:
                    # A rank with nothing to generate in a round skips `generate`, which is a collective for an
                    # engine sampling with the FSDP-sharded module: every source holds the gathered weights
                    # through the rounds instead, entered together here (the sizes are the same on every rank).
                    held.enter_context(self.ensure_engine().holding_weights())
                rounds += 1
                new, seconds, sent = self._refill_round(ticket, number=rounds, first=self.prompts_per_step + drawn,
                                                        sizes=sizes)
                continue_indices(samples, new)
                samples = samples + new
                generated, drawn = generated + sizes[self.dp_rank], drawn + sum(sizes)
                share_seconds, shared_bytes = share_seconds + seconds, shared_bytes + sent
        return samples, rounds, drawn, share_seconds, shared_bytes

    def _refill_round(self, ticket: RolloutTicket, *, number: int, first: int,
                      sizes: list[int]) -> tuple[list[Sample], float, int]:
        """Refill round `number`, `sizes[r]` prompts for DP rank r: (this rank's samples, hand-over seconds and bytes).
        Its prompts follow every prompt the step drew before, and so do its prompt groups' numbers (group g of the
        step is data position step * prompts_per_step + refill_prompts + g): no two groups of a step share one."""
        more = refill_ticket(self.task, self.tokenizer, step=ticket.step, number=number, first_group=first,
                             start=ticket.step * self.prompts_per_step + self.refill_prompts + first, sizes=sizes,
                             dp_rank=self.dp_rank, seed=self.seed)
        if not more.records:  # nothing to generate here: the round's check is a collective all the same
            self.rollout_step.check([], reduce_sum=self.collectives.sum)
            return [], 0.0, 0
        _, new, seconds, sent = self._gather(more)
        return new, seconds, sent

    def _round_sizes(self, want: int) -> list[int]:
        """Every DP rank's `want` (the same list on every rank: one all-reduce over the DP group)."""
        mine = torch.zeros(self.dp_size, dtype=torch.int64)
        mine[self.dp_rank] = want
        return [int(v) for v in self.collectives.sum(mine).tolist()]

    def _pack(self, step: int, samples: list[Sample], *, trained_version: int | None,
              most: int | None = None) -> tuple[list[PackedBatch], GroupSelection, dict[str, float], dict, dict]:
        """(micro-batches, this rank's groups, the DP-global group counts, the staleness and overlong metrics):
        whole groups selected (none with a token older than max_staleness updates; at most `most` informative
        ones), overlong filtering and penalty, advantages, DP-global denominators, packing."""
        live = [s for s in samples if s.status != SampleStatus.ABORTED]
        stale = 0
        if trained_version is not None:
            live, stale = drop_stale_groups(live, trained_version=trained_version, max_staleness=self.max_staleness)
        selection = informative_groups(live, drop=self.drop_zero_variance_groups, most=most)
        train = selection.train
        dp = self.collectives
        # Per trajectory: a multi-turn trajectory split into several samples is one reward in its group's statistics.
        filtered = self.overlong.filter_truncated(train)  # before the denominators: its tokens leave the loss
        penalties = self.overlong.penalties(train, max_new_tokens=self.params.max_new_tokens)
        adv = trajectory_advantages(self.advantage, train, reduce=dp.sum,
                                    shaping=penalties if self.overlong.penalises else None)
        short = most is not None and selection.informative < most  # a refilled rank stopped at its budget
        totals = dp.sum(torch.tensor(
            [float(sum(sum(s.loss_mask) for s in train)), float(len(train)), float(not train), selection.groups,
             selection.filtered, selection.surplus, selection.trained, float(short)], dtype=torch.float64))
        if totals[2] > 0:  # reduced: every DP rank raises alike instead of hanging in the next collective
            _fail_without_samples(step, samples)
        # A step whose every token was filtered out trains on nothing: any denominator gives the zero loss.
        micro = pack_samples(train, adv, max_tokens=self.max_tokens, num_loss_tokens_global=float(totals[0]) or 1.0,
                             num_sequences_global=int(totals[1]), trained_version=trained_version,
                             most=lambda count: max(dp.max(count), self.min_micro_batches))
        groups = dict(zip(("generated", "filtered", "surplus", "trained", "capped_ranks"), totals[3:].tolist(),
                          strict=True)) | {"loss_tokens": float(totals[0])}
        figures = {} if trained_version is None else staleness_stats(train, trained_version=trained_version,
                                                                     dropped=stale, dp=dp)
        return micro, selection, groups, figures, self.overlong.stats(filtered=filtered, penalties=penalties)

    # ----- checkpoint state -----
    def state_dict(self) -> dict[str, Any]:
        state = {"step": self.step, "seed": self.seed, "prompts_per_step": self.prompts_per_step,
                 "refill_prompts": self.refill_prompts}
        if self._ahead is not None:  # per DP rank, the generations in flight from `self.step` on (waits for them)
            mine = self._ahead.state(self.step, self.engine) if self.peers.is_source else None
            # Every rank builds a checkpoint, Lightning writes rank 0's datamodule state: rank 0's DP group holds
            # the source of every DP rank.
            entries = self.collectives.gather_objects((self.dp_rank, mine))
            state["in_flight"] = {dp: entry for dp, entry in entries if entry is not None}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("prompts_per_step", self.prompts_per_step) != self.prompts_per_step:
            raise ValueError(
                f"checkpoint was written with prompts_per_step={state['prompts_per_step']}, this run has "
                f"{self.prompts_per_step}; resume with the same value so the data position means the same prompts"
            )
        self.step = int(state["step"])
        self.seed = int(state["seed"])
        self.refill_prompts = int(state.get("refill_prompts", 0))  # 0 in a checkpoint written before refill
        entry = (state.get("in_flight") or {}).get(self.dp_rank) if self._ahead is not None else None
        if entry is not None and self.peers.is_source:
            self._ahead.restore(entry, self.step, self.ensure_engine())


def _informative(samples: list[Sample]) -> int:
    """Groups of `samples` whose live rewards differ."""
    return informative_groups([s for s in samples if s.status != SampleStatus.ABORTED], drop=True).informative


def _fail_without_samples(step: int, samples: list[Sample]) -> None:
    """A step with no trainable sample on some DP rank stops the run rather than being skipped: a skip would
    need the module, every callback and every rank to agree on it, and would keep consuming prompts while the
    engine serves nothing (every sample aborted: someone called /abort_request, or the server is draining).
    The data position is not advanced, so resuming from the last checkpoint regenerates this very step."""
    reasons: dict[str, int] = {}
    for s in samples:
        if s.status == SampleStatus.ABORTED:
            reason = (s.metadata.get("finish_reason") or {}).get("message") or "no finish reason"
            reasons[reason] = reasons.get(reason, 0) + 1
    aborted = sum(reasons.values())
    raise RuntimeError(
        f"rollout step {step}: {aborted} of {len(samples)} samples on this rank were aborted by the engine "
        f"(finish reasons: {reasons}), and a data-parallel rank has no sample left to train on; find out why the "
        "engine aborts (its log; an /abort_request call), then resume from the last checkpoint (ckpt_path=last)"
    )

