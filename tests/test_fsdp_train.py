"""`train.py`'s run under `parallel=fsdp` (FSDP2 over the HF backbone) on gloo, against the single-rank run of the
same global batch, step for step.

Each data-parallel rank samples its own share of the prompts with its own seed, so an FSDP run and a one-rank run
draw different samples. The reference therefore replays the FSDP run's samples: a one-rank `HFBackbone` run whose
engine returns, at every step, the samples all FSDP ranks drew (rank order = the global prompt order). It scores,
numbers, packs and trains on them as one batch; its loss, grad norm, reward and masked mismatch (its own
on-policy log-probs against the FSDP engine's recorded ones, which sampled with the FSDP weights) must equal the FSDP
run's within 1e-5 at every step. Cases (one spawn per world size, every case inside it):
- tiny Qwen2 at world 2 and 4 (micro-batches of about 2 samples: several micro-batches, one reduce-scatter per step),
  the embedded engine sharing the sharded module (gathered around each generate);
- tiny Qwen2 at world 2 with the engine's own full copy (`share_weights=false`), synced from gathered weights;
- tiny Qwen2 at world 2 with LoRA (`module.lora.rank=4`, KL against the sharded base): against the one-rank LoRA run
  (KL too), its merged `hf/` export against the one-rank run's; a 2-step run's sharded checkpoint resumes to the
  uninterrupted run's step 3 and exports (merged model and adapter dir) to what the run itself exported;
- tiny Qwen3-MoE at world 2 and 4;
- checkpoints: world 2 stops after step 2 (sharded: each rank's shards of the weights and AdamW state) and resumes
  for step 3, equal to the uninterrupted world-2 run's step 3; world 4 resumes the same checkpoint (resharded);
  the export command assembles the shards into the weights the run exported at step 2.
Gradient checkpointing (a tiny 2-rank spawn of `FSDPBackbone` alone, dense and MoE): one backward with HF's layer
recompute gives the gradients of one without it, bit for bit; and the bf16-mixed GPU policy's dtypes on gloo.
And `rollout=sglang` at world 2: both data-parallel ranks sample from one real SGLang server (float32), which gets the
weights gathered from the shards after every step; the trainer's masked log-probs equal the server's within 1e-4.
And `data.refill=true` at world 2, where a refill round has one rank generating and the other not (the engine's
`generate` on the sharded module is a collective): the run completes and every step's group counts add up.
"""

import copy
import csv
import os
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from lightning.pytorch.callbacks import Callback

from topp_rl.engines.base import RolloutEngine

TINY = [
    "trainer.max_steps=3", "rollout.prompts_per_step=4", "rollout.n_samples=4", "rollout.max_new_tokens=6",
    "checkpoint.every_n_steps=0", "trainer.enable_progress_bar=false", "rollout.top_p=0.9", "logger=csv",
    "data.max_tokens_per_micro_batch=20",
]
PRELOAD = ("topp_rl.train", "topp_rl.fsdp", "hydra")
KEYS = ("train/loss", "train/grad_norm", "rollout/reward_mean", "train/rollout_logprob_abs_diff_max",
        "train/rollout_logprob_abs_diff", "rollout/num_micro_batches", "train/rollout_logprob_abs_diff_unmasked",
        "rollout/aborted_frac", "perf/weight_sync_bytes", "train/kl_ref")
EXACT = ("train/loss", "train/grad_norm", "rollout/reward_mean", "train/rollout_logprob_abs_diff")
MOE = ("model.family=qwen3_moe",)
COPY = ("rollout.engine.share_weights=false",)
LORA = ("module.lora.rank=4", "algo.loss.kl_coef=0.1", "optimizer.lr=0.01")  # KL: the sharded base as reference


def _metrics(output_dir: Path) -> dict[str, list[float]]:
    (path,) = output_dir.glob("csv/*/metrics.csv")
    with path.open() as f:
        rows = list(csv.DictReader(f))
    return {k: [float(r[k]) for r in rows if r.get(k)] for k in KEYS}


