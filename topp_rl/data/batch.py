"""`PackedBatch` (one THD-packed micro-batch) and `RolloutBatch` (a rollout step's micro-batches and samples):
what the trainer trains on. `topp_rl.rollout.packing` builds them; the layout is in docs/ARCHITECTURE.md."""

from dataclasses import dataclass, field, fields

import torch

from topp_rl.data.sample import Sample
from topp_rl.ops import Candidates


@dataclass(kw_only=True)
class PackedBatch:
    """One packed micro-batch. T tokens, B samples, R response tokens (shapes in brackets)."""

    tokens: torch.Tensor  # int64 [T]
    cu_seqlens: torch.Tensor  # int32 [B + 1]
    seq_lengths: torch.Tensor  # int64 [B]
    response_lengths: torch.Tensor  # int64 [B]
    position_ids: torch.Tensor  # int64 [T], restarting at 0 for every sequence
    loss_mask: torch.Tensor  # float32 [R]
    advantages: torch.Tensor  # float32 [R]
    rollout_log_probs: torch.Tensor  # float32 [R]
    response_tokens: torch.Tensor  # int64 [R]
    candidates: Candidates | None  # R rows, or None when no sample here recorded candidates
    # int16 [T, moe_layers, top_k] aligned with `tokens`: each token's recorded experts, NO_ROUTE (-1) rows where
    # none was recorded (every sequence's last token); None when no sample here carries routes
    routes: torch.Tensor | None = None
    # int64 [R]: weight updates between the weights that sampled each response token and the weights this step
    # trains (`Sample.token_versions`); None: every token was sampled by them (on-policy)
    staleness: torch.Tensor | None = None
    rewards: torch.Tensor  # float32 [B]
    group_index: torch.Tensor  # int64 [B]
    sample_index: torch.Tensor  # int64 [B], position in the rollout step
    num_loss_tokens_global: float  # sum of loss_mask over the whole step, all micro-batches and DP ranks
    num_sequences_global: int

    @property
    def num_samples(self) -> int:
        return self.seq_lengths.numel()

    def to(self, device: torch.device | str) -> "PackedBatch":
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor | Candidates):
                moved[name] = value.to(device)
        return PackedBatch(**moved)


@dataclass(kw_only=True)
class RolloutBatch:
    """One rollout step: its micro-batches, the samples (this DP rank's), step index and rollout stats."""

    micro_batches: list[PackedBatch]
    samples: list[Sample]
    step: int
    stats: dict[str, tuple[float, float]] = field(default_factory=dict)  # (sum, count) pairs

    def to(self, device: torch.device | str) -> "RolloutBatch":
        # Lightning moves any object with `.to`; samples stay on the host.
        return RolloutBatch(
            micro_batches=[mb.to(device) for mb in self.micro_batches],
            samples=self.samples,
            step=self.step,
            stats=self.stats,
        )
