"""On-policy distillation: a teacher's per-token reverse KL, as an algorithm (`OPDLoss`) and as a term any RL loss
adds to its reward advantage (`TeacherKL`, `algo.teacher_kl_coeff`).

Which distributions. At response position t the sampler kept the set S_t (top-p / top-k / min-p; the whole
vocabulary where nothing was cut) and the student's sampling distribution is the renormalised kept-set one,
q(y) = pi(y) / pi(S_t) for y in S_t (the trainer's masked log-prob, `LossInputs.logprobs`). The teacher p is scored
- over the full vocabulary, p(y) = p_T(y) (`teacher.use_candidate_mask=false`, the default): KL(q || p_T) is then
  the kept-set KL below minus log p_T(S_t), per token; or
- over the same kept set, p(y) = p_T(y) / p_T(S_t) (true): both live on S_t, so KL(q || p) >= 0 and 0 iff they
  agree on S_t. It is blind to where S_t lies: a one-token kept set gives 0 for any teacher.
The quantity minimised, per model token, is the reverse KL KL(q || p) = sum_{y in S_t} q(y) (log q(y) - log p(y)).

How. With x_t = log q(y_t) - log p(y_t) on the sampled token (k1, unbiased), the per-token advantage is -x_t, under
stop-gradient, in the algorithm's own surrogate (PPO ratio pi / pi_old, clip, TIS / ICEPOP): on-policy its
expected gradient, sum_y q(y) x(y) grad log q(y), is exactly grad KL(q || p) (sum_y q(y) grad log q(y) = 0), and
samples of an older policy are importance-weighted like the reward's, so `rollout.max_staleness` works.
x_t uses the old-log-prob pass (the trainer's log q at the weights before this step's update). No return-to-go:
each token carries its own term (discount 0, like slime's OPD and Thinking Machines' on-policy distillation).
The full-vocabulary choice only adds the per-position constant -log p_T(S_t) to x_t (a baseline at fixed S_t:
same expected gradient, another value). Tokens with loss_mask 0 (environment tokens) carry no term.
"""

import torch
from torch import Tensor

from topp_rl.losses.algorithms import GRPOLoss
from topp_rl.losses.correction import Pairs
from topp_rl.losses.inputs import LossInputs


class OPDLoss(GRPOLoss):
    """Pure on-policy distillation: GRPO's PPO-clip surrogate with the teacher's per-token advantage
    -(log q - log p) and no reward (the datamodule's reward advantages are ignored). `teacher_kl_coef` scales it
    (1: the plain reverse KL)."""

    def __init__(self, *, teacher_kl_coef: float = 1.0, **kwargs) -> None:
        if not teacher_kl_coef > 0:
            raise ValueError(f"algo=opd with teacher_kl_coeff={teacher_kl_coef}: it must be > 0 (1.0: the plain "
                             "reverse KL); for RL without a teacher choose another algo")
        super().__init__(teacher_kl_coef=teacher_kl_coef, **kwargs)

    def shaped_advantages(self, inputs: LossInputs) -> tuple[Tensor, Pairs]:
        return torch.zeros_like(inputs.old_logprobs), {}