class Samples(Callback):
    """Keeps every step's samples of this rank; with `path`, also writes them to `<path>/samples-rank<r>.pt` at the
    end (a torchrun run: `+callbacks.samples._target_=test_fsdp_train.Samples`, tests/ on PYTHONPATH)."""

    def __init__(self, path: str | None = None):
        self.steps, self.path = [], path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append(copy.deepcopy(outputs["rollout"].samples))

    def on_train_end(self, trainer, pl_module):
        if self.path is not None:
            torch.save(self.steps, Path(self.path) / f"samples-rank{trainer.global_rank}.pt")


def _run(output_dir: Path, *extra: str, ckpt_path: Path | None = None, engine: RolloutEngine | None = None):
    from helpers import compose_config

    from topp_rl.train import build_run

    cfg = compose_config(output_dir, *TINY, *extra)
    run = build_run(cfg)
    if engine is not None:
        run.datamodule.engine = engine
    samples = Samples()
    run.trainer.callbacks.insert(0, samples)
    try:
        run.trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=ckpt_path)
    finally:
        run.datamodule.close_engine()
    return (_metrics(output_dir) if run.trainer.is_global_zero else {}), samples.steps


def _worker(rank: int, tmp: str, world: int) -> dict:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # the group is up: Lightning only reads ranks
    fsdp = ("parallel=fsdp", f"trainer.devices={world}")
    out = {"qwen2": _run(Path(tmp) / f"w{world}_qwen2", *fsdp), "moe": _run(Path(tmp) / f"w{world}_moe", *fsdp, *MOE)}
    if world == 2:
        out["copy"] = _run(Path(tmp) / "w2_copy", *fsdp, *COPY)
        out["lora"] = _run(Path(tmp) / "w2_lora", *fsdp, *LORA)
        _run(Path(tmp) / "lora_part", *fsdp, *LORA, "trainer.max_steps=2", "checkpoint.every_n_steps=1")
        out["lora_resumed"] = _run(Path(tmp) / "lora_resumed", *fsdp, *LORA,
                                   ckpt_path=Path(tmp) / "lora_part/checkpoints/last.ckpt")
        _run(Path(tmp) / "part", *fsdp, "trainer.max_steps=2", "checkpoint.every_n_steps=1")
        out["resumed"] = _run(Path(tmp) / "resumed", *fsdp, ckpt_path=Path(tmp) / "part/checkpoints/last.ckpt")
    else:  # world 2's checkpoint on 4 ranks: other prompts per rank, so no step to compare; it must load and agree
        out["resumed"] = _run(Path(tmp) / "resumed4", *fsdp, ckpt_path=Path(tmp) / "part/checkpoints/last.ckpt")
    return out


class ReplayEngine(RolloutEngine):
    """Returns, step after step, the samples the FSDP ranks drew (fresh copies; the datamodule numbers and scores
    them again)."""

    def __init__(self, steps: list[list], vocab_size: int) -> None:
        self.steps, self.vocab_size, self.calls = steps, vocab_size, 0

    def generate(self, prompts, params, *, seed=None):
        samples = copy.deepcopy(self.steps[self.calls])
        self.calls += 1
        assert [s.prompt_ids for s in samples[:: params.n]] == prompts, "replayed prompts differ"
        return samples

    def update_weights(self, named_tensors) -> None:
        pass

    def close(self) -> None:
        pass


