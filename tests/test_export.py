"""HF export: a short run writes `<run dir>/hf/`, which transformers loads with the trained policy's log-probs;
`python -m topp_rl.export` on the run's last.ckpt writes the same weights; the generation config holds the
rollout's sampling settings. The fault fixtures of issue 18: the export replaces only an empty dir or a previous
export (never a user's files, the checkpoint or the run dir), reads checkpoints with torch's safe loader, and
leaves nothing behind after a full disk or a SIGKILL."""

import hashlib
import importlib.util
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, compose_config
from hydra.utils import instantiate
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from topp_rl.data.sample import Sample
from topp_rl.models import build_char_tokenizer, load_hf
from topp_rl.rollout.packing import pack_samples
from topp_rl.run import export
from topp_rl.train import RunSummary, build_callbacks, build_run, fit

RUN = [
    "trainer.max_steps=2", "rollout.prompts_per_step=2", "rollout.n_samples=2", "rollout.max_new_tokens=4",
    "trainer.enable_progress_bar=false", "logger=none", "checkpoint.every_n_steps=1",
    "rollout.top_p=0.9", "rollout.top_k=20", "rollout.min_p=0.01", "rollout.temperature=0.8",
]
SEQUENCES = [([5, 6, 7], [8, 9, 10, 2]), ([12, 3], [40, 41]), ([1, 20, 21, 22, 23], [30])]


def _run(output_dir: Path):
    cfg = compose_config(output_dir, *RUN)
    run = build_run(cfg)
    fit(run)
    return run


def _policy_logprobs(module) -> torch.Tensor:
    """The trained module's own scoring path (backbone hidden states + scorer), full vocabulary, [R]."""
    samples = [Sample(prompt_ids=p, response_ids=r, loss_mask=[1] * len(r), rollout_log_probs=[0.0] * len(r),
                      reward=0.0, index=i) for i, (p, r) in enumerate(SEQUENCES)]
    (batch,) = pack_samples(samples, [0.0] * len(samples), max_tokens=4096)
    with torch.no_grad():
        return module.score(module.policy, batch, use_mask=False)


def _hf_logprobs(model, temperature: float) -> torch.Tensor:
    out = []
    with torch.no_grad():
        for prompt, response in SEQUENCES:
            ids = torch.tensor([prompt + response])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
            out.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0])
    return torch.cat(out)


def test_run_exports_an_hf_dir_with_the_trained_policy_and_the_cli_matches(tmp_path):
    run = _run(tmp_path / "run")
    hf_dir = tmp_path / "run" / "hf"
    model, info = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True, output_loading_info=True)
    assert not any(info.values()), info  # no missing / unexpected / mismatched keys
    expected = _policy_logprobs(run.module)
    got = _hf_logprobs(model.eval(), temperature=0.8)
    assert got.shape == expected.shape == (7,)
    assert torch.allclose(got, expected, rtol=0, atol=1e-6), (got - expected).abs().max()
    trained = {n: t.clone() for n, t in run.module.hf_named_tensors()}
    written = load_file(hf_dir / "model.safetensors")
    assert written.keys() == trained.keys()
    assert all(torch.equal(written[n], trained[n]) for n in trained)  # bit for bit

    generation = json.loads((hf_dir / "generation_config.json").read_text())
    assert {k: generation[k] for k in ("do_sample", "temperature", "top_p", "top_k", "min_p", "max_new_tokens")} \
        == {"do_sample": True, "temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.01, "max_new_tokens": 4}
    assert json.loads((hf_dir / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert json.loads((hf_dir / export.INFO_FILE).read_text())["step"] == 2
    _, tokenizer = load_hf(hf_dir)
    ids = build_char_tokenizer()("7+8=15").input_ids
    assert tokenizer("7+8=15").input_ids == ids
    assert AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)("7+8=15").input_ids == ids

    out = tmp_path / "cli"
    export.main([str(tmp_path / "run" / "checkpoints" / "last.ckpt"), str(out)])
    cli = load_file(out / "model.safetensors")
    assert cli.keys() == trained.keys() and all(torch.equal(cli[n], trained[n]) for n in trained)
    assert json.loads((out / "generation_config.json").read_text()) == generation
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in hf_dir.iterdir())
    assert not list(tmp_path.glob("run/.hf.*")) and not list(tmp_path.glob(".cli.*"))  # no staging left


def test_generation_config_maps_top_k_zero_to_the_vocabulary():
    tokenizer = build_char_tokenizer()
    rollout = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "max_new_tokens": 7,
               "stop_token_ids": [5, tokenizer.eos_token_id]}
    config = export.generation_config(rollout, vocab_size=128, tokenizer=tokenizer)
    assert (config.top_k, config.max_new_tokens, config.eos_token_id) == (128, 7, [tokenizer.eos_token_id, 5])


