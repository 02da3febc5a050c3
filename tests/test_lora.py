"""LoRA through PEFT (`module.lora`, topp_rl/trainer/lora.py): the adapter gradients equal a dense float64 reference that
trains W + B @ A * alpha / r as a plain weight, with the KL reference being the frozen base; only the adapters
train; the merged weights equal PEFT's `merge_and_unload()`; short runs stay within the on-policy mismatch bound
with the embedded engine sharing the adapted module and with an engine copy synced with merged weights; bad
settings are refused at start, an adapter dir that is, holds or lies in the export dir too (the run and the export
command), and the run's summary and the command name every dir they write."""

import copy
import json

import pytest
import torch
from helpers import column, compose_cfg, read_metrics
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback
from test_module import TEMP, make_samples, pack
from torch import nn
from torch.nn.utils import parametrize

from topp_rl.losses import GRPOLoss
from topp_rl.models import build_char_tokenizer, build_tiny_model
from topp_rl.run import export
from topp_rl.run.export import HFExport
from topp_rl.run.summary import summary_lines
from topp_rl.train import build_run, fit, train
from topp_rl.trainer.backbone import HFBackbone
from topp_rl.trainer.hook import ToppLogProb
from topp_rl.trainer.lora import BASE_RECORD, LoraBackbone, LoraSettings, apply_lora, merged_named_tensors
from topp_rl.trainer.module import PolicyModule
from topp_rl.trainer.timer import PhaseTimer

SETTINGS = LoraSettings(rank=4, alpha=6.0, target_modules=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"))


def _model(dtype=torch.float32):
    return build_tiny_model(vocab_size=96, hidden=32, layers=2, heads=4, kv_heads=2, seed=3,
                            tokenizer=build_char_tokenizer()).to(dtype)


def _randomise_adapters(model: nn.Module, seed: int) -> None:
    """Nonzero A and B (PEFT starts B at zero, where A's gradient is zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)


class _LowRankDelta(nn.Module):
    """weight -> weight + B @ A * scale, with A and B leaf parameters: the dense reference's adapted weight."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        super().__init__()
        self.a, self.b, self.scale = nn.Parameter(a.clone()), nn.Parameter(b.clone()), scale

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + (self.b @ self.a) * self.scale


def _module(backbone, loss, reference=None):
    return PolicyModule(policy=backbone, reference=reference, loss=loss,
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), hook=ToppLogProb(temperature=TEMP))


def _accumulate(module, micro):
    old = [module.onpolicy_pass(mb)[0] for mb in micro]
    module.accumulate_gradients(micro, module.reference_pass(micro), old=old, timer=PhaseTimer())


