"""`CompletionsLog`: a few prompts and their completions per rollout step, with reward and log-prob mismatch.

Each logged step writes one JSONL line per chosen sample to `path` (`<run dir>/completions.jsonl`: step,
sample_index, group_index, prompt, completion, reward, mismatch, length, status), a W&B table
`rollout/completions` when a `WandbLogger` is present, and every `console_every_n_steps` one console line.
`step` is the rollout step, the `step` column of metrics.csv.

The samples are chosen across prompts (the first completion of each of the first prompts, then the second
ones), so a step shows several prompts rather than one prompt's n samples. `mismatch` is the sample's mean
|log p_train - log p_rollout| over its trainable tokens on the on-policy pass (mask on), from
`outputs["onpolicy"]`, whose tokens follow the micro-batches' samples in order. It is null for a sample that
was not trained on (aborted, or in a dropped zero-variance group) and under context parallelism, where this
rank's record holds only its CP share of the tokens and no token-to-sample map.

Data parallel: global rank 0 logs its own samples (no gather: a few samples are all this shows). Text is
decoded with the datamodule's tokenizer, special tokens kept (an `<eos>` shows where a completion stopped).
"""

import json
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger
from tqdm import tqdm

COLUMNS = ("step", "sample_index", "group_index", "prompt", "completion", "reward", "mismatch", "length",
           "status")


def sample_mismatch(rollout, record) -> dict[int, float]:
    """{sample index: mean masked |train - rollout| log-prob} for the trained samples (empty under CP)."""
    micro = rollout.micro_batches
    if not micro:
        return {}
    seq = torch.cat([torch.repeat_interleave(mb.sample_index, mb.response_lengths) for mb in micro])
    if seq.numel() != record.logprobs.numel():  # a CP rank's share of the tokens: no token-to-sample map
        return {}
    ids, seq = torch.unique(seq, return_inverse=True)
    keep = (record.loss_mask > 0).double()
    diff = (record.logprobs.double() - record.rollout_logprobs.double()).abs() * keep
    sums = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, seq, diff)
    counts = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, seq, keep)
    # Python floats: one conversion per column, not three tensor reads per sample (the same float64 quotients)
    return {i: s / c for i, s, c in zip(ids.tolist(), sums.tolist(), counts.tolist(), strict=True) if c > 0}


def choose(samples: list, k: int) -> list:
    """Up to k samples spread over prompts: each group's first sample, then each group's second, ..."""
    rank: dict[int, int] = {}
    order = []
    for s in samples:
        order.append((rank.get(s.group_index, 0), s.index, s))
        rank[s.group_index] = rank.get(s.group_index, 0) + 1
    return [s for *_, s in sorted(order, key=lambda t: t[:2])[:k]]


class CompletionsLog(Callback):
    def __init__(self, *, path: str, samples_per_step: int = 4, every_n_steps: int = 1,
                 console_every_n_steps: int = 10, console_chars: int = 80) -> None:
        for name, value in (("samples_per_step", samples_per_step), ("every_n_steps", every_n_steps),
                            ("console_every_n_steps", console_every_n_steps)):
            if value < 1:
                raise ValueError(
                    f"callbacks.completions.{name}={value} must be >= 1; drop the callback "
                    "(callbacks.completions=null) to log no completions"
                )
        self.path = Path(path)
        self.samples_per_step = samples_per_step
        self.every_n_steps = every_n_steps
        self.console_every_n_steps = console_every_n_steps
        self.console_chars = console_chars

    def rows(self, rollout, record, tokenizer) -> list[dict]:
        mismatch = sample_mismatch(rollout, record) if record is not None else {}
        return [
            {
                "step": int(rollout.step), "sample_index": int(s.index), "group_index": int(s.group_index),
                "prompt": tokenizer.decode(s.prompt_ids), "completion": tokenizer.decode(s.response_ids),
                "reward": None if s.reward is None else float(s.reward), "mismatch": mismatch.get(int(s.index)),
                "length": s.response_length, "status": str(s.status),
            }
            for s in choose(rollout.samples, self.samples_per_step)
        ]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not outputs or "rollout" not in outputs or not trainer.is_global_zero:
            return
        rollout = outputs["rollout"]
        if rollout.step % self.every_n_steps:
            return
        rows = self.rows(rollout, outputs.get("onpolicy"), trainer.datamodule.tokenizer)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:  # append: a resumed run continues the file
            f.writelines(json.dumps(r) + "\n" for r in rows)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_table("rollout/completions", columns=list(COLUMNS),
                                 data=[[r[c] for c in COLUMNS] for r in rows], step=int(rollout.step))
        if rows and rollout.step % self.console_every_n_steps == 0:
            tqdm.write(self.console_line(rows[0]))  # tqdm.write keeps a live progress bar intact

    def console_line(self, row: dict) -> str:
        def short(text: str) -> str:
            text = repr(text)
            return text if len(text) <= self.console_chars else text[: self.console_chars - 3] + "..."

        mismatch = "n/a" if row["mismatch"] is None else f"{row['mismatch']:.2g}"
        reward = "n/a" if row["reward"] is None else f"{row['reward']:.3g}"
        return (f"[topp_rl] step {row['step']} sample {row['sample_index']}: reward {reward}, mismatch {mismatch}, "
                f"{row['length']} tokens ({row['status']}): {short(row['prompt'])} -> {short(row['completion'])}")
