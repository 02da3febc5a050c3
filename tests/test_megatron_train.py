"""`train.py`'s run with `parallel=tp2` and `parallel=cp2` on 2 CPU processes (one gloo spawn, Trainer in each rank):

- on the on-policy pass the Megatron log-probs equal the embedded engine's rollout log-probs
  (`train/rollout_logprob_abs_diff_max` <= 1e-5 at every step; later steps sample with weights exported from
  the updated Megatron model, so this also checks the export);
- after `fit`, the engine's HF weights equal the Megatron weights gathered under HF names, bit for bit;
- the run follows the HF-backbone run of the same config step for step (loss, grad norm, rewards);
- a tp2 run checkpointed after step 2 (HF-named full weights + per-TP-rank AdamW state + rollout state) and
  resumed at TP 2 gives the uninterrupted run's step 3;
- only the source rank of the TP / CP group holds an engine, and both peers train on byte-identical rollouts
  (a digest of every step's samples, candidate sets included, is equal on both ranks);
- the same with `rollout=sglang`: one real SGLang server (float32), launched by the source rank alone.
"""

import csv
import gc
import hashlib
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
]
PRELOAD = ("megatron.core", "megatron.core.models.gpt", "topp_rl.megatron.strategy", "topp_rl.train", "hydra")
KEYS = ("train/loss", "train/grad_norm", "rollout/reward_mean", "train/rollout_logprob_abs_diff_max",
        "train/rollout_logprob_abs_diff_unmasked", "rollout/weight_staleness")
# rollout.overlap: the source rank generates the next step on a background thread beside the TP / CP collectives.
OVERLAP = ("rollout.overlap=true", "rollout.engine.share_weights=false", "algo.loss.tis_cap=2.0")


def _metrics(output_dir: Path) -> dict[str, list[float]]:
    (path,) = output_dir.glob("csv/*/metrics.csv")
    with path.open() as f:
        rows = list(csv.DictReader(f))
    return {k: [float(r[k]) for r in rows if r.get(k)] for k in KEYS}


def sample_digest(samples) -> str:
    """One hash over everything a step trains on: tokens, masks, log-probs (exact bits), sets, rewards, status."""
    h = hashlib.sha256()
    for s in samples:
        h.update(repr((s.prompt_ids, s.response_ids, s.loss_mask, s.rollout_log_probs, s.rollout_raw_log_probs,
                       s.reward, str(s.status), s.index, s.group_index)).encode())
        if s.candidates is not None:
            h.update(s.candidates.ids.numpy().tobytes() + s.candidates.offsets.numpy().tobytes())
    return h.hexdigest()


def _digests():
    from lightning.pytorch.callbacks import Callback

    class Digests(Callback):
        def __init__(self):
            self.steps = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.steps.append(sample_digest(outputs["rollout"].samples))

    return Digests()


def _run(output_dir: Path, parallel: str, *extra: str, ckpt_path: Path | None = None) -> tuple[dict, dict]:
    from helpers import compose_config
    from transformers import PreTrainedModel

    from topp_rl.engines.embedded import EmbeddedEngine
    from topp_rl.train import build_run

    cfg = compose_config(output_dir, *TINY, f"parallel={parallel}", *extra)
    run = build_run(cfg)
    digests = _digests()
    run.trainer.callbacks.insert(0, digests)
    try:
        run.trainer.fit(run.module, datamodule=run.datamodule, ckpt_path=ckpt_path)
        exported = dict(run.module.hf_named_tensors())  # a TP collective: every rank takes part
        engine = run.datamodule.engine
        synced = None
        if isinstance(engine, EmbeddedEngine):  # it keeps its weights in memory: compare them bit for bit
            synced = all(torch.equal(engine.model.state_dict()[n], t) for n, t in exported.items())
    finally:
        run.datamodule.close_engine()
    # A peer lets go of the engine factory, and with it the full HF model the factory holds (2 per rank before).
    gc.collect()
    hf_models = sum(isinstance(o, PreTrainedModel) for o in gc.get_objects())
    info = {"has_engine": engine is not None, "synced": synced, "digests": digests.steps, "hf_models": hf_models,
            "is_source": run.datamodule.peers.is_source}
    return (_metrics(output_dir) if run.trainer.is_global_zero else {}), info


def _worker(rank: int, tmp: str) -> dict:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # the group is up: Lightning only reads ranks
    out = {p: _run(Path(tmp) / p, p) for p in ("tp2", "cp2")}
    # Once a gloo collective mismatch; checkpoints at steps 2 and 3 gather every rank's rollout in flight.
    out["cp2_overlap"] = _run(Path(tmp) / "cp2_overlap", "cp2", *OVERLAP, "checkpoint.every_n_steps=2")
    # Checkpoint after 2 steps, resume at the saved TP for the 3rd: it must match the uninterrupted run.
    _run(Path(tmp) / "part", "tp2", "trainer.max_steps=2", "checkpoint.every_n_steps=1")
    out["resumed"] = _run(Path(tmp) / "resumed", "tp2", ckpt_path=Path(tmp) / "part/checkpoints/last.ckpt")
    return out


