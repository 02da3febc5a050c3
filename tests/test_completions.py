"""`CompletionsLog` in a short run: completions.jsonl holds the chosen samples' decoded text, reward, status and
per-sample masked mismatch (checked against a token-by-token reference), and the console line appears."""

import json
import math

import pytest
from helpers import compose_config
from lightning.pytorch.callbacks import Callback

from topp_rl.callbacks.completions import CompletionsLog, choose
from topp_rl.data.sample import Sample
from topp_rl.train import build_run, fit

RUN = [
    "trainer.max_steps=2", "rollout.prompts_per_step=3", "rollout.n_samples=2", "rollout.max_new_tokens=4",
    "trainer.enable_progress_bar=false", "logger=none", "checkpoint.every_n_steps=0", "export.hf=false",
    "rollout.top_p=0.9", "callbacks.completions.samples_per_step=4", "callbacks.completions.console_every_n_steps=1",
]


class Keep(Callback):
    """Keeps each step's samples and on-policy record (the reference below recomputes from them)."""

    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append((outputs["rollout"], outputs["onpolicy"]))


def reference_mismatch(rollout, record) -> dict[int, float]:
    """Token by token: walk the micro-batches' samples in order, mean |train - rollout| over loss-mask tokens."""
    out, pos = {}, 0
    for mb in rollout.micro_batches:
        for index, length in zip(mb.sample_index.tolist(), mb.response_lengths.tolist(), strict=True):
            diffs = [abs(float(record.logprobs[t]) - float(record.rollout_logprobs[t]))
                     for t in range(pos, pos + length) if record.loss_mask[t] > 0]
            out[index] = sum(diffs) / len(diffs)
            pos += length
    return out


def test_completions_jsonl_and_console(tmp_path, capsys):
    cfg = compose_config(tmp_path, *RUN)
    run = build_run(cfg)
    keep = Keep()
    run.trainer.callbacks.append(keep)
    fit(run)
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0] * 4 + [1] * 4
    tokenizer = run.datamodule.tokenizer
    for step, (rollout, record) in enumerate(keep.steps):
        by_index = {s.index: s for s in rollout.samples}
        reference = reference_mismatch(rollout, record)
        got = [r for r in rows if r["step"] == step]
        # Spread over prompts: the first sample of each of the 3 prompts, then the first prompt's second one.
        assert [(r["group_index"], r["sample_index"]) for r in got] == [(0, 0), (1, 2), (2, 4), (0, 1)]
        for r in got:
            s = by_index[r["sample_index"]]
            assert r["prompt"] == tokenizer.decode(s.prompt_ids) and r["prompt"].endswith(":")  # copy_digit
            assert r["completion"] == tokenizer.decode(s.response_ids)
            assert (r["reward"], r["length"], r["status"]) == (s.reward, s.response_length, str(s.status))
            assert math.isclose(r["mismatch"], reference[s.index], rel_tol=1e-9, abs_tol=1e-15)
            assert r["mismatch"] <= 1e-5  # on-policy, mask on
    console = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[topp_rl] step ")]
    assert len(console) == 2 and console[0].startswith("[topp_rl] step 0 sample 0: reward ")


def test_choose_spreads_over_prompts_and_rejects_bad_counts():
    samples = [Sample(prompt_ids=[1], group_index=i // 3, index=i) for i in range(6)]
    assert [s.index for s in choose(samples, 3)] == [0, 3, 1]
    with pytest.raises(ValueError, match="samples_per_step=0 must be >= 1"):
        CompletionsLog(path="x", samples_per_step=0)
