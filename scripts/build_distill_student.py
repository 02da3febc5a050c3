"""Build the distillation demo's student offline: SmolLM2-135M-Instruct cut to its first `--layers` decoder layers
(embeddings, those layers, the final norm and the tied output layer copied; same tokenizer), saved as an HF
checkpoint. It shares the teacher's vocabulary, as on-policy distillation requires, and starts far weaker.

    .venv/bin/python scripts/build_distill_student.py            # -> ~/.cache/topp_rl/smollm2-135m-student-l4
    .venv/bin/python scripts/build_distill_student.py --layers 2 --out DIR
"""

import argparse
import copy
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from topp_rl.models import load_smollm2, save_model

CACHE = Path.home() / ".cache" / "topp_rl"


def build_student(layers: int, out: Path) -> Path:
    teacher, tokenizer = load_smollm2()
    if not 1 <= layers < teacher.config.num_hidden_layers:
        raise ValueError(f"--layers {layers} must be in [1, {teacher.config.num_hidden_layers - 1}] (the teacher's "
                         "decoder layers, fewer than all)")
    config = copy.deepcopy(teacher.config)
    config.num_hidden_layers = layers
    student = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # the first `layers` layers keep their names; the teacher's other layers have none in the student
    missing, unexpected = student.load_state_dict(teacher.state_dict(), strict=False)
    assert not missing, missing
    assert all(k.startswith("model.layers.") for k in unexpected), unexpected
    return save_model(student.eval(), tokenizer, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="decoder layers kept (the teacher has 30)")
    parser.add_argument("--out", type=Path, default=None, help="default: ~/.cache/topp_rl/smollm2-135m-student-l<L>")
    args = parser.parse_args()
    out = args.out or CACHE / f"smollm2-135m-student-l{args.layers}"
    print(build_student(args.layers, out))


if __name__ == "__main__":
    main()
