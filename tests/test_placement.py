"""The placement plan (`topp_rl.parallel.placement`): over a grid of nodes x GPUs per node x layouts (FSDP, TP,
TP x CP, EP, PP) x placements, every rule holds (one trainer rank per GPU, no GPU shared in disaggregated mode, each
server's GPUs on one node and of its own replica when colocated, every replica pushing from its source to its own
servers, memory fractions summing to at most 1 per GPU); the replicas are megatron-core's own (`RankGenerator`).
Each refusal names its numbers; the config keys are validated at start and `topp-rl plan` prints or refuses a plan
without building anything."""

import re
import subprocess
import sys

import pytest
from helpers import ROOT, compose_config, train_env
from hydra.utils import instantiate
from megatron.core.parallel_state import RankGenerator

from topp_rl.config import placement_of, target_parameters, validate_config
from topp_rl.parallel.placement import TRAINER_SHARE, parse_gpus, plan_placement, render, replica_ranks, span
from topp_rl.parallel.plan import ParallelPlan
from topp_rl.train import engine_settings, print_placement

LAYOUTS = {"fsdp": {"fsdp": True}, "tp": {"tp": 2}, "tp_cp": {"tp": 2, "cp": 2}, "ep": {"ep": 2}, "pp": {"pp": 2}}


def _grid():
    for nodes in (1, 2):
        for devices in (1, 2, 8):
            for name, sizes in LAYOUTS.items():
                try:
                    plan = ParallelPlan(world=nodes * devices, **sizes)
                except ValueError:
                    continue  # the layout needs more ranks than this grid point has
                for server_tp in sorted({1, plan.tp}):
                    yield pytest.param(plan, nodes, devices, "colocated", server_tp,
                                       id=f"{nodes}x{devices}-{name}-colocated-tp{server_tp}")
                    if server_tp <= devices:
                        yield pytest.param(plan, nodes, devices, "disaggregated", server_tp,
                                           id=f"{nodes}x{devices}-{name}-disaggregated-tp{server_tp}")


def megatron_replicas(plan: ParallelPlan) -> list[list[int]]:
    """Each data-parallel replica's ranks as megatron-core forms its model-parallel groups, in DP order."""
    generator = RankGenerator(tp=plan.tp, ep=1, dp=plan.dp, pp=plan.pp, cp=plan.cp, order="tp-cp-ep-dp-pp")
    return sorted(generator.get_ranks("tp-cp-pp"))


