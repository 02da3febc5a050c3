"""`ParallelLayout`: the tensor-, context- and pipeline-parallel coordinates of one rank, passed explicitly to the ops.

Math code never reads parallel state from globals; it receives this frozen, validated record instead.
`from_megatron` is the one place that reads megatron-core's `parallel_state` (imported lazily, so the
library works without the `megatron` extra).

Vocabulary rule: the vocabulary is split into `tp_size` equal contiguous shards, rank r owning
[r * V / tp_size, (r + 1) * V / tp_size). A vocabulary not divisible by `tp_size` is rejected. Padding it
(Megatron's `make_vocab_size_divisible_by`) is not a fix here: padded ids would add logits to every
unrestricted softmax, so log-probs would no longer equal the HF model's; choose a TP size that divides the
vocabulary instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from topp_rl.parallel.context import CP_MODES, CPMode, cp_local_positions
from topp_rl.parallel.plan import chunk_layers

DIMS = ("tp", "cp", "ep", "pp")  # the factors with a rank and a group


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """This rank's place in the TP x CP grid, with the process groups the ops reduce over.

    `tp_group` / `cp_group` / `ep_group` / `pp_group` may be None only when the matching size is 1. Pipeline
    parallelism (`pp_*`) splits the decoder layers into stages; only the last stage holds the final hidden states
    and the output layer, so only it scores tokens (`is_last_stage`); with `vpp_size` > 1 virtual stages each rank
    holds vpp_size model chunks (megatron's interleaved schedule, `plan.chunk_layers`). Expert parallelism
    (`ep_*`) splits an MoE layer's experts over EP ranks, which span data / context-parallel ranks (megatron's
    expert grid: expert TP = TP, so EP must divide DP x CP); the ops never reduce over it. `vocab_size` is the full
    (TP-unsharded, already padded) vocabulary, i.e. `tp_size` times the width of this rank's logits.
    """

    vocab_size: int
    tp_size: int = 1
    tp_rank: int = 0
    cp_size: int = 1
    cp_rank: int = 0
    cp_mode: CPMode = "zigzag"
    ep_size: int = 1
    ep_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    vpp_size: int = 1  # virtual pipeline stages: model chunks per pipeline rank (1: one contiguous stage)
    fsdp_size: int = 1  # ranks the weights are sharded over by FSDP2 (all data-parallel; 1 = unsharded)
    tp_group: dist.ProcessGroup | None = None
    cp_group: dist.ProcessGroup | None = None
    ep_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "tp_size", "cp_size", "ep_size", "pp_size", "vpp_size", "fsdp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelLayout {name}={value!r} must be an int >= 1; pass a positive size")
        for dim in DIMS:
            _check_rank(dim, getattr(self, f"{dim}_size"), getattr(self, f"{dim}_rank"))
        if self.vpp_size > 1 and self.pp_size == 1:
            raise ValueError(f"ParallelLayout vpp_size={self.vpp_size} needs pp_size > 1 (virtual stages interleave "
                             "the chunks of several pipeline ranks); pass vpp_size=1")
        if self.cp_mode not in CP_MODES:
            raise ValueError(f"ParallelLayout cp_mode={self.cp_mode!r} must be one of {CP_MODES}")
        if self.vocab_size % self.tp_size:
            raise ValueError(
                f"ParallelLayout vocab_size={self.vocab_size} is not divisible by tp_size={self.tp_size}; "
                "exact log-probs need equal unpadded vocabulary shards: choose a tp_size that divides "
                f"{self.vocab_size}"
            )
        for dim in DIMS:
            _check_group(dim, getattr(self, f"{dim}_size"), getattr(self, f"{dim}_rank"),
                         getattr(self, f"{dim}_group"))

    @classmethod
    def single(cls, vocab_size: int) -> ParallelLayout:
        """No tensor or context parallelism: one rank holds the whole vocabulary and every sequence."""
        return cls(vocab_size=vocab_size)

    @classmethod
    def from_megatron(cls, vocab_size: int, *, cp_mode: CPMode = "zigzag") -> ParallelLayout:
        """Read TP / CP / EP / PP sizes, ranks and groups from megatron-core after `initialize_model_parallel`.

        `vocab_size` is Megatron's padded vocabulary (the output layer's full row count).
        """
        try:
            from megatron.core import parallel_state as ps
        except ImportError as err:
            raise ImportError(
                "ParallelLayout.from_megatron needs megatron-core; install the extra: pip install 'topp_rl[megatron]'"
            ) from err
        if not ps.model_parallel_is_initialized():
            raise ValueError(
                "ParallelLayout.from_megatron: megatron's model parallel state is not initialised; call "
                "megatron.core.parallel_state.initialize_model_parallel(...) first"
            )
        return cls(
            vocab_size=vocab_size,
            tp_size=ps.get_tensor_model_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            cp_size=ps.get_context_parallel_world_size(),
            cp_rank=ps.get_context_parallel_rank(),
            cp_mode=cp_mode,
            ep_size=ps.get_expert_model_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            tp_group=ps.get_tensor_model_parallel_group(),
            cp_group=ps.get_context_parallel_group(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            vpp_size=ps.get_virtual_pipeline_model_parallel_world_size() or 1,
            ep_group=ps.get_expert_model_parallel_group(),
            pp_group=ps.get_pipeline_model_parallel_group(),
        )

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank runs the last pipeline stage: the one with the final hidden states, which scores."""
        return self.pp_rank == self.pp_size - 1

    @property
    def vocab_shard_size(self) -> int:
        return self.vocab_size // self.tp_size

    def vocab_range(self) -> tuple[int, int]:
        """This rank's [start, end) slice of the vocabulary (equal contiguous shards in rank order)."""
        start = self.tp_rank * self.vocab_shard_size
        return start, start + self.vocab_shard_size

    def describe(self, *, world_size: int, num_layers: int | None = None) -> str:
        """One line for the run log, e.g. `world=4 dp=1 tp=2 cp=2 (zigzag) ep=1`; `fsdp=4` when sharded; when
        pipelined, `pp=2` and, given the model's `num_layers`, each stage's layers (embedding on the first stage,
        head and scoring on the last), e.g. `pp=2 [stage 0: embedding + layers 0-1 | stage 1: layers 2-3 + head]`;
        with virtual stages `pp=2 vpp=2` and each stage's chunks, e.g. `[stage 0: embedding + layers 0-1, layers
        4-5 | stage 1: layers 2-3, layers 6-7 + head]`."""
        model_parallel = self.tp_size * self.cp_size * self.pp_size
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not a multiple of tp_size * cp_size * pp_size = {model_parallel}; "
                "launch a multiple of the model-parallel size"
            )
        dp = world_size // model_parallel
        if (dp * self.cp_size) % self.ep_size:
            raise ValueError(
                f"ep_size={self.ep_size} does not divide dp x cp = {dp} x {self.cp_size}; experts are spread over "
                "data / context-parallel ranks: choose an ep_size dividing it or launch more ranks"
            )
        mode = f" ({self.cp_mode})" if self.cp_size > 1 else ""
        pp = f" pp={self.pp_size}" if self.pp_size > 1 else ""
        pp += f" vpp={self.vpp_size}" if self.vpp_size > 1 else ""
        if pp and num_layers is not None:
            pp += f" [{pipeline_stages(num_layers, self.pp_size, self.vpp_size)}]"
        fsdp = f" fsdp={self.fsdp_size}" if self.fsdp_size > 1 else ""
        return f"world={world_size} dp={dp} tp={self.tp_size} cp={self.cp_size}{mode} ep={self.ep_size}{pp}{fsdp}"

    def local_positions(self, seq_lengths: torch.Tensor) -> torch.Tensor:
        """`cp_local_positions` for this rank: packed-stream position of each local row, -1 for padding."""
        return cp_local_positions(seq_lengths, cp_size=self.cp_size, cp_rank=self.cp_rank, mode=self.cp_mode)


