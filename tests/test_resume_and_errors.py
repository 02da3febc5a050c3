"""Two things a user meets on the command line: a refused setting prints one clean message and exits 2 (its
traceback only with HYDRA_FULL_ERROR=1), and a run resumes from its dir alone (`hydra.run.dir=DIR ckpt_path=last`,
or `topp-rl resume DIR`), its recorded overrides beneath the ones given."""

import csv
import io
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, train_env
from hydra.errors import InstantiationException

from topp_rl.run.console_log import console_to_log
from topp_rl.run.errors import refusal
from topp_rl.run.resume_args import override_key, resume_overrides, with_recorded_overrides

TINY = ["trainer.max_steps=2", "rollout.prompts_per_step=2", "rollout.n_samples=2", "rollout.max_new_tokens=4",
        "eval.every_n_steps=0", "logger=csv", "checkpoint.every_n_steps=1"]


def raised_in(filename: str, exc_source: str) -> BaseException:
    """An error raised by code compiled as if it lived in `filename`."""
    try:
        exec(compile(exc_source, filename, "exec"), {})
    except BaseException as err:  # noqa: BLE001
        return err
    raise AssertionError("nothing raised")


def test_only_what_the_project_refuses_on_purpose_loses_its_traceback():
    from_project = raised_in(str(ROOT / "topp_rl" / "config.py"), "raise ValueError('config x=1: must be 2')")
    assert refusal(from_project) is from_project
    assert refusal(raised_in(str(ROOT / "topp_rl" / "x.py"), "raise RuntimeError('server exited')")) is not None
    assert refusal(raised_in(str(ROOT / "topp_rl" / "x.py"), "raise KeyError('bug')")) is None  # a bug
    assert refusal(raised_in("/home/me/my_reward.py", "raise ValueError('mine')")) is None  # the user's code
    wrapped = raised_in(str(ROOT / "topp_rl" / "x.py"), "raise ValueError('bad')")
    try:
        raise InstantiationException("Error in call to target") from wrapped
    except InstantiationException as err:
        assert refusal(err) is wrapped


def test_an_override_is_keyed_by_what_it_sets_and_the_command_line_wins(tmp_path):
    assert [override_key(o) for o in ["rollout.top_p=0.9", "+rollout.engine.x=1", "~logger", "rollout=sglang",
                                      "++a.b=c=d"]] == ["rollout.top_p", "rollout.engine.x", "logger", "rollout", "a.b"]
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text(
        "- rollout.top_p=0.9\n- trainer.max_steps=2\n- hydra.run.dir=elsewhere\n- ckpt_path=old\n- logger=csv\n")
    given = [f"hydra.run.dir={tmp_path}", "ckpt_path=last", "trainer.max_steps=5"]
    assert resume_overrides(tmp_path, given) == ["rollout.top_p=0.9", "logger=csv", *given]
    assert with_recorded_overrides(given) == ["rollout.top_p=0.9", "logger=csv", *given]
    quoted = [f"hydra.run.dir='{tmp_path}'", "ckpt_path=last"]  # as a sweep job's printed resume line quotes it
    assert with_recorded_overrides(quoted) == ["rollout.top_p=0.9", "trainer.max_steps=2", "logger=csv", *quoted]
    assert with_recorded_overrides(["rollout.top_p=0.9"]) == ["rollout.top_p=0.9"]  # not a resume: as given
    assert with_recorded_overrides(["-m", *given]) == ["-m", *given]  # a sweep's jobs keep their own
    with pytest.raises(ValueError, match=r"hydra.run.dir=.*nowhere: no \.hydra/overrides\.yaml there"):
        resume_overrides(tmp_path / "nowhere", given)


def _train(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, capture_output=True, text=True,
                          env=train_env(**env), timeout=600)


def _resume(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "topp_rl.cli", "resume", *args], cwd=cwd, capture_output=True,
                          text=True, env=train_env(PYTHONPATH=str(ROOT)), timeout=600)


@pytest.mark.subprocess
def test_a_refused_setting_prints_one_clean_message_and_exits_2(tmp_path):
    done = _train("rollout.top_p=1.2", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith("error: config rollout.top_p=1.2: must be in (0, 1]"), done.stderr
    assert "Traceback" not in done.stderr and "(the traceback: run again with HYDRA_FULL_ERROR=1)" in done.stderr
    reward = _train("task=gsm8k", "task.reward_fn=nowhere.py:score", cwd=tmp_path)
    assert reward.returncode == 2 and "Traceback" not in reward.stderr
    assert reward.stderr.startswith("error: reward_fn 'nowhere.py:score': file ") and "does not exist" in reward.stderr
    agent = _train("task=agent", f"task.agent={ROOT}/tests/endpoint_agents.py:other_temperature", "trainer.max_steps=1",
                   "logger=csv", cwd=tmp_path)  # every trajectory refused by the endpoint (HTTP 400)
    assert agent.returncode == 2 and "Traceback" not in agent.stderr, agent.stderr[-3000:]
    assert "error: " in agent.stderr and "trajectories failed" in agent.stderr and "agent_timeout_s" not in agent.stderr
    full = _train("rollout.top_p=1.2", cwd=tmp_path, HYDRA_FULL_ERROR="1")
    assert full.returncode == 1 and "Traceback" in full.stderr and "must be in (0, 1]" in full.stderr


@pytest.mark.subprocess
def test_a_run_resumes_from_its_dir_alone_with_its_recorded_overrides(tmp_path):
    run = tmp_path / "run"
    first = _train(*TINY, "rollout.top_p=0.9", f"hydra.run.dir={run}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    # top_p (a guarded key) and the small step are not retyped: they come from the run's record
    second = _train(f"hydra.run.dir={run}", "ckpt_path=last", "trainer.max_steps=3", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "[topp_rl] resuming" in second.stderr and "rollout.top_p=0.9" in second.stderr
    third = _resume(str(run), "trainer.max_steps=4", cwd=tmp_path)
    assert third.returncode == 0, third.stderr[-3000:]
    steps = [sorted({int(r["step"]) for r in csv.DictReader(path.open()) if r.get("train/loss")})
             for path in sorted(run.glob("csv/version_*/metrics.csv"))]
    assert steps == [[0, 1], [2], [3]]  # each start logs its own steps (one CSV version per start)
    # an override on top is still checked against resume.guarded_keys
    guarded = _resume(str(run), "trainer.max_steps=5", "rollout.top_p=0.8", cwd=tmp_path)
    assert guarded.returncode == 2 and "rollout.top_p" in guarded.stderr and "Traceback" not in guarded.stderr


def test_the_runs_own_lines_reach_train_log_and_bar_frames_do_not(caplog, monkeypatch):
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    with caplog.at_level("INFO", logger="topp_rl.console"), console_to_log():
        print("[topp_rl] layout: world=1")
        print("  reward mean: first 0.1 -> last 0.2")
        sys.stderr.write("step:  50%|#####     | 1/2\rstep: 100%|##########| 2/2\n")  # a bar's frames
        sys.stderr.write("\r          \r[topp_rl] SGLang server http://x: ready in 1.0 s\n")  # as tqdm.write clears
        sys.stderr.write("wandb: offline\n")
    assert [r.getMessage() for r in caplog.records] == [
        "[topp_rl] layout: world=1", "  reward mean: first 0.1 -> last 0.2",
        "[topp_rl] SGLang server http://x: ready in 1.0 s"]
    assert out.getvalue().count("\n") == 2 and "wandb: offline" in err.getvalue()  # the console keeps everything