@pytest.mark.parametrize(("plan", "nodes", "devices", "mode", "server_tp"), list(_grid()))
def test_every_rule_holds_over_the_grid(plan, nodes, devices, mode, server_tp):
    gpus = f"{devices}-{2 * devices - 1}" if mode == "disaggregated" else None  # the node's other half
    replicas = megatron_replicas(plan)
    assert [replica_ranks(plan, d) for d in range(plan.dp)] == replicas
    first = replicas[0][:server_tp]
    if mode == "colocated" and len({r // devices for r in first}) > 1:  # the server's TP would cross a node
        with pytest.raises(ValueError, match=r"rollout.engine.tp_size=2: must be a size whose GPUs lie on one node"):
            plan_placement(plan, nodes=nodes, devices=devices, placement=mode, tp_size=server_tp)
        return
    p = plan_placement(plan, nodes=nodes, devices=devices, placement=mode, gpus=gpus, tp_size=server_tp)
    # Trainer ranks: Lightning's order, one per GPU.
    assert [(t.node, t.gpu) for t in p.trainer] == [(r // devices, r % devices) for r in range(plan.world)]
    trainer_gpus = {(t.node, t.gpu): t.rank for t in p.trainer}
    server_gpus = [(s.node, g) for s in p.servers for g in s.gpus]
    assert len(server_gpus) == len(set(server_gpus)), "a GPU holds two servers"
    for s in p.servers:
        assert s.tp_size == server_tp and len(set(s.gpus)) == server_tp
        replica = replicas[s.dp_group]
        assert s.pushed_by == replica[0] == min(replica)  # the replica's source pushes
        if mode == "disaggregated":  # on the named GPUs, none a trainer rank's
            assert set(s.gpus) <= set(parse_gpus(gpus))
            assert not any((s.node, g) in trainer_gpus for g in s.gpus)
        else:  # on the GPUs of its own replica's ranks, all on its node
            assert all(trainer_gpus.get((s.node, g)) in replica for g in s.gpus)
    # Every replica pushes to exactly one server (num_servers=1), every server is pushed by exactly one replica.
    assert sorted(s.dp_group for s in p.servers) == list(range(plan.dp))
    assert all(len(p.servers_of(d)) == 1 for d in range(plan.dp))
    use = p.gpu_use()
    assert max(use.values()) <= 1.0
    shared = {k for k in use if k in trainer_gpus and k in set(server_gpus)}
    assert (not shared) if mode == "disaggregated" else all(use[k] == 0.4 + TRAINER_SHARE for k in shared)
    assert render(p).count("    server ") == plan.dp


def test_a_pipeline_across_two_nodes_keeps_each_server_with_its_replicas_source():
    p = plan_placement(ParallelPlan(world=16, tp=2, pp=2), nodes=2, devices=8, placement="colocated", tp_size=2)
    assert [(s.node, s.gpus, s.pushed_by) for s in p.servers] == [
        (0, (0, 1), 0), (0, (2, 3), 2), (0, (4, 5), 4), (0, (6, 7), 6)]
    assert render(p).splitlines()[1:3] == [
        "  node 0: trainer ranks 0-7 on GPUs 0-7",
        "    server 0: GPUs 0-1 (CUDA_VISIBLE_DEVICES=0,1 base_gpu_id=0 tp_size=2 mem_fraction_static=0.4), weights "
        "from rank 0 (replica 0)"]


def test_disaggregated_servers_sit_on_the_node_of_the_rank_that_launches_them():
    p = plan_placement(ParallelPlan(world=8, tp=2), nodes=2, devices=4, gpus="4-7")
    assert [(s.node, s.gpus, s.pushed_by) for s in p.servers] == [(0, (4,), 0), (0, (5,), 2), (1, (4,), 4),
                                                                   (1, (5,), 6)]
    # PP over the nodes' ranks: every source (stage 0) on node 0, which has GPUs for all four servers.
    p = plan_placement(ParallelPlan(world=8, pp=2), nodes=2, devices=4, gpus="4-7")
    assert [(s.node, s.gpus, s.pushed_by) for s in p.servers] == [(0, (4,), 0), (0, (5,), 1), (0, (6,), 2),
                                                                   (0, (7,), 3)]
    # ... and with two server GPUs per node, node 1's free GPUs are of no use: a source launches beside itself.
    with pytest.raises(ValueError, match=r"num_servers=1: must be such that every replica's servers fit on the node "
                                         r"of the rank that launches them: replica 2 \(source rank 2, node 0\)"):
        plan_placement(ParallelPlan(world=8, pp=2), nodes=2, devices=4, gpus="4-5")


def test_disaggregated_servers_fill_the_named_gpus_node_by_node():
    p = plan_placement(ParallelPlan(world=8, fsdp=True), nodes=2, devices=4, gpus=[4, 5, 6, 7], mem_fraction=0.8)
    assert p.mode == "disaggregated"  # the default once gpus is set
    assert [(s.node, s.gpus, s.pushed_by, s.mem_fraction) for s in p.servers] == [
        (0, (4,), 0, 0.8), (0, (5,), 1, 0.8), (0, (6,), 2, 0.8), (0, (7,), 3, 0.8),
        (1, (4,), 4, 0.8), (1, (5,), 5, 0.8), (1, (6,), 6, 0.8), (1, (7,), 7, 0.8)]


@pytest.mark.parametrize(("spec", "ids"), [("4-7", (4, 5, 6, 7)), ("0-1,6", (0, 1, 6)), (3, (3,)),
                                          ([6, 4], (4, 6)), ("4, 5", (4, 5))])
def test_gpu_ids_parse_from_ranges_and_lists(spec, ids):
    assert parse_gpus(spec) == ids
    assert span([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


FSDP4 = ParallelPlan(world=4, fsdp=True)
FSDP8 = ParallelPlan(world=8, fsdp=True)
REFUSALS = [
    ("gpus a", FSDP4, 1, 4, {"gpus": "a"}, r"rollout.engine.gpus='a': must be GPU ids of a node as ranges"),
    ("gpus down", FSDP4, 1, 4, {"gpus": "7-4"}, r"gpus='7-4': must be ranges that go up \(7-4 goes down\); write 4-7"),
    ("gpus twice", FSDP4, 1, 4, {"gpus": "4-5,5"}, r"gpus='4-5,5': must be each GPU id at most once"),
    ("gpus semicolon", FSDP4, 1, 4, {"gpus": "4;5"}, r"gpus='4;5': must be GPU ids of a node"),
    ("shared gpu", FSDP4, 1, 4, {"gpus": "2-5"},
     r"gpus='2-5': must be GPUs no trainer rank uses .* trainer ranks on GPUs 0-3 of every node; 2-3 would hold both"),
    ("tp crosses node", FSDP4, 1, 4, {"gpus": "4-7", "tp_size": 8},
     r"tp_size=8: must be at most the server GPUs of one node \(4: rollout.engine.gpus=4-7\)"),
    ("colocated tp crosses node", ParallelPlan(world=2, tp=2), 2, 1, {"tp_size": 2},
     r"tp_size=2: must be a size whose GPUs lie on one node \(server 0 would span rank 0 on node 0, rank 1 on node 1"),
    ("more servers than gpus", FSDP4, 1, 4, {"gpus": "4-7", "num_servers": 2},
     r"num_servers=2: .* 4 data-parallel replicas x 2 servers x tp_size 1 need 8 GPUs, and rollout.engine.gpus=4-7 "
     r"on 1 node\(s\) holds 4 server"),
    ("more colocated servers than gpus", FSDP8, 1, 8, {"tp_size": 2},
     r"num_servers \* rollout.engine.tp_size=2: must be at most the GPUs of one data-parallel replica \(tp x cp x pp "
     r"= 1\) .* \(8 replicas x 1 servers x tp_size 2 = 16 GPUs for 8\)"),
    ("colocated fraction", FSDP8, 1, 8, {"mem_fraction": 0.6},
     r"mem_fraction=0.6: must be at most 0.5 with rollout.engine.placement=colocated"),
    ("fraction zero", FSDP4, 1, 4, {"gpus": "4-7", "mem_fraction": 0}, r"mem_fraction=0: must be a number in \(0, 1\]"),
    ("fraction above one", FSDP4, 1, 4, {"gpus": "4-7", "mem_fraction": 1.5}, r"mem_fraction=1.5: must be a number"),
    ("unknown placement", FSDP4, 1, 4, {"placement": "both"}, r"placement='both': must be one of colocated, "),
    ("colocated with gpus", FSDP4, 1, 4, {"placement": "colocated", "gpus": "4-7"},
     r"gpus='4-7': must be null with rollout.engine.placement=colocated"),
    ("disaggregated without gpus", FSDP4, 1, 4, {"placement": "disaggregated"},
     r"gpus=None: must be the GPUs of each node given to the servers"),
    ("tp_size zero", FSDP4, 1, 4, {"tp_size": 0}, r"tp_size=0: must be an integer >= 1"),
]


@pytest.mark.parametrize(("plan", "nodes", "devices", "settings", "message"),
                         [pytest.param(*r[1:], id=r[0]) for r in REFUSALS])
def test_a_placement_that_cannot_work_is_refused_with_its_numbers(plan, nodes, devices, settings, message):
    with pytest.raises(ValueError, match=message):
        plan_placement(plan, nodes=nodes, devices=devices, **settings)


GPU8 = ["rollout=sglang", "trainer=gpu", "parallel=fsdp", "trainer.devices=8"]


def test_the_config_keys_reach_the_plan_and_not_the_engine(tmp_path):
    cfg = compose_config(tmp_path, "rollout=sglang", "trainer=gpu", "parallel=fsdp", "trainer.devices=4",
                         "rollout.engine.gpus=[4,5,6,7]", "rollout.engine.mem_fraction=0.7")
    validate_config(cfg)
    p = placement_of(cfg)
    assert (p.mode, [s.gpus for s in p.servers], p.servers[0].mem_fraction) == ("disaggregated",
                                                                                [(4,), (5,), (6,), (7,)], 0.7)
    factory = instantiate(engine_settings(cfg))  # what engine_for builds each rank's engine with
    assert not {"placement", "gpus", "tp_size", "mem_fraction"} & set(factory.keywords)
    assert set(factory.keywords) <= set(target_parameters(str(cfg.rollout.engine._target_)))
    assert factory.keywords["num_servers"] == 1 and factory.keywords["max_candidates"] == 4096  # resolved


def test_the_block_is_printed_at_start_for_sglang_on_gpus_only(tmp_path, capsys):
    print_placement(compose_config(tmp_path))
    print_placement(compose_config(tmp_path, "rollout=sglang"))
    assert capsys.readouterr().out == ""  # the default run and CPU servers: unchanged output
    print_placement(compose_config(tmp_path, *GPU8))
    assert capsys.readouterr().out.startswith("[topp_rl] placement: colocated, 1 node(s) x 8 trainer rank(s)")


def test_cpu_runs_and_the_embedded_engine_have_no_placement(tmp_path):
    assert placement_of(compose_config(tmp_path)) is None  # the default run: nothing printed, nothing checked
    assert placement_of(compose_config(tmp_path, "rollout=sglang")) is None  # SGLang on CPU
    assert placement_of(compose_config(tmp_path, *GPU8, "rollout.engine.urls=[http://127.0.0.1:30000]")) is None
    with pytest.raises(ValueError, match=r"config rollout.engine.gpus='4-7': must be null on a CPU run "
                                         r"\(trainer.accelerator=cpu"):
        validate_config(compose_config(tmp_path, "rollout=sglang", "rollout.engine.gpus=4-7"))
    with pytest.raises(ValueError, match=r"config rollout.engine.mem_fraction=0.9: must be at most 0.5"):
        validate_config(compose_config(tmp_path, *GPU8, "rollout.engine.mem_fraction=0.9"))


def _plan_command(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "topp_rl.cli", "plan", *overrides], cwd=ROOT, env=train_env(PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=300)


@pytest.mark.subprocess
def test_topp_rl_plan_prints_a_colocated_and_a_disaggregated_8_gpu_plan_and_refuses_a_bad_one():
    colocated = _plan_command(*GPU8, "rollout.engine.placement=colocated")
    assert colocated.returncode == 0, colocated.stderr
    assert colocated.stdout.splitlines()[:3] == [
        "[topp_rl] placement: colocated, 1 node(s) x 8 trainer rank(s) (dp=8 tp=1 cp=1 pp=1), 8 server(s) of tp_size "
        "1 at mem_fraction 0.4", "  node 0: trainer ranks 0-7 on GPUs 0-7",
        "    server 0: GPUs 0 (CUDA_VISIBLE_DEVICES=0 base_gpu_id=0 tp_size=1 mem_fraction_static=0.4), weights from "
        "rank 0 (replica 0)"]
    split = _plan_command("rollout=sglang", "trainer=gpu", "parallel=megatron", "parallel.tp_size=2",
                          "trainer.devices=4", "rollout.engine.gpus=4-7", "rollout.engine.tp_size=2")
    assert split.returncode == 0, split.stderr
    assert split.stdout.splitlines()[-3:] == [
        "    server 0: GPUs 4-5 (CUDA_VISIBLE_DEVICES=4,5 base_gpu_id=0 tp_size=2 mem_fraction_static=0.85), weights "
        "from rank 0 (replica 0)",
        "    server 1: GPUs 6-7 (CUDA_VISIBLE_DEVICES=6,7 base_gpu_id=0 tp_size=2 mem_fraction_static=0.85), weights "
        "from rank 2 (replica 1)",
        "  weights: rollout.engine.weight_sync=distributed: an NCCL broadcast from the pushing rank, in buckets"]
    refused = _plan_command(*GPU8, "rollout.engine.gpus=4-7")
    assert refused.returncode == 2 and refused.stdout == ""
    assert "topp-rl plan: error: config rollout.engine.gpus='4-7': must be GPUs no trainer rank uses" in refused.stderr


def _recipes() -> list[tuple[list[str], str]]:
    """(the overrides of each `topp-rl train` command, the plan block after it) in docs/scale.md's one-node recipe."""
    text = (ROOT / "docs" / "scale.md").read_text()
    section = text[text.index("## One node, 8 GPUs"):text.index("### Memory per GPU")]
    blocks = re.findall(r"```bash\n(topp-rl train .*?)```\n\n```\n(.*?)```", section, re.S)
    return [(cmd.replace("\\\n", " ").split()[2:], plan.rstrip("\n")) for cmd, plan in blocks]


@pytest.mark.subprocess
def test_the_docs_recipe_commands_print_the_plans_shown_beside_them():
    recipes = _recipes()
    assert len(recipes) == 3
    for overrides, shown in recipes:
        done = _plan_command(*overrides)
        assert done.returncode == 0, done.stderr
        assert done.stdout.rstrip("\n") == shown, " ".join(overrides)
