"""Every config group composes, its `_target_`s resolve, and the cheap parts instantiate on CPU; validation
errors name the key, the constraint and the fix."""

import re
from pathlib import Path

import pytest
from helpers import ROOT, compose_config
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf

from topp_rl.config import validate_config

CONF = ROOT / "conf"
GROUPS = ("algo", "rollout", "rollout/step", "model", "task", "trainer", "logger", "callbacks", "parallel",
          "experiment", "teacher")


def _compose(overrides: list[str], tmp_path: Path) -> DictConfig:
    return compose_config(tmp_path, *overrides)


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
    # parallel / experiment may need several ranks / other venvs; the agent loop alone has no environment, the
    # endpoint no agent function, the dataset task no reward, the replay no recording (refused at start, test_invalid_
    # values_fail_at_start_naming_the_key, test_agent_docs.py, test_replay.py); algo=opd has no teacher, the teachers
    # no path (test_teacher.py)
    if group not in ("parallel", "experiment") and key not in ("rollout/step=agent", "rollout/step=endpoint",
                                                               "task=agent", "task=dataset", "rollout=replay",
                                                               "algo=opd", "teacher=hf_path", "teacher=sglang"):
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
    from topp_rl.train import RunSummary, build_callbacks

    callbacks = build_callbacks(cfg, RunSummary(), loggers=[instantiate(cfg.logger.csv)])
    assert "LogConfig" in [type(c).__name__ for c in callbacks]  # with a logger, the config goes to it
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
        ("parallel=tp2 trainer.devices=3", "parallel.tp_size * parallel.cp_size * parallel.pp_size"),
        # Pipeline parallelism (issue 38): stages need a Megatron layout, the world, an even layer split, a dense
        # model.
        ("parallel=tp2 parallel.pp_size=2", "parallel.tp_size * parallel.cp_size * parallel.pp_size"),
        ("parallel.pp_size=0", "parallel.pp_size"),
        ("parallel.pp_size=2 trainer.devices=2", "parallel.pp_size"),
        ("parallel=pp2 model.layers=3", "parallel.pp_size"),
        # Virtual stages: a size >= 1, pp > 1, the layers in pp x vpp equal chunks, dense models.
        ("parallel=pp2 parallel.vpp_size=0", "parallel.vpp_size"),
        ("parallel=megatron parallel.vpp_size=2", "parallel.vpp_size"),
        ("parallel=pp2 model.layers=8 parallel.vpp_size=2 parallel.distributed_optimizer=true",
         "parallel.distributed_optimizer"),
        ("parallel=pp2 model.layers=4 parallel.vpp_size=4", "parallel.vpp_size"),
        ("parallel=pp2 parallel.pp_size=4 trainer.devices=4 model.layers=8 parallel.vpp_size=2 "
         "rollout.prompts_per_step=1 rollout.n_samples=2", "parallel.vpp_size"),  # fewer samples than stages
        ("parallel=pp2 model.family=qwen3_moe model.layers=8 parallel.vpp_size=2", "parallel.vpp_size"),
        # parallel=none runs the HF model whole: a size or a CP layout would do nothing there.
        ("parallel.tp_size=2", "parallel.tp_size"),
        ("parallel.cp_size=2 trainer.devices=2", "parallel.cp_size"),
        ("+parallel.cp_mode=allgather", "parallel.cp_mode"),
        ("trainer.devices=2", "trainer.devices * trainer.num_nodes"),
        ("module.ppo_epochs=0", "module.ppo_epochs"),
        ("optimizer.lr=0", "optimizer.lr"),
        ("parallel=cp2 parallel.cp_mode=allgather", "parallel.cp_mode"),
        ("parallel=tp2_cp2 parallel.cp_mode=allgather", "parallel.cp_mode"),
        # Expert parallelism: EP must divide DP x CP; EP and the aux loss need the Megatron backbone.
        ("parallel=tp2_ep2 trainer.devices=2", "parallel.ep_size"),
        ("parallel=ep2 parallel.ep_size=4", "parallel.ep_size"),
        ("parallel.ep_size=2", "parallel.ep_size"),
        ("module.moe_aux_loss_coeff=0.01", "module.moe_aux_loss_coeff"),
        # The sharded (megatron) optimizer: a bool, Adam(W) only, dense models only, Megatron backbone only.
        ("parallel=tp2 parallel.distributed_optimizer=yes", "parallel.distributed_optimizer"),
        ("parallel=tp2 parallel.distributed_optimizer=true optimizer._target_=torch.optim.NAdam ~optimizer.fused",
         "optimizer._target_"),
        ("parallel=ep2 parallel.distributed_optimizer=true", "parallel.distributed_optimizer"),
        ("parallel=tp2 parallel.distributed_optimizer=true trainer=cpu_fp16", "parallel.distributed_optimizer"),
        ("parallel=pp2 parallel.distributed_optimizer=true trainer=cpu_fp16", "parallel.distributed_optimizer"),
        ("+parallel.distributed_optimizer=true", "parallel.distributed_optimizer"),
        ("parallel=ep2 module.moe_aux_loss_coeff=-1", "module.moe_aux_loss_coeff"),
        # parallel=fsdp shards data-parallel ranks only; no offload on CPU; every rank must join a shared gather.
        ("parallel=fsdp parallel.tp_size=2", "parallel.tp_size"),
        ("parallel=fsdp parallel.ep_size=2", "parallel.ep_size"),
        ("parallel=fsdp parallel.cpu_offload=true", "parallel.cpu_offload"),
        ("parallel=fsdp parallel.cpu_offload=yes", "parallel.cpu_offload"),
        ("parallel=fsdp module.moe_aux_loss_coeff=0.01", "module.moe_aux_loss_coeff"),
        ("parallel=fsdp trainer.devices=4 eval.every_n_steps=1 eval.num_prompts=2", "eval.num_prompts"),
        # A key the layout does not read, and device counts that would divide the prompts by zero (issue 35).
        ("parallel=fsdp +parallel.distributed_optimizer=true", "parallel.distributed_optimizer"),
        ("parallel=fsdp +parallel.cp_mode=zigzag", "parallel.cp_mode"),
        ("parallel=tp2 +parallel.cpu_offload=true", "parallel.cpu_offload"),
        ("parallel=fsdp trainer.devices=0", "trainer.devices"),
        ("trainer.devices=0", "trainer.devices"),
        ("trainer.devices=-1", "trainer.devices"),
        ("parallel=fsdp trainer.num_nodes=0", "trainer.num_nodes"),
        # Held-out prompts chosen for an evaluation that never runs.
        ("eval.split=test", "eval.split"),
        ("callbacks=minimal +eval.split=test", "eval.split"),
        ("trainer.devices=2", "trainer.devices * trainer.num_nodes"),  # plain DDP: the fix names parallel=fsdp
        # Wrong types name the key instead of raising a raw TypeError; bools are not numbers.
        ("rollout.top_p=abc", "rollout.top_p"),
        ("rollout.top_k=true", "rollout.top_k"),
        ("rollout.top_k=0.5", "rollout.top_k"),
        ("rollout.temperature=1e-45", "rollout.temperature"),
        ("optimizer.lr=abc", "optimizer.lr"),
        ("rollout.n_samples=true", "rollout.n_samples"),
        ("trainer.max_steps=abc", "trainer.max_steps"),
        ("callbacks.weight_sync=null", "callbacks.weight_sync"),  # off-policy without saying so
        # Rollouts ahead: the engine must keep its own weights; K is one integer; partial rollouts need K >= 1
        # and an engine whose updates land between decode steps.
        ("rollout.overlap=true", "rollout.engine.share_weights"),
        ("rollout.max_staleness=2", "rollout.engine.share_weights"),
        ("rollout.overlap=yes", "rollout.overlap"),
        ("rollout.max_staleness=-1", "rollout.max_staleness"),
        ("rollout.max_staleness=1.5", "rollout.max_staleness"),
        ("rollout.max_staleness=true", "rollout.max_staleness"),
        ("rollout.overlap=true rollout.max_staleness=2", "rollout.overlap"),
        ("rollout.partial_rollouts=true", "rollout.partial_rollouts"),
        ("rollout.partial_rollouts=yes", "rollout.partial_rollouts"),
        ("rollout.max_staleness=2 rollout.partial_rollouts=true rollout.engine.share_weights=false "
         "rollout.engine.batching=static", "rollout.engine.batching"),
        # Every boolean key: a string would be truthy ("false" included). Issue 18 part 5f.
        ("module.gradient_checkpointing=yes", "module.gradient_checkpointing"),
        ("module.use_mask=no", "module.use_mask"),
        ("allow_stale_weights=1", "allow_stale_weights"),
        ("host_memory_reuse=yes", "host_memory_reuse"),
        ("export.hf=on", "export.hf"),
        ("export.on_checkpoint=0", "export.on_checkpoint"),
        ("resume.allow_config_change=yes", "resume.allow_config_change"),
        ("data.drop_zero_variance_groups=yes", "data.drop_zero_variance_groups"),
        # Dynamic sampling: refill needs the groups it replaces dropped, a bounded factor, and no overlap.
        ("data.drop_zero_variance_groups=true data.refill=yes", "data.refill"),
        ("data.refill=true", "data.refill"),
        ("data.drop_zero_variance_groups=true data.refill=true rollout.overlap=true rollout.engine.share_weights=false "
         "algo.loss.tis_cap=2.0", "data.refill"),
        ("data.drop_zero_variance_groups=true data.refill=true data.max_refill_factor=0.5", "data.max_refill_factor"),
        ("data.max_refill_factor=inf", "data.max_refill_factor"),
        ("data.max_refill_factor=nan", "data.max_refill_factor"),
        ("data.max_refill_factor=abc", "data.max_refill_factor"),
        ("data.max_refill_factor=true", "data.max_refill_factor"),
        ("rollout.engine.share_weights=yes", "rollout.engine.share_weights"),
        ("rollout=sglang rollout.engine.router=yes", "rollout.engine.router"),
        ("rollout=sglang rollout.max_candidates=0", "rollout.max_candidates"),
        # The serving limits moved into nested groups (issue 36): the old flat key names its new place.
        ("rollout=sglang +rollout.engine.first_byte_timeout_s=900", "rollout.engine.first_byte_timeout_s"),
        ("rollout=sglang rollout.max_candidates=-3", "rollout.max_candidates"),
        # Several turns need the agent loop; its budgets are positive.
        ("rollout.max_turns=3", "rollout.max_turns"),
        ("rollout/step=agent", "rollout.step.environment"),
        ("task=lookup rollout.max_turns=0", "rollout.max_turns"),
        ("task=lookup rollout.max_trajectory_tokens=0", "rollout.max_trajectory_tokens"),
        ("task=agent", "task.agent"),
        ("rollout/step=endpoint", "task.agent"),
        # Group advantages need groups, whatever the algorithm is called.
        ("algo=reinforce_pp algo.advantage._target_=topp_rl.rollout.advantages.GroupAdvantage "
         "rollout.n_samples=1", "rollout.n_samples"),
    ],
)
def test_invalid_values_fail_at_start_naming_the_key(override, key, tmp_path):
    cfg = _compose(override.split(), tmp_path)
    with pytest.raises(ValueError, match=rf"config {re.escape(key)}=.*must be .*;"):
        validate_config(cfg)


