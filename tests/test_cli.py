"""Using topp_rl without a clone: the packaged config and data (found from any directory), the Python API
(`topp_rl.fit` / `compose`, reward callables, twice in one process, an explicit run dir used as given and
resumed), a Hub id as `model.path` (from an HF cache this test fills), the `topp-rl` command, and a wheel installed
into a fresh venv run from outside the clone."""

import json
import logging
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import ROOT, TINY, train_env
from hydra.core.global_hydra import GlobalHydra

import topp_rl
from topp_rl import cli
from topp_rl.models import build_tiny, load_hf, save_model
from topp_rl.paths import config_dir, resolve_data_path, resource_root

GSM8K = "data/gsm8k_sample.jsonl"
HUB_ID = "topp-rl-tests/tiny-qwen2"


def no_hydra_state() -> bool:
    return not GlobalHydra.instance().is_initialized()


# ----- where the config and data are -----
def test_a_clone_finds_its_own_conf_and_data():
    assert resource_root() == ROOT
    assert config_dir() == ROOT / "conf"


def test_a_relative_data_path_is_found_in_the_working_directory_then_among_the_shipped_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_data_path(GSM8K) == ROOT / GSM8K  # not in the cwd: the shipped file
    (tmp_path / "data").mkdir()
    (tmp_path / GSM8K).write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    assert resolve_data_path(GSM8K) == Path(GSM8K)  # the cwd's own file comes first
    assert resolve_data_path(tmp_path / "elsewhere.jsonl") == tmp_path / "elsewhere.jsonl"  # absolute: as given
    with pytest.raises(ValueError) as err:
        resolve_data_path("data/nowhere.jsonl")
    assert str(tmp_path / "data/nowhere.jsonl") in str(err.value)
    assert str(ROOT / "data/nowhere.jsonl") in str(err.value)
    assert "task.path ('data/nowhere.jsonl')" in str(err.value)


def test_task_gsm8k_and_the_smollm2_experiment_data_load_from_another_directory(tmp_path, monkeypatch):
    from hydra.utils import instantiate

    monkeypatch.chdir(tmp_path)
    cfg = topp_rl.compose(["task=gsm8k"])
    task = instantiate(cfg.task)
    assert task.path == ROOT / GSM8K and task.num_examples == 32
    experiment = topp_rl.compose(["experiment=smollm2_gsm8k", "model=tiny"])
    word_sums = instantiate(experiment.task)
    assert word_sums.path == ROOT / "data/word_sums.jsonl" and word_sums.num_examples == 192  # train[:192]


