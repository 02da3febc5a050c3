"""End to end with `rollout=vllm`: a real vLLM server on CPU samples (top_p 0.9, top_k 20), the trainer scores over
the kept sets read from its processed log-probs, and weights are synced to the server from disk after each step:
the trainer's float32 pass matches the server's recorded log-probs at SGLang's bar; with rollout.overlap=true it
generates one update behind. The tiny model with 2 heads (head size 32: vLLM's CPU attention has no 16).

Two launched servers, round-robin, two updates ahead (`rollout.max_staleness=2`, no partial rollouts), the weights
broadcast to both (`rollout.engine.weight_sync=distributed`).

Composition, two steps each on one server for the module (`tiny_vllm_url`, launched as a run launches one; every
run pushes its policy's weights at start; 2 KV heads so that Megatron's TP2 splits them): the agent loop
(`task=lookup`), the OpenAI-compatible endpoint (`task=agent`) two updates ahead with partial rollouts, FSDP on 2
ranks sharing the server, and Megatron TP2 (three steps)."""

import os
import re
from pathlib import Path

import pytest
from dist_utils import run_distributed
from helpers import column, compose_cfg, launched_server_url, read_metrics
from vllm_checks import require_vllm

from topp_rl.train import train

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
require_vllm(module=True)
VLLM = ("rollout=vllm", "rollout.top_p=0.9", "rollout.top_k=20", "model.heads=2", "model.kv_heads=2")


def test_vllm_rollouts_train_with_exact_logprobs(tmp_path, capsys):
    summary = train(compose_cfg(tmp_path, "rollout=vllm", "rollout.top_p=0.9", "rollout.top_k=20", "model.heads=2",
                                "model.kv_heads=1", "logger=csv", "trainer.max_steps=3"))  # fmt: skip
    rows = [r for r in read_metrics(tmp_path) if r.get("train/rollout_logprob_abs_diff")]
    assert len(rows) == 3  # every step on-policy after a weight sync, exact
    assert max(column(rows, "train/rollout_logprob_abs_diff_max")) <= 1e-4
    assert max(column(rows, "train/rollout_logprob_abs_diff")) <= 1e-5
    assert summary["train/rollout_logprob_abs_diff_unmasked"] > 1e-2  # the sets drop real mass
    synced = [r for r in read_metrics(tmp_path) if r.get("perf/weight_sync_bytes")]
    assert len(synced) == 3
    out = capsys.readouterr().err
    assert re.search(r"\[topp_rl\] vLLM server http://127\.0\.0\.1:\d+: ready in \d+\.\d s", out), out


def test_vllm_overlap_generates_beside_training_one_update_behind(tmp_path):
    """rollout.overlap=true: step k + 1's requests run while step k trains; each step's weight push (which pauses
    the server) waits for them, so every step after the first trains one update behind."""
    train(compose_cfg(tmp_path, "rollout=vllm", "rollout.top_p=0.9", "rollout.top_k=20", "model.heads=2",
                      "model.kv_heads=1", "logger=csv", "trainer.max_steps=3", "rollout.overlap=true",
                      "algo.loss.tis_cap=2.0"))  # fmt: skip
    rows = [r for r in read_metrics(tmp_path) if r.get("rollout/weight_staleness")]
    assert column(rows, "rollout/weight_staleness") == [0.0, 1.0, 1.0]
    assert float(rows[0]["train/rollout_logprob_abs_diff_max"]) <= 1e-4  # step 0: on-policy, exact
    overflow = [r for r in read_metrics(tmp_path) if r.get("rollout/candidate_overflow_frac")]
    assert column(overflow, "rollout/candidate_overflow_frac") == [0.0, 0.0, 0.0]


