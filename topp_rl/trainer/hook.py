"""`ToppLogProb`: per-response-token log-probs of a packed micro-batch over the rollout's candidate sets.

Maps a `PackedBatch` onto the ops: the rows of this rank's local logits (or final hidden states) that predict a
response token (`cp_local_positions` + `response_rows`), the sampled tokens, and the recorded candidate rows of
those tokens. Empty candidate rows mean "unrestricted" (no candidate data, or a non-trainable token) and are
dropped before the ops, which reject them. Default path: `candidate_head_logprobs` on hidden states and the
output-layer weight, which never forms [T, V] logits for rows with candidates; `token_logprobs` when only
logits exist or entropy is asked for (entropy needs the full distribution anyway); there, under TP, the hidden
states' gradient is summed over the TP group (`_SumGrad`), as `candidate_head_logprobs` does inside.
"""

from dataclasses import dataclass

import torch

from topp_rl.data import PackedBatch
from topp_rl.ops import candidate_head_logprobs, token_logprobs
from topp_rl.parallel import ParallelLayout, cp_local_positions, response_rows
from topp_rl.trainer.records import OnPolicyRecord

RECORD_BLOCK_ELEMENTS = 1 << 23  # logits per block of the on-policy record pass


@dataclass(frozen=True)
class TokenLogProbs:
    """This rank's response tokens of one micro-batch, in local-row order (all [R_local])."""

    logprobs: torch.Tensor  # float32; with grad when the inputs have it
    token_index: torch.Tensor  # int64 index into the micro-batch's R response tokens (for scatter/gather)
    support_size: torch.Tensor  # int64 candidate-set size, 0 = unrestricted
    entropy: torch.Tensor | None = None  # unrestricted, temperature-scaled


class _SumGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over `group`. Hidden states are replicated over TP and each rank's
    vocabulary shard of the logits gives only its part of their gradient (Megatron's copy-to-TP-region)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def _sum_grad(hidden: torch.Tensor, group) -> torch.Tensor:
    return _SumGrad.apply(hidden, group) if group is not None and hidden.requires_grad else hidden


class ToppLogProb:
    """Log-probs of the sampled response tokens over exactly the candidate sets the sampler kept.

    Dense computation it equals (per response token i, predicted by local logit row r_i): with full-vocab logits
    L = hidden @ weight.T (TP shards concatenated), z = L[r_i] / temperature, z[v] = -inf for v outside
    cands(i) U {token_i} when row i has candidates (and `use_mask`), the result is log_softmax(z)[token_i].
    `use_mask=False` scores every token over the full vocabulary (the biased baseline, for ablations).
    """

    def __init__(self, *, use_mask: bool = True, temperature: float = 1.0) -> None:
        if not temperature > 0:
            raise ValueError(
                f"ToppLogProb temperature={temperature} must be > 0; pass the rollout's sampling temperature"
            )
        self.use_mask = use_mask
        self.temperature = float(temperature)

    def _locate(self, batch: PackedBatch, layout: ParallelLayout):
        """Local rows predicting response tokens, their token index in [0, R), the tokens and candidate rows."""
        positions = cp_local_positions(
            batch.seq_lengths, cp_size=layout.cp_size, cp_rank=layout.cp_rank, mode=layout.cp_mode
        )
        rows, token_index = response_rows(positions, batch.seq_lengths, batch.response_lengths)
        tokens = batch.response_tokens[token_index]
        cands, kept, sizes = None, None, torch.zeros_like(token_index)
        if batch.candidates is not None:
            local = batch.candidates.select(token_index)
            sizes = local.row_lengths()
            kept = local.nonempty_rows()  # empty rows = unrestricted: the ops reject them
            cands = local.select(kept)
        return rows, token_index, tokens, cands, kept, sizes

    def __call__(
        self,
        batch: PackedBatch,
        *,
        layout: ParallelLayout,
        hidden: torch.Tensor | None = None,
        weight: torch.Tensor | None = None,
        logits: torch.Tensor | None = None,
        return_entropy: bool = False,
    ) -> TokenLogProbs:
        """Log-probs of this rank's response tokens from `hidden` [T_local, H] + `weight` [V_local, H], or `logits`."""
        if (logits is None) == (hidden is None or weight is None):
            raise ValueError(
                "ToppLogProb needs either logits=[T_local, V_local] or both hidden=[T_local, H] and "
                "weight=[V_local, H]; pass exactly one of the two"
            )
        rows, token_index, tokens, cands, kept, sizes = self._locate(batch, layout)
        if not self.use_mask:
            cands, kept = None, None
        vocab_start, _ = layout.vocab_range()
        common = dict(cands=cands, rows=kept, temperature=self.temperature, vocab_start=vocab_start,
                      tp_group=layout.tp_group)
        entropy = None
        if logits is None and not return_entropy:
            logprobs = candidate_head_logprobs(hidden[rows], weight, tokens, **common)
        else:
            row_logits = logits[rows] if logits is not None else _sum_grad(hidden[rows], layout.tp_group) @ weight.T
            out = token_logprobs(row_logits, tokens, return_entropy=return_entropy, **common)
            logprobs, entropy = out if return_entropy else (out, None)
        return TokenLogProbs(logprobs=logprobs, token_index=token_index, support_size=sizes, entropy=entropy)

    @torch.no_grad()
    def onpolicy(
        self,
        batch: PackedBatch,
        *,
        layout: ParallelLayout,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        chunk_rows: int | None = None,
        masked: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, OnPolicyRecord]:
        """(token index [R_local] into the micro-batch's R response tokens, this rank's `OnPolicyRecord`).

        Masked means over the recorded candidates regardless of `use_mask`, so the mismatch callbacks always
        see both figures. The masked log-probs are the loss's own computation: this hook's call with the mask
        on (`candidate_head_logprobs`), or `masked` [R_local] when the caller has just made that call (the
        gradient pass of a one-epoch step, detached), so a step's old log-probs are bit for bit its loss's.
        The unmasked log-probs and the entropy come from [chunk_rows, V_local] logits blocks (no grad); by
        default a block holds `RECORD_BLOCK_ELEMENTS` logits (32 MB in fp32: 170 rows at V = 49152, one block
        for a small vocabulary), since each reduction makes a few temporaries of the block's size, and blocks
        bound the memory of this pass (TP peers hold the same rows, so their collectives stay in step).
        """
        rows, token_index, tokens, _, _, sizes = self._locate(batch, layout)
        vocab_start, _ = layout.vocab_range()
        common = dict(temperature=self.temperature, vocab_start=vocab_start, tp_group=layout.tp_group)
        entropy, unmasked = [], []
        chunk_rows = chunk_rows or max(1, RECORD_BLOCK_ELEMENTS // weight.shape[0])
        for a in range(0, max(rows.numel(), 1), chunk_rows):
            b = min(a + chunk_rows, rows.numel())
            full, ent = token_logprobs(hidden[rows[a:b]] @ weight.T, tokens[a:b], return_entropy=True, **common)
            unmasked.append(full)
            entropy.append(ent)
        if masked is None:
            scorer = self if self.use_mask else ToppLogProb(use_mask=True, temperature=self.temperature)
            masked = scorer(batch, layout=layout, hidden=hidden, weight=weight).logprobs
        return token_index, OnPolicyRecord(
            logprobs=masked.detach(), logprobs_unmasked=torch.cat(unmasked),
            rollout_logprobs=batch.rollout_log_probs[token_index].float(),
            loss_mask=batch.loss_mask[token_index].float(), entropy=torch.cat(entropy), support_size=sizes,
            staleness=None if batch.staleness is None else batch.staleness[token_index],
        )
