"""Tensor- and context-parallel layout: `ParallelLayout`, the CP index map and the rows that predict responses."""

from topp_rl.parallel.context import (
    CP_MODES,
    CPMode,
    cp_local_lengths,
    cp_local_positions,
    cp_padded_lengths,
    cp_shard,
    cu_seqlens,
)
from topp_rl.parallel.layout import ParallelLayout
from topp_rl.parallel.rows import response_rows
from topp_rl.parallel.tokens import gather_tokens

__all__ = [
    "CP_MODES",
    "CPMode",
    "ParallelLayout",
    "cp_local_lengths",
    "cp_local_positions",
    "cp_padded_lengths",
    "cp_shard",
    "cu_seqlens",
    "gather_tokens",
    "response_rows",
]
