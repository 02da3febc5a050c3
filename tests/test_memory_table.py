"""scripts/memory_per_rank.py (docs/evidence/scale.md, "Memory per rank by layout"): its parameter counts agree
with the published sizes of the Qwen3 models, its per-rank bytes with a hand count, and it lists only layouts the project accepts; with
--recipes, the one-node recipes' memory per GPU follows from the arithmetic and their GPU roles from their plans."""

import runpy
from pathlib import Path

import pytest

from topp_rl.parallel.placement import plan_placement
from topp_rl.parallel.plan import ParallelPlan

SCRIPT = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "memory_per_rank.py"))
MODELS = {m.name: m for m in SCRIPT["QWEN3"]}
Layout, bytes_per_rank = SCRIPT["Layout"], SCRIPT["bytes_per_rank"]


@pytest.mark.parametrize("name, billions", [("Qwen3-8B", 8.2), ("Qwen3-32B", 32.8), ("Qwen3-30B-A3B", 30.5),
                                            ("Qwen3-235B-A22B", 235.1)])
def test_parameter_counts_match_the_published_sizes(name, billions):
    assert MODELS[name].total() / 1e9 == pytest.approx(billions, abs=0.05)


def test_bytes_per_rank_by_hand():
    m = MODELS["Qwen3-8B"]
    assert bytes_per_rank(m, Layout(8, fsdp=True)) == pytest.approx(16 * m.total() / 8)
    # TP2 at pp 1: both vocab matrices and the layers halved, norms whole; AdamW whole without dist. opt.
    layer = m.attention() + 3 * m.hidden * m.ffn
    halved = (m.layers * layer + 2 * m.vocab * m.hidden) / 2
    whole = m.layers * m.replicated_per_layer() + m.hidden
    assert bytes_per_rank(m, Layout(2, tp=2)) == pytest.approx(16 * (halved + whole))
    # MoE at EP8 x DP8: the expert-data-parallel size is 1, so the distributed optimizer shards no expert state.
    moe = MODELS["Qwen3-30B-A3B"]
    experts = moe.layers * moe.expert_params() / 8
    assert bytes_per_rank(moe, Layout(8, ep=8, dist_opt=True)) > 16 * experts


def test_every_listed_layout_is_one_the_project_accepts():
    for name, layouts in SCRIPT["CHOICES"].items():
        for lay in layouts:
            assert bytes_per_rank(MODELS[name], lay) > 0
    with pytest.raises(ValueError, match=r"parallel.pp_size=4: must be a divisor of the model's layer count "
                                         r"\(num_hidden_layers=94"):
        bytes_per_rank(MODELS["Qwen3-235B-A22B"], Layout(16, tp=4, pp=4))


GB = 1e9


@pytest.fixture(scope="module")
def recipes():
    return {name: SCRIPT["load_recipe"](name, overrides) for name, overrides in SCRIPT["RECIPES"].items()}


def test_server_weights_and_kv_cache_per_token_by_hand():
    m = MODELS["Qwen3-8B"]
    assert SCRIPT["server_weight_bytes"](m, tp=1, dtype_b=2) == pytest.approx(2 * m.total())
    # 36 layers x 8 KV heads x head_dim 128 x (K and V) x 2 B; a TP2 server holds 4 heads per GPU
    assert SCRIPT["kv_bytes_per_token"](m, tp=1, dtype_b=2) == 36 * 8 * 128 * 2 * 2 == 147456
    assert SCRIPT["kv_bytes_per_token"](m, tp=2, dtype_b=2) == 73728
    assert SCRIPT["kv_bytes_per_token"](m, tp=16, dtype_b=2) == 36 * 1 * 128 * 2 * 2  # one head per GPU at least


def test_recipes_are_the_plans_of_their_commands(recipes):
    """The GPU roles come from each command's own placement: the plans `plan_placement` gives those layouts."""
    fsdp8, fsdp4 = ParallelPlan(world=8, fsdp=True), ParallelPlan(world=4, fsdp=True)
    assert recipes["A"].placement == plan_placement(fsdp8, nodes=1, devices=8)
    assert recipes["B"].placement == plan_placement(fsdp4, nodes=1, devices=4, gpus="4-7")
    assert recipes["C"].placement == plan_placement(ParallelPlan(world=8, tp=2), nodes=1, devices=8, tp_size=2)
    roles = {name: [(row.gpus, row.role) for row in SCRIPT["gpu_memory"](r)] for name, r in recipes.items()}
    assert roles == {"A": [("0-7", "trainer rank + server (mem_fraction 0.4)")],
                     "B": [("0-3", "trainer rank"), ("4-7", "server (mem_fraction 0.85)")],
                     "C": [("0-7", "trainer rank + TP2 server shard (mem_fraction 0.4)")]}


def test_recipe_memory_per_gpu_by_hand(recipes):
    m = MODELS["Qwen3-8B"]
    (a,) = SCRIPT["gpu_memory"](recipes["A"])
    assert a.trainer == pytest.approx(16 * m.total() / 8)
    assert a.pool == pytest.approx(0.4 * 80 * GB)  # FSDP's shards reach the GPU after the server starts
    assert a.server_weights == pytest.approx(2 * m.total())
    assert a.kv_tokens == (0.4 * 80 * GB - 2 * m.total()) // 147456
    assert a.peak == pytest.approx(a.trainer + a.pool)  # the pool is released while the trainer trains

    trainers, servers = SCRIPT["gpu_memory"](recipes["B"])
    assert (trainers.trainer, trainers.pool, trainers.peak) == (pytest.approx(16 * m.total() / 4), 0.0, trainers.trainer)
    assert (servers.trainer, servers.pool) == (0.0, pytest.approx(0.85 * 80 * GB))
    assert servers.kv_tokens == (0.85 * 80 * GB - 2 * m.total()) // 147456 and servers.peak == servers.pool

    (c,) = SCRIPT["gpu_memory"](recipes["C"])
    assert c.trainer == pytest.approx(bytes_per_rank(m, Layout(8, tp=2, dist_opt=True)))
    # Megatron's float32 weights (half the matrices, the norms whole) are on the GPU when the server starts
    halved = (m.layers * (m.attention() + 3 * m.hidden * m.ffn) + 2 * m.vocab * m.hidden) / 2
    whole = m.layers * m.replicated_per_layer() + m.hidden
    assert c.pool == pytest.approx(0.4 * (80 * GB - 4 * (halved + whole)))
    assert c.server_weights == pytest.approx(2 * (halved + whole))
    assert c.kv_tokens == (c.pool - 2 * (halved + whole)) // 73728
    assert c.peak == pytest.approx(c.trainer + c.pool) and c.peak < 80 * GB


def test_recipes_table_printed(capsys):
    SCRIPT["main"](["--recipes"])
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("| A") or line.startswith("| B") or line.startswith("| C")]
    assert rows[0] == ("| A: Qwen3-8B, FSDP 8, colocated | 0-7 | trainer rank + server (mem_fraction 0.4) | 16.4 | "
                       "32.0 | 16.4 | 15.6 | 105,919 | 48.4 | yes (31.6 GB left) |")
    assert len(rows) == 4 and any("Not counted: activations" in line for line in lines)
