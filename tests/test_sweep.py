"""Sweep names (topp_rl.run.sweep): job dirs name the swept keys (filesystem-safe, bounded), the W&B group names the
sweep, and a resume hint for such a dir is one shell word that Hydra parses back to the dir. A sweep ends with a
table of every job (topp_rl.run.sweep_table); default run and sweep dirs name the task and model; the plot commands a
run prints work as printed."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT
from hydra.core.override_parser.overrides_parser import OverridesParser

from topp_rl.report import load_jobs, render
from topp_rl.report.labels import run_labels
from topp_rl.report.plots import reward_figure
from topp_rl.run.commands import report_command
from topp_rl.run.sweep import (
    MAX_DIR_LABEL_CHARS,
    group_label,
    job_label,
    job_subdir,
    run_dir_override,
    safe_dir_name,
    swept_keys,
    task_model_label,
)


def test_swept_keys_and_job_label():
    keys = swept_keys(["rollout.top_p=0.8,1.0", "seed=0", "algo=glob(g*)", "optimizer.lr=range(1,3)", "+x=1"])
    assert keys == ["rollout.top_p", "algo", "optimizer.lr"]
    assert job_label(["rollout.top_p=0.8", "seed=0", "algo=gspo", "optimizer.lr=2"], keys) == \
        "rollout.top_p=0.8,algo=gspo,optimizer.lr=2"


def test_dir_names_are_single_safe_bounded_names():
    assert safe_dir_name("rollout.top_p=0.9,algo=grpo") == "rollout.top_p=0.9,algo=grpo"
    assert safe_dir_name("model.path=/data/m 1,tags=[a,b]") == "model.path=_data_m_1,tags=_a,b_"
    long_a, long_b = ("task.path=" + "x" * 200 + end for end in ("a", "b"))
    cut_a, cut_b = safe_dir_name(long_a), safe_dir_name(long_b)
    assert len(cut_a) == len(cut_b) == MAX_DIR_LABEL_CHARS
    assert cut_a[:90] == cut_b[:90] and cut_a != cut_b  # same prefix, told apart by the hash of the full label


def test_job_subdir_without_multirun_yaml_names_every_override(tmp_path):
    """A sweeper that writes no multirun.yaml: every override of the job counts; none at all: the run name."""
    assert job_subdir(4, "grpo-top_p0.9-seed0", tmp_path, ["rollout.top_p=0.9", "+x=a/b"]) == \
        "4-rollout.top_p=0.9,+x=a_b"
    assert job_subdir(0, "grpo-top_p1.0-seed0", tmp_path, []) == "0-grpo-top_p1.0-seed0"


def test_group_names_the_sweep_and_its_keys():
    assert group_label("multirun/2026-12-02/14-05-09", ["rollout.top_p", "algo"]) == \
        "2026-12-02_14-05-09 [rollout.top_p,algo]"
    assert group_label("/tmp/grp", []) == "grp"
    assert len(group_label("/tmp/grp", ["k" * 80, "j" * 80])) == 128


@pytest.mark.parametrize("path", ["/tmp/runs/plain-run_1", "/tmp/s/3-rollout.top_p=0.9,algo=grpo",
                                  "/tmp/my runs/0-tags=_a,b_", "/tmp/it's/0-a=1", "/tmp/$HOME/0-a=1",
                                  "/tmp/say \"it's\"/0-a=1"])
def test_run_dir_override_is_one_shell_word_hydra_reads_back(path):
    (word,) = shlex.split(run_dir_override(path))
    override = OverridesParser.create().parse_override(word)
    assert override.key_or_group == "hydra.run.dir" and override.value() == path
    if path == "/tmp/runs/plain-run_1":
        assert run_dir_override(path) == "hydra.run.dir=/tmp/runs/plain-run_1"  # no quotes where none are needed


@pytest.mark.subprocess
def test_multirun_job_dirs_group_and_names_hold_the_swept_keys(tmp_path):
    """A real Hydra multirun (basic sweeper) of an app on conf/config.yaml that prints its job dir, its W&B run
    name and group; one swept value holds a '/', which must not nest the job dir."""
    app = tmp_path / "app.py"
    app.write_text(
        "import hydra\nfrom hydra.core.hydra_config import HydraConfig\n"
        "from topp_rl.run.loggers import group_name, run_display_name\n"
        f"@hydra.main(version_base='1.3', config_path={str(ROOT / 'conf')!r}, config_name='config')\n"
        "def main(cfg):\n"
        "    print('JOB', HydraConfig.get().runtime.output_dir, '|', run_display_name(cfg), '|', group_name(cfg))\n"
        "main()\n"
    )
    # Two jobs, two swept keys (a glob over the algo options matching one); the group lists them in typed order.
    cmd = [sys.executable, str(app), "-m", "+note=a/b,c/d", "seed=3", "algo=glob(gs*)", f"hydra.sweep.dir={tmp_path}/grp",
           "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    jobs = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("JOB ")]
    assert jobs == [[f"JOB {tmp_path}/grp/0-+note=a_b,algo=gspo",
                     "copy_digit-tiny-gspo-top_p1.0-seed3 [+note=a/b,algo=gspo]", "grp [+note,algo]"],
                    [f"JOB {tmp_path}/grp/1-+note=c_d,algo=gspo",
                     "copy_digit-tiny-gspo-top_p1.0-seed3 [+note=c/d,algo=gspo]", "grp [+note,algo]"]]


# ----- the sweep's end: a table of every job, and commands that work as printed -----
TINY_JOB = ["trainer.max_steps=1", "rollout.prompts_per_step=2", "rollout.n_samples=2", "rollout.max_new_tokens=4",
            "checkpoint.every_n_steps=0", "trainer.enable_progress_bar=false", "logger=csv", "num_threads=1"]


def bare_env(**extra: str) -> dict[str, str]:
    """A shell with no virtual environment active (no venv on PATH): where `python` lacks the project's packages
    or does not exist at all."""
    from helpers import train_env

    env = {k: v for k, v in train_env().items() if k not in ("VIRTUAL_ENV", "PATH")}
    return env | {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"} | extra


def printed(stdout: str, prefix: str) -> list[str]:
    return [line.removeprefix(prefix) for line in stdout.splitlines() if line.startswith(prefix)]


def run_as_printed(command: str, *, cwd, env: dict[str, str]) -> list[str]:
    """Run a printed command through a shell, exactly as printed; the PNG paths it wrote."""
    done = subprocess.run(command, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{command}\n{done.stderr[-2000:]}"
    return sorted(Path(line).name for line in done.stdout.split())


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A real 2-job sweep of the tiny default model, from a directory of its own (the default sweep dir)."""
    cwd = tmp_path_factory.mktemp("sweep")
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), "-m", "rollout.top_p=0.8,1.0", *TINY_JOB],
                          cwd=cwd, env=bare_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (sweep_dir,) = (cwd / "multirun").glob("*/*")
    return cwd, sweep_dir, done.stdout


