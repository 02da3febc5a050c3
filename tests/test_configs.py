"""Every config group composes, its `_target_`s resolve, and the cheap parts instantiate on CPU; validation
errors name the key, the constraint and the fix."""

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf

from topp_rl.config import validate_config

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ("algo", "rollout", "model", "task", "trainer", "logger", "callbacks", "parallel", "experiment")


def _compose(overrides: list[str], tmp_path: Path) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[f"paths.output_dir={tmp_path}", *overrides])


def _targets(node) -> list[str]:
    if isinstance(node, DictConfig):
        found = [str(node["_target_"])] if "_target_" in node else []
        return found + [t for k in node if k != "_target_" for t in _targets(node._get_node(k))]
    if isinstance(node, ListConfig):
        return [t for item in node for t in _targets(item)]
    return []


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


CASES = [(g, o) for g in GROUPS for o in _options(g)]


@pytest.mark.parametrize(("group", "option"), CASES, ids=[f"{g}={o}" for g, o in CASES])
def test_every_option_composes_and_targets_resolve(group, option, tmp_path):
    from hydra._internal.utils import _locate

    key = f"{group}={option}"
    cfg = _compose([key], tmp_path)
    targets = _targets(cfg)
    assert len(targets) >= 6  # model, engine, task, advantage, loss, optimizer, trainer, ...
    for target in targets:
        _locate(target)  # raises ImportError / AttributeError on a mistyped _target_
    if group not in ("parallel", "experiment"):  # those may need several ranks / other venvs
        validate_config(cfg)


def test_default_parts_instantiate_on_cpu(tmp_path):
    cfg = _compose(["logger=csv"], tmp_path)
    validate_config(cfg)
    policy, tokenizer = instantiate(cfg.model)
    assert policy.get_output_embeddings().weight.shape[0] >= len(tokenizer)
    for algo in _options("algo"):
        algo_cfg = _compose([f"algo={algo}"], tmp_path).algo
        loss, advantage = instantiate(algo_cfg.loss), instantiate(algo_cfg.advantage)
        assert type(loss).__name__ == algo_cfg.loss._target_.rsplit(".", 1)[1]
        assert (loss.eps_clip, loss.aggregation) == (algo_cfg.loss.eps_clip, algo_cfg.loss.get("aggregation",
                                                                                                 loss.aggregation))
        assert type(advantage).__name__ == algo_cfg.advantage._target_.rsplit(".", 1)[1]
    callbacks = [instantiate(c) for c in cfg.callbacks.values()]
    assert [type(c).__name__ for c in callbacks] == [
        "LogProbMismatch", "SupportStats", "RolloutStats", "WeightSync", "CompletionsLog", "TrainingHealth"]
    trainer = instantiate(cfg.trainer, logger=[instantiate(cfg.logger.csv)], callbacks=callbacks)
    assert trainer.max_steps == cfg.trainer.max_steps == 120
    task = instantiate(cfg.task)
    record = task.prompt(0, tokenizer)
    assert record.text == f"{record.answer}:" and task.reward(record.answer, record) == 1.0  # copy_digit


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("rollout.top_p=1.2", "rollout.top_p"),
        ("rollout.top_p=0", "rollout.top_p"),
        ("rollout.temperature=0", "rollout.temperature"),
        ("rollout.top_k=-1", "rollout.top_k"),
        ("rollout.min_p=1.0", "rollout.min_p"),
        ("rollout.n_samples=1", "rollout.n_samples"),
        ("trainer.max_steps=0", "trainer.max_steps"),
        ("trainer.devices=2 rollout.prompts_per_step=3", "rollout.prompts_per_step"),
        ("trainer.devices=3 parallel.tp_size=2", "parallel.tp_size * parallel.cp_size"),
        ("trainer.devices=2", "trainer.devices * trainer.num_nodes"),
        ("module.ppo_epochs=0", "module.ppo_epochs"),
        ("optimizer.lr=0", "optimizer.lr"),
        ("parallel=cp2 parallel.cp_mode=allgather", "parallel.cp_mode"),
        ("parallel=tp2_cp2 parallel.cp_mode=allgather", "parallel.cp_mode"),
        # Wrong types name the key instead of raising a raw TypeError; bools are not numbers.
        ("rollout.top_p=abc", "rollout.top_p"),
        ("rollout.top_k=true", "rollout.top_k"),
        ("rollout.top_k=0.5", "rollout.top_k"),
        ("rollout.temperature=1e-45", "rollout.temperature"),
        ("optimizer.lr=abc", "optimizer.lr"),
        ("rollout.n_samples=true", "rollout.n_samples"),
        ("trainer.max_steps=abc", "trainer.max_steps"),
        ("callbacks.weight_sync=null", "callbacks.weight_sync"),  # off-policy without saying so
        # Overlap: the engine must keep its own weights, and the one-update gap must be corrected.
        ("rollout.overlap=true", "rollout.engine.share_weights"),
        ("rollout.overlap=true rollout.engine.share_weights=false", "algo.loss.tis_cap"),
        ("rollout.overlap=yes", "rollout.overlap"),
        # Group advantages need groups, whatever the algorithm is called.
        ("algo=reinforce_pp algo.advantage._target_=topp_rl.rollout.advantages.GroupAdvantage "
         "rollout.n_samples=1", "rollout.n_samples"),
    ],
)
def test_invalid_values_fail_at_start_naming_the_key(override, key, tmp_path):
    cfg = _compose(override.split(), tmp_path)
    with pytest.raises(ValueError, match=rf"config {re.escape(key)}=.*must be .*;"):
        validate_config(cfg)


def test_dropping_the_weight_sync_is_allowed_when_asked_for(tmp_path):
    validate_config(_compose(["callbacks.weight_sync=null", "allow_stale_weights=true"], tmp_path))


def test_batch_advantages_allow_one_sample_per_prompt(tmp_path):
    validate_config(_compose(["algo=reinforce_pp", "rollout.n_samples=1"], tmp_path))


def test_megatron_strategy_rejects_allgather_cp():
    pytest.importorskip("megatron.core", reason="megatron-core (the `megatron` extra) is not installed")
    from topp_rl.megatron.strategy import MegatronStrategy

    with pytest.raises(ValueError, match=r"cp_mode='allgather'.*supports only 'zigzag'.*parallel.cp_mode=zigzag"):
        MegatronStrategy(cp_size=2, cp_mode="allgather")
    assert MegatronStrategy(tp_size=2, cp_mode="allgather").cp_mode == "allgather"  # no CP: nothing to split


def test_sweep_values_parse_as_numbers(tmp_path):
    cfg = _compose(["rollout.top_p=0.8"], tmp_path)
    assert OmegaConf.select(cfg, "rollout.top_p") == pytest.approx(0.8)
    assert cfg.run_name == "grpo-top_p0.8-seed0"