def _check_against_replay(tmp_path: Path, results: list[dict], case: str, extra: tuple[str, ...], tag: str,
                          keys: tuple[str, ...] = EXACT):
    steps = [sum((r[case][1][step] for r in results), []) for step in range(3)]
    ref, _ = _run(tmp_path / f"ref_{tag}", *extra, engine=ReplayEngine(steps, vocab_size=0))
    got = results[0][case][0]
    assert len(got["train/loss"]) == 3, tag
    assert max(got["rollout/num_micro_batches"]) > 1, tag  # gradient accumulation over micro-batches is exercised
    assert max(got["train/rollout_logprob_abs_diff_max"]) <= 1e-5, tag  # the FSDP engine and trainer agree
    for key in keys:
        diff = max(abs(a - b) for a, b in zip(got[key], ref[key], strict=True))
        assert diff <= 1e-5, (tag, key, got[key], ref[key])
    return got


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_train_equals_one_rank_on_the_same_batches(tmp_path):
    for world in (2, 4):
        results = run_distributed(_worker, world, str(tmp_path), world, timeout=600, preload=PRELOAD)
        _check_against_replay(tmp_path, results, "qwen2", (), f"qwen2_w{world}")
        _check_against_replay(tmp_path, results, "moe", MOE, f"moe_w{world}")
        resumed = results[0]["resumed"][0]
        assert len(resumed["train/loss"]) == 1, "the resumed run trains only the 3rd step"
        assert resumed["train/rollout_logprob_abs_diff_max"][0] <= 1e-5
        if world == 2:
            _check_against_replay(tmp_path, results, "copy", COPY, "copy_w2")
            full = results[0]["qwen2"][0]
            for key in EXACT:  # same world size: the same samples, so the uninterrupted run's step 3
                assert abs(resumed[key][0] - full[key][-1]) <= 1e-5, key
            _check_export_of_the_sharded_checkpoint(tmp_path / "part")
            _check_lora(tmp_path, results)


def _check_lora(tmp_path: Path, results: list[dict]) -> None:
    """`parallel=fsdp module.lora.rank=4`: the one-rank LoRA run's figures on the same samples (KL against the sharded
    base, adapters off, included) and its merged export; the sharded checkpoint (base shards, adapters, their AdamW
    state) resumes to the uninterrupted run's step 3 and exports to the merged model and adapter dir the run wrote
    from its live shards."""
    from safetensors.torch import load_file

    keys = (*EXACT, "train/kl_ref")
    got = _check_against_replay(tmp_path, results, "lora", LORA, "lora_w2", keys=keys)
    assert len(got["train/kl_ref"]) == 3 and got["train/kl_ref"][-1] > 0  # the adapters moved off the base
    merged, one_rank = (load_file(tmp_path / d / "hf" / "model.safetensors") for d in ("w2_lora", "ref_lora_w2"))
    assert merged.keys() == one_rank.keys() and not any(".lora_" in k or "base_layer" in k for k in merged)
    for name, tensor in one_rank.items():  # the gathered, merged weights: W + B @ A * alpha / r, as on one rank
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-5, msg=name)
    resumed = results[0]["lora_resumed"][0]
    assert len(resumed["train/loss"]) == 1, "the resumed run trains only the 3rd step"
    for key in keys:
        assert abs(resumed[key][0] - got[key][-1]) <= 1e-5, key
    _check_export_of_the_sharded_checkpoint(tmp_path / "lora_part", adapter=True)


def _check_export_of_the_sharded_checkpoint(run_dir: Path, *, adapter: bool = False) -> None:
    """`python -m topp_rl.export` on the sharded last.ckpt (one process assembling both ranks' shards) writes the
    weights the run itself exported at that step (gathered from the live shards); LoRA: merged, and the adapters."""
    from safetensors.torch import load_file

    from topp_rl.run.export import export_checkpoint

    last = run_dir / "checkpoints" / "last.ckpt"
    assert last.is_symlink() and (last / "meta.pt").is_file() and len(list(last.glob("*.distcp"))) == 2
    out = export_checkpoint(last, run_dir / "exported")
    got, want = load_file(out / "model.safetensors"), load_file(run_dir / "hf" / "model.safetensors")
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    if adapter:  # a LoRA run: the adapter dirs (PEFT's format) beside the merged exports agree too
        got = load_file(run_dir / "exported_adapter" / "adapter_model.safetensors")
        want = load_file(run_dir / "hf_adapter" / "adapter_model.safetensors")
        assert got.keys() == want.keys() and len(got) > 0
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), name


