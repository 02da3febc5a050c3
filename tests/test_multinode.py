"""Two "nodes" on loopback: `torchrun --nnodes=2 --nproc-per-node=2` with Megatron TP=2 (so DP=2 across the
nodes) trains exactly like the same job on one node (`--nnodes=1 --nproc-per-node=4`): the same global ranks
hold the same shards and rollouts, so loss, reward and mismatch agree step for step. Real torchrun, real
Lightning TorchElasticEnvironment, the embedded engine (one per TP group, on its source rank); and the same
two-node job fed by real SGLang servers, each behind a real router (smg). And `parallel=fsdp` on the two "nodes"
(world 4, every rank a data-parallel rank) equals the one-rank run of the same global batch step for step, the
reference replaying the samples the four ranks drew (tests/test_fsdp_train.py's machinery)."""

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from topp_rl.engines.serving.net import free_port

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")
JOB = [
    "parallel=tp2", "trainer.max_steps=3", "rollout.prompts_per_step=4", "rollout.n_samples=2",
    "rollout.max_new_tokens=4", "rollout.top_p=0.9", "logger=csv", "checkpoint.every_n_steps=0",
    "trainer.enable_progress_bar=false",
]
KEYS = ("train/loss", "train/grad_norm", "rollout/reward_mean", "train/rollout_logprob_abs_diff",
        "train/rollout_logprob_abs_diff_max", "train/rollout_logprob_abs_diff_unmasked")

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.subprocess]  # torchrun
NO_MEGATRON = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                 reason="megatron-core (the `megatron` extra) is not installed")


def _launch(run_dir: Path, *, nnodes: int, nproc: int, job: tuple[str, ...] = tuple(JOB),
            extra: tuple[str, ...] = ()) -> None:
    """Start every node's torchrun (all on this machine), wait for all, fail with their logs on error. tests/ is on
    the ranks' PYTHONPATH (a callback of a test module can be added with `+callbacks.<name>._target_=...`)."""
    port = free_port()  # torchrun's store binds it later: drawn below the kernel's ephemeral range
    path = os.pathsep.join(p for p in (str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", HF_HUB_OFFLINE="1", PYTHONPATH=path)
    procs = []
    for node in range(nnodes):
        cmd = [str(TORCHRUN), f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", f"--node-rank={node}",
               "--master-addr=127.0.0.1", f"--master-port={port}", "train.py", *job,
               f"trainer.num_nodes={nnodes}", f"trainer.devices={nproc}", f"hydra.run.dir={run_dir}", *extra]
        log = open(run_dir.parent / f"{run_dir.name}-node{node}.log", "w")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True), log))
    try:
        codes = [p.wait(timeout=300) for p, _ in procs]
    finally:
        for p, log in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
            log.close()
    if any(codes):
        logs = "\n".join(Path(log.name).read_text()[-3000:] for _, log in procs)
        raise AssertionError(f"torchrun exit codes {codes}:\n{logs}")


def _metrics(run_dir: Path) -> dict[str, list[float]]:
    (path,) = run_dir.glob("csv/*/metrics.csv")
    with path.open() as f:
        rows = list(csv.DictReader(f))
    return {k: [float(r[k]) for r in rows if r.get(k)] for k in KEYS}


@NO_MEGATRON
def test_two_nodes_on_loopback_train_like_one_node(tmp_path):
    _launch(tmp_path / "two_nodes", nnodes=2, nproc=2)
    _launch(tmp_path / "one_node", nnodes=1, nproc=4)
    two, one = _metrics(tmp_path / "two_nodes"), _metrics(tmp_path / "one_node")
    assert len(two["train/loss"]) == 3
    assert max(two["train/rollout_logprob_abs_diff_max"]) <= 1e-5  # exact on-policy pass across nodes
    for key in KEYS:
        assert two[key] == pytest.approx(one[key], rel=0, abs=1e-5), key
    assert "[topp_rl] layout: world=4 dp=2 tp=2 cp=1" in (tmp_path / "two_nodes-node0.log").read_text()


@NO_MEGATRON
@pytest.mark.sglang
def test_two_nodes_with_sglang_behind_a_router(tmp_path):
    """Each DP rank's source (global ranks 0 and 2, one per "node") launches one SGLang server behind its own
    router; SGLang on CPU ignores seeds, so the check is exactness on the on-policy pass, not equality with
    another run."""
    from sglang_checks import require_sglang

    require_sglang()
    run_dir = tmp_path / "two_nodes_sglang"
    _launch(run_dir, nnodes=2, nproc=2, extra=("rollout=sglang", "rollout.engine.router=true", "export.hf=false"))
    metrics = _metrics(run_dir)
    assert len(metrics["train/loss"]) == 3
    assert max(metrics["train/rollout_logprob_abs_diff_max"]) <= 1e-4  # float32 server vs Megatron trainer
    assert "[topp_rl] layout: world=4 dp=2 tp=2 cp=1" in (tmp_path / "two_nodes_sglang-node0.log").read_text()
    assert min(metrics["train/rollout_logprob_abs_diff_unmasked"]) > 1e-3  # the sets came through the router


def test_fsdp_on_two_nodes_equals_one_rank(tmp_path):
    """World 4 over two "nodes" of 2: each rank writes the samples it drew; the one-rank reference replays them as
    one batch and must give the same loss, grad norm, reward and masked mismatch at every step (within 1e-5)."""
    import torch
    from test_fsdp_train import TINY, _check_against_replay
    from test_fsdp_train import _metrics as fsdp_metrics

    run_dir = tmp_path / "fsdp_two_nodes"
    _launch(run_dir, nnodes=2, nproc=2, job=(*TINY, "parallel=fsdp", "export.hf=false"),
            extra=("+callbacks.samples._target_=test_fsdp_train.Samples", f"+callbacks.samples.path={run_dir}"))
    steps = [torch.load(run_dir / f"samples-rank{rank}.pt", weights_only=False) for rank in range(4)]
    results = [{"fsdp": (fsdp_metrics(run_dir) if rank == 0 else {}, steps[rank])} for rank in range(4)]
    _check_against_replay(tmp_path, results, "fsdp", ("export.hf=false",), "two_nodes_fsdp")
    assert "[topp_rl] layout: world=4 dp=4 tp=1 cp=1 ep=1 fsdp=4" in (tmp_path / "fsdp_two_nodes-node0.log").read_text()