@pytest.mark.parametrize("override", [
    "task=lookup rollout=sglang", "task=lookup parallel=fsdp trainer.devices=2", "task=lookup parallel=tp2_cp2",
    "task=lookup parallel=ep2 model.family=qwen3_moe rollout.routing_replay=true",
])
def test_the_agent_loop_runs_with_either_engine_and_any_layout(override, tmp_path):
    """Measured exact through the loop (tests/test_agent_dist.py, tests/test_agent_sglang.py): accepted."""
    validate_config(_compose(override.split(), tmp_path))


def test_fsdp_refuses_the_distributed_optimizer_saying_fsdp_shards_the_optimizer_state(tmp_path):
    """parallel=fsdp reads no distributed_optimizer key: `+parallel.distributed_optimizer=true` trained without a
    word (issue 35). FSDP2 already shards the AdamW state, so the key is refused rather than implemented."""
    with pytest.raises(ValueError) as info:
        validate_config(_compose(["parallel=fsdp", "+parallel.distributed_optimizer=true"], tmp_path))
    assert str(info.value) == (
        "config parallel.distributed_optimizer=True: must be absent with parallel=fsdp (FSDP2 already shards the "
        "AdamW state over the ranks, with the weights and gradients; megatron-core's DistributedOptimizer is the "
        "Megatron layouts' ZeRO-1); drop the key, or pick a layout that reads it "
        "(parallel=cp2/ep2/megatron/pp2/pp2_cp2/pp2_ep2/tp2/tp2_cp2/tp2_ep2/tp2_pp2)"
    )
    with pytest.raises(ValueError) as info:  # and a Megatron layout has no CPU offload to switch
        validate_config(_compose(["parallel=tp2", "+parallel.cpu_offload=true"], tmp_path))
    assert str(info.value) == (
        "config parallel.cpu_offload=True: must be absent with parallel=cp2/ep2/megatron/pp2/pp2_cp2/pp2_ep2/tp2/tp2_cp2/"
        "tp2_ep2/"
        "tp2_pp2 (the "
        "keys it reads: cp_mode, cp_size, distributed_optimizer, ep_size, pp_size, strategy, tp_size, vpp_size); drop the "
        "key, or pick "
        "a layout that reads it (parallel=fsdp)"
    )