def _sglang_worker(rank: int, tmp: str, url: str) -> dict:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    # Both ranks connect to the module's one server (each pushes the gathered weights, at start and after every step).
    metrics, _ = _run(Path(tmp) / "sglang", "parallel=fsdp", "trainer.devices=2", "rollout=sglang",
                      f"rollout.engine.urls=['{url}']", "export.hf=false")
    return metrics


@pytest.mark.distributed
@pytest.mark.sglang
@pytest.mark.slow
def test_fsdp_with_sglang_rollouts(tmp_path, tiny_sglang_url):
    got = run_distributed(_sglang_worker, 2, str(tmp_path), tiny_sglang_url, timeout=600, preload=PRELOAD)[0]
    assert len(got["train/loss"]) == 3
    assert got["rollout/aborted_frac"] == [0.0] * 3  # one rank's weight push never aborts the other's rollout
    assert min(got["perf/weight_sync_bytes"]) > 0  # every step's full weights reached the server
    # The server (float32) and the FSDP trainer agree over the server's candidate sets, at every step.
    assert max(got["train/rollout_logprob_abs_diff_max"]) <= 1e-4, got["train/rollout_logprob_abs_diff_max"]
    assert min(got["train/rollout_logprob_abs_diff_unmasked"]) > 1e-3  # the sets came from the server


def _checkpointing_worker(rank: int) -> dict:
    """Per family: the full gradients of one backward through `FSDPBackbone` (this rank's own micro-batch), without
    and with the HF layer recompute; and how often layer 0 ran in the recompute's backward."""
    from test_module import make_samples, pack
    from torch.distributed.device_mesh import init_device_mesh

    from topp_rl.fsdp.backbone import FSDPBackbone
    from topp_rl.fsdp.strategy import mixed_precision_policy
    from topp_rl.models import build_char_tokenizer, build_tiny_model
    from topp_rl.parallel.dtensor import full_tensor
    from topp_rl.trainer.backbone import HFBackbone

    mesh = init_device_mesh("cpu", (2,))
    out = {}
    for family in ("qwen2", "qwen3_moe"):
        model = build_tiny_model(family, vocab_size=96, hidden=32, layers=2, heads=4, kv_heads=2, seed=3,
                                 tokenizer=build_char_tokenizer())
        samples = make_samples(model)
        batch = pack(samples, [2 * rank, 2 * rank + 1, 4 + rank], advantages=torch.zeros(6))
        for checkpointing in (False, True):
            fsdp = FSDPBackbone(HFBackbone(copy.deepcopy(model), gradient_checkpointing=checkpointing), mesh=mesh)
            calls = []
            fsdp.model.model.layers[0].input_layernorm.register_forward_hook(lambda *_, c=calls: c.append(1))
            hidden, weight = fsdp.forward_hidden(batch)
            logp = torch.log_softmax(hidden @ weight.T, dim=-1)
            logp[torch.arange(len(batch.tokens) - 1), batch.tokens[1:]].sum().backward()
            grads = {name: full_tensor(p.grad).clone() for name, p in fsdp.model.named_parameters()}
            out[family, checkpointing] = grads, len(calls)
    # The bf16-mixed GPU policy, here on gloo: bf16 gathers (the root's output weight reaches the head in bf16),
    # float32 shards and float32 sharded gradients.
    policy = mixed_precision_policy("bf16-mixed", "cuda")
    fsdp = FSDPBackbone(HFBackbone(copy.deepcopy(model)), mesh=mesh, mp_policy=policy)
    hidden, weight = fsdp.forward_hidden(batch)
    hidden.float().sum().backward()
    out["mixed"] = {"gathered": weight.dtype, "hidden": hidden.dtype,
                    "shards": {p.dtype for p in fsdp.parameters()}, "grads": {p.grad.dtype for p in fsdp.parameters()}}
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_gradient_checkpointing_gives_the_same_gradients():
    """HF's layer recompute runs inside FSDP2's per-layer units (the recompute's forward hooks find the layer
    already gathered by its pre-backward, and neither gather nor reshard again): the same gradients, bit for bit.
    Same spawn: `FSDPBackbone` under the bf16-mixed GPU policy gathers in bf16 and keeps float32 shards and grads."""
    for result in run_distributed(_checkpointing_worker, 2, timeout=300, preload=PRELOAD):
        for family in ("qwen2", "qwen3_moe"):
            (plain, calls_plain), (ckpt, calls_ckpt) = result[family, False], result[family, True]
            assert (calls_plain, calls_ckpt) == (1, 2), family  # the layer ran again in the backward
            assert plain.keys() == ckpt.keys()
            assert all(plain[f"model.layers.{i}.self_attn.q_proj.weight"].abs().sum() > 0 for i in (0, 1))
            for name in plain:
                torch.testing.assert_close(ckpt[name], plain[name], rtol=0, atol=0, msg=f"{family} {name}")
        assert result["mixed"] == {"gathered": torch.bfloat16, "hidden": torch.bfloat16, "shards": {torch.float32},
                                   "grads": {torch.float32}}