@pytest.mark.subprocess
def test_a_sweep_ends_with_a_table_of_every_job(sweep):
    cwd, sweep_dir, stdout = sweep
    relative = sweep_dir.relative_to(cwd)
    lines = stdout.splitlines()
    start = lines.index(f"[topp_rl] sweep finished: 2 jobs in {relative}")
    header, *rows = (line.split() for line in lines[start + 1: start + 4])
    assert header == ["rollout.top_p", "reward", "first", "reward", "last", "mismatch", "last", "wall", "s", "job",
                      "dir"]
    for row, top_p, job in zip(rows, ("0.8", "1.0"), ("0-rollout.top_p=0.8", "1-rollout.top_p=1.0"), strict=True):
        summary = json.loads((sweep_dir / job / "summary.json").read_text())
        # the masked mismatch of float32 engine and trainer: rounding, which some CPUs' kernels make exactly 0
        assert 0 <= summary["mismatch_last"] <= 1e-5
        assert row == [top_p, f"{summary['reward_first']:.3f}", f"{summary['reward_last']:.3f}",
                       f"{summary['mismatch_last']:.3g}", f"{summary['wall_s']:.1f}", job]
    assert lines[start + 4] == f"  plots of every job: {sys.executable} -m topp_rl.report {relative}"
    # The commands work as printed, with no virtual environment active: the sweep's, and each job's.
    plots = printed(stdout, "  plots of every job: ") + printed(stdout, "  plots: ")
    assert len(plots) == 3
    for command in plots:  # (top_p=1.0 keeps every id: no candidate sets, no support_size_hist.png)
        assert {"mismatch.png", "reward.png"} <= set(run_as_printed(command, cwd=cwd, env=bare_env()))


