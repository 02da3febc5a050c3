"""HF export: a short run writes `<run dir>/hf/`, which transformers loads with the trained policy's log-probs;
`python -m topp_rl.export` on the run's last.ckpt writes the same weights; the generation config holds the
rollout's sampling settings."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from topp_rl import export
from topp_rl.models import build_char_tokenizer, load_hf
from topp_rl.rollout.packing import pack_samples
from topp_rl.rollout.sample import Sample
from topp_rl.train import build_run, fit

ROOT = Path(__file__).resolve().parents[1]
RUN = [
    "trainer.max_steps=2", "rollout.prompts_per_step=2", "rollout.n_samples=2", "rollout.max_new_tokens=4",
    "trainer.enable_progress_bar=false", "logger=none", "checkpoint.every_n_steps=1",
    "rollout.top_p=0.9", "rollout.top_k=20", "rollout.min_p=0.01", "rollout.temperature=0.8",
]
SEQUENCES = [([5, 6, 7], [8, 9, 10, 2]), ([12, 3], [40, 41]), ([1, 20, 21, 22, 23], [30])]


def _run(output_dir: Path):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"paths.output_dir={output_dir}", *RUN])
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
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"paths.output_dir={tmp}", *RUN, "trainer.max_steps=1", "parallel=tp2"])
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
