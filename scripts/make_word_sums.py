"""Write data/word_sums.jsonl: one-step word problems with 1-digit addends in GSM8K's format ("question", and
"answer" = "reasoning\n#### number"), the data of `experiment=smollm2_gsm8k`. Deterministic (seed 0), so the
shipped file is reproducible: `python scripts/make_word_sums.py`.

Why not GSM8K itself on CPU: SmolLM2-135M-Instruct answers 0 of the 32 problems in data/gsm8k_sample.jsonl
greedily (128 new tokens), so there is no reward to learn from; one-step sums keep the whole pipeline (dataset
task, chat template, math-verify reward, evaluation, export) and give a signal at this model size.
"""

import json
import random
from pathlib import Path

TEMPLATES = (
    "{name} has {a} apples and buys {b} more. How many apples does {name} have now?",
    "There are {a} birds on a tree and {b} more land on it. How many birds are on the tree?",
    "{name} read {a} pages on Monday and {b} pages on Tuesday. How many pages did {name} read in total?",
    "A box holds {a} red balls and {b} blue balls. How many balls are in the box?",
    "{name} walked {a} km in the morning and {b} km in the evening. How many km did {name} walk?",
    "A shelf has {a} books. {name} puts {b} more books on it. How many books are on the shelf?",
)
NAMES = ("Sam", "Maria", "Lee", "Ana", "Tom", "Priya", "Omar", "Zoe")


def rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        question = rng.choice(TEMPLATES).format(name=rng.choice(NAMES), a=a, b=b)
        out.append({"question": question, "answer": f"{a} + {b} = {a + b}\n#### {a + b}"})
    return out


def main() -> None:
    path = Path(__file__).resolve().parents[1] / "data" / "word_sums.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows(256)))
    print(path)


if __name__ == "__main__":
    main()