def test_zero_devices_is_refused_instead_of_dividing_by_zero(tmp_path):
    """`parallel=fsdp trainer.devices=0` was a ZeroDivisionError in the validator (issue 35)."""
    with pytest.raises(ValueError) as info:
        validate_config(_compose(["parallel=fsdp", "trainer.devices=0"], tmp_path))
    assert str(info.value) == (
        "config trainer.devices=0: must be an integer >= 1; set trainer.devices=1 or more, or trainer.devices=auto "
        "for every device of the node"
    )
    validate_config(_compose(["trainer.devices=auto"], tmp_path))  # Lightning counts them; not refused


def test_unknown_trainer_key_names_the_nearest_parameter_instead_of_a_raw_type_error(tmp_path):
    with pytest.raises(ValueError) as info:
        validate_config(_compose(["+trainer.max_stepz=3"], tmp_path))
    message = str(info.value)
    assert message.startswith("config trainer.max_stepz=3: must be a parameter of lightning.Trainer (accelerator, "
                              "strategy, devices, num_nodes, precision, logger, callbacks, ")
    assert message.endswith("; did you mean trainer.max_steps? fix the spelling, or drop the key")
    # List items are walked too (trainer.plugins), and a callback entry's `enabled` switch is not a kwarg.
    with pytest.raises(ValueError, match=r"^config trainer.plugins.0.init_scal=2.0: must be a parameter of "
                                         r"topp_rl.trainer.precision.LossScaledFP16 \(device, init_scale, growth_interval\); "
                                         r"did you mean trainer.plugins.0.init_scale\? "):
        validate_config(_compose(["trainer=cpu_fp16", "+trainer.plugins.0.init_scal=2.0"], tmp_path))
    assert "enabled" in _compose([], tmp_path).callbacks.export


def test_an_eval_split_without_an_evaluation_is_refused(tmp_path):
    """eval.split / eval.task pick the held-out prompts; with eval.every_n_steps=0 nothing read them (issue 35)."""
    with pytest.raises(ValueError) as info:
        validate_config(_compose(["eval.split=test"], tmp_path))
    assert str(info.value) == (
        "config eval.split='test': must be null with eval.every_n_steps=0 (no evaluation runs, so nothing reads it); "
        "set eval.every_n_steps=N to evaluate on it every N steps, or drop eval.split"
    )
    with pytest.raises(ValueError, match=r"^config eval.task='topp_rl.tasks.CopyDigitTask': must be null with "):
        validate_config(_compose(["+eval.task._target_=topp_rl.tasks.CopyDigitTask"], tmp_path))