def test_cli_names_a_missing_or_foreign_checkpoint(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        export.main([str(tmp_path / "nope.ckpt"), str(tmp_path / "out")])
    assert exc.value.code == 2 and "does not exist" in capsys.readouterr().err
    torch.save({"state_dict": {}}, tmp_path / "plain.ckpt")
    with pytest.raises(ValueError, match="holds no run config"):
        export.export_checkpoint(tmp_path / "plain.ckpt", tmp_path / "out")


NO_MEGATRON = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                 reason="megatron-core (the `megatron` extra) is not installed")
PRELOAD = ("megatron.core", "megatron.core.models.gpt", "topp_rl.megatron.strategy", "topp_rl.train", "hydra")


def _megatron_worker(rank: int, tmp: str) -> dict | None:
    import os

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # the group is up: Lightning only reads ranks
    cfg = compose_config(tmp, *RUN, "trainer.max_steps=1", "parallel=tp2")
    run = build_run(cfg)
    fit(run)
    gathered = {n: t.clone() for n, t in run.module.hf_named_tensors()}  # a TP collective: both ranks
    return gathered if run.trainer.is_global_zero else None


@NO_MEGATRON
@pytest.mark.distributed
def test_megatron_tp2_run_exports_the_gathered_weights_and_the_cli_reads_its_checkpoint(tmp_path):
    from dist_utils import run_distributed

    gathered, other = run_distributed(_megatron_worker, 2, str(tmp_path / "run"), timeout=300, preload=PRELOAD)
    assert other is None and not list(tmp_path.glob("run/.hf.*"))  # rank 1 wrote nothing
    written = load_file(tmp_path / "run" / "hf" / "model.safetensors")
    assert written.keys() == gathered.keys() and all(torch.equal(written[n], gathered[n]) for n in gathered)
    export.main([str(tmp_path / "run" / "checkpoints" / "last.ckpt"), str(tmp_path / "cli")])
    cli = load_file(tmp_path / "cli" / "model.safetensors")
    assert cli.keys() == gathered.keys() and all(torch.equal(cli[n], gathered[n]) for n in gathered)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf", local_files_only=True).eval()
    assert torch.isfinite(_hf_logprobs(model, temperature=0.8)).all()