# ----- compose: the packaged config, a user's config dir, no Hydra state left -----
def test_compose_adds_a_user_config_dir_through_hydra_searchpath(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "my_conf" / "experiment"
    mine.mkdir(parents=True)
    (mine / "mine.yaml").write_text("# @package _global_\ntrainer:\n  max_steps: 7\nrollout:\n  top_p: 0.8\n")
    cfg = topp_rl.compose([f"hydra.searchpath=[file://{tmp_path / 'my_conf'}]", "experiment=mine"])
    assert (cfg.trainer.max_steps, cfg.rollout.top_p) == (7, 0.8)
    run_dir = Path(cfg.paths.output_dir)
    assert run_dir.is_absolute() and run_dir.parent.parent == tmp_path / "outputs"
    assert run_dir.name.endswith("-copy_digit-tiny-grpo-top_p0.8-seed0") and "hydra" not in cfg  # task, model
    assert no_hydra_state()
    with pytest.raises(Exception, match="experiment"):  # without the search path the option does not exist
        topp_rl.compose(["experiment=mine"])
    assert no_hydra_state()


# ----- fit -----
def constant_reward(response, record):
    return 0.75


def one_per_response(responses, records):
    return [1.0] * len(responses)


def test_fit_twice_in_one_process_with_python_rewards(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    root_handlers = list(logging.getLogger().handlers)
    seen = []

    def counted(response, record):
        seen.append((response, record.answer))
        return 0.5

    first = topp_rl.fit(config=topp_rl.compose([*TINY, "logger=none"]))
    second = topp_rl.fit([*TINY, "task=gsm8k", "logger=none"],
                         rewards=[counted, {"fn": one_per_response, "weight": 0.5, "batched": True, "name": "ones"}])
    assert no_hydra_state() and logging.getLogger().handlers == root_handlers
    for result in (first, second):
        assert result.summary["steps"] == 2 and result.run_dir.parent.parent == tmp_path / "outputs"
        assert json.loads((result.run_dir / "summary.json").read_text())["steps"] == 2
        assert "Trainer.fit" in (result.run_dir / "train.log").read_text()  # Lightning's INFO lines: the file only
    assert first.run_dir != second.run_dir
    # 2 steps x 2 prompts x 2 samples, each scored once; reward = 0.5 + 0.5 * 1.0 exactly
    assert len(seen) == 8 and all(answer.rpartition("####")[2].strip() for _, answer in seen)
    assert second.metrics["rollout/reward_mean"] == 1.0
    assert second.metrics["rollout/reward/counted_mean"] == 0.5
    assert second.metrics["rollout/reward/ones_mean"] == 1.0
    recorded = yaml.safe_load((second.run_dir / "config.yaml").read_text())["task"]
    assert recorded["reward_fn"] is None
    assert [r["fn"] for r in recorded["rewards"]] == [
        f"{__name__}:test_fit_twice_in_one_process_with_python_rewards.<locals>.counted",
        f"{__name__}:one_per_response"]
    assert "GPU available" not in capsys.readouterr().out  # the console as the command line's: no Lightning INFO


def test_fit_refuses_a_multi_process_run_at_start(tmp_path, monkeypatch):
    """Lightning would start rank 1 by re-running this process's command line (a notebook's, `python -c`'s)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^topp_rl.fit runs one process, and trainer.devices x trainer.num_nodes "
                                         r"is 2: .* Run multi-device jobs with the command \(topp-rl train"):
        topp_rl.fit(overrides=["parallel=fsdp", "trainer.devices=2"])
    assert not (tmp_path / "outputs").exists()


def test_fit_refuses_rewards_a_task_cannot_take_before_training(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="task CopyDigitTask .* takes none"):
        topp_rl.fit(TINY, reward_fn=constant_reward)
    with pytest.raises(ValueError, match=r"rewards\[0\] \('pkg.mod:fn'\) is not a function"):
        topp_rl.fit([*TINY, "task=gsm8k"], rewards=["pkg.mod:fn"])
    with pytest.raises(ValueError, match="overrides .* or config, not both"):
        topp_rl.fit(TINY, config=topp_rl.compose(TINY))
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").rglob("summary.json"))


def test_fit_runs_in_an_explicit_run_dir_as_given_and_resumes_it(tmp_path, monkeypatch):
    """An existing hydra.run.dir was moved to `<dir>-1`, so `fit(..., ckpt_path=last)` looked for the checkpoint
    there and failed, telling the user to do what they did (issue 35)."""
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "my_run"
    common = [*TINY, "logger=none", "checkpoint.every_n_steps=2", f"hydra.run.dir={run_dir}"]
    first = topp_rl.fit(common)
    assert (first.run_dir, first.summary["checkpoint_step"]) == (run_dir, 2)
    with pytest.raises(ValueError, match=f"^run dir {run_dir} already holds a run \\(config.yaml\\); resume it with "
                                         "ckpt_path=last, or start this run in a new dir"):
        topp_rl.fit(common)  # a fresh start over a run is refused, not moved aside
    resumed = topp_rl.fit([*common, "trainer.max_steps=3", "ckpt_path=last"])
    assert resumed.run_dir == run_dir and resumed.config.paths.output_dir == str(run_dir)
    assert {k: resumed.summary[k] for k in ("resumed_from", "resumed_step", "steps", "checkpoint_step")} == {
        "resumed_from": str(run_dir / "checkpoints" / "last.ckpt"), "resumed_step": 2, "steps": 3,
        "checkpoint_step": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_run"]  # no my_run-1
    assert sorted(p.name for p in run_dir.glob("config*.yaml")) == ["config.resume-1.yaml", "config.yaml"]


def test_compose_gives_only_a_clock_named_run_dir_a_fresh_suffix_and_never_to_a_resume(tmp_path, monkeypatch):
    """The `-<n>` suffix is for two runs started in the same second under a `${now:...}` name (the default's);
    a resume (`ckpt_path`) means the existing dir, whatever names it."""
    monkeypatch.chdir(tmp_path)
    year = time.strftime("%Y")
    (Path.cwd() / "runs" / year).mkdir(parents=True)
    clock = "hydra.run.dir=runs/${now:%Y}"
    assert topp_rl.compose([clock]).paths.output_dir == str(Path.cwd() / "runs" / f"{year}-1")
    assert topp_rl.compose([clock, "ckpt_path=last"]).paths.output_dir == str(Path.cwd() / "runs" / year)
    assert topp_rl.compose([f"hydra.run.dir=runs/{year}"]).paths.output_dir == str(Path.cwd() / "runs" / year)


# ----- model.path: a Hub id from the HF cache -----
def fill_hub_cache(cache: Path, repo_id: str = HUB_ID) -> torch.Tensor:
    """The HF cache layout transformers reads (models--org--name/snapshots/<rev>/ + refs/main), holding a tiny
    model saved with save_pretrained; returns its embedding weights."""
    model, tokenizer = build_tiny(seed=3)
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    revision = "0" * 40
    save_model(model, tokenizer, repo / "snapshots" / revision)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    return model.get_input_embeddings().weight.detach().clone()


def test_model_path_takes_a_hub_id_found_in_the_hf_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.chdir(tmp_path)
    weights = fill_hub_cache(tmp_path / "hub")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # what HF_HUB_CACHE / HF_HOME set
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    model, tokenizer = load_hf(HUB_ID)
    assert torch.equal(model.get_input_embeddings().weight, weights) and tokenizer.encode("7") == [10]
    with pytest.raises(ValueError) as err:
        load_hf("topp-rl-tests/absent")
    message = str(err.value)
    assert "model.path ('topp-rl-tests/absent') is neither a local directory" in message
    assert str(tmp_path / "hub") in message and "HF_HUB_OFFLINE" in message


# ----- the command -----
def test_the_command_dispatches_export_and_report_and_names_itself(tmp_path, capsys):
    for argv, message in [
        (["fly"], "topp-rl: error: unknown command 'fly'; use train, resume, plan, export or report"),
        (["plan", "parallel=nowhere"], "topp-rl plan: error: In 'config': Could not find 'parallel/nowhere'"),
        ([], "topp-rl: error: no command given"),
        (["report", "/nonexistent/run"], "topp-rl report: error: run directory /nonexistent/run does not exist"),
        (["export", str(tmp_path / "no.ckpt"), str(tmp_path / "hf")],
         f"topp-rl export: error: checkpoint {tmp_path / 'no.ckpt'} does not exist"),
    ]:
        with pytest.raises(SystemExit) as done:
            cli.main(argv)
        assert done.value.code == 2
        assert message in capsys.readouterr().err


@pytest.mark.subprocess
def test_help_lists_the_groups_and_the_most_used_keys(tmp_path):
    env = {k: v for k, v in train_env(PYTHONPATH=str(ROOT)).items()}
    top = subprocess.run([sys.executable, "-m", "topp_rl.cli", "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert top.returncode == 0, top.stderr
    assert "train   train a policy" in top.stdout and "export  write" in top.stdout and "plan    print" in top.stdout
    assert "algo: cispo, dr_grpo, grpo, gspo, opd, reinforce_pp, rloo" in top.stdout
    assert "task: agent, arithmetic, copy_digit, countdown, dataset, gsm8k, jsonl, lookup, python_tool" in top.stdout
    train = subprocess.run([sys.executable, str(ROOT / "train.py"), "rollout.top_p=0.9", "--help"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=120)
    assert train.returncode == 0, train.stderr
    assert "rollout.top_p [0.9]  nucleus mass" in train.stdout  # the composed value, overrides applied
    assert "hydra.searchpath=[file:///my/conf]" in train.stdout
    assert not list(tmp_path.iterdir())  # --help writes no run dir


# ----- a wheel in a fresh venv, run from outside the clone -----
WHEEL_SOURCES = ("pyproject.toml", "README.md", "topp_rl", "callbacks", "conf", "data")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A venv holding only the wheel built from this checkout; its dependencies come from the running
    interpreter's site-packages through a .pth line (whose own .pth files, the editable install, stay unread)."""
    base = tmp_path_factory.mktemp("wheel")
    source = base / "src"
    source.mkdir()
    for name in WHEEL_SOURCES:  # a copy: building in the checkout would leave build/ in it
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", str(source), "-w", str(base / "dist")],
                   check=True, timeout=300, capture_output=True)
    (wheel,) = (base / "dist").glob("topp_rl-*.whl")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    purelib = Path(subprocess.check_output([str(venv / "bin" / "python"), "-c",
                                            "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True)
                   .strip())
    (purelib / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([*pip, "--python", str(venv / "bin" / "python"), "install", "--no-deps", "--ignore-installed",
                    str(wheel)], check=True, timeout=300, capture_output=True)
    return venv


def outside_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in train_env(HF_HUB_CACHE=str(tmp_path / "hub")).items() if k != "PYTHONPATH"}
    return env | {"HF_HUB_OFFLINE": "1"}


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_installed_wheel_trains_from_outside_the_clone(installed, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    fill_hub_cache(tmp_path / "hub")
    user_conf = tmp_path / "my_conf" / "experiment"
    user_conf.mkdir(parents=True)
    (user_conf / "mine.yaml").write_text("# @package _global_\nrollout:\n  top_p: 0.9\n")
    env = outside_env(tmp_path)
    # Two ranks: Lightning starts rank 1 by re-running the command line, which must be `topp-rl train ...` again.
    job = [*TINY[:-1], "task=gsm8k", "logger=csv", "model=hf_path", f"model.path={HUB_ID}",
           f"hydra.searchpath=[file://{tmp_path / 'my_conf'}]", "experiment=mine", "hydra.run.dir=run",
           "parallel=fsdp", "trainer.devices=2"]
    done = subprocess.run([str(installed / "bin" / "topp-rl"), "train", *job], cwd=work, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    shipped = next(installed.glob("lib/python*/site-packages/topp_rl/resources/data/gsm8k_sample.jsonl"))
    assert f"task: {shipped} [train]: 32 prompts" in done.stdout  # the wheel's copy of the data
    config = yaml.safe_load((work / "run" / "config.yaml").read_text())
    assert config["rollout"]["top_p"] == 0.9 and config["model"]["path"] == HUB_ID
    assert json.loads((work / "run" / "summary.json").read_text())["steps"] == 2
    assert (work / "run" / "train.log").is_file()
    assert "layout: world=2 dp=2 tp=1 cp=1 ep=1 fsdp=2" in done.stdout + done.stderr

    code = textwrap.dedent(f"""
        import json, topp_rl
        result = topp_rl.fit(overrides={[*TINY, "logger=none", "task=gsm8k"]!r},
                             reward_fn=lambda response, record: 0.25)
        print(json.dumps({{"module": topp_rl.__file__, "steps": result.summary["steps"],
                           "reward": result.metrics["rollout/reward_mean"], "run_dir": str(result.run_dir)}}))
    """)
    fit = subprocess.run([str(installed / "bin" / "python"), "-c", code], cwd=work, env=env,
                         capture_output=True, text=True, timeout=600)
    assert fit.returncode == 0, fit.stdout[-3000:] + fit.stderr[-3000:]
    result = json.loads(fit.stdout.strip().splitlines()[-1])
    assert Path(result["module"]).is_relative_to(installed) and result["steps"] == 2 and result["reward"] == 0.25
    assert Path(result["run_dir"]).parent.parent == work / "outputs"