def test_megatron_resume_refusals_name_the_export_way_out():
    """They advised 'use weights_only', which no key or doc offers (issue 35); the real way out is an export and a
    new run on it (docs/megatron.md)."""
    pytest.importorskip("megatron.core", reason="megatron-core (the `megatron` extra) is not installed")
    from topp_rl.megatron.strategy import MegatronStrategy

    way_out = ("to go on from its weights alone at this layout, export them (python -m topp_rl.export <ckpt> OUT) "
               "and start a new run on them (model=hf_path model.path=OUT, no ckpt_path)")
    saved_at_tp1 = {"optimizer_states": [{"megatron_tp_size": 1, "megatron_ep_size": 1, "per_tp_rank": [{}]}]}
    with pytest.raises(ValueError) as info:
        MegatronStrategy(tp_size=2).load_optimizer_state_dict(saved_at_tp1)
    assert str(info.value) == (
        f"optimizer state was saved at (tp_size, ep_size, pp_size)=(1, 1, 1), this run has (2, 1, 1); resume at the "
        f"saved sizes, or {way_out}"
    )
    # A pipelined run's state restores at another pp only with its parameters' names (saved since issue 38; the
    # regrouping itself is tested in test_megatron_pipeline.py).
    saved_at_pp2 = {"optimizer_states": [{"megatron_tp_size": 1, "megatron_ep_size": 1, "megatron_pp_size": 2,
                                          "per_pp_tp_rank": [{}, {}]}]}
    with pytest.raises(ValueError) as info:
        MegatronStrategy().load_optimizer_state_dict(saved_at_pp2)
    assert str(info.value) == (
        f"optimizer state was saved at (tp_size, ep_size, pp_size)=(1, 1, 2), this run has (1, 1, 1); resume at the "
        f"saved pp_size (this checkpoint predates the parameter names that let its optimizer state restore at "
        f"another pp_size), or {way_out}"
    )
    # the same at another vpp_size: a rank holds other layers than at vpp 1 (same pp)
    with pytest.raises(ValueError) as info:
        MegatronStrategy(pp_size=2, vpp_size=2).load_optimizer_state_dict(saved_at_pp2)
    assert str(info.value) == (
        "optimizer state was saved at parallel.vpp_size=1, this run has 2; resume at the saved vpp_size (this "
        f"checkpoint predates the parameter names that let its optimizer state restore at another one), or {way_out}"
    )
    with pytest.raises(ValueError) as info:
        MegatronStrategy(tp_size=2).load_optimizer_state_dict(saved_at_pp2)
    assert "(1, 1, 2), this run has (2, 1, 1); resume at the saved sizes, or" in str(info.value)
    sharded = MegatronStrategy(tp_size=2)
    sharded._layout_key = lambda: (2, 2, 1, 1)  # (world, tp, cp, pp) without a process group
    with pytest.raises(ValueError) as info:  # a key saved before pp existed (world, tp, cp) reads as pp = 1
        sharded.load_optimizer_state_dict({"optimizer_states": [{"megatron_distributed_optimizer": (4, 2, 1)}]})
    assert str(info.value) == (
        "optimizer state was saved at (world, tp, cp, pp)=(4, 2, 1, 1), this run has (world, tp, cp, pp)=(2, 2, 1, 1) "
        f"and distributed_optimizer=False: sharded optimizer state restores only at the saved layout and setting; "
        f"resume with them, or {way_out}"
    )
    # The same world, TP and CP at another pipeline split holds other shards: refused too (issue 38).
    at_pp2 = MegatronStrategy(pp_size=2, distributed_optimizer=True)
    at_pp2._layout_key = lambda: (4, 1, 1, 2)
    with pytest.raises(ValueError, match=r"saved at \(world, tp, cp, pp\)=\(4, 1, 1, 1\), this run has "
                       r"\(world, tp, cp, pp\)=\(4, 1, 1, 2\) and distributed_optimizer=True"):
        at_pp2.load_optimizer_state_dict({"optimizer_states": [{"megatron_distributed_optimizer": (4, 1, 1, 1)}]})
    assert "weights_only" not in (ROOT / "topp_rl" / "megatron" / "strategy.py").read_text()


def test_dropping_the_weight_sync_is_allowed_when_asked_for(tmp_path):
    validate_config(_compose(["callbacks.weight_sync=null", "allow_stale_weights=true"], tmp_path))


def test_fsdp_accepts_many_ranks(tmp_path):
    for extra in ([], ["trainer.devices=4", "trainer.num_nodes=2", "rollout.prompts_per_step=8"],
                  ["module.gradient_checkpointing=true"], ["eval.every_n_steps=1", "eval.num_prompts=2"]):
        validate_config(_compose(["parallel=fsdp", *extra], tmp_path))


def test_batch_advantages_allow_one_sample_per_prompt(tmp_path):
    validate_config(_compose(["algo=reinforce_pp", "rollout.n_samples=1"], tmp_path))


def test_megatron_strategy_rejects_allgather_cp():
    pytest.importorskip("megatron.core", reason="megatron-core (the `megatron` extra) is not installed")
    from topp_rl.megatron.strategy import MegatronStrategy

    with pytest.raises(ValueError, match=r"cp_mode='allgather'.*zigzag only.*parallel.cp_mode=zigzag"):
        MegatronStrategy(cp_size=2, cp_mode="allgather")
    assert MegatronStrategy(tp_size=2, cp_mode="allgather").cp_mode == "allgather"  # no CP: nothing to split