def test_adapter_gradients_equal_the_dense_merged_weight_reference_with_the_base_as_kl_reference():
    """float64: PEFT's adapted model under PolicyModule (KL reference = its own base, adapters off) against a
    plain model whose adapted weights are parametrized as W + B @ A * alpha / r, with a frozen copy of the base as
    the KL reference. The gradients of every A and B agree to float64 rounding."""
    base = _model(torch.float64)
    dense = copy.deepcopy(base).requires_grad_(False)
    peft_model = apply_lora(base, SETTINGS)
    _randomise_adapters(base, seed=1)
    backbone = LoraBackbone(peft_model, settings=SETTINGS)
    loss = GRPOLoss(kl_coef=0.5)
    module = _module(backbone, loss)
    assert backbone.has_frozen_base and module.reference is None  # no second copy of the model
    trainable = {n for n, p in backbone.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    optimizer = module.configure_optimizers()["optimizer"]
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {
        id(p) for p in backbone.parameters() if p.requires_grad}

    deltas = {}
    for path, layer in ((n, m) for n, m in peft_model.get_base_model().named_modules() if hasattr(m, "lora_A")):
        a, b = layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach()
        deltas[path] = _LowRankDelta(a, b, SETTINGS.lora_alpha / SETTINGS.rank)
        parametrize.register_parametrization(dense.get_submodule(path), "weight", deltas[path])
    assert len(deltas) == 2 * 5  # 2 layers x 5 targets
    reference = HFBackbone(copy.deepcopy(base_without_adapters(peft_model)))
    dense_module = _module(HFBackbone(dense), loss, reference=reference)

    samples = make_samples(dense)
    micro = [pack(samples, idx, advantages=torch.linspace(-1.0, 1.5, 6)) for idx in ([0, 1, 2], [3, 4, 5])]
    _accumulate(module, micro)
    _accumulate(dense_module, micro)
    # The KL term is live: the adapted policy differs from its base, so the reference log-probs differ too.
    ref_lora, ref_dense = module.reference_pass(micro)[0], dense_module.reference_pass(micro)[0]
    torch.testing.assert_close(ref_lora, ref_dense, rtol=1e-12, atol=1e-12)
    assert float((ref_lora - module.onpolicy_pass(micro[0])[0]).abs().max()) > 1e-3
    for path, delta in deltas.items():
        layer = peft_model.get_base_model().get_submodule(path)
        got_a, got_b = layer.lora_A["default"].weight.grad, layer.lora_B["default"].weight.grad
        assert float(delta.a.grad.abs().max()) > 1e-6 and float(delta.b.grad.abs().max()) > 1e-6, path
        torch.testing.assert_close(got_a, delta.a.grad, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(got_b, delta.b.grad, rtol=1e-9, atol=1e-12)
    assert all(p.grad is None for n, p in backbone.named_parameters() if n not in trainable)


def base_without_adapters(peft_model):
    """A plain copy of the base model (PEFT's own unload on a copy: the adapters dropped, not merged)."""
    return copy.deepcopy(peft_model).unload()


def test_merged_tensors_equal_peft_merge_and_unload_under_the_plain_hf_names():
    base = _model()
    plain_names = [n for n, _ in base.named_parameters()]
    peft_model = apply_lora(base, SETTINGS)
    _randomise_adapters(base, seed=2)
    merged = dict(merged_named_tensors(peft_model.get_base_model()))
    reference = dict(copy.deepcopy(peft_model).merge_and_unload().named_parameters())
    assert list(merged) == plain_names == list(reference)
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-7, msg=name)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert float((merged[q] - base.get_submodule("model.layers.0.self_attn.q_proj").base_layer.weight)
                 .abs().max()) > 1e-3  # the adapter is in it
    backbone = LoraBackbone(peft_model, settings=SETTINGS)
    assert [n for n, _ in backbone.hf_named_tensors()] == plain_names


class _EngineAtEnd(Callback):
    """Keeps the rollout engine seen at train end (the run closes and drops it afterwards)."""

    def on_train_end(self, trainer, pl_module) -> None:
        self.engine = trainer.datamodule.engine


def _run(tmp_path, *overrides):
    run = build_run(compose_cfg(tmp_path, "logger=csv", "module.lora.rank=4", "optimizer.lr=0.01",
                                "rollout.prompts_per_step=4", "rollout.n_samples=4", *overrides))
    seen = _EngineAtEnd()
    run.trainer.callbacks.append(seen)
    fit(run)
    return run, seen.engine


@pytest.mark.parametrize("engine", ["shared", "copy"])
def test_lora_run_stays_on_policy_and_trains_only_the_adapters(tmp_path, engine):
    """The embedded engine sharing the adapted module, or keeping its own plain copy synced with the merged
    weights: the masked on-policy mismatch stays at float32 rounding; the base weights never move; KL on."""
    extra = ("rollout.engine.share_weights=false",) if engine == "copy" else ()
    run, engine_obj = _run(tmp_path, "algo.loss.kl_coef=0.1", *extra)
    rows = read_metrics(tmp_path)
    assert max(column(rows, "train/rollout_logprob_abs_diff_max")) <= 1e-5
    assert min(column(rows, "train/rollout_logprob_abs_diff_unmasked")) > 1e-3
    assert max(column(rows, "train/grad_norm")) > 0
    kl = column(rows, "train/kl_ref")
    assert len(kl) == 2 and kl[0] == pytest.approx(0.0, abs=1e-9) and kl[1] > 0  # step 1: adapters moved
    module = run.module
    initial, _ = instantiate(run.cfg.model)
    for name, tensor in initial.float().named_parameters():  # the frozen base, bit for bit
        path, _, leaf = name.rpartition(".")
        held = module.policy.model.get_submodule(path)
        held = held.base_layer if hasattr(held, "base_layer") else held
        assert torch.equal(getattr(held, leaf), tensor), name
    assert module.reference is None and isinstance(module.policy, LoraBackbone)
    assert not any(k.startswith("reference.") for k in module.state_dict())
    opt = run.trainer.optimizers[0]
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {
        id(p) for n, p in module.policy.named_parameters() if ".lora_" in n}
    if engine == "copy":  # the engine's plain model holds the merged weights of the last sync
        state = engine_obj.model.state_dict()
        for name, tensor in module.hf_named_tensors():
            torch.testing.assert_close(state[name], tensor, rtol=0, atol=0, msg=name)
        assert min(column(rows, "perf/weight_sync_bytes")) > 0
    else:
        assert engine_obj.model is module.policy.model


def test_bad_lora_settings_are_refused_at_start_naming_the_key(tmp_path):
    cases = [
        (("module.lora.rank=4", "module.lora.dropout=0.1"), "module.lora.dropout=0.1: must be 0"),
        (("module.lora.rank=-1",), "module.lora.rank=-1: must be an integer >= 0"),
        (("module.lora.rank=4", "module.lora.alpha=0"), "module.lora.alpha=0: must be > 0"),
        (("module.lora.rank=4", "module.lora.target_modules=[q_proj,qkv]"), r"names \['qkv'\]"),
        (("module.lora.rank=4", "+module.lora.bias=all"), "module.lora.bias: not a LoRA setting"),
        (("module.lora.rank=4", "parallel=tp2"), "MegatronStrategy.*use parallel=none"),
    ]
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message):
            build_run(compose_cfg(tmp_path, "logger=none", *overrides))


