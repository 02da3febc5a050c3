"""The run dir's lifecycle through `train(cfg)` in this process: a locked dir refuses a second run, `ckpt_path=last`
needs a checkpoint, a resume may not change the guarded config (unless allowed, then recorded), the config
history is kept, the checkpoint dir is checked at start, stale temp files are removed, one W&B run id per dir."""

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import ROOT, compose_config, train_env
from helpers import TINY as BASE
from omegaconf import OmegaConf

from topp_rl.run.rundir import report_versioned_checkpoints
from topp_rl.train import train

TINY = [*BASE, "checkpoint.every_n_steps=1", "logger=none"]  # the tiny run, checkpointing every step


def compose_cfg(output_dir: Path, *overrides: str):
    return compose_config(output_dir, *TINY, *overrides)


def test_ckpt_path_last_without_a_checkpoint_fails_naming_the_path(tmp_path):
    """Lightning warns and trains from scratch: a typo in hydra.run.dir silently lost the run being resumed."""
    with pytest.raises(ValueError) as info:
        train(compose_cfg(tmp_path, "ckpt_path=last"))
    assert str(info.value).startswith(
        f"ckpt_path=last: no checkpoint at {tmp_path}/checkpoints/last.ckpt, so there is nothing to resume; "
        "drop ckpt_path to start a new run, or point hydra.run.dir at the dir of the run to resume"
    )
    assert not (tmp_path / "config.yaml").exists()
    with pytest.raises(ValueError, match=f"ckpt_path={tmp_path}/nope.ckpt: no checkpoint at {tmp_path}/nope.ckpt"):
        train(compose_cfg(tmp_path, f"ckpt_path={tmp_path}/nope.ckpt"))


HOLDER = textwrap.dedent("""
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, f"{os.getpid()}\\n".encode())
    print("locked", flush=True)
    time.sleep(120)
""")


