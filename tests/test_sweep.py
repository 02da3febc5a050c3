"""Sweep names (topp_rl.run.sweep): job dirs name the swept keys (filesystem-safe, bounded), the W&B group names the
sweep, and a resume hint for such a dir is one shell word that Hydra parses back to the dir."""

import shlex
import subprocess
import sys

import pytest
from helpers import ROOT
from hydra.core.override_parser.overrides_parser import OverridesParser

from topp_rl.run.sweep import (
    MAX_DIR_LABEL_CHARS,
    group_label,
    job_label,
    job_subdir,
    run_dir_override,
    safe_dir_name,
    swept_keys,
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
    assert jobs == [[f"JOB {tmp_path}/grp/0-+note=a_b,algo=gspo", "gspo-top_p1.0-seed3 [+note=a/b,algo=gspo]",
                     "grp [+note,algo]"],
                    [f"JOB {tmp_path}/grp/1-+note=c_d,algo=gspo", "gspo-top_p1.0-seed3 [+note=c/d,algo=gspo]",
                     "grp [+note,algo]"]]