def test_a_rank_above_the_adapted_layers_dimensions_is_refused_at_start(tmp_path):
    """rank 100000 on the 64-wide tiny model trained 230x slower without a word (issue 35): B @ A cannot exceed
    the smaller side of a layer, so the rank is refused before the engine or trainer is built."""
    with pytest.raises(ValueError) as info:
        build_run(compose_cfg(tmp_path, "logger=none", "module.lora.rank=1000"))
    assert str(info.value) == (
        "module.lora.rank=1000: must be <= 32, the smallest dimension of the adapted layers "
        "(model.layers.0.self_attn.k_proj: 64 -> 32); a larger rank adds no capacity (B @ A has rank <= 32 there), "
        "only compute and memory. Set module.lora.rank=32 or less (e.g. 16), or drop the narrow layers from "
        "module.lora.target_modules"
    )
    from topp_rl.trainer.lora import check_lora_rank

    model = build_tiny_model(hidden=64, layers=1, heads=4, kv_heads=2)
    check_lora_rank(model, LoraSettings(rank=32))  # full rank on k_proj / v_proj: allowed
    check_lora_rank(model, LoraSettings(rank=64, target_modules=("q_proj", "o_proj")))  # 64 -> 64 layers only


def test_the_config_comment_says_lora_composes_with_fsdp_and_is_refused_with_megatron(tmp_path):
    """conf/config.yaml said LoRA was "Refused with parallel strategies (Megatron, FSDP)"; FSDP composes
    (FSDPLoraBackbone), so the comment says what check_lora_config does."""
    from helpers import ROOT

    from topp_rl.trainer.lora import check_lora_config

    text = (ROOT / "conf" / "config.yaml").read_text()
    comment = text[text.index("  # LoRA adapters through PEFT"):text.index("  lora:\n")]
    assert "Composes with parallel=fsdp" in comment and "refused with the Megatron layouts" in comment
    assert "FSDP)" not in comment
    assert check_lora_config(compose_cfg(tmp_path, "parallel=fsdp", "module.lora.rank=4")).rank == 4
    with pytest.raises(ValueError, match="MegatronStrategy"):
        check_lora_config(compose_cfg(tmp_path, "parallel=tp2", "module.lora.rank=4"))


def _adapters(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.policy.named_parameters() if ".lora_" in n}