def pipeline_stages(num_layers: int, pp_size: int, vpp_size: int = 1) -> str:
    """`stage 0: embedding + layers 0-1 | stage 1: layers 2-3 + head` (megatron-core's even split); with virtual
    stages each stage's chunks, comma-separated (`plan.chunk_layers`)."""
    stages = []
    for s in range(pp_size):
        chunks = [f"layers {r.start}-{r.stop - 1}" if len(r) > 1 else f"layer {r.start}"
                  for r in chunk_layers(num_layers, pp_size, vpp_size, s)]
        text = ("embedding + " if s == 0 else "") + ", ".join(chunks) + (" + head" if s == pp_size - 1 else "")
        stages.append(f"stage {s}: {text}")
    return " | ".join(stages)


def _check_rank(dim: str, size: int, rank: object) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < size:
        raise ValueError(
            f"ParallelLayout {dim}_rank={rank!r} must be an int in [0, {dim}_size={size}); "
            f"pass this rank's index inside its {dim.upper()} group"
        )


def _check_group(dim: str, size: int, rank: int, group: dist.ProcessGroup | None) -> None:
    """A group is required for size > 1 and, when given, must match the declared size and rank."""
    if group is None:
        if size > 1:
            raise ValueError(
                f"ParallelLayout {dim}_size={size} needs {dim}_group (the process group of the {size} "
                f"{dim.upper()} ranks); pass it, or use {dim}_size=1"
            )
        return
    if not dist.is_initialized():
        raise ValueError(f"ParallelLayout {dim}_group is set but torch.distributed is not initialised")
    group_size, group_rank = dist.get_world_size(group), dist.get_rank(group)
    if (group_size, group_rank) != (size, rank):
        raise ValueError(
            f"ParallelLayout {dim}_group has size {group_size} and this process is its rank {group_rank}, "
            f"but {dim}_size={size} and {dim}_rank={rank}; pass the sizes and ranks of the group you give"
        )
