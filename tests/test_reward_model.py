"""`RewardModel` (issue 22 part 2): a tiny random Qwen2 sequence-classification model saved to disk scores
batched, padded texts exactly as the model scores each text alone; its checks; a short training run on CPU whose
every logged sample reward is the model's own logit."""

import json
import math

import pytest
import torch
from helpers import column, compose_cfg, read_metrics
from transformers import Qwen2Config, Qwen2ForSequenceClassification

from topp_rl.data import PromptRecord
from topp_rl.models import build_char_tokenizer, save_model
from topp_rl.tasks import RewardModel
from topp_rl.tasks.rewards import RewardSet


def build_reward_model(path, *, num_labels: int = 1, pad: bool = True):
    """A random one-label Qwen2ForSequenceClassification with the char tokenizer, saved at `path`."""
    tok = build_char_tokenizer()
    if not pad:
        tok.pad_token = None
    config = Qwen2Config(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, num_labels=num_labels, initializer_range=0.2,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForSequenceClassification(config).eval()
    save_model(model, tok, path)
    return model, tok


def own_logit(model, tok, text: str) -> float:
    """The model's score of one text alone: no padding, its last token pooled."""
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        return float(model(input_ids=ids).logits[0, 0])


def _record(text: str, answer: str | None = None) -> PromptRecord:
    return PromptRecord(index=0, text=text, prompt_ids=[1], answer=answer)


PROMPTS = ["7:", "12+30=", "a much longer prompt here:", "3:", "x"]
RESPONSES = ["7", "42", "no", "3 and a longer completion", "yy"]


@pytest.mark.parametrize("pad", [True, False], ids=["pad_token", "eos_as_pad"])
def test_scores_equal_the_models_own_logits_per_text(tmp_path, pad):
    """Five texts of different lengths in batches of 2 (right padding with the pad token, or with EOS for a
    tokenizer without one) score exactly what the model gives each text alone."""
    model, tok = build_reward_model(tmp_path / "rm", pad=pad)
    rm = RewardModel(path=tmp_path / "rm", batch_size=2)
    records = [_record(p) for p in PROMPTS]
    scores = rm(RESPONSES, records)
    expected = [own_logit(model, tok, p + r) for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert len({round(s, 5) for s in scores}) == 5  # distinct texts, distinct scores: the check is not vacuous
    assert rm.pad_id == (0 if pad else tok.eos_token_id)
    assert not any(p.requires_grad for p in rm.model.parameters())  # scored without gradients
    # A template and an answer; one batch of all five gives the same values as batches of two.
    rm_all = RewardModel(path=tmp_path / "rm", batch_size=8, template="{prompt} {completion}")
    assert rm_all(RESPONSES, records) == pytest.approx(
        [own_logit(model, tok, f"{p} {r}") for p, r in zip(PROMPTS, RESPONSES, strict=True)], rel=1e-5, abs=1e-6
    )
    # left truncation keeps the completion's end
    rm_short = RewardModel(path=tmp_path / "rm", max_length=4)
    assert rm_short(["3 and a longer completion"], [_record("3:")]) == pytest.approx(
        [own_logit(model, tok, "tion")], rel=1e-5, abs=1e-6
    )


def test_reward_model_in_a_reward_set_and_its_errors(tmp_path):
    model, tok = build_reward_model(tmp_path / "rm")
    rewards = RewardSet.from_config([
        {"fn": {"_target_": "topp_rl.tasks.RewardModel", "path": str(tmp_path / "rm")}, "weight": 2.0, "name": "rm"},
        {"_target_": "topp_rl.tasks.RewardModel", "path": str(tmp_path / "rm"), "name": "rm_plain"},
    ])
    assert [(t.name, t.weight, t.batched) for t in rewards.terms] == [("rm", 2.0, True), ("rm_plain", 1.0, True)]
    rewards.to_device(torch.device("cpu"))
    assert [t.fn.device for t in rewards.terms] == [torch.device("cpu")] * 2
    unloaded = RewardModel(path=tmp_path / "rm")  # the trainer's device is taken unless `device` names one
    unloaded.to_device(torch.device("meta"))
    pinned = RewardModel(path=tmp_path / "rm", device="cpu")
    pinned.to_device(torch.device("meta"))
    assert (unloaded.device, pinned.device) == (torch.device("meta"), torch.device("cpu"))
    totals, parts = rewards(["7", "42"], [_record("7:"), _record("1:")], [0, 1])
    logits = [own_logit(model, tok, "7:7"), own_logit(model, tok, "1:42")]
    assert [p["rm"] for p in parts] == pytest.approx(logits, rel=1e-5, abs=1e-6)
    assert totals == pytest.approx([3 * x for x in logits], rel=1e-5, abs=1e-6)

    build_reward_model(tmp_path / "two", num_labels=2)
    with pytest.raises(ValueError, match=r"has num_labels=2; a reward model scores with one label"):
        RewardModel(path=tmp_path / "two")
    with pytest.raises(ValueError, match=r"reward model path \(.*nowhere\) has no config.json"):
        RewardModel(path=tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"template \('\{prompt\}\{reply\}'\) may use only"):
        RewardModel(path=tmp_path / "rm", template="{prompt}{reply}")
    with pytest.raises(ValueError, match=r"chat_template=true, but the tokenizer of .* has no chat template"):
        RewardModel(path=tmp_path / "rm", chat_template=True)
    with pytest.raises(ValueError, match=r"RewardModel\(batch_size=0"):
        RewardModel(path=tmp_path / "rm", batch_size=0)
    build_reward_model(tmp_path / "eos_pad", pad=False)
    with pytest.raises(ValueError, match=r"the text '7:7<eos>' ends in the pad token \(id 2\)"):
        RewardModel(path=tmp_path / "eos_pad")(["7<eos>"], [_record("7:")])


def test_a_reward_model_run_trains_on_cpu(tmp_path):
    """Issue 22: a reward-model run trains in the suite. Every sample completions.jsonl logs (all 4 of each step)
    carries the reward model's own logit for its prompt and completion, and rollout/reward_mean is their mean."""
    model, tok = build_reward_model(tmp_path / "rm")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{d}:", "answer": str(d)}) + "\n" for d in range(8)))
    out = tmp_path / "run"
    entry = f"{{_target_: topp_rl.tasks.RewardModel, path: '{tmp_path / 'rm'}', batch_size: 3}}"
    from topp_rl.train import train

    train(compose_cfg(out, "task=dataset", f"task.path={data}", f"task.rewards=[{entry}]",
                      f"task.cache_dir={tmp_path / 'cache'}", "logger=csv"))
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0] * 4 + [1] * 4
    for row in rows:  # the logged text keeps special tokens; the reward saw it decoded without them
        prompt = tok.decode(tok(row["prompt"])["input_ids"], skip_special_tokens=True)
        completion = tok.decode(tok(row["completion"])["input_ids"], skip_special_tokens=True)
        assert row["reward"] == pytest.approx(own_logit(model, tok, prompt + completion), rel=1e-5, abs=1e-6), row
    metrics = read_metrics(out)
    means = [sum(r["reward"] for r in rows if r["step"] == s) / 4 for s in (0, 1)]
    assert column(metrics, "rollout/reward_mean") == pytest.approx(means, rel=1e-5, abs=1e-6)
    assert column(metrics, "rollout/reward/reward_model_mean") == pytest.approx(means, rel=1e-5, abs=1e-6)
    assert all(math.isfinite(v) for v in column(metrics, "train/loss"))
