"""scripts/memory_per_rank.py (docs/scale.md "Which layout"): its parameter counts agree with the published sizes
of the Qwen3 models, its per-rank bytes with a hand count, and it lists only layouts the project accepts."""

import runpy
from pathlib import Path

import pytest

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
