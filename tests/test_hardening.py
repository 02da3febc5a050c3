"""Silent wrong results made loud (issue 9's defects 1-3, 13-15, 18): each test reproduces one defect that used
to train wrongly and exit 0, or crash with a raw error, and checks the named error or alarm that replaces it.
Fixture models are tiny configs saved with `save_pretrained` (no download)."""

import math
from pathlib import Path

import pytest
import torch
from helpers import compose_cfg as train_cfg
from helpers import read_metrics
from transformers import AutoModelForCausalLM, CohereConfig, Gemma2Config, GraniteConfig

from topp_rl.engines.embedded import EmbeddedEngine
from topp_rl.models import build_char_tokenizer, build_tiny_model, load_hf, save_model
from topp_rl.ops import sampling_candidates
from topp_rl.rollout import SamplingParams
from topp_rl.tasks.rewards import RewardError
from topp_rl.train import build_run, print_summary, train
from topp_rl.trainer.backbone import HFBackbone

TOK = build_char_tokenizer()
SIZES = dict(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, pad_token_id=TOK.pad_token_id, bos_token_id=TOK.bos_token_id,
             eos_token_id=TOK.eos_token_id)
TRANSFORMS = {  # architecture -> (config class, the field that transforms the logits, a typical value)
    "granite": (GraniteConfig, "logits_scaling", 8.0),
    "cohere": (CohereConfig, "logit_scale", 0.0625),
    "gemma2": (Gemma2Config, "final_logit_softcapping", 30.0),
}


def compose_cfg(output_dir: Path, *overrides: str):
    """The tiny config (helpers.TINY), with the CSV logger and 2 new tokens (every check here reads metrics.csv)."""
    return train_cfg(output_dir, "logger=csv", "rollout.max_new_tokens=2", *overrides)


@pytest.mark.parametrize("arch", sorted(TRANSFORMS))
def test_models_with_transformed_logits_are_rejected_at_start(arch, tmp_path):
    config_cls, field, value = TRANSFORMS[arch]
    extra = {"head_dim": 8} if arch == "gemma2" else {}
    model = AutoModelForCausalLM.from_config(config_cls(**SIZES, **extra, **{field: value}))
    save_model(model, TOK, tmp_path / arch)
    cfg = compose_cfg(tmp_path / "run", "model=hf_path", f"model.path={tmp_path / arch}")
    with pytest.raises(ValueError, match=rf"config {field}={value!r} transforms the logits"):
        build_run(cfg)


class _DoubledHead(torch.nn.Linear):
    """An output layer whose logits are 2 * hidden @ W.T: a transform no config field announces."""

    def forward(self, x):
        return 2 * super().forward(x)


def test_an_unannounced_logit_transform_is_caught_by_the_start_probe():
    model = build_tiny_model(vocab_size=128, hidden=32, seed=1)
    head = _DoubledHead(32, 128, bias=False)
    head.weight = model.lm_head.weight
    model.lm_head = head
    with pytest.raises(ValueError, match=r"logits differ from final hidden @ lm_head.weight.T by .* on a 8-token"):
        HFBackbone(model)


def test_nan_weights_fail_at_start_and_nan_logits_never_sample():
    model = build_tiny_model(vocab_size=128, hidden=32, seed=1)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite weights .* first 'model.layers.0.mlp.down_proj.weight'"):
        HFBackbone(model)
    logits = torch.zeros(3, 10)
    logits[1, 4] = float("nan")
    with pytest.raises(ValueError, match=r"logits row 1 \(of 3\) is not finite after dividing by temperature=1"):
        sampling_candidates(logits, top_p=0.9)
    logits[1, 4] = float("inf")
    with pytest.raises(ValueError, match=r"logits row 1 .* is not finite"):
        sampling_candidates(logits, top_p=0.9, convention="vllm")
    # The engine used to sample a token outside its own (meaningless) set; now it stops on the first step.
    engine = EmbeddedEngine(model, progress=False)
    with pytest.raises(ValueError, match=r"logits row 0 .* is not finite"):
        engine.generate([[1, 10]], SamplingParams(top_p=0.9, max_new_tokens=2), seed=0)


def test_nan_logits_raise_on_the_untruncated_path_too():
    """At top_p=1.0 (no truncation) the engine drew token 127 three times with NaN log-probs and status
    TRUNCATED (issue 18 part 5h): the finite check rode only on the truncating path's sampling_candidates."""
    model = build_tiny_model(vocab_size=128, hidden=32, seed=1)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    engine = EmbeddedEngine(model, progress=False)
    expected = (
        "logits row 0 (of 2) is not finite after dividing by temperature=0.7 (NaN, +inf, or every entry -inf): it "
        "defines no distribution to truncate; check the model weights for NaN and that the temperature does not "
        "overflow the logits"
    )
    for params in (SamplingParams(top_p=1.0, temperature=0.7, max_new_tokens=3, n=2),
                   SamplingParams(top_p=0.9, temperature=0.7, max_new_tokens=3, n=2)):
        with pytest.raises(ValueError) as info:
            engine.generate([[1, 10]], params, seed=0)
        assert str(info.value) == expected
    # A finite model still samples on the untruncated path (the check adds no false alarm).
    healthy = EmbeddedEngine(build_tiny_model(vocab_size=128, hidden=32, seed=1), progress=False)
    (sample,) = healthy.generate([[1, 10]], SamplingParams(top_p=1.0, max_new_tokens=3), seed=0)
    assert len(sample.response_ids) == 3 and all(math.isfinite(x) for x in sample.rollout_log_probs)


