"""`HFTeacher`: an HF checkpoint as the distillation teacher, run in-process.

The teacher is a second reference-like backbone: frozen (no parameter requires grad), in eval mode, scored without
grad over the same packed micro-batches as the policy (`PolicyModule.teacher_pass`), and sharded by the same
strategy (FSDP shards it like the policy; Megatron converts it to its TP / CP / PP layout). Its vocabulary must be
the policy's: the same tokenizer ids and the same embedding rows, since the student's kept sets are scored on it.
"""

from dataclasses import dataclass

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from topp_rl.models import load_hf
from topp_rl.trainer.backbone import HFBackbone


@dataclass(frozen=True)
class HFTeacher:
    """teacher=hf_path: `path` (a checkpoint directory or a Hub id in the HF cache); `use_candidate_mask`: score the
    teacher over the sampler's kept set (renormalised) rather than the full vocabulary."""

    path: str
    use_candidate_mask: bool = False

    def module_parts(self, *, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, policy_name: str) -> dict:
        """`PolicyModule`'s teacher arguments: the frozen teacher backbone, after checking its tokenizer and
        vocabulary against the policy's."""
        model, teacher_tokenizer = load_hf(self.path)
        check_same_tokenizer(policy=(policy_name, output_rows(policy), tokenizer),
                             teacher=(self.path, output_rows(model), teacher_tokenizer))
        backbone = HFBackbone(model.float().eval()).requires_grad_(False)
        return {"teacher": backbone, "teacher_use_mask": self.use_candidate_mask}


def output_rows(model: PreTrainedModel) -> int:
    """The model's vocabulary size as its output layer holds it (embedding rows, padding included)."""
    return int(model.get_output_embeddings().weight.shape[0])


def check_same_tokenizer(*, policy: tuple[str, int, PreTrainedTokenizerBase],
                         teacher: tuple[str, int, PreTrainedTokenizerBase]) -> None:
    """Refuse a teacher whose token ids or vocabulary size (output rows) differ from the policy's, naming both."""
    (p_name, p_rows, p_tok), (t_name, t_rows, t_tok) = policy, teacher
    if p_rows != t_rows:
        raise ValueError(
            f"the teacher {t_name} has {t_rows} vocabulary rows, the policy {p_name} {p_rows}; on-policy distillation "
            "scores the student's tokens and kept sets with the teacher, so both need the same vocabulary: choose a "
            "teacher of the policy's tokenizer family"
        )
    p_vocab, t_vocab = p_tok.get_vocab(), t_tok.get_vocab()
    if p_vocab != t_vocab:
        differ = sorted(set(p_vocab.items()) ^ set(t_vocab.items()), key=lambda kv: kv[1])
        raise ValueError(
            f"the teacher {t_name}'s tokenizer ({len(t_vocab)} tokens) differs from the policy {p_name}'s "
            f"({len(p_vocab)} tokens), first at {differ[0]!r}; the teacher must score the same token ids: choose a "
            "teacher with the policy's tokenizer"
        )
