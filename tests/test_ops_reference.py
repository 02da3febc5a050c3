"""Dense reference for the restricted log-prob ops (float64, plain loops); helpers only, no tests here."""

import torch


def dense_mask(num_rows, vocab, tokens, rows, cand_lists):
    """bool [num_rows, vocab]: listed rows keep their candidates and token, the others everything."""
    mask = torch.ones(num_rows, vocab, dtype=torch.bool)
    for r, ids in zip(rows, cand_lists, strict=True):
        mask[r] = False
        for v in ids:
            mask[r, v] = True
        mask[r, int(tokens[r])] = True
    return mask


def dense_logprobs(logits, tokens, rows, cand_lists, temperature):
    """log_softmax over the kept set of logits / temperature at the token, and the unrestricted entropy."""
    z = logits / temperature
    mask = dense_mask(z.shape[0], z.shape[1], tokens, rows, cand_lists)
    logp = (
        torch.log_softmax(z.masked_fill(~mask, float("-inf")), dim=-1).gather(1, tokens[:, None]).squeeze(1)
    )
    full = torch.log_softmax(z, dim=-1)
    entropy = -(full.exp() * full).sum(dim=-1)
    return logp, entropy
