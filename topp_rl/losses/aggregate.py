"""Loss aggregation over tokens with global denominators, so micro-batching equals one large batch.

Dense equivalents, with l the per-token loss, m the loss mask, N the global loss-token count, G the global
sequence count and n_s the loss tokens of sample s:
- token-mean:          sum_t m_t l_t / N
- seq-mean-token-mean: sum_s (sum_{t in s} m_t l_t / n_s) / G
- seq-mean-token-sum:  sum_s (sum_{t in s} m_t l_t) / G
Samples with no loss tokens contribute 0 but still count in G, like in the whole-step computation.
"""

from torch import Tensor

from topp_rl.losses.inputs import LossInputs

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def check_aggregation(mode: str) -> str:
    if mode not in AGGREGATIONS:
        raise ValueError(f"aggregation={mode!r} is not supported; choose one of {', '.join(AGGREGATIONS)}")
    return mode


def aggregate(values: Tensor, inputs: LossInputs, *, mode: str) -> Tensor:
    """Scalar loss from per-token `values` [R] (mask applied here) under `mode`."""
    masked = values * inputs.loss_mask
    if mode == "token-mean":
        return masked.sum() / inputs.num_loss_tokens_global
    per_seq = inputs.segment_sum(masked)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / inputs.segment_sum(inputs.loss_mask).clamp(min=1.0)
    return per_seq.sum() / inputs.num_sequences_global


def denominator_share(inputs: LossInputs, *, mode: str) -> float:
    """Share of the global denominator these inputs hold: summed over a step's micro-batches it is 1."""
    if mode == "token-mean":
        return float(inputs.loss_mask.sum()) / inputs.num_loss_tokens_global
    return inputs.segments[1] / inputs.num_sequences_global
