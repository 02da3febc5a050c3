"""Teachers for on-policy distillation (`conf/teacher/`, `topp_rl.losses.distill`): what scores the student's own
samples token by token. `HFTeacher` (teacher=hf_path) loads an HF checkpoint in-process as a frozen backbone that
the module scores like its reference, sharded by the policy's strategy; `SGLangTeacher` (teacher=sglang) asks a running SGLang server for the
prompt log-probs of each sample. Either gives `PolicyModule` its teacher arguments (`module_parts`)."""

from topp_rl.teacher.hf import HFTeacher, check_same_tokenizer
from topp_rl.teacher.sglang import SGLangTeacher

__all__ = ["HFTeacher", "SGLangTeacher", "check_same_tokenizer"]