def test_a_second_run_in_a_locked_run_dir_is_refused_naming_the_holder(tmp_path):
    """Two runs in one dir wrote into each other's checkpoints and config; the lock protocol is `<dir>/.lock`
    flocked, holder's pid inside (here held by a bare process, as a running `train.py` holds it)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / ".lock")], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(ValueError) as info:
            train(compose_cfg(tmp_path))
        assert str(info.value) == (
            f"run dir {tmp_path} is in use by another run (pid {holder.pid}, holding {tmp_path}/.lock); wait for "
            "that run to end, or start this one in its own dir (another hydra.run.dir)"
        )
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]  # nothing else was written


def _read_only(directory: Path):
    """Make `directory` unwritable; returns the undo, or None where this machine cannot. Root ignores mode bits,
    so as root the dir is made immutable (`chattr +i`, ext4 / xfs)."""
    directory.mkdir(parents=True)
    if os.geteuid() != 0:
        directory.chmod(0o555)
        return lambda: directory.chmod(0o755)
    if shutil.which("chattr") and subprocess.run(["chattr", "+i", str(directory)]).returncode == 0:
        return lambda: subprocess.run(["chattr", "-i", str(directory)], check=True)
    return None


def test_unwritable_checkpoint_dir_fails_at_start_naming_it(tmp_path):
    """Found only at the first save before, after the first step had run."""
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "checkpoints").write_text("a file where the dir should be")
    with pytest.raises(ValueError) as info:
        train(compose_cfg(blocked))
    assert str(info.value).startswith(f"checkpoint dir {blocked}/checkpoints is not writable (FileExistsError: ")
    assert str(info.value).endswith("fix the path or its permissions, or point hydra.run.dir at a writable dir")

    locked = tmp_path / "locked"
    undo = _read_only(locked / "checkpoints")
    if undo is None:
        return  # no way to make a dir unwritable for root here; the blocked case above still ran
    try:
        with pytest.raises(ValueError, match=f"^checkpoint dir {locked}/checkpoints is not writable "
                                             "\\(PermissionError: "):
            train(compose_cfg(locked))
    finally:
        undo()


def _stale_temps(checkpoints: Path, live_pid: int) -> dict[str, Path]:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    checkpoints.mkdir(parents=True)
    temps = {
        "dead": checkpoints / f".last.ckpt.{int(dead.stdout)}.0123abcd.tmp",  # SIGKILL mid-write
        "old": checkpoints / ".last.ckpt.x1y2z3.tmp",  # mkstemp name, written before pids were in the names
        "live": checkpoints / f".other.ckpt.{live_pid}.4567cdef.tmp",  # a writer still running
    }
    for p in temps.values():
        p.write_bytes(b"partial")
    return temps


def test_resume_checks_the_config_keeps_its_history_and_the_wandb_run(tmp_path, capfd):
    out = tmp_path / "run"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        temps = _stale_temps(out / "checkpoints", live.pid)
        train(compose_cfg(out, "logger=wandb"))
        err = capfd.readouterr().err
        assert not temps["dead"].exists() and not temps["old"].exists() and temps["live"].exists()
        assert (f"[topp_rl] removed stale temp file {temps['dead']} (7 bytes) left by a writer that is gone "
                f"(pid {temps['dead'].name.split('.')[3]})") in err
        assert f"removed stale temp file {temps['old']} (7 bytes)" in err
    finally:
        live.kill()
        live.wait(timeout=10)

    # A second fresh start would overwrite the run's checkpoint and config.
    with pytest.raises(ValueError, match=f"run dir {out} already holds a run \\(config.yaml\\); resume it with "
                                         "ckpt_path=last, or start this run in a new dir"):
        train(compose_cfg(out))
    # Resuming with other sampling and another seed would continue a different experiment under the same name.
    with pytest.raises(ValueError) as info:
        train(compose_cfg(out, "ckpt_path=last", "rollout.top_p=0.8", "seed=1", "rollout.n_samples=4"))
    message = str(info.value)
    assert message.startswith(f"resuming {out}/checkpoints/last.ckpt would change 5 setting(s) the run was trained "
                              "with: model.seed: 0 -> 1; rollout.n_samples: 2 -> 4; rollout.top_p: 0.9 -> 0.8; "
                              "seed: 0 -> 1; task.seed: 0 -> 1; ")
    assert message.endswith("or set resume.allow_config_change=true to continue with the new ones")

    # Allowed explicitly: trains step 3 only, says what changed, and the first config stays as it was.
    train(compose_cfg(out, "ckpt_path=last", "trainer.max_steps=3", "rollout.top_p=0.8", "logger=wandb",
                      "resume.allow_config_change=true"))
    assert (f"resuming {out}/checkpoints/last.ckpt with changed settings (resume.allow_config_change=true): "
            "rollout.top_p: 0.9 -> 0.8") in capfd.readouterr().err
    checkpoint = torch.load(out / "checkpoints/last.ckpt", weights_only=True, mmap=True)
    assert checkpoint["global_step"] == 3
    assert checkpoint["topp_rl"]["config"]["rollout"]["top_p"] == 0.8
    assert OmegaConf.load(out / "config.yaml").rollout.top_p == 0.9
    assert OmegaConf.load(out / "config.resume-1.yaml").rollout.top_p == 0.8
    assert OmegaConf.load(out / "config.resume-1.yaml").ckpt_path == "last"
    # Both starts logged into one W&B run (offline dirs are named offline-run-<time>-<id>, plus "-<n>" when two
    # starts fall in the same second).
    run_id = (out / "wandb_id").read_text().strip()
    runs = sorted(p.name for p in (out / "wandb").glob("offline-run-*"))
    pattern = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?")
    assert len(runs) == 2 and all(pattern.fullmatch(r) for r in runs), (runs, run_id)


@pytest.mark.subprocess
def test_a_refused_second_run_leaves_the_first_runs_hydra_files_alone(tmp_path):
    """Hydra wrote `<run dir>/.hydra/` before `train()` ran, so a second start refused for the dir's run had
    already replaced the first run's config.yaml / overrides.yaml with its own (issue 18 part 6i)."""
    env = train_env()
    env.pop("PYTHONPATH", None)
    base = [sys.executable, "train.py", f"hydra.run.dir={tmp_path}", *TINY, "trainer.max_steps=1"]
    first = subprocess.run(base, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    hydra_dir = tmp_path / ".hydra"
    written = {p.name: p.read_bytes() for p in hydra_dir.iterdir()}
    assert sorted(written) == ["config.yaml", "hydra.yaml", "overrides.yaml"]
    assert OmegaConf.load(hydra_dir / "config.yaml").rollout.top_p == 0.9  # the task config, as Hydra writes it
    assert "trainer.max_steps=1" in OmegaConf.load(hydra_dir / "overrides.yaml")
    second = subprocess.run([*base, "rollout.top_p=0.5"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert second.returncode == 2 and "Traceback" not in second.stderr
    assert (f"error: run dir {tmp_path} already holds a run (config.yaml); resume it with ckpt_path=last, or start this "
            "run in a new dir") in second.stderr
    assert {p.name: p.read_bytes() for p in hydra_dir.iterdir()} == written  # byte for byte


def test_a_versioned_last_checkpoint_is_reported_at_start_with_both_steps(tmp_path, capfd):
    """`last-v1.ckpt` is what Lightning's version counter wrote beside an older `last.ckpt`; topp_rl no longer
    writes one, but a run dir from before may hold it, and `ckpt_path=last` reads `last.ckpt` only."""
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    torch.save({"global_step": 18}, checkpoints / "last.ckpt")
    torch.save({"global_step": 120}, checkpoints / "last-v1.ckpt")
    torch.save({"global_step": 10}, checkpoints / "last-v2.ckpt")
    assert report_versioned_checkpoints(checkpoints) == [checkpoints / "last-v1.ckpt", checkpoints / "last-v2.ckpt"]
    err = capfd.readouterr().err
    assert (f"[topp_rl] found {checkpoints}/last-v1.ckpt (step 120), a versioned copy an older topp_rl wrote beside "
            f"last.ckpt (step 18); ckpt_path=last reads last.ckpt only; this copy is NEWER: resume it with "
            f"ckpt_path={checkpoints}/last-v1.ckpt, and delete the copies you no longer need") in err
    assert f"{checkpoints}/last-v2.ckpt (step 10)" in err and "(step 18); ckpt_path=last reads last.ckpt only; it is not newer" in err


def test_a_task_recorded_under_its_old_module_path_is_the_same_task():
    """topp_rl.rollout.tasks moved to topp_rl.tasks.generated: a checkpoint written before names the same class."""
    from topp_rl.run.rundir import config_changes

    old = {"task": {"_target_": "topp_rl.rollout.tasks.CopyDigitTask", "seed": 0}}
    new = {"task": {"_target_": "topp_rl.tasks.generated.CopyDigitTask", "seed": 0}}
    assert config_changes(old, new, ["task"]) == []
    other = {"task": {"_target_": "topp_rl.tasks.generated.ArithmeticTask", "seed": 0}}
    assert config_changes(old, other, ["task"]) == [
        "task._target_: 'topp_rl.rollout.tasks.CopyDigitTask' -> 'topp_rl.tasks.generated.ArithmeticTask'"]
    # The callbacks folder installs as topp_rl.callbacks (it was a top-level package named `callbacks`).
    old_cb = {"callbacks": {"weight_sync": {"_target_": "callbacks.WeightSync"}}}
    new_cb = {"callbacks": {"weight_sync": {"_target_": "topp_rl.callbacks.WeightSync"}}}
    assert config_changes(old_cb, new_cb, ["callbacks"]) == []


def test_guarded_keys_added_later_read_the_behaviour_an_older_checkpoint_had():
    """A checkpoint written before rollout.step / max_turns / max_trajectory_tokens existed resumes as the
    single-turn run it was; a resume that moves away from that behaviour is still refused."""
    from topp_rl.run.rundir import config_changes

    keys = ["rollout.step", "rollout.max_turns", "rollout.max_trajectory_tokens"]
    old = {"rollout": {"top_p": 0.9}}
    single = {"rollout": {"step": {"_target_": "topp_rl.rollout.step.SingleTurnStep"}, "max_turns": 1,
                          "max_trajectory_tokens": 256}}
    assert config_changes(old, single, keys) == []
    agent = {"rollout": {"step": {"_target_": "topp_rl.rollout.agent_step.AgentLoopStep"}, "max_turns": 2,
                         "max_trajectory_tokens": 16}}
    assert config_changes(old, agent, keys) == [
        "rollout.max_turns: 1 -> 2",
        "rollout.step._target_: 'topp_rl.rollout.step.SingleTurnStep' -> 'topp_rl.rollout.agent_step.AgentLoopStep'"]


def _record(tmp_path: Path, *overrides: str) -> dict:
    """The config record a checkpoint of a run with `overrides` holds (resolved, as `RunRecord` stores it)."""
    return OmegaConf.to_container(compose_cfg(tmp_path, *overrides), resolve=True)


WEIGHTS_ONLY = ("or to go on from its weights alone at this layout, export them (python -m topp_rl.export <ckpt> OUT) "
                "and start a new run on them (model=hf_path model.path=OUT, no ckpt_path)")
OTHER_STRATEGY = ("a checkpoint resumes under the parallel strategy that wrote it (each lays out the weights and the "
                  "optimizer state its own way)")
TP_EP = ("the optimizer state is stored per TP x EP rank and restores at the saved tp_size and ep_size only (cp_size, "
         "pp_size, vpp_size and the device count may change)")


@pytest.mark.parametrize(("saved", "wanted", "message"), [
    # A parallel=tp2 / pp2 checkpoint resumed without the layout failed in Lightning's load with a raw
    # `Missing key(s) in state_dict: "policy.model.lm_head.weight"`, after the ranks had started.
    (["parallel=tp2"], [],
     "was saved at parallel=tp2 trainer.devices=2 (MegatronStrategy: tp 2, cp 1, ep 1, pp 1, vpp 1, 2 devices), this "
     f"run asks for parallel=none trainer.devices=1 (no parallel strategy, 1 device): {OTHER_STRATEGY}; resume with "
     f"the saved layout (add parallel=tp2 trainer.devices=2 to the resume command), {WEIGHTS_ONLY}"),
    (["parallel=pp2"], ["parallel=fsdp"],
     "was saved at parallel=pp2 trainer.devices=2 (MegatronStrategy: tp 1, cp 1, ep 1, pp 2, vpp 1, 2 devices), this "
     "run asks for parallel=fsdp trainer.devices=2 (FSDPStrategy: tp 1, cp 1, ep 1, pp 1, vpp 1, 2 devices): "
     f"{OTHER_STRATEGY}; resume with the saved layout (add parallel=pp2 trainer.devices=2 to the resume command)"),
    ([], ["parallel=tp2"],
     "was saved at parallel=none trainer.devices=1 (no parallel strategy, 1 device), this run asks for parallel=tp2 "
     "trainer.devices=2 (MegatronStrategy: tp 2, cp 1, ep 1, pp 1, vpp 1, 2 devices)"),
    (["parallel=tp2"], ["parallel=megatron", "trainer.devices=2"],
     f"this run asks for parallel=megatron trainer.devices=2 (MegatronStrategy: tp 1, cp 1, ep 1, pp 1, vpp 1, 2 "
     f"devices): {TP_EP}; resume with the saved layout (add parallel=tp2 trainer.devices=2 to the resume command)"),
    (["parallel=tp2", "parallel.tp_size=4", "trainer.devices=4"], ["parallel=tp2", "trainer.devices=4"],
     f"was saved at parallel=megatron parallel.tp_size=4 trainer.devices=4 (MegatronStrategy: tp 4, cp 1, ep 1, pp 1, "
     "vpp 1, 4 devices), this run asks for parallel=tp2 trainer.devices=4 (MegatronStrategy: tp 2, cp 1, ep 1, pp 1, "
     f"vpp 1, 4 devices): {TP_EP}; resume with the saved layout (add parallel=megatron parallel.tp_size=4 "
     "trainer.devices=4"),
    (["parallel=tp2", "trainer.devices=4", "parallel.distributed_optimizer=true"],
     ["parallel=tp2", "trainer.devices=4"],
     "distributed optimizer, 4 devices), this run asks for parallel=tp2 trainer.devices=4 (MegatronStrategy: tp 2, cp "
     "1, ep 1, pp 1, vpp 1, 4 devices): the optimizer state is sharded with parallel.distributed_optimizer=true and "
     "whole without it: it restores at the saved setting only; resume with the saved layout (add parallel=tp2 "
     "parallel.distributed_optimizer=true trainer.devices=4 to the resume command)"),
    (["parallel=tp2", "trainer.devices=4", "parallel.distributed_optimizer=true"],
     ["parallel=tp2", "trainer.devices=2", "parallel.distributed_optimizer=true"],
     "the distributed optimizer's sharded state restores at the saved (world size, cp_size, pp_size) only"),
])
def test_a_resume_at_a_layout_the_checkpoint_cannot_restore_at_is_refused_naming_both(tmp_path, saved, wanted,
                                                                                      message):
    from topp_rl.run.rundir import check_resume_layout

    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    with pytest.raises(ValueError) as info:
        check_resume_layout(compose_cfg(tmp_path, *wanted), ckpt, _record(tmp_path, *saved))
    assert str(info.value).startswith(f"checkpoint {ckpt} ") and message in str(info.value), str(info.value)


@pytest.mark.parametrize(("saved", "wanted"), [
    ([], ["trainer.devices=1"]),
    (["parallel=tp2"], ["parallel=tp2", "trainer.devices=4"]),  # more data-parallel replicas
    (["parallel=tp2_pp2", "trainer.devices=4"], ["parallel=tp2_cp2", "trainer.devices=4"]),  # docs/megatron.md
    (["parallel=pp2"], ["parallel=megatron", "trainer.devices=1"]),  # another pp size: restaged by name
    (["parallel=pp2", "parallel.vpp_size=2"], ["parallel=pp2"]),  # another vpp size
    (["parallel=fsdp"], ["parallel=fsdp", "trainer.devices=4"]),  # DCP re-shards at any world size
    (["parallel=tp2", "trainer.devices=4", "parallel.distributed_optimizer=true"],
     ["parallel=tp2", "trainer.devices=4", "parallel.distributed_optimizer=true"]),
])
def test_every_layout_change_a_checkpoint_restores_across_is_let_through(tmp_path, saved, wanted):
    from topp_rl.run.rundir import check_resume_layout

    check_resume_layout(compose_cfg(tmp_path, *wanted), tmp_path / "last.ckpt", _record(tmp_path, *saved))


@pytest.mark.subprocess
@pytest.mark.distributed
@pytest.mark.slow
def test_a_tp2_checkpoint_resumed_without_its_layout_is_refused_at_start_and_the_offered_command_works(tmp_path):
    """Was a raw `Missing key(s) in state_dict` from Lightning's load once the model was built. A resume takes the
    run's recorded layout by itself (`topp_rl.run.resume_args`); one that asks for another (`parallel=none` on its
    command line, which wins over the record) is refused, offering the overrides of the saved layout instead."""
    env = train_env()
    base = [sys.executable, "train.py", f"hydra.run.dir={tmp_path}", *TINY, "trainer.max_steps=1"]
    first = subprocess.run([*base, "parallel=tp2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    resume = [*base[:-1], "trainer.max_steps=2", "ckpt_path=last"]
    refused = subprocess.run([*resume, "parallel=none"], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=600)
    assert refused.returncode == 2
    assert "Missing key" not in refused.stderr
    assert (f"error: checkpoint {tmp_path}/checkpoints/last.ckpt was saved at parallel=tp2 trainer.devices=2 "
            "(MegatronStrategy: tp 2, cp 1, ep 1, pp 1, vpp 1, 2 devices), this run asks for parallel=none "
            "trainer.devices=1 (no parallel strategy, 1 device)") in refused.stderr
    offered = re.search(r"\(add (.*) to the resume command\)", refused.stderr)[1]
    assert offered == "parallel=tp2 trainer.devices=2"
    resumed = subprocess.run([*resume, *offered.split()], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert torch.load(tmp_path / "checkpoints/last.ckpt", weights_only=True, mmap=True)["global_step"] == 2


def _offered_rm(message: str) -> Path:
    return Path(re.search(r"\(rm -r (\S+)\)", message)[1])


def test_a_run_dir_without_a_checkpoint_offers_a_command_that_works(tmp_path):
    """The refusal said "resume it with ckpt_path=last", and ckpt_path=last then refused: nothing to resume."""
    out = tmp_path / "run"
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1:", "answer": "1"}\n{"prompt": "2:", "answer": "2"}\n')
    (tmp_path / "broken.py").write_text("def reward(response, record):\n    raise RuntimeError('reward down')\n")
    died = ("task=jsonl", f"task.path={data}", f"task.reward_fn={tmp_path}/broken.py:reward")
    with pytest.raises(RuntimeError, match="reward down"):  # a start that dies in its first step
        train(compose_cfg(out, *died))
    assert (out / "config.yaml").exists() and not (out / "checkpoints" / "last.ckpt").exists()
    way_on = (f"run dir {out} holds a run that saved no checkpoint (config.yaml, no checkpoints/last.ckpt: its start "
              f"ended before its first save), so there is nothing to resume; start it over by deleting the dir (rm -r "
              f"{out}) and running the same command without ckpt_path, or start this run in a new dir (another "
              "hydra.run.dir)")
    for resume in ((), ("ckpt_path=last",)):
        with pytest.raises(ValueError) as info:
            train(compose_cfg(out, *resume))
        assert str(info.value) == (f"ckpt_path=last: no checkpoint at {out}/checkpoints/last.ckpt: " if resume
                                   else "") + way_on
    shutil.rmtree(_offered_rm(way_on))  # the offered command, then the same start again
    assert train(compose_cfg(out))["steps"] == 2

    # A finished run that saved none (checkpoint.every_n_steps=0): the same way on, with that reason.
    finished = tmp_path / "finished"
    train(compose_cfg(finished, "checkpoint.every_n_steps=0"))
    with pytest.raises(ValueError, match=re.escape(f"run dir {finished} holds a run that saved no checkpoint "
                                                   "(config.yaml, no checkpoints/last.ckpt: it finished with "
                                                   "checkpoint.every_n_steps=0)")):
        train(compose_cfg(finished))


def _cli(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`train.py` with `overrides`, from `cwd` (where the default outputs/ dir goes)."""
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *TINY, "trainer.max_steps=1", *overrides],
                          cwd=cwd, env=train_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=600)


NAME_RULE = ("must be one directory name, without '/', '\\' or NUL, and not '.' or '..' (the run dir is "
             "outputs/<date>/<time>-<task>-<model>-<run_name>); set run_name to a name of letters, digits and ._-=+@%, or "
             "hydra.run.dir to the dir the run should use")


@pytest.mark.subprocess
def test_a_run_name_cannot_put_the_run_dir_outside_the_outputs_dir(tmp_path):
    """run_name='../../../../x' made the default run dir outputs/<date>/<time>-../../../../x, outside outputs/."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    done = _cli(cwd, "run_name='../../../../escaped'")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip() == f"error: config run_name='../../../../escaped': {NAME_RULE}"
    assert list(cwd.iterdir()) == [] and not (tmp_path / "escaped").exists()  # nothing was created

    from topp_rl.api import compose

    for name in ("a/b", "..", "a\\b"):
        with pytest.raises(ValueError) as info:
            compose([f"run_name='{name}'"])
        assert str(info.value) == f"config run_name={name!r}: {NAME_RULE}"
    assert compose(["run_name='my run: v2'"]).run_name == "my run: v2"  # any other name


@pytest.mark.subprocess
def test_an_unwritable_run_dir_is_a_clear_error_naming_it(tmp_path):
    """Hydra's log setup failed with "Unable to configure handler 'file'" (a read-only dir), or its mkdir with a
    bare NotADirectoryError (a file where a dir of the path should be): root ignores mode bits, so a regular file
    in the path is the case every machine has, and an immutable dir (`chattr +i`) the read-only one."""
    fix = ("the run's log (train.log), config and checkpoints go there: fix the path or its permissions, or point "
           "hydra.run.dir at a writable dir")
    (tmp_path / "file").write_text("a file where a dir of the run dir's path should be")
    inside_a_file = tmp_path / "file" / "run"
    done = _cli(tmp_path, f"hydra.run.dir={inside_a_file}")
    assert done.returncode == 2
    assert done.stderr.strip() == (f"error: run dir {inside_a_file} is not writable (NotADirectoryError: [Errno "
                                   f"20] Not a directory: '{inside_a_file}'); {fix}")
    from topp_rl.api import fit

    with pytest.raises(ValueError, match=re.escape(f"run dir {inside_a_file} is not writable (NotADirectoryError")):
        fit([f"hydra.run.dir={inside_a_file}", *TINY])

    locked = tmp_path / "locked"
    undo = _read_only(locked)
    if undo is None:
        return  # no way to make a dir unwritable for root here; the case above still ran
    try:
        done = _cli(tmp_path, f"hydra.run.dir={locked}")
        assert done.returncode == 2
        assert "Unable to configure handler" not in done.stderr
        assert re.fullmatch(rf"error: run dir {locked} is not writable \((PermissionError|OSError): .*\); "
                            f"{re.escape(fix)}", done.stderr.strip()), done.stderr[-2000:]
    finally:
        undo()