def test_sweep_values_parse_as_numbers(tmp_path):
    cfg = _compose(["rollout.top_p=0.8"], tmp_path)
    assert OmegaConf.select(cfg, "rollout.top_p") == pytest.approx(0.8)
    assert cfg.run_name == "grpo-top_p0.8-seed0"


def test_max_candidates_of_one_with_sglang_fails_before_the_server_starts(tmp_path):
    """Found only at the first step before (issue 18 part 5g): after the ~60 s server start, every sample whose kept
    set held two ids was aborted and the step stopped. validate_config runs before any engine is built."""
    cfg = _compose(["rollout=sglang", "rollout.max_candidates=1", "rollout.top_p=0.9"], tmp_path)
    with pytest.raises(ValueError) as info:
        validate_config(cfg)
    assert str(info.value) == (
        "config rollout.max_candidates=1: must be >= 2 with rollout=sglang and truncated sampling (top_p=0.9, "
        "top_k=0, min_p=0.0): the engine aborts every sample whose kept set holds more than 1 id, so the first step "
        "would stop with its samples aborted; set rollout.max_candidates=2 or more (default 4096)"
    )
    for ok in (["rollout.max_candidates=2", "rollout.top_p=0.9"],  # the smallest cap that can hold a choice
               ["rollout.max_candidates=1", "rollout.top_k=1"],  # greedy keeps one id: works (checked on a server)
               ["rollout.max_candidates=1"]):  # untruncated: no mask is asked for, nothing can overflow
        validate_config(_compose(["rollout=sglang", *ok], tmp_path))



def test_sglang_limits_are_nested_groups_checked_at_start(tmp_path):
    """rollout.engine.timeouts / retries map onto `Timeouts` / `Retries` (the defaults' values), and a key or a
    value they would refuse fails at start naming the key, not when the engine is built after the model loaded."""
    import dataclasses

    from topp_rl.engines.serving import Retries, Timeouts

    cfg = _compose(["rollout=sglang"], tmp_path)
    assert dict(cfg.rollout.engine.timeouts) == dataclasses.asdict(Timeouts())
    assert dict(cfg.rollout.engine.retries) == dataclasses.asdict(Retries())
    validate_config(cfg)
    validate_config(_compose(["rollout=sglang", "rollout.engine.timeouts.first_byte_s=900"], tmp_path))
    with pytest.raises(ValueError) as info:
        validate_config(_compose(["rollout=sglang", "+rollout.engine.timeouts.connect_timeout_s=5"], tmp_path))
    assert str(info.value) == (
        "config rollout.engine.timeouts.connect_timeout_s=5: must be a field of Timeouts (connect_s, first_byte_s, "
        "per_token_s, transfer_s, weight_update_s, per_gb_s); did you mean rollout.engine.timeouts.connect_s? fix "
        "the spelling, or drop the key"
    )
    with pytest.raises(ValueError, match=r"^config rollout.engine.retries.attempts=2: must be a field of Retries "
                                         r"\(max_retries, backoff_s, max_backoff_s\); fix the spelling"):
        validate_config(_compose(["rollout=sglang", "+rollout.engine.retries.attempts=2"], tmp_path))
    with pytest.raises(ValueError, match=r"^config rollout.engine.timeouts.per_token_s=-1: must be a finite number "
                                         r"of seconds in \[0, 86400\]; set rollout.engine.timeouts.per_token_s in "
                                         r"that range, e.g. rollout.engine.timeouts.per_token_s=0.5$"):
        validate_config(_compose(["rollout=sglang", "rollout.engine.timeouts.per_token_s=-1"], tmp_path))
    # The flat keys of before are refused, naming the nested key each moved to.
    with pytest.raises(ValueError, match=r"^config rollout.engine.first_byte_timeout_s=5: must be absent: it moved to "
                                         r"rollout.engine.timeouts.first_byte_s; set rollout.engine.timeouts."
                                         r"first_byte_s instead$"):
        validate_config(_compose(["rollout=sglang", "+rollout.engine.first_byte_timeout_s=5"], tmp_path))


# Each engine group's choice with the count of numeric keys it ships under rollout.engine and rollout.step.
ENGINE_GROUPS = [(["rollout=embedded"], 0), (["rollout=sglang"], 14), (["task=lookup", "rollout/step=agent"], 2),
                 (["task=agent", "task.agent=topp_rl.tasks.agents.lookup:lookup_agent"], 2)]


def _numeric_leaves(node: DictConfig, path: str) -> list[str]:
    """The dotted keys under `node` whose value is a number (interpolations resolved, e.g. max_candidates)."""
    found = []
    for key in node:
        child, dotted = node._get_node(key), f"{path}.{key}"
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_interpolation():
            found += _numeric_leaves(child, dotted)
        elif not child._is_interpolation():
            value = node[key]
            if isinstance(value, int | float) and not isinstance(value, bool):
                found.append(dotted)
    return found


@pytest.mark.parametrize(("overrides", "count"), ENGINE_GROUPS,
                         ids=[o[1] if len(o) > 1 else o[0] for o, _ in ENGINE_GROUPS])