@pytest.mark.slow
def test_checkpoint_holds_adapters_and_their_optimizer_state_and_resumes_exactly(tmp_path):
    """2 steps + resume for 2 more from last.ckpt equals 4 uninterrupted steps: the same losses, rewards and
    final adapter weights, bit for bit. The checkpoint holds the adapters and their optimizer state only, with the
    base's digest: a resume onto another base (here another seed) is refused."""
    common = ("module.lora.rank=4", "optimizer.lr=0.01", "rollout.prompts_per_step=4", "rollout.n_samples=4",
              "logger=csv", "export.hf=false", "algo.loss.kl_coef=0.1")
    whole = build_run(compose_cfg(tmp_path / "whole", *common, "trainer.max_steps=4"))
    fit(whole)
    first = build_run(compose_cfg(tmp_path / "split", *common, "checkpoint.every_n_steps=2"))
    fit(first)
    ckpt = torch.load(tmp_path / "split" / "checkpoints" / "last.ckpt", weights_only=False)
    lora_keys = [k for k in ckpt["state_dict"] if ".lora_" in k]
    assert len(lora_keys) == 2 * 2 * 7  # 2 layers x 7 target layers x (A, B)
    assert sorted(ckpt["state_dict"]) == sorted(lora_keys)  # the frozen base is left out, its digest kept
    assert len(ckpt[BASE_RECORD]["digest"]) == 32
    with pytest.raises(ValueError, match="trained on a base model whose weights differ from the run's model"):
        other = build_run(compose_cfg(tmp_path / "split", *common, "trainer.max_steps=4", "ckpt_path=last",
                                      "model.seed=7", "resume.allow_config_change=true"))
        fit(other)
    (opt,) = ckpt["optimizer_states"]
    assert len(opt["state"]) == len(lora_keys) and all(s["exp_avg"].abs().max() > 0 for s in opt["state"].values())
    resumed = build_run(compose_cfg(tmp_path / "split", *common, "trainer.max_steps=4", "ckpt_path=last"))
    fit(resumed)
    for key in ("train/loss", "rollout/reward_mean", "train/kl_ref", "train/grad_norm"):
        want = column(read_metrics(tmp_path / "whole"), key)
        got = column(_all_rows(tmp_path / "split"), key)
        assert got == want, key
    after, want = _adapters(resumed.module), _adapters(whole.module)
    assert after.keys() == want.keys() and all(torch.equal(after[k], want[k]) for k in want)


def _all_rows(run_dir):
    """metrics.csv rows of every fit in a run dir (a resumed fit writes its own csv version dir)."""
    import csv

    rows = []
    for path in sorted(run_dir.glob("csv/*/metrics.csv")):
        with path.open() as f:
            rows += list(csv.DictReader(f))
    return rows


def _logprobs(model, sequences) -> torch.Tensor:
    out = []
    with torch.no_grad():
        for prompt, response in sequences:
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
            out.append(torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(response)[:, None])[:, 0])
    return torch.cat(out)


