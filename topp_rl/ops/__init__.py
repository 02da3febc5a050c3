"""Exact top-p / top-k / min-p log-probs: candidate sets, the sampler's rule, masks and restricted log-probs.

Pure numerics (torch only, optional torch.distributed for the TP reductions); no Lightning or engine imports.
"""

from topp_rl.ops._checks import SAMPLING_RULES, SamplingRule, check_sampling_value
from topp_rl.ops.candidates import Candidates, rows_missing_token
from topp_rl.ops.head import candidate_head_logprobs
from topp_rl.ops.logprob import token_logprobs
from topp_rl.ops.mask import keep_mask
from topp_rl.ops.sampling import sampling_candidates

__all__ = [
    "SAMPLING_RULES",
    "Candidates",
    "SamplingRule",
    "candidate_head_logprobs",
    "check_sampling_value",
    "keep_mask",
    "rows_missing_token",
    "sampling_candidates",
    "token_logprobs",
]