def test_every_numeric_key_of_the_engine_groups_has_a_range(overrides, count, tmp_path):
    """A number the engine groups ship (or a constructor reads) is checked at start like the others: a key added
    to the yaml without a range here fails this test."""
    from topp_rl.config import ENGINE_NUMBERS

    cfg = _compose(overrides, tmp_path)
    leaves = _numeric_leaves(cfg.rollout.engine, "rollout.engine") + _numeric_leaves(cfg.rollout.step, "rollout.step")
    assert len(leaves) == count, leaves
    assert not set(leaves) - set(ENGINE_NUMBERS), sorted(set(leaves) - set(ENGINE_NUMBERS))


@pytest.mark.parametrize(("overrides", "message"), [
    # `abc` was a raw TypeError from Timeouts / AgentLoopStep; `inf` and a billion retries passed.
    (["rollout=sglang", "rollout.engine.timeouts.connect_s=abc"],
     "config rollout.engine.timeouts.connect_s='abc': must be a finite number of seconds in (0, 86400]; set "
     "rollout.engine.timeouts.connect_s in that range, e.g. rollout.engine.timeouts.connect_s=10"),
    (["rollout=sglang", "rollout.engine.timeouts.first_byte_s=inf"],
     "config rollout.engine.timeouts.first_byte_s=inf: must be a finite number of seconds in (0, 86400]; set "
     "rollout.engine.timeouts.first_byte_s in that range, e.g. rollout.engine.timeouts.first_byte_s=60"),
    (["rollout=sglang", "rollout.engine.timeouts.weight_update_s=172800"],
     "config rollout.engine.timeouts.weight_update_s=172800: must be a finite number of seconds in (0, 86400]; set "
     "rollout.engine.timeouts.weight_update_s in that range, e.g. rollout.engine.timeouts.weight_update_s=120"),
    (["rollout=sglang", "rollout.engine.retries.max_retries=1000000000"],
     "config rollout.engine.retries.max_retries=1000000000: must be an integer in [0, 100]; set "
     "rollout.engine.retries.max_retries in that range, e.g. rollout.engine.retries.max_retries=4"),
    (["rollout=sglang", "rollout.engine.retries.backoff_s=nan"],
     "config rollout.engine.retries.backoff_s=nan: must be a finite number of seconds in [0, 86400]; set "
     "rollout.engine.retries.backoff_s in that range, e.g. rollout.engine.retries.backoff_s=0.5"),
    (["rollout=sglang", "rollout.engine.num_servers=2.5"],
     "config rollout.engine.num_servers=2.5: must be an integer in [1, 1024]; set rollout.engine.num_servers in "
     "that range, e.g. rollout.engine.num_servers=1"),
    (["rollout=sglang", "rollout.engine.progress_interval_s=true"],
     "config rollout.engine.progress_interval_s=True: must be a finite number of seconds in [0, 86400]; set "
     "rollout.engine.progress_interval_s in that range, e.g. rollout.engine.progress_interval_s=30"),
    (["rollout=sglang", "rollout.engine.server_kwargs.max_total_tokens=abc"],
     "config rollout.engine.server_kwargs.max_total_tokens='abc': must be an integer in [1, 2147483647]; set "
     "rollout.engine.server_kwargs.max_total_tokens in that range, e.g. "
     "rollout.engine.server_kwargs.max_total_tokens=8192"),
    (["rollout=sglang", "+rollout.engine.router_kwargs.max_retries=-1"],
     "config rollout.engine.router_kwargs.max_retries=-1: must be an integer in [0, 100]; set "
     "rollout.engine.router_kwargs.max_retries in that range, e.g. rollout.engine.router_kwargs.max_retries=3"),
    (["task=lookup", "rollout/step=agent", "rollout.step.max_failed_frac=abc"],
     "config rollout.step.max_failed_frac='abc': must be a finite number in [0, 1]; set "
     "rollout.step.max_failed_frac in that range, e.g. rollout.step.max_failed_frac=0.5"),
    (["task=lookup", "rollout/step=agent", "rollout.step.env_timeout_s=inf"],
     "config rollout.step.env_timeout_s=inf: must be a finite number of seconds in (0, 86400]; set "
     "rollout.step.env_timeout_s in that range, e.g. rollout.step.env_timeout_s=30"),
    (["task=agent", "task.agent=topp_rl.tasks.agents.lookup:lookup_agent", "rollout.step.agent_timeout_s=0"],
     "config rollout.step.agent_timeout_s=0: must be a finite number of seconds in (0, 86400]; set "
     "rollout.step.agent_timeout_s in that range, e.g. rollout.step.agent_timeout_s=120"),
])
def test_engine_numbers_are_refused_at_start_naming_the_key_and_range(overrides, message, tmp_path):
    with pytest.raises(ValueError) as info:
        validate_config(_compose(overrides, tmp_path))
    assert str(info.value) == message


def test_engine_numbers_at_their_bounds_pass(tmp_path):
    validate_config(_compose(["rollout=sglang", "rollout.engine.timeouts.first_byte_s=86400",
                              "rollout.engine.timeouts.per_token_s=0", "rollout.engine.retries.max_retries=100",
                              "rollout.engine.retries.backoff_s=0", "rollout.engine.progress_interval_s=0"], tmp_path))
    validate_config(_compose(["task=lookup", "rollout/step=agent", "rollout.step.max_failed_frac=1",
                              "rollout.step.env_timeout_s=0.5"], tmp_path))