# ----- issue 18, part 3: what an export may replace, how it reads a checkpoint, what a failure leaves -----
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A training checkpoint of the tiny model at global step 7 (the keys the command reads), without training."""
    run_dir = tmp_path_factory.mktemp("run")
    cfg = compose_config(run_dir, *RUN)
    model, _ = instantiate(cfg.model)
    path = run_dir / "checkpoints" / "last.ckpt"
    path.parent.mkdir()
    torch.save({"global_step": 7, "topp_rl": {"config": OmegaConf.to_container(cfg, resolve=True)},
                "state_dict": {export.POLICY_PREFIX + n: t.float() for n, t in model.state_dict().items()}}, path)
    return path


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tree(directory: Path) -> dict[str, str]:
    return {p.name: _digest(p) for p in sorted(directory.iterdir())}


def _refused(argv: list, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        export.main([str(a) for a in argv])
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_cli_replaces_an_empty_dir_or_a_previous_export_and_names_the_checkpoint_and_its_step(ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    previous = os.umask(0o022)
    try:
        for _ in range(2):  # an empty dir, then the previous export
            export.main([str(ckpt), str(out)])
            assert capsys.readouterr().out == (f"[topp_rl] exported checkpoint {ckpt.resolve()} (global step 7) "
                                               f"to {out}\n")
    finally:
        os.umask(previous)
    info = json.loads((out / export.INFO_FILE).read_text())
    assert (info["source"], info["step"]) == (str(ckpt.resolve()), 7)
    assert info["files"] == sorted(p.name for p in out.iterdir())
    assert {"config.json", "model.safetensors", "generation_config.json", export.INFO_FILE} <= set(info["files"])
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {n: "0o644" for n in info["files"]}
    assert oct(out.stat().st_mode & 0o777) == "0o755"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staged or replaced copy (`.out.*`) left


def test_cli_refuses_a_dir_of_other_files_and_a_file_and_deletes_nothing(ckpt, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    for name in ("a.txt", "b.txt", "c.txt", "d.txt", "e.txt", "f.txt"):
        (mine / name).write_text(name)
    (mine / "sub").mkdir()
    err = _refused([ckpt, mine], capsys)
    assert (f"export target {mine} holds files that are not a topp_rl export (a.txt, b.txt, c.txt, d.txt, e.txt, "
            f"...); an export replaces its target, so it writes only to a new or empty dir or a previous export "
            f"(marked by its topp_rl_export.json): choose an empty or new dir, or delete {mine} yourself") in err
    assert sorted(p.name for p in mine.iterdir()) == ["a.txt", "b.txt", "c.txt", "d.txt", "e.txt", "f.txt", "sub"]

    prev = tmp_path / "prev"  # a previous export a user added a file to is no longer only an export
    export.main([str(ckpt), str(prev)])
    (prev / "notes.md").write_text("mine")
    assert "holds files that are not a topp_rl export (notes.md); " in _refused([ckpt, prev], capsys)
    assert (prev / "notes.md").read_text() == "mine"

    a_file = tmp_path / "model.bin"
    a_file.write_bytes(b"weights")
    assert (f"export target {a_file} is a file; pass the path of a new or empty directory, or of a previous export "
            f"(a dir holding topp_rl_export.json)") in _refused([ckpt, a_file], capsys)
    assert f"export target {a_file / 'hf'} is below the file {a_file}; " in _refused([ckpt, a_file / "hf"], capsys)
    assert a_file.read_bytes() == b"weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "model.bin", "prev"]  # no hidden copies


def test_cli_refuses_the_checkpoint_its_dir_and_the_run_dir(ckpt, capsys):
    run_dir, before = ckpt.parent.parent, _digest(ckpt)
    for target in (ckpt, ckpt.parent):  # `export d/last.ckpt d/last.ckpt`, `export d/last.ckpt d`
        assert (f"export target {target} is or contains the checkpoint being exported ({ckpt}); an export replaces "
                f"its target, which would delete the checkpoint: choose a new or empty dir outside it, e.g. "
                f"<run dir>/hf") in _refused([ckpt, target], capsys)
    assert f"export target {run_dir.parent} is or contains the checkpoint being exported" in \
        _refused([ckpt, run_dir.parent], capsys)
    assert (f"export target {ckpt.parent / 'hf'} is inside the checkpoint dir {ckpt.parent}, which holds the run's "
            f"checkpoints and their temp files only: use {run_dir / 'hf'} (the default)") in \
        _refused([ckpt, ckpt.parent / "hf"], capsys)
    assert _digest(ckpt) == before and sorted(p.name for p in ckpt.parent.iterdir()) == ["last.ckpt"]


def test_export_dir_may_not_be_the_run_dir_an_ancestor_or_the_checkpoint_dir(tmp_path):
    """The probe's `'export.dir=${paths.output_dir}'` deleted config.yaml, .hydra/, train.log and csv/."""
    run_dir = tmp_path / "run"
    for name in ("config.yaml", "train.log", ".hydra/config.yaml", "csv/metrics.csv"):
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(name)
    cfg = compose_config(run_dir, *RUN, "export.dir=${paths.output_dir}")
    with pytest.raises(ValueError) as info:
        build_callbacks(cfg, RunSummary(), loggers=[])
    assert str(info.value) == (
        f"export.dir {run_dir} is or contains the run dir {run_dir}; an export replaces its target, which would "
        f"delete the run's config, logs and checkpoints: use {run_dir / 'hf'} (the default) or another dir that "
        f"holds no run")
    with pytest.raises(ValueError, match=f"^export.dir {tmp_path} is or contains the run dir {run_dir}; "):
        export.HFExport(dirpath=tmp_path, rollout={}, run_dir=run_dir)
    with pytest.raises(ValueError, match=f"^export.dir {run_dir}/checkpoints/hf is inside the checkpoint dir "):
        export.HFExport(dirpath=run_dir / "checkpoints" / "hf", rollout={}, run_dir=run_dir)
    with pytest.raises(ValueError, match=f"^export.dir {run_dir}/csv holds files that are not a topp_rl export "
                                         "\\(metrics.csv\\); "):
        export.HFExport(dirpath=run_dir / "csv", rollout={}, run_dir=run_dir)
    assert export.HFExport(dirpath=run_dir / "hf", rollout={}, run_dir=run_dir).dirpath == run_dir / "hf"
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file()) == \
        [".hydra/config.yaml", "config.yaml", "csv/metrics.csv", "train.log"]


class RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_cli_refuses_a_crafted_checkpoint_without_running_its_code(tmp_path, capsys):
    crafted, marker = tmp_path / "crafted.ckpt", tmp_path / "code_ran"
    torch.save({"state_dict": {}, "topp_rl": RunsCode(marker)}, crafted)
    err = _refused([crafted, tmp_path / "out"], capsys)
    assert f"error: checkpoint {crafted} holds objects torch's safe loader refuses (" in err
    assert "GLOBAL posix.system" in err  # torch's words for the refused global vary between versions
    assert ("loading them could run code, so export reads tensors and plain values only: pass a checkpoint written "
            "by topp_rl's train.py") in err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_full_disk_names_the_path_and_the_space_and_keeps_the_checkpoint_and_the_previous_export(ckpt, tmp_path,
                                                                                                 capsys):
    """A real write failure (a 64 KiB file-size limit; the tiny model's weights are larger)."""
    out, before = tmp_path / "out", _digest(ckpt)
    export.main([str(ckpt), str(out)])
    previous_export = _tree(out)
    needed = sum(t.numel() * t.element_size() for t in load_file(out / "model.safetensors").values())
    assert needed > 1 << 16
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the test process
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, hard))
    try:
        with pytest.raises(SystemExit) as exc:
            export.main([str(ckpt), str(out)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    err = capsys.readouterr().err
    assert exc.value.code == 1
    assert err.startswith(f"python -m topp_rl.export: error: could not write the export {out}: ")
    assert "File too large" in err  # the cause, as the OS put it (EFBIG here; ENOSPC on a full disk)
    assert (f"; its weights need {needed / 2**20:.1f} MiB ({needed} bytes), " in err
            and f" MiB free in {tmp_path}: free space there or export to a larger disk; the checkpoint and the "
                f"previous out, if any, are kept\n" in err)
    assert _digest(ckpt) == before and _tree(out) == previous_export
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


KILLED_MID_WRITE = """
import os, signal, sys
import safetensors.torch
from topp_rl.run import export

save_file = safetensors.torch.save_file
def save_and_die(*args, **kwargs):
    save_file(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)
safetensors.torch.save_file = save_and_die
export.main(sys.argv[1:])
"""


@pytest.mark.subprocess
def test_a_sigkill_mid_export_leaves_a_staged_copy_the_next_export_removes(ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_WRITE, str(ckpt), str(out)], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    (staged,) = tmp_path.iterdir()
    assert staged.name.startswith(".out.") and staged.name.endswith(".tmp") and staged.is_dir()
    assert (staged / "model.safetensors").exists() and not out.exists()
    export.main([str(ckpt), str(out)])
    err = capsys.readouterr().err
    assert f"[topp_rl] removed stale temp dir {staged} (" in err
    assert f" bytes) left by a writer that is gone (pid {staged.name.split('.')[2]})" in err
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert json.loads((out / export.INFO_FILE).read_text())["step"] == 7


def test_a_previous_export_without_a_file_list_is_still_one(tmp_path):
    """Exports written before manifests listed their files: the known export files are theirs."""
    old = tmp_path / "hf"
    old.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", export.INFO_FILE):
        (old / name).write_text("{}")
    assert export.check_target(old) == old
    (old / "config.yaml").write_text("run: 1")
    with pytest.raises(ValueError, match="holds files that are not a topp_rl export \\(config.yaml\\); "):
        export.check_target(old)


def test_a_run_start_removes_the_copies_of_an_export_killed_with_its_run(tmp_path, capfd):
    """`HFExport.on_fit_start` (rank 0): staged / replaced copies of `<run dir>/hf` whose writer is gone."""
    from types import SimpleNamespace

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    run_dir = tmp_path / "run"
    stale, other = run_dir / f".hf.{int(dead.stdout)}.0123abcd.tmp", run_dir / f".hf2.{int(dead.stdout)}.0123abcd.tmp"
    for d in (stale, other):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"partial")
    callback = export.HFExport(dirpath=run_dir / "hf", rollout={}, run_dir=run_dir)
    callback.on_fit_start(SimpleNamespace(is_global_zero=True), None)
    assert (f"[topp_rl] removed stale temp dir {stale} (7 bytes) left by a writer that is gone "
            f"(pid {int(dead.stdout)})") in capfd.readouterr().err
    assert not stale.exists() and other.exists()  # another target's copy is not this export's to remove
