"""`parallel.distributed_optimizer=true` (megatron-core's DDP + DistributedOptimizer, `topp_rl.megatron.dist_opt`)
through `train.py`'s run at TP=2 x DP=2 on 4 CPU processes (one gloo spawn, a Trainer in each rank):

- it follows the run without it step for step: loss, grad norm (clipped: megatron's norm over the shards equals
  the unsharded one), lr (cosine decay through the same `LambdaLR`), masked on-policy mismatch; the final
  weights (all-gathered, exported under HF names) match, and the engine holds the exported weights;
- each rank's Adam state is about half the unsharded one (sharded over DP=2);
- its step-2 checkpoint (per-rank shard state), resumed, gives the uninterrupted run's step 3 (same config, so
  the lr schedule's length is the same too);
- refused at start, naming the key: an MoE model, and a resume from the plain run's (unsharded) checkpoint.
"""

import csv
import importlib.util
import os
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed

NO_MEGATRON = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                 reason="megatron-core (the `megatron` extra) is not installed")

TINY = [
    "trainer.max_steps=3", "rollout.prompts_per_step=4", "rollout.n_samples=4", "rollout.max_new_tokens=6",
    "checkpoint.every_n_steps=0", "trainer.enable_progress_bar=false", "rollout.top_p=0.9", "logger=csv",
    "parallel=tp2", "trainer.devices=4", "module.grad_clip=0.05", "lr_schedule.min_ratio=0.1",
    "lr_schedule.decay=cosine",
]
DIST_OPT = "parallel.distributed_optimizer=true"
PRELOAD = ("megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer", "topp_rl.megatron.strategy",
           "topp_rl.train", "hydra")
KEYS = ("train/loss", "train/grad_norm", "train/lr", "rollout/reward_mean", "train/rollout_logprob_abs_diff_max")


def _metrics(output_dir: Path) -> dict[str, list[float]]:
    (path,) = output_dir.glob("csv/*/metrics.csv")
    with path.open() as f:
        rows = list(csv.DictReader(f))
    return {k: [float(r[k]) for r in rows if r.get(k)] for k in KEYS}


def _keep_step2(checkpoints: Path):
    """Copy last.ckpt as written after step 2 (before step 3 runs) to step2.ckpt."""
    import shutil

    from lightning.pytorch.callbacks import Callback

    class KeepStep2(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 2 and trainer.is_global_zero and (checkpoints / "last.ckpt").exists():
                shutil.copy(checkpoints / "last.ckpt", checkpoints / "step2.ckpt")

    return KeepStep2()


def _run(output_dir: Path, *extra: str, ckpt_path: Path | None = None) -> dict:
    from helpers import compose_config

    from topp_rl.megatron.dist_opt import ShardedOptimizer, plain_state_bytes
    from topp_rl.train import build_run

    run = build_run(compose_config(output_dir, *TINY, *extra))
    run.trainer.callbacks.insert(0, _keep_step2(output_dir / "checkpoints"))
    try:
        run.trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=ckpt_path)
        exported = {n: t.clone() for n, t in run.module.hf_named_tensors()}  # a TP collective
        engine = run.datamodule.engine
        synced = None if engine is None else all(torch.equal(engine.model.state_dict()[n], t)
                                                  for n, t in exported.items())
    finally:
        run.datamodule.close_engine()
    (opt,) = run.trainer.strategy.optimizers
    state_bytes = opt.state_bytes() if isinstance(opt, ShardedOptimizer) else plain_state_bytes(opt)
    first = run.trainer.is_global_zero
    return {"metrics": _metrics(output_dir) if first else {}, "weights": exported if first else {},
            "synced": synced, "state_bytes": state_bytes}


def _refusal(output_dir: Path, *extra: str, ckpt_path: Path | None = None) -> str:
    """The ValueError a run stops with (every rank raises it alike, before any collective)."""
    try:
        _run(output_dir, *extra, ckpt_path=ckpt_path)
    except ValueError as err:
        return str(err)
    return "no error"


def _worker(rank: int, tmp: str) -> dict:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE="4",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # the group is up: Lightning only reads ranks
    sharded = (DIST_OPT, "checkpoint.every_n_steps=2")
    out = {"plain": _run(Path(tmp) / "plain", "checkpoint.every_n_steps=2"),
           "sharded": _run(Path(tmp) / "sharded", *sharded)}
    out["resumed"] = _run(Path(tmp) / "resumed", *sharded, ckpt_path=Path(tmp) / "sharded/checkpoints/step2.ckpt")
    out["refusals"] = [_refusal(Path(tmp) / "moe", DIST_OPT, "model.family=qwen3_moe"),
                       _refusal(Path(tmp) / "from_plain", *sharded, ckpt_path=Path(tmp) / "plain/checkpoints/last.ckpt")]
    return out


@NO_MEGATRON
@pytest.mark.distributed
def test_distributed_optimizer_equals_plain_tp2_dp2(tmp_path):
    results = run_distributed(_worker, 4, str(tmp_path), timeout=500, preload=PRELOAD)
    plain, sharded = results[0]["plain"]["metrics"], results[0]["sharded"]["metrics"]
    assert len(sharded["train/loss"]) == 3
    assert max(plain["train/grad_norm"]) > 0.05, "clipping at 0.05 must be active for the test to bite"
    assert len(set(sharded["train/lr"])) == 3, "cosine decay: a different lr every step"
    for key in KEYS:
        assert sharded[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-6), key
    assert max(sharded["train/rollout_logprob_abs_diff_max"]) <= 1e-5
    w_plain, w_sharded = results[0]["plain"]["weights"], results[0]["sharded"]["weights"]
    assert set(w_plain) == set(w_sharded)
    errs = {k: float((w_plain[k] - w_sharded[k]).abs().max()) for k in w_plain}
    assert max(errs.values()) <= 1e-5, sorted(errs.items(), key=lambda kv: -kv[1])[:3]
    assert all(r["sharded"]["synced"] in (True, None) for r in results) and results[0]["sharded"]["synced"]
    for r in results:  # DP=2 halves the Adam moments (up to megatron's bucket padding)
        assert 0.45 < r["sharded"]["state_bytes"] / r["plain"]["state_bytes"] < 0.55, (r["sharded"]["state_bytes"],
                                                                                      r["plain"]["state_bytes"])
    resumed = results[0]["resumed"]["metrics"]
    assert len(resumed["train/loss"]) == 1, "the resumed run trains only the 3rd step"
    for key in KEYS:
        assert resumed[key] == pytest.approx(sharded[key][-1:], rel=1e-5, abs=1e-7), key
    errs = {k: float((results[0]["resumed"]["weights"][k] - w_sharded[k]).abs().max()) for k in w_sharded}
    assert max(errs.values()) <= 1e-6, sorted(errs.items(), key=lambda kv: -kv[1])[:3]
    for r in results:
        moe, from_plain = r["refusals"]
        assert "parallel.distributed_optimizer" in moe and "MoE expert parameters" in moe, moe
        assert "without parallel.distributed_optimizer" in from_plain and "python -m topp_rl.export" in from_plain, from_plain
    print({"state_bytes_per_rank": [(r["plain"]["state_bytes"], r["sharded"]["state_bytes"]) for r in results]})
