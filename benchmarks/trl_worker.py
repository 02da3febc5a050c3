"""One TRL GRPOTrainer run for benchmarks/bench_vs_trl.py; runs in the TRL venv (scripts/setup_trl.sh), so it
imports nothing from topp_rl. Reads a JSON spec (model dir, prompts, answers, sampling, batch, steps), prints one
JSON line: per-step seconds split into generation / scoring / optimisation, completion tokens, peak RSS.

Phases: generation = time inside `GRPOTrainer._generate` (HF `generate` plus decoding); scoring = the rest of
`_generate_and_score_completions` (rewards, advantages, and the old / reference log-prob passes when TRL runs
them); optimisation = the remainder of the training step (forward, backward, optimizer).
"""

import json
import resource
import sys
import time

import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerFast, TrainerCallback
from trl import GRPOConfig, GRPOTrainer


class PhaseTimer(TrainerCallback):
    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.gen = self.score_total = 0.0
        self.tokens = 0

    def on_step_begin(self, args, state, control, **kwargs):
        self.gen = self.score_total = 0.0
        self.tokens = 0
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        step = time.perf_counter() - self._start
        self.rows.append(dict(generate_s=self.gen, score_s=self.score_total - self.gen,
                              optim_s=step - self.score_total, step_s=step, tokens=self.tokens))


def wrap_timed(obj, name: str, on_done) -> None:
    inner = getattr(obj, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        on_done(time.perf_counter() - start, out)
        return out

    setattr(obj, name, timed)


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    torch.set_num_threads(spec["threads"])
    tokenizer = (PreTrainedTokenizerFast.from_pretrained(spec["model_dir"]) if spec["plain_tokenizer"]
                 else None)
    answers = dict(zip(spec["prompts"], spec["answers"], strict=True))

    def reward(prompts, completions, **kwargs):
        return [1.0 if c.strip().startswith(answers[p]) else 0.0 for p, c in zip(prompts, completions, strict=True)]

    config = GRPOConfig(
        output_dir=spec["output_dir"], per_device_train_batch_size=spec["prompts_per_step"] * spec["n_samples"],
        num_generations=spec["n_samples"], max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"], top_p=spec["top_p"], top_k=0, learning_rate=spec["lr"],
        max_steps=spec["steps"], use_cpu=True, report_to="none", save_strategy="no", logging_steps=1,
        dataloader_num_workers=0, bf16=False, seed=0, disable_tqdm=True, shuffle_dataset=False,
        gradient_checkpointing=spec.get("gradient_checkpointing", True),  # GRPOConfig's default is True
    )
    trainer = GRPOTrainer(
        model=spec["model_dir"], reward_funcs=reward, args=config, processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": spec["prompts"]}),
    )
    timer = PhaseTimer()
    trainer.add_callback(timer)

    def on_generate(seconds, out):
        timer.gen += seconds
        completion_ids = out[1] if isinstance(out, tuple) else None
        if completion_ids is not None:
            timer.tokens += sum(len(c) for c in completion_ids)

    def on_score(seconds, out):
        timer.score_total += seconds

    wrap_timed(trainer, "_generate", on_generate)
    wrap_timed(trainer, "_generate_and_score_completions", on_score)
    trainer.train()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(dict(rows=timer.rows, peak_rss_mb=peak_mb)))


if __name__ == "__main__":
    main()