def test_two_launched_servers_two_updates_ahead_with_broadcast_weights(tmp_path, capsys):
    """rollout.num_servers=2: samples alternate between two servers, each of which gets every weight push (a gloo
    broadcast to both workers, `weight_sync=distributed`); two updates ahead without partial rollouts, so each push
    waits for the requests in flight and the tokens the current weights sampled are exact."""
    train(compose_cfg(tmp_path, *VLLM, "rollout.engine.num_servers=2", "rollout.max_staleness=2", "logger=csv",
                      "trainer.max_steps=3", "algo.loss.tis_cap=2.0", "rollout.engine.weight_sync=distributed"))  # fmt: skip
    out = capsys.readouterr().err
    assert len(re.findall(r"\[topp_rl\] vLLM server http://127\.0\.0\.1:\d+: ready in", out)) == 2, out
    assert "vLLM kept sets: read from the top-(top_k + 1) processed log-probs (2 server(s), " in out
    rows = read_metrics(tmp_path)
    staleness = column(rows, "rollout/staleness_max")
    assert len(staleness) == 3 and max(staleness) <= 2 and max(staleness) >= 1, staleness
    current = column(rows, "train/rollout_logprob_abs_diff_current")
    assert current and max(current) <= 1e-5, current
    assert column(rows, "rollout/dropped_stale") == [0.0] * 3
    assert column(rows, "rollout/candidate_overflow_frac") == [0.0] * 3


def test_the_default_tiny_model_is_refused_naming_its_head_size(tmp_path):
    with pytest.raises(ValueError, match=r"this model's is 16 .*model.heads=2 model.kv_heads=1"):
        train(compose_cfg(tmp_path, "rollout=vllm", "rollout.top_p=0.9", "rollout.top_k=20"))


@pytest.fixture(scope="module")
def tiny_vllm_url(tmp_path_factory) -> str:
    """One vLLM server for the composition runs, launched the way a `rollout=vllm` run launches one (on the tiny
    policy's initial weights); runs connect with `rollout.engine.urls=[url]`."""
    with launched_server_url(tmp_path_factory.mktemp("tiny-vllm"), *VLLM) as url:
        yield url


def exact_on_policy(rows, steps: int) -> None:
    """Every step's masked |train - rollout| log-prob at the SGLang bar; the unmasked one far above it."""
    masked, worst = column(rows, "train/rollout_logprob_abs_diff"), column(rows, "train/rollout_logprob_abs_diff_max")
    assert len(masked) == len(worst) == steps
    assert max(masked) <= 1e-5 and max(worst) <= 1e-4, (masked, worst)
    assert min(column(rows, "train/rollout_logprob_abs_diff_unmasked")) > 1e-2


def test_the_agent_loop_through_vllm_stays_exact(tmp_path, tiny_vllm_url):
    """task=lookup: each turn is a request of the running ids (the earlier turns served from vLLM's prefix cache);
    the trainer recomputes the whole trajectory."""
    train(compose_cfg(tmp_path, "task=lookup", *VLLM, f"rollout.engine.urls=['{tiny_vllm_url}']", "logger=csv",
                      "rollout.max_new_tokens=4", "rollout.prompts_per_step=4", "rollout.n_samples=4",
                      "trainer.max_steps=2"))  # fmt: skip
    rows = read_metrics(tmp_path)
    exact_on_policy(rows, 2)
    assert max(column(rows, "rollout/env_tokens_frac")) > 0 and max(column(rows, "rollout/turns_mean")) > 1
    assert column(rows, "rollout/prefix_breaks") == [0.0] * 2
    assert column(rows, "rollout/trajectories_failed") == [0.0] * 2