@pytest.mark.subprocess
def test_default_sweep_and_run_dirs_name_the_task_and_model(sweep, tmp_path, monkeypatch):
    cwd, sweep_dir, _ = sweep
    assert re.fullmatch(r"\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d-copy_digit-tiny", str(sweep_dir.relative_to(cwd / "multirun")))
    from topp_rl.api import compose

    monkeypatch.chdir(tmp_path)
    names = {Path(compose(overrides).paths.output_dir).name for overrides in (
        ["rollout.top_p=0.9"], ["task=arithmetic", "model=hf_path", "model.path=Qwen/Qwen3-0.6B/"])}
    assert {re.sub(r"^\d\d-\d\d-\d\d-", "", name) for name in names} == {
        "copy_digit-tiny-grpo-top_p0.9-seed0", "arithmetic-Qwen3-0.6B-grpo-top_p1.0-seed0"}
    assert task_model_label("agent", "hf_path", "/models/my model") == "agent-my_model"  # one safe dir name


@pytest.mark.subprocess
def test_report_overlays_two_jobs_of_a_sweep_labelled_by_their_overrides(sweep, tmp_path):
    _, sweep_dir, _ = sweep
    jobs = [sweep_dir / "0-rollout.top_p=0.8", sweep_dir / "1-rollout.top_p=1.0"]
    assert run_labels(jobs) == {jobs[0]: "rollout.top_p=0.8", jobs[1]: "rollout.top_p=1.0"}
    fig = reward_figure(load_jobs(jobs))
    assert [line.get_label() for line in fig.axes[0].lines] == [
        "rollout.top_p=0.8: reward mean", "rollout.top_p=0.8: accuracy",
        "rollout.top_p=1.0: reward mean", "rollout.top_p=1.0: accuracy"]
    paths = render(jobs, out_dir=tmp_path / "both")
    assert sorted(p.name for p in paths) == ["mismatch.png", "reward.png", "support_size_hist.png"]


def test_the_plot_command_is_the_one_that_started_the_run(tmp_path, monkeypatch):
    """`<python> -m topp_rl.report` with the interpreter that ran the run (relative below the working dir), or
    `topp-rl report` when the run was `topp-rl train` (its path where PATH finds another or none)."""
    monkeypatch.chdir(tmp_path)
    venv_python = tmp_path / ".venv" / "bin" / "python"
    assert report_command(argv0="train.py", python=str(venv_python)) == ".venv/bin/python -m topp_rl.report"
    assert report_command(argv0="train.py", python="/usr/bin/python3") == "/usr/bin/python3 -m topp_rl.report"
    script = tmp_path / "bin" / "topp-rl"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin:/bin")
    assert report_command(argv0=str(script)) == "topp-rl report"
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert report_command(argv0=str(script)) == "bin/topp-rl report"


@pytest.mark.subprocess
def test_a_run_started_by_topp_rl_prints_a_topp_rl_plot_command_that_works(tmp_path):
    """The `topp-rl` console script (as pip writes it) on PATH: the run's plot command is `topp-rl report DIR`,
    and it runs as printed."""
    script = tmp_path / "bin" / "topp-rl"
    script.parent.mkdir()
    script.write_text(f"#!{sys.executable}\nimport sys\nfrom topp_rl.cli import main\nsys.exit(main())\n")
    script.chmod(0o755)
    env = bare_env(PATH=f"{script.parent}:/usr/bin:/bin")
    done = subprocess.run(["topp-rl", "train", *TINY_JOB, "hydra.run.dir=run"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (command,) = printed(done.stdout, "  plots: ")
    assert command == f"topp-rl report {tmp_path / 'run'}"
    assert {"mismatch.png", "reward.png"} <= set(run_as_printed(command, cwd=tmp_path, env=env))