def test_export_writes_the_merged_model_and_a_peft_adapter_dir_and_the_cli_matches(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from topp_rl.run import export

    run, _ = _run(tmp_path / "run", "checkpoint.every_n_steps=2")
    sequences = [([5, 6, 7], [8, 9, 10, 2]), ([12, 3], [40, 41])]
    trained = _logprobs(run.module.policy.model.eval(), sequences)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf", local_files_only=True).eval()
    torch.testing.assert_close(_logprobs(merged, sequences), trained, rtol=0, atol=1e-5)
    written = load_file(tmp_path / "run" / "hf" / "model.safetensors")
    expected = dict(run.module.hf_named_tensors())
    assert written.keys() == expected.keys() and all(torch.equal(written[k], expected[k]) for k in expected)

    base, _ = instantiate(run.cfg.model)
    initial = _logprobs(base.float().eval(), sequences)
    assert float((initial - trained).abs().max()) > 1e-4  # the adapters changed the policy
    adapted = PeftModel.from_pretrained(base, tmp_path / "run" / "hf_adapter").eval()  # injects into `base`
    torch.testing.assert_close(_logprobs(adapted, sequences), trained, rtol=0, atol=1e-5)
    with adapted.disable_adapter():
        torch.testing.assert_close(_logprobs(adapted, sequences), initial, rtol=0, atol=0)

    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    export.main([str(ckpt), str(tmp_path / "cli")])
    cli = load_file(tmp_path / "cli" / "model.safetensors")
    assert cli.keys() == written.keys() and all(torch.equal(cli[k], written[k]) for k in written)
    assert load_file(tmp_path / "cli_adapter" / "adapter_model.safetensors").keys() == load_file(
        tmp_path / "run" / "hf_adapter" / "adapter_model.safetensors").keys()
    export.main([str(ckpt), str(tmp_path / "only"), "--no-merge-lora"])
    assert (tmp_path / "only_adapter" / "adapter_config.json").is_file() and not (tmp_path / "only").exists()


# ----- issue 35: an adapter dir equal to (or nested with) the export dir dropped the adapters without a word -----
def _apart_message(adapter_name: str, adapter_dir, where: str, model_name: str, model_dir, fix: str) -> str:
    return (f"{adapter_name} {adapter_dir} {where} {model_name} {model_dir}: a LoRA export writes the adapters and "
            "the merged model, each replacing its whole dir, and adapter files beside a merged model make "
            f"transformers apply the adapters twice, so the two dirs must be apart; {fix}")


RUN_FIX = ("drop the export.adapter_dir override (the default is ${export.dir}_adapter) or name a dir apart from "
           "export.dir, or set export.merge_lora=false to write the adapters only")


@pytest.mark.parametrize(("overrides", "adapter_dir", "where", "model_dir"), [
    (("export.adapter_dir=${export.dir}",), "hf", "is", "hf"),
    (("export.adapter_dir=${export.dir}/adapter",), "hf/adapter", "is inside", "hf"),
    (("export.adapter_dir=${paths.output_dir}/out", "export.dir=${paths.output_dir}/out/merged"), "out", "contains",
     "out/merged"),
], ids=["equal", "inside", "contains"])
def test_an_adapter_dir_that_is_holds_or_lies_in_the_export_dir_is_refused_at_start(tmp_path, overrides, adapter_dir,
                                                                                     where, model_dir):
    """The merged model's write replaced the adapter dir it equals (exit 0, no adapter_config.json); nested dirs
    failed at the first export, after the steps before it. Adapters alone may go to export.dir."""
    with pytest.raises(ValueError) as info:
        build_run(compose_cfg(tmp_path, "logger=none", "module.lora.rank=4", *overrides))
    assert str(info.value) == _apart_message("export.adapter_dir", tmp_path / adapter_dir, where, "export.dir",
                                             tmp_path / model_dir, RUN_FIX)
    assert list(tmp_path.iterdir()) == []  # refused before anything was written
    run = build_run(compose_cfg(tmp_path, "logger=none", "module.lora.rank=4", "export.merge_lora=false",
                                *overrides))
    (export_callback,) = [c for c in run.trainer.callbacks if isinstance(c, HFExport)]
    assert (export_callback.adapter_dir, export_callback.dirpath) == (tmp_path / adapter_dir, tmp_path / model_dir)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A 2-step LoRA run through `train` (run dir, summary), its last.ckpt at step 2: (run dir, summary)."""
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    summary = train(compose_cfg(run_dir, "logger=none", "module.lora.rank=4", "checkpoint.every_n_steps=2"))
    return run_dir, summary


def test_a_lora_runs_summary_names_the_merged_model_and_the_adapter_dir(lora_run):
    run_dir, summary = lora_run
    assert {k: summary[k] for k in ("hf_export", "hf_export_step", "adapter_export", "adapter_export_step")} == {
        "hf_export": str(run_dir / "hf"), "hf_export_step": 2,
        "adapter_export": str(run_dir / "hf_adapter"), "adapter_export_step": 2}
    assert json.loads((run_dir / "summary.json").read_text())["adapter_export"] == str(run_dir / "hf_adapter")
    lines = summary_lines(summary, str(run_dir))
    assert f"  HF checkpoint: {run_dir / 'hf'} (step 2; loads with transformers' from_pretrained)" in lines
    assert (f"  LoRA adapters: {run_dir / 'hf_adapter'} (step 2; PEFT's format: PeftModel.from_pretrained(base "
            "model, dir))") in lines


def test_an_adapters_only_run_in_the_export_dir_names_that_dir_as_the_adapters_only(tmp_path):
    """export.merge_lora=false with export.adapter_dir=${export.dir}: the adapters go to hf/, and the summary
    names hf/ as what it holds (it said `HF checkpoint: hf/ ... loads with from_pretrained`, of adapter files)."""
    summary = train(compose_cfg(tmp_path, "logger=none", "module.lora.rank=4", "export.merge_lora=false",
                                "export.adapter_dir=${export.dir}"))
    assert "hf_export" not in summary
    assert (summary["adapter_export"], summary["adapter_export_step"]) == (str(tmp_path / "hf"), 2)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "topp_rl_export.json"]
    lines = summary_lines(summary, str(tmp_path))
    assert not any(line.startswith("  HF checkpoint:") for line in lines)
    adapters = f"  LoRA adapters: {tmp_path / 'hf'} (step 2; PEFT's format: PeftModel.from_pretrained(base model, dir))"
    assert adapters in lines


def _cli_refusal(argv: list, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        export.main([str(a) for a in argv])
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(("adapter_dir", "where"), [("out", "is"), ("out/adapter", "is inside"), (".", "contains")],
                         ids=["equal", "inside", "contains"])
def test_the_export_command_refuses_an_adapter_dir_that_is_holds_or_lies_in_its_target(lora_run, tmp_path, capsys,
                                                                                       adapter_dir, where):
    """`--adapter-dir OUT` exited 0 with OUT holding the merged model only: refused before the checkpoint is read.
    The adapters alone (`--no-merge-lora`) may go there."""
    ckpt, out, adapter_dir = lora_run[0] / "checkpoints" / "last.ckpt", tmp_path / "out", tmp_path / adapter_dir
    fix = (f"drop --adapter-dir (the default is {tmp_path / 'out_adapter'}) or pass a dir apart from {out}, or add "
           "--no-merge-lora to write the adapters only")
    err = _cli_refusal([ckpt, out, "--adapter-dir", adapter_dir], capsys)
    message = _apart_message("--adapter-dir", adapter_dir, where, "the export target", out, fix)
    assert err.endswith(f"error: {message}\n")
    assert list(tmp_path.iterdir()) == []
    export.main([str(ckpt), str(out), "--adapter-dir", str(adapter_dir), "--no-merge-lora"])
    assert sorted(p.name for p in adapter_dir.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "topp_rl_export.json"]


def test_the_export_command_names_every_dir_it_writes(lora_run, tmp_path, capsys):
    ckpt = lora_run[0] / "checkpoints" / "last.ckpt"
    export.main([str(ckpt), str(tmp_path / "out")])
    assert capsys.readouterr().out == (
        f"[topp_rl] exported checkpoint {ckpt.resolve()} (global step 2) to {tmp_path / 'out'} (the merged model) "
        f"and {tmp_path / 'out_adapter'} (the LoRA adapters, PEFT's format)\n")
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert (tmp_path / "out_adapter" / "adapter_model.safetensors").is_file()
    export.main([str(ckpt), str(tmp_path / "only"), "--no-merge-lora"])
    assert capsys.readouterr().out == (f"[topp_rl] exported checkpoint {ckpt.resolve()} (global step 2) to "
                                       f"{tmp_path / 'only_adapter'} (the LoRA adapters, PEFT's format)\n")


@pytest.mark.sglang
@pytest.mark.slow
def test_sglang_server_samples_with_the_merged_weights_within_the_bound(tmp_path, tiny_sglang_url):
    """rollout=sglang with LoRA: the server (started without LoRA) gets the merged weights each step, so its
    sampled log-probs match the adapted policy's to the float32 server bound, at every step."""
    run, _ = _run(tmp_path, "rollout=sglang", f"rollout.engine.urls=['{tiny_sglang_url}']", "trainer.max_steps=3")
    rows = read_metrics(tmp_path)
    assert max(column(rows, "train/rollout_logprob_abs_diff_max")) <= 1e-4
    assert len(column(rows, "perf/weight_sync_bytes")) == 3
    # The pushes are the plain model's tensors: the merged weights, never the adapters' own.
    plain = sum(t.numel() * t.element_size() for _, t in run.module.hf_named_tensors())
    assert column(rows, "perf/weight_sync_bytes") == [float(plain)] * 3