@NO_MEGATRON
@pytest.mark.distributed
def test_train_py_through_megatron_tp2_and_cp2(tmp_path):
    results = run_distributed(_worker, 2, str(tmp_path), timeout=400, preload=PRELOAD)
    ref, _ = _run(tmp_path / "none", "none")  # the HF backbone, in this (non-distributed) process
    for parallel in ("tp2", "cp2"):
        infos = [results[rank][parallel][1] for rank in range(2)]
        assert [i["has_engine"] for i in infos] == [True, False], parallel  # the source rank alone generates
        assert infos[1]["hf_models"] == 0, parallel  # the peer holds no copy of the HF model
        assert infos[0]["synced"], f"{parallel}: engine weights != exported Megatron weights"
        assert len(infos[0]["digests"]) == 3 and infos[0]["digests"] == infos[1]["digests"], parallel
        metrics, _ = results[0][parallel]
        assert len(metrics["train/loss"]) == 3, parallel
        # A real update before the last step, so the last rollout samples with changed, exported weights.
        assert max(metrics["train/grad_norm"][:-1]) > 0, parallel
        assert max(metrics["train/rollout_logprob_abs_diff_max"]) <= 1e-5, parallel
        assert min(metrics["train/rollout_logprob_abs_diff_unmasked"]) > 1e-3, parallel  # the mask matters
        for key in ("train/loss", "train/grad_norm", "rollout/reward_mean"):
            assert metrics[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (parallel, key)
    overlap_ref, _ = _run(tmp_path / "none_overlap", "none", *OVERLAP)
    infos = [results[rank]["cp2_overlap"][1] for rank in range(2)]
    assert len(infos[0]["digests"]) == 3 and infos[0]["digests"] == infos[1]["digests"]
    metrics, _ = results[0]["cp2_overlap"]
    assert metrics["rollout/weight_staleness"] == [0.0, 1.0, 1.0]  # each step after the first: one update behind
    # The last checkpoint holds the source rank's generation in flight (step 3, gathered over the ranks).
    ckpt = torch.load(tmp_path / "cp2_overlap" / "checkpoints" / "last.ckpt", weights_only=True, mmap=True)
    in_flight = ckpt["RolloutDataModule"]["in_flight"]
    assert ckpt["global_step"] == 3 and list(in_flight) == [0] and list(in_flight[0]["steps"]) == [3]
    for key in ("train/loss", "train/grad_norm", "rollout/reward_mean", "rollout/weight_staleness"):
        assert metrics[key] == pytest.approx(overlap_ref[key], rel=1e-4, abs=1e-6), ("cp2_overlap", key)
    resumed, _ = results[0]["resumed"]
    full, _ = results[0]["tp2"]
    assert len(resumed["train/loss"]) == 1, "the resumed run trains only the 3rd step"
    for key in ("train/loss", "train/grad_norm", "rollout/reward_mean"):
        assert resumed[key] == pytest.approx(full[key][-1:], rel=1e-5, abs=1e-7), key


def _sglang_worker(rank: int, tmp: str, url: str) -> dict:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    # Both runs connect to the session's server (each pushes its weights at train start) instead of launching.
    return {p: _run(Path(tmp) / p, p, "rollout=sglang", f"rollout.engine.urls=['{url}']") for p in ("tp2", "cp2")}


@NO_MEGATRON
@pytest.mark.distributed
@pytest.mark.sglang
@pytest.mark.slow
def test_sglang_rollouts_under_tp2_and_cp2(tmp_path, tiny_sglang_url):
    results = run_distributed(_sglang_worker, 2, str(tmp_path), tiny_sglang_url, timeout=600, preload=PRELOAD)
    for parallel in ("tp2", "cp2"):
        infos = [results[rank][parallel][1] for rank in range(2)]
        assert [i["has_engine"] for i in infos] == [True, False], parallel  # one server, on the source rank
        assert len(infos[0]["digests"]) == 3 and infos[0]["digests"] == infos[1]["digests"], parallel
        metrics, _ = results[0][parallel]
        # The server (float32) and the Megatron trainer agree over the server's candidate sets.
        assert max(metrics["train/rollout_logprob_abs_diff_max"]) <= 1e-4, parallel
        assert min(metrics["train/rollout_logprob_abs_diff_unmasked"]) > 1e-3, parallel