def test_timeouts_and_retries_refuse_what_the_config_refuses():
    """The same bounds for a `Timeouts` / `Retries` built in Python (the engine's keyword arguments)."""
    from topp_rl.engines.serving import Retries, Timeouts

    for bad in ({"first_byte_s": float("inf")}, {"connect_s": "abc"}, {"per_gb_s": float("nan")},
                {"transfer_s": 86401}):
        with pytest.raises(ValueError, match="out of range: bases must be > 0, per-token / per-GB allowances >= 0, "
                                             "each a finite number of seconds <= 86400"):
            Timeouts(**bad)
    for bad in ({"max_retries": 101}, {"max_retries": True}, {"backoff_s": float("inf")}):
        with pytest.raises(ValueError, match=r"at most 100 retries and finite backoffs of at most 86400 s$"):
            Retries(**bad)


def test_booleans_name_the_key_value_and_fix(tmp_path):
    with pytest.raises(ValueError) as info:
        validate_config(_compose(["module.gradient_checkpointing=yes"], tmp_path))
    assert str(info.value) == (
        "config module.gradient_checkpointing='yes': must be true or false; set module.gradient_checkpointing=true "
        "or module.gradient_checkpointing=false"
    )


@pytest.mark.parametrize(
    ("override", "key", "near"),
    [
        ("+rollout.topp=0.9", "rollout.topp", "rollout.top_p"),
        ("+rollout.top_pp=0.9", "rollout.top_pp", "rollout.top_p"),
        ("+module.gradient_checkpoint=1", "module.gradient_checkpoint", "module.gradient_checkpointing"),
        ("+eval.every_n_step=5", "eval.every_n_step", "eval.every_n_steps"),
        ("+seeed=1", "seeed", "seed"),
        ("+optimizer.weight_decy=0.1", "optimizer.weight_decy", "optimizer.weight_decay"),
        ("+data.max_tokens_per_microbatch=64", "data.max_tokens_per_microbatch", "data.max_tokens_per_micro_batch"),
        # Every `_target_` node against its constructor (issue 35): a raw Trainer.__init__ TypeError before.
        ("+trainer.max_stepz=3", "trainer.max_stepz", "trainer.max_steps"),
        ("+algo.loss.kl_coeff=0.1", "algo.loss.kl_coeff", "algo.loss.kl_coef"),
        ("+algo.advantage.normalise_std=1", "algo.advantage.normalise_std", "algo.advantage.normalize_std"),
        ("+callbacks.health.zero_grad_step=2", "callbacks.health.zero_grad_step", "callbacks.health.zero_grad_steps"),
        ("+logger.csv.flush_logs_every_n_step=5", "logger.csv.flush_logs_every_n_step",
         "logger.csv.flush_logs_every_n_steps"),
        ("+rollout.sampling.top_kk=5", "rollout.sampling.top_kk", "rollout.sampling.top_k"),
        # EmbeddedEngine.for_policy takes **kwargs and passes them to the class: the class's names count.
        ("+rollout.engine.max_batch_siz=8", "rollout.engine.max_batch_siz", "rollout.engine.max_batch_size"),
        ("+algo.nam=1", "algo.nam", "algo.name"),  # algo is closed to its options' keys
    ],
)
def test_an_unknown_key_fails_at_start_naming_the_nearest_known_one(override, key, near, tmp_path):
    """Hydra's `+` adds any key; a misspelt one used to be ignored, the run training with the default (issue 18
    part 5a). Closed sections are checked against the shipped yaml, `optimizer` / `data` against their target."""
    with pytest.raises(ValueError) as info:
        validate_config(_compose([override], tmp_path))
    message = str(info.value)
    assert message.startswith(f"config {key}={override.split('=', 1)[1]}: must be a ")
    assert f"; did you mean {near}? fix the spelling, or drop the key" in message


def test_an_unknown_rollout_key_lists_the_known_ones(tmp_path):
    with pytest.raises(ValueError) as info:
        validate_config(_compose(["+rollout.topp=0.9"], tmp_path))
    assert str(info.value) == (
        "config rollout.topp=0.9: must be a key the shipped config defines (in rollout: engine, max_new_tokens, "
        "max_staleness, max_trajectory_tokens, max_turns, min_p, n_samples, overlap, partial_rollouts, prompts_per_step, "
        "record, record_routes, routing_replay, sampling, step, stop_token_ids, "
        "temperature, top_k, top_p); "
        "did you mean rollout.top_p? fix the spelling, or drop the key (Hydra's + adds any key, and nothing reads "
        "this one)"
    )


def test_a_key_of_another_rollout_choice_is_refused(tmp_path):
    """rollout.max_candidates caps what an SGLang server records; the embedded engine has no cap, so the key is
    absent under rollout=embedded (Hydra refuses it) and refused when added with `+`."""
    with pytest.raises(ValueError, match=r"^config rollout.max_candidates=8: must be a key the shipped config "
                                         r"defines \(in rollout: engine, max_new_tokens, "):
        validate_config(_compose(["+rollout.max_candidates=8"], tmp_path))
    sglang = _compose(["rollout=sglang"], tmp_path)
    assert sglang.rollout.max_candidates == 4096 and "share_weights" not in sglang.rollout.engine
    embedded = _compose([], tmp_path)
    assert "max_candidates" not in embedded.rollout and embedded.rollout.engine.share_weights is True
    # What both choices share comes from one file, so they cannot drift apart.
    assert {k: sglang.rollout[k] for k in ("sampling", "n_samples", "overlap")} == {
        k: embedded.rollout[k] for k in ("sampling", "n_samples", "overlap")}


