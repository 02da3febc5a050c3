"""The teacher's per-token reverse-KL term (`TeacherKL`): what it estimates and why it enters as an advantage
is stated in `topp_rl.losses.distill`."""

from torch import Tensor

from topp_rl.losses.correction import Pairs
from topp_rl.losses.inputs import LossInputs


def teacher_advantage(logprobs: Tensor, teacher_logprobs: Tensor) -> Tensor:
    """-(log q - log p) per token [R] (the negative k1 reverse-KL estimate), without gradient."""
    return (teacher_logprobs - logprobs).detach()


class TeacherKL:
    """`coef` * the teacher's per-token advantage -(log q - log p), added to the reward advantage; its metrics."""

    def __init__(self, *, coef: float) -> None:
        if not coef >= 0:
            raise ValueError(f"teacher_kl_coeff={coef} must be >= 0; use 0 to train without the teacher's KL")
        self.coef = coef

    @property
    def enabled(self) -> bool:
        return self.coef > 0

    def shaped(self, inputs: LossInputs, advantages: Tensor) -> tuple[Tensor, Pairs]:
        """(`advantages` [R] + coef * -(old log q - log p), the teacher figures over loss tokens); without teacher
        log-probs in `inputs` the advantages unchanged (refused when the term is on)."""
        if inputs.teacher_logprobs is None:
            if self.enabled:
                raise ValueError(
                    f"teacher_kl_coeff={self.coef} (or algo=opd) needs LossInputs.teacher_logprobs; configure a "
                    "teacher (teacher=hf_path teacher.path=DIR) or set algo.teacher_kl_coeff=0"
                )
            return advantages, {}
        adv = teacher_advantage(inputs.old_logprobs, inputs.teacher_logprobs)
        pairs = teacher_pairs(inputs, teacher=inputs.teacher_logprobs, advantage=adv)
        return (advantages + self.coef * adv if self.enabled else advantages), pairs


def teacher_pairs(inputs: LossInputs, *, teacher: Tensor, advantage: Tensor) -> Pairs:
    """`train/teacher_kl` (mean k1 estimate of KL(q || p) per loss token) and `train/teacher_logprob_mean`."""
    m = inputs.loss_mask
    n = m.sum()
    return {
        "train/teacher_kl": ((-advantage * m).sum(), n),
        "train/teacher_logprob_mean": ((teacher.detach() * m).sum(), n),
    }