@pytest.mark.parametrize(("precision", "device", "policy"), [
    ("bf16-mixed", "cuda", (torch.bfloat16, torch.float32)),  # FSDP2's bf16 gathers, float32 reduce-scatter
    ("bf16-mixed", "cpu", None),  # autocast alone, as the unsharded HF backbone
    ("32-true", "cuda", None), ("32-true", "cpu", None),
    ("16-mixed", "cuda", None),  # LossScaledFP16: autocast and the loss scale, float32 gathers
    ("bf16-true", "cuda", None),  # the weights themselves are bf16: nothing to cast
])
def test_fsdp_mixed_precision_policy_follows_the_trainer_precision(precision, device, policy):
    from topp_rl.fsdp.strategy import mixed_precision_policy

    got = mixed_precision_policy(precision, device)
    if policy is None:
        assert got is None
    else:
        param_dtype, reduce_dtype = policy
        assert (got.param_dtype, got.reduce_dtype, got.output_dtype) == (param_dtype, reduce_dtype, None)
        assert got.cast_forward_inputs


def _refill_worker(rank: int, tmp: str) -> dict:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    from helpers import metric_columns

    out = Path(tmp) / "refill"
    _, steps = _run(out, "parallel=fsdp", "trainer.devices=2", "data.drop_zero_variance_groups=true", "data.refill=true",
                    "data.max_refill_factor=3")
    return {"metrics": metric_columns(out) if rank == 0 else {},
            "groups": [len({s.group_index for s in samples}) for samples in steps]}


@pytest.mark.distributed
def test_fsdp_refill_rounds_with_a_rank_that_generates_nothing(tmp_path):
    """data.refill=true with the embedded engine sampling from the FSDP-sharded module, whose `generate` is a
    collective: in a round where one rank needs more groups and the other none, the ranks still meet (the rounds
    run inside the engine's held weights); without that the run hangs."""
    ranks = run_distributed(_refill_worker, 2, str(tmp_path), timeout=420, preload=PRELOAD)
    per_rank = [r["groups"] for r in ranks]
    assert any(a != b for a, b in zip(*per_rank, strict=True)), per_rank  # a step whose ranks drew differently
    m = ranks[0]["metrics"]
    assert len(m["rollout/refill_rounds"]) == 3 and max(m["rollout/refill_rounds"]) > 0
    for generated, trained, filtered, surplus, capped in zip(
            m["rollout/groups_generated"], m["rollout/groups_trained"], m["rollout/groups_filtered"],
            m["rollout/groups_surplus"], m["rollout/refill_capped"], strict=True):
        assert generated == trained + filtered + surplus and (trained == 4 or capped == 1.0)
    assert [sum(step) for step in zip(*per_rank, strict=True)] == m["rollout/groups_generated"]
