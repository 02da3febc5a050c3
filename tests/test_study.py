"""`python -m study ratios` (issue 13): the figures' identities on a tiny model, and the command end to end."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from study.grid import Setting, grid, parse_truncation
from study.ratios import kept_log_mass, run_engine
from study.stats import table_rows
from topp_rl.data.sample import Sample
from topp_rl.engines.embedded import EmbeddedEngine
from topp_rl.models import build_tiny
from topp_rl.ops import Candidates
from topp_rl.rollout import pack_samples
from topp_rl.tasks import CountdownTask
from topp_rl.trainer.backbone import HFBackbone

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = [Setting(truncation="top_p=0.9", temperature=1.0), Setting(truncation="top_k=20", temperature=0.7)]


@pytest.fixture(scope="module")
def figures():
    model, tokenizer = build_tiny(seed=0)
    model.float().eval()
    task = CountdownTask(seed=0)
    prompts = [task.prompt(i, tokenizer).prompt_ids for i in range(4)]
    engine = EmbeddedEngine.for_policy(model=model, tokenizer=tokenizer, workdir=None, progress=False)
    run = run_engine("embedded", engine, HFBackbone(model), prompts, SETTINGS, samples=3, max_new_tokens=12,
                     max_tokens=512, seed=0, log=lambda _: None)
    return run.figures


def test_masked_scoring_matches_the_rollout_on_its_weights(figures):
    for fig in figures.values():
        assert fig.rollout.numel() > 20
        assert float((fig.masked - fig.rollout).abs().max()) < 1e-4


def test_unmasked_minus_masked_is_the_log_kept_mass(figures):
    for fig in figures.values():
        torch.testing.assert_close(fig.unmasked - fig.masked, fig.log_kept_mass, atol=1e-5, rtol=0)


def test_table_values_follow_the_sampling_rules(figures):
    top_p = table_rows(figures[SETTINGS[0]], setting="top_p")
    masked, unmasked = top_p
    assert abs(masked["ratio_mean"] - 1) < 1e-4 and masked["max_abs_log_ratio"] < 1e-4
    assert masked["outside_0.9_1.1"] == 0
    # Unmasked ratio = kept mass token by token (rollout = masked here); the nucleus keeps at least 0.9 of the mass.
    assert unmasked["ratio_mean"] < 1
    assert abs(unmasked["ratio_mean"] - unmasked["kept_mass_mean"]) < 1e-4
    assert float(torch.exp(figures[SETTINGS[0]].log_kept_mass).min()) >= 0.9 - 1e-6
    top_k = figures[SETTINGS[1]]
    assert torch.equal(top_k.kept_size, torch.full_like(top_k.kept_size, 20))  # vocab 128 > 20: exactly k kept
    assert table_rows(top_k)[1]["ratio_mean"] < table_rows(top_k)[0]["ratio_mean"]


def test_kept_log_mass_equals_the_dense_sum():
    torch.manual_seed(0)
    hidden, weight = torch.randn(7, 8), torch.randn(16, 8)
    rows = [[1, 2, 3], [], [0], [5, 9, 15, 4], [7], [2, 3], [11, 12]]  # [] = nothing cut
    samples = [Sample(prompt_ids=[1, 2], response_ids=[r[0] if r else 6 for r in rows[:3]],
                      loss_mask=[1] * 3, rollout_log_probs=[0.0] * 3, candidates=Candidates.from_lists(rows[:3])),
               Sample(prompt_ids=[3], response_ids=[r[0] for r in rows[3:]], loss_mask=[1] * 4,
                      rollout_log_probs=[0.0] * 4, candidates=Candidates.from_lists(rows[3:]))]
    (batch,) = pack_samples(samples, [0.0, 0.0], max_tokens=64)
    token_hidden = torch.zeros(int(batch.seq_lengths.sum()), 8)
    predicting = torch.tensor([1, 2, 3, 5, 6, 7, 8])  # the rows before each response token
    token_hidden[predicting] = hidden
    log_mass, sizes = kept_log_mass(token_hidden, weight, batch, temperature=0.7, chunk_rows=3)
    probs = torch.softmax(hidden.double() @ weight.double().T / 0.7, dim=-1)
    expected = [float(probs[i, r].sum().log()) if r else 0.0 for i, r in enumerate(rows)]
    torch.testing.assert_close(log_mass, torch.tensor(expected, dtype=torch.float64), atol=1e-5, rtol=0)
    assert sizes.tolist() == [3, 16, 1, 4, 1, 2, 2]


def test_settings_parse_and_reject_unknown_rules():
    assert [s.name for s in grid(["top_p=0.9", "min_p=0.1"], [1.0, 0.7])] == [
        "top_p=0.9 T=1", "min_p=0.1 T=1", "top_p=0.9 T=0.7", "min_p=0.1 T=0.7"]
    assert parse_truncation("top_k=20") == ("top_k", 20)
    with pytest.raises(ValueError, match="top_q=0.9.*rule=value"):
        parse_truncation("top_q=0.9")


@pytest.mark.subprocess
def test_the_command_runs_end_to_end(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "study", "ratios", "model=tiny", "--prompts", "3", "--samples", "2",
           "--max-new-tokens", "8", "--truncations", "top_p=0.9,top_k=20", "--temperatures", "1.0",
           "--out", str(tmp_path), "task=countdown"]  # overrides on both sides of the options
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[study] embedded 2/2 top_k=20 T=1" in done.stdout
    rows = list(csv.DictReader(open(tmp_path / "ratios.csv")))
    assert [(r["truncation"], r["scoring"]) for r in rows] == [
        ("top_p=0.9", "masked"), ("top_p=0.9", "unmasked"), ("top_k=20", "masked"), ("top_k=20", "unmasked")]
    for masked, unmasked in (rows[:2], rows[2:]):
        assert float(masked["max_abs_log_ratio"]) < 1e-4
        assert float(unmasked["ratio_mean"]) < 1
        assert abs(float(unmasked["ratio_mean"]) - float(unmasked["kept_mass_mean"])) < 1e-4
    assert (tmp_path / "ratios.png").stat().st_size > 10_000
    assert "| engine | temperature |" in (tmp_path / "ratios.md").read_text()
    assert "CountdownTask" in (tmp_path / "ratios.md").read_text()


@pytest.mark.subprocess
def test_the_command_names_a_bad_engine():
    done = subprocess.run([sys.executable, "-m", "study", "ratios", "--engines", "vllm"], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "unknown ['vllm']; choose from embedded, sglang" in done.stderr


def _write_job(root: Path, name: str, rewards: list[float]) -> None:
    path = root / name / "csv" / "version_0"
    path.mkdir(parents=True)
    with open(path / "metrics.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "rollout/reward_mean", "train/grad_norm"])
        writer.writerows([i, r, 1.0] for i, r in enumerate(rewards))


def test_report_groups_seeds_into_mean_and_band(tmp_path):
    from topp_rl.report import group_seeds, load_jobs, render, seed_band, variant_of

    assert variant_of("4-p0.9-k0-maskTrue-tisNone-seed1") == "p0.9-k0-maskTrue-tisNone"
    _write_job(tmp_path, "0-maskTrue-seed0", [0.1, 0.2, 0.3])
    _write_job(tmp_path, "1-maskFalse-seed0", [0.0, 0.0, 0.0])
    _write_job(tmp_path, "2-maskTrue-seed1", [0.3, 0.4])  # stopped early: only common steps count
    groups = group_seeds(load_jobs(tmp_path))
    assert sorted(groups) == ["maskFalse", "maskTrue"] and len(groups["maskTrue"]) == 2
    steps, mean, low, high = seed_band(groups["maskTrue"], "rollout/reward_mean")
    assert steps == [0.0, 1.0]
    assert mean == pytest.approx([0.2, 0.3]) and low == [0.1, 0.2] and high == [0.3, 0.4]
    written = render(tmp_path, out_dir=tmp_path / "plots", seeds=True)
    assert tmp_path / "plots" / "seeds.png" in written
    table = (tmp_path / "plots" / "seeds.md").read_text()
    # maskTrue: seed 0 mean of [0.1, 0.2, 0.3] = 0.2, seed 1 mean of [0.3, 0.4] = 0.35 (fewer than 5 points).
    assert "| maskTrue | rollout/reward_mean | 2 | 0.275 | 0.275 | 0.2 to 0.35 |" in table
    assert "| maskFalse | train/grad_norm | 1 | 1 | 1 | 1 to 1 |" in table


def test_saved_figures_merge_into_the_same_table(figures, tmp_path):
    from argparse import Namespace

    from study.output import rows_of
    from study.ratios import EngineRun
    from study.run import load_runs, merge_ratios, save_runs

    runs = [EngineRun(engine=name, prompts=4, figures=figures, wall_s=1.0) for name in ("embedded", "sglang")]
    for run in runs:
        (tmp_path / run.engine).mkdir()
        save_runs([run], {"wall_s": {run.engine: 1.0}, "seed": 0}, tmp_path / run.engine / "figures.pt")
    loaded, facts = load_runs(tmp_path / "sglang" / "figures.pt")
    assert rows_of(loaded) == rows_of(runs[1:])
    merge_ratios(Namespace(dirs=[tmp_path / "embedded", tmp_path / "sglang"], out=tmp_path / "both", plot=None))
    merged = list(csv.DictReader(open(tmp_path / "both" / "ratios.csv")))
    assert [r["engine"] for r in merged] == ["embedded"] * 4 + ["sglang"] * 4
    assert "- wall_s: {'embedded': 1.0, 'sglang': 1.0}" in (tmp_path / "both" / "ratios.md").read_text()
