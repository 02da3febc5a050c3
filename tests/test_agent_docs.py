"""docs/agents.md as a user follows it: environments named like rewards and agents (`path/to/file.py:Class`,
`pkg.mod:Class`), the dataset task without a reward where the step never calls it, and every command of the page
run as written (the page's own `my_env.py` / `my_agent.py` written to a fresh working directory, no PYTHONPATH),
shortened to one step."""

import re
import subprocess
import sys

import pytest
from helpers import ROOT, compose_cfg, read_metrics, train_env
from hydra.utils import instantiate

from topp_rl.config import validate_config
from topp_rl.rollout.agent_step import AgentLoopStep
from topp_rl.tasks.datasets import DatasetTask
from topp_rl.tasks.environment import resolve_environment
from topp_rl.tasks.lookup import LookupEnvironment

PAGE = ROOT / "docs" / "agents.md"
DATA = "data/agent_lookup.jsonl"
# One short step of each command: two prompts x two trajectories, a csv log, no checkpoint.
SHORT = ["trainer.max_steps=1", "rollout.prompts_per_step=2", "rollout.n_samples=2", "logger=csv",
         "checkpoint.every_n_steps=0", "trainer.enable_progress_bar=false", "num_threads=1"]
# Covered by tests/test_python_tool.py::test_the_smollm2_preset_trains_a_step_exactly (SmolLM2, bubblewrap).
ELSEWHERE = {"experiment=smollm2_python_tool"}


def page_files() -> dict[str, str]:
    """The page's Python blocks that open with `# <name>.py`: the files a user writes beside them."""
    blocks = re.findall(r"```python\n# (\w+\.py)\n(.*?)```", PAGE.read_text(), re.S)
    return dict(blocks)


def page_commands() -> list[list[str]]:
    """The overrides of every `.venv/bin/python train.py ...` command on the page (bash blocks and inline)."""
    text = PAGE.read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            commands.append(line.partition("#")[0].split()[2:])
    commands += [c.split()[2:] for c in re.findall(r"`(\.venv/bin/python train\.py [^`]*)`", text)]
    return commands


def write_page_files(where) -> None:
    for name, source in page_files().items():
        (where / name).write_text(source)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    write_page_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_environments_are_named_by_file_or_module_like_rewards_and_agents(in_tmp):
    from_file = resolve_environment("my_env.py:LookupTool")
    assert type(from_file).__name__ == "LookupTool"
    assert isinstance(resolve_environment("topp_rl.tasks.lookup:LookupEnvironment"), LookupEnvironment)
    (in_tmp / "bad_env.py").write_text("class NeedsArgs:\n    def __init__(self, size):\n        pass\n"
                                       "    def start(self, record):\n        pass\n"
                                       "class NoStart:\n    pass\n")
    with pytest.raises(ValueError, match=r"rollout.step.environment='bad_env.py:NeedsArgs': building it with no "
                                         r"arguments raised TypeError: .*'size'.*; give its arguments defaults, or "
                                         r"name it in a task config"):
        resolve_environment("bad_env.py:NeedsArgs")
    with pytest.raises(ValueError, match=r"rollout.step.environment='bad_env.py:NoStart' built a NoStart, which has "
                                         r"no start\(record\)"):
        resolve_environment("bad_env.py:NoStart")
    with pytest.raises(ValueError, match=r"rollout.step.environment 'bad_env:NoStart' cannot be imported: no module "
                                         r"named 'bad_env'.*bad_env.py exists: name it by its file, bad_env.py:NoStart"):
        resolve_environment("bad_env:NoStart")


def test_the_agent_loop_on_a_dataset_needs_no_task_reward(in_tmp):
    """The page's second command, composed: it validates, and its step and task build (the task's reward is never
    called by the agent loop); the same task on the single-turn step is refused at start, naming the keys."""
    cfg = compose_cfg(in_tmp, "task=dataset", f"task.path={DATA}", "rollout/step=agent",
                      "rollout.step.environment=my_env.py:LookupTool", "rollout.max_turns=2",
                      "rollout.max_new_tokens=1")
    validate_config(cfg)
    step = instantiate(cfg.rollout.step)
    assert isinstance(step, AgentLoopStep) and type(step.environment).__name__ == "LookupTool"
    assert isinstance(instantiate(cfg.task), DatasetTask)
    single = compose_cfg(in_tmp, "task=dataset", f"task.path={DATA}")
    with pytest.raises(ValueError, match=r"config task.reward_fn=None / task.rewards=None: must set one with "
                                         r"rollout.step=SingleTurnStep \(it scores each response with the task's "
                                         r"reward\); set task.reward_fn=pkg.mod:fn"):
        validate_config(single)
    missing = compose_cfg(in_tmp, "task=dataset", f"task.path={DATA}", "rollout/step=agent", "rollout.max_turns=2")
    with pytest.raises(ValueError, match=r"config rollout.step.environment='\?\?\?': must be an environment .*set "
                                         r"rollout.step.environment=path/to/env.py:Class"):
        validate_config(missing)


def test_the_page_lists_the_commands_this_module_runs():
    commands = page_commands()
    assert len(commands) == 5
    assert {" ".join(c) for c in commands if set(c) & ELSEWHERE} == {"experiment=smollm2_python_tool"}
    assert set(page_files()) == {"my_env.py", "my_agent.py"}


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("overrides", [c for c in page_commands() if not set(c) & ELSEWHERE],
                         ids=lambda c: " ".join(c)[:60])
def test_the_pages_commands_run_as_written(tmp_path, overrides):
    """From a fresh working directory holding only the page's files, without PYTHONPATH: one step trains and
    logs a reward, and no trajectory fails."""
    write_page_files(tmp_path)
    env = {k: v for k, v in train_env().items() if k != "PYTHONPATH"}
    cmd = [sys.executable, str(ROOT / "train.py"), *overrides, *SHORT, f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [r for r in read_metrics(tmp_path / "run") if r.get("rollout/reward_mean")]
    assert 0.0 <= float(row["rollout/reward_mean"]) <= 1.0
    assert float(row["rollout/trajectories_failed"]) == 0.0