def test_the_endpoint_through_vllm_two_updates_ahead_with_partial_rollouts(tmp_path, tiny_vllm_url):
    """Agent code against the OpenAI-compatible endpoint, served by vLLM two weight updates ahead of training, the
    updates landing in the requests in flight (`/pause?mode=keep`): every step within the bound, the tokens the
    trained weights sampled on-policy to float32 rounding."""
    train(compose_cfg(tmp_path, "task=agent", "task.agent=topp_rl.tasks.agents.lookup:lookup_agent", *VLLM,
                      f"rollout.engine.urls=['{tiny_vllm_url}']", "logger=csv", "rollout.prompts_per_step=4",
                      "rollout.n_samples=4", "trainer.max_steps=2", "rollout.max_staleness=2",
                      "rollout.partial_rollouts=true", "algo.loss.tis_cap=2.0"))  # fmt: skip
    rows = read_metrics(tmp_path)
    current = column(rows, "train/rollout_logprob_abs_diff_current")
    assert 1 <= len(current) <= 2 and max(current) <= 1e-5, current
    assert max(column(rows, "rollout/staleness_max")) <= 2 and column(rows, "rollout/dropped_stale") == [0.0] * 2
    assert min(column(rows, "train/rollout_logprob_abs_diff_unmasked")) > 1e-2
    assert column(rows, "rollout/trajectories_failed") == [0.0] * 2


def _fsdp_worker(rank: int, tmp: str, url: str) -> dict[str, list[float]]:
    from test_fsdp_train import _run  # its tiny FSDP run, metrics of rank 0

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # the group is up: Lightning only reads ranks  # fmt: skip
    metrics, _ = _run(Path(tmp) / "fsdp", "parallel=fsdp", "trainer.devices=2", *VLLM,
                      f"rollout.engine.urls=['{url}']", "trainer.max_steps=2", "export.hf=false")  # fmt: skip
    return metrics


@pytest.mark.distributed
def test_fsdp_on_two_ranks_shares_one_vllm_server_exactly(tmp_path, tiny_vllm_url):
    """Both data-parallel ranks sample from the one server, which gets the weights gathered from the shards after
    every step; one rank's weight push never aborts the other's rollout."""
    got = run_distributed(_fsdp_worker, 2, str(tmp_path), tiny_vllm_url, timeout=600,
                          preload=("topp_rl.train", "topp_rl.fsdp", "hydra"))[0]  # fmt: skip
    assert len(got["train/loss"]) == 2
    assert got["rollout/aborted_frac"] == [0.0] * 2
    assert min(got["perf/weight_sync_bytes"]) > 0  # every step's full weights reached the server
    assert max(got["train/rollout_logprob_abs_diff_max"]) <= 1e-4, got["train/rollout_logprob_abs_diff_max"]
    assert max(got["train/rollout_logprob_abs_diff"]) <= 1e-5, got["train/rollout_logprob_abs_diff"]
    assert min(got["train/rollout_logprob_abs_diff_unmasked"]) > 1e-3  # the sets came from the server


def _megatron_worker(rank: int, tmp: str, url: str) -> dict:
    from test_megatron_train import _run  # its tiny Megatron run: (rank 0's metrics, info)

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # fmt: skip
    return _run(Path(tmp) / "tp2", "tp2", *VLLM, f"rollout.engine.urls=['{url}']")


@pytest.mark.distributed
def test_megatron_tp2_trains_on_vllm_rollouts_exactly(tmp_path, tiny_vllm_url):
    """The source rank of the TP group holds the engine; the server gets the weights gathered from both TP shards
    under HF names after every step, and the vocabulary-sharded trainer scores over vLLM's sets at the bar."""
    pytest.importorskip("megatron.core", reason="megatron-core (the `megatron` extra) is not installed")
    from test_megatron_train import PRELOAD

    results = run_distributed(_megatron_worker, 2, str(tmp_path), tiny_vllm_url, timeout=600, preload=PRELOAD)
    infos = [results[rank][1] for rank in range(2)]
    assert [i["has_engine"] for i in infos] == [True, False]
    assert len(infos[0]["digests"]) == 3 and infos[0]["digests"] == infos[1]["digests"]
    metrics = results[0][0]
    assert max(metrics["train/rollout_logprob_abs_diff_max"]) <= 1e-4, metrics["train/rollout_logprob_abs_diff_max"]
    assert min(metrics["train/rollout_logprob_abs_diff_unmasked"]) > 1e-3