def test_a_nan_written_into_a_checkpoint_stops_the_resumed_run(tmp_path):
    out = tmp_path / "run"
    train(compose_cfg(out, "trainer.max_steps=2", "checkpoint.every_n_steps=1"))
    ckpt = out / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, weights_only=False)
    name = next(k for k in state["state_dict"] if k.endswith("down_proj.weight"))
    state["state_dict"][name][0, 0] = float("nan")
    torch.save(state, ckpt)
    with pytest.raises(FloatingPointError, match=r"non-finite weights .* at train start \(parameter 'model\..*"
                                                   r"down_proj.weight'"):
        train(compose_cfg(out, "trainer.max_steps=3", "checkpoint.every_n_steps=1", "ckpt_path=last"))


def test_an_overflowing_learning_rate_stops_naming_the_step_and_the_lr(tmp_path):
    with pytest.raises(FloatingPointError, match=r"step 0: the optimizer update overflowed float32 .* "
                                                   r"optimizer.lr=1e\+38 is far too large"):
        train(compose_cfg(tmp_path, "trainer.max_steps=2", "optimizer.lr=1e38"))
    # The foreach AdamW fails on the overflowing scalar itself; the same message either way.
    with pytest.raises(FloatingPointError, match=r"step 0: the optimizer update overflowed float32 .* "
                                                   r"optimizer.lr=1e\+38 is far too large"):
        train(compose_cfg(tmp_path / "foreach", "trainer.max_steps=2", "optimizer.lr=1e38", "optimizer.fused=false"))


def test_a_dead_gradient_raises_the_zero_grad_alarm(tmp_path, capfd):
    """optimizer.lr=1e3 destroys the tiny model in one step; from then on every group ties and the gradient is 0."""
    train(compose_cfg(tmp_path, "trainer.max_steps=10", "optimizer.lr=1e3", "rollout.max_new_tokens=2"))
    rows = read_metrics(tmp_path)
    grad = [float(r["train/grad_norm"]) for r in rows if r.get("train/grad_norm")]
    alarm = [float(r["health/zero_grad_alarm"]) for r in rows if r.get("health/zero_grad_alarm")]
    assert len(alarm) == 10
    # The alarm is on exactly at the steps that end a run of >= 5 zero gradients.
    runs, expected = 0, []
    for g in grad:
        runs = runs + 1 if g == 0.0 else 0
        expected.append(float(runs >= 5))
    assert alarm == expected and max(alarm) == 1.0
    assert "WARNING at step" in capfd.readouterr().err


def test_training_without_weight_sync_raises_the_mismatch_alarm(tmp_path, capfd):
    """Allowed explicitly (allow_stale_weights=true), the off-policy drift is still reported (an engine with its
    own copy of the weights: one that shares the policy's module samples with the trained weights anyway)."""
    train(compose_cfg(tmp_path, "trainer.max_steps=6", "callbacks.weight_sync=null", "allow_stale_weights=true",
                      "rollout.top_p=0.9", "optimizer.lr=0.01", "rollout.engine.share_weights=false"))
    rows = read_metrics(tmp_path)
    diff = [float(r["train/rollout_logprob_abs_diff"]) for r in rows if r.get("train/rollout_logprob_abs_diff")]
    alarm = [float(r["health/mismatch_alarm"]) for r in rows if r.get("health/mismatch_alarm")]
    assert diff[0] <= 1e-5  # step 0: the engine still has the weights the trainer starts from
    assert alarm == [float(d > 1e-3) for d in diff] and alarm[-1] == 1.0
    assert "the engine is not sampling with the trained weights" in capfd.readouterr().err


def test_a_prompt_the_tokenizer_cannot_encode_is_refused(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1 € + 2 £ =", "answer": "3"}\n', encoding="utf-8")
    cfg = compose_cfg(tmp_path / "run", "task=jsonl", f"task.path={data}", "task.reward_fn=json:loads",
                      "trainer.max_steps=1")
    run = build_run(cfg)
    with pytest.raises(ValueError, match=r"prompt 0 \('1 € \+ 2 £ ='\) holds characters the tokenizer cannot "
                                         r"encode: \['£', '€'\]"):
        run.datamodule.ticket(0)


def test_a_model_dir_without_tokenizer_files_is_named(tmp_path):
    save_model(build_tiny_model(vocab_size=128, hidden=32), None, tmp_path)
    with pytest.raises(ValueError, match=rf"{tmp_path} has no tokenizer files \(none of tokenizer.json"):
        load_hf(tmp_path)


def test_the_summary_never_hides_a_nan(capsys):
    print_summary({"wall_s": 1.0, "steps": 3, "train/rollout_logprob_abs_diff": math.nan}, "/run")
    assert "train/rollout_logprob_abs_diff: nan" in capsys.readouterr().out


def test_an_extreme_reward_is_a_named_error_not_an_overflow(tmp_path):
    """A reward of 1e300 used to crash the metric callback with a bare OverflowError (reward std)."""
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1:", "answer": "1"}\n{"prompt": "2:", "answer": "2"}\n')
    (tmp_path / "huge.py").write_text("def reward(response, record):\n    return 1e300\n")
    cfg = compose_cfg(tmp_path / "run", "task=jsonl", f"task.path={data}", f"task.reward_fn={tmp_path}/huge.py:reward",
                      "trainer.max_steps=1")
    with pytest.raises(RewardError, match=r"returned 1e\+300 .* rewards must lie in \[-1e\+06, 1e\+06\]"):
        train(cfg)