@pytest.mark.parametrize(
    "overrides",
    [
        ["+callbacks.more_stats._target_=topp_rl.callbacks.RolloutStats"],  # `+callbacks.<name>` adds a callback
        ["+optimizer.amsgrad=true"],  # a torch.optim.AdamW kwarg the shipped yaml does not set
        ["rollout=sglang", "+rollout.engine.server_kwargs.device=cuda"],  # engine kwargs (docs/sglang.md)
        ["+model.rope_theta=10000.0"],  # model / task / trainer / logger: constructor kwargs via _target_
        ["+trainer.gradient_clip_val=1.0"],
        ["+rollout.engine.max_batch_size=8"],  # an EmbeddedEngine kwarg, through for_policy's **kwargs
        ["rollout=sglang", "+rollout.engine.max_concurrency=8"],  # an SGLangEngine kwarg, likewise
        ["+logger.wandb.entity=me"],  # WandbLogger takes **kwargs (wandb.init's)
        ["+parallel.strategy.foo=1", "parallel=fsdp"],  # FSDPStrategy takes **kwargs (Lightning's)
        ["eval.split=test", "eval.every_n_steps=5"],  # the split an evaluation reads
        ["parallel=pp2", "parallel.distributed_optimizer=true"],  # issue 38: both through the pipeline schedule
        ["parallel=pp2", "trainer=cpu_fp16"],
    ],
)
def test_legitimate_extra_keys_are_accepted(overrides, tmp_path):
    validate_config(_compose(overrides, tmp_path))


def _built(tmp_path: Path, *overrides: str) -> list[str]:
    from topp_rl.train import RunSummary, build_callbacks

    cfg = _compose(list(overrides), tmp_path)
    validate_config(cfg)
    return [type(c).__name__ for c in build_callbacks(cfg, RunSummary(), loggers=[])]


BOOKKEEPING = ["RunRecord", "StopOnSignal", "StepTimer"]  # added by train.py to any choice (LogConfig too, when logging)


def test_callbacks_minimal_is_minimal_and_default_lists_every_callback(tmp_path):
    """Every callback but the run's bookkeeping is an entry of the chosen callbacks config (issue 19 part 2):
    eval, checkpoint, export and the progress bar included, in the order they run."""
    assert _built(tmp_path, "callbacks=minimal") == [
        "WeightSync", "TrainingHealth", "LastCheckpoint", *BOOKKEEPING, "RunSummary"]
    assert _built(tmp_path) == [
        "LogProbMismatch", "SupportStats", "RolloutStats", "WeightSync", "CompletionsLog", "TrainingHealth",
        "Evaluation", "LastCheckpoint", "HFExport", *BOOKKEEPING, "StepProgressBar", "RunSummary"]
    # The switches users know keep their meaning: they turn their entry off.
    assert _built(tmp_path, "export.hf=false", "trainer.enable_progress_bar=false") == [
        "LogProbMismatch", "SupportStats", "RolloutStats", "WeightSync", "CompletionsLog", "TrainingHealth",
        "Evaluation", "LastCheckpoint", *BOOKKEEPING, "RunSummary"]


def test_callback_settings_without_their_callback_are_refused(tmp_path):
    # Absent under callbacks=minimal: Hydra itself refuses the key ...
    with pytest.raises(Exception, match="eval"):
        _compose(["callbacks=minimal", "eval.every_n_steps=5"], tmp_path)
    # ... and with `+` (or after dropping the entry) nothing would act on it: refused at start.
    for overrides, key, fix in (
        (["callbacks=minimal", "+eval.every_n_steps=5"], "eval.every_n_steps=5", "set eval.every_n_steps=0"),
        (["callbacks.evaluation=null", "eval.every_n_steps=5"], "eval.every_n_steps=5", "set eval.every_n_steps=0"),
        (["callbacks.export=null"], "export.hf=True", "set export.hf=false"),
    ):
        with pytest.raises(ValueError) as info:
            validate_config(_compose(overrides, tmp_path))
        assert str(info.value).startswith(f"config {key}: must be off without a callbacks."), overrides
        assert f"; {fix}, or use callbacks=default" in str(info.value)
    assert "HFExport" not in _built(tmp_path, "callbacks.export=null", "export.hf=false")


def test_moe_models_pipeline_with_the_experts_split_inside_a_stage(tmp_path):
    """parallel=pp2_ep2 with a Qwen3-MoE and routing replay (issue 38; refused before): accepted, world 4 = pp 2 x
    dp 2 with ep 2 over each stage's two data-parallel ranks; an odd layer count is still refused."""
    from topp_rl.config import parallel_plan

    cfg = _compose("parallel=pp2_ep2 model.family=qwen3_moe model.layers=4 rollout.routing_replay=true".split(),
                   tmp_path)
    validate_config(cfg)
    plan = parallel_plan(cfg)
    assert (plan.world, plan.dp, plan.ep, plan.pp) == (4, 2, 2, 2)
    with pytest.raises(ValueError, match=r"config parallel.pp_size=2: must be a divisor of the model's layer count"):
        validate_config(_compose("parallel=pp2_ep2 model.family=qwen3_moe model.layers=3".split(), tmp_path))
