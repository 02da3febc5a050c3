"""`SGLangEngine` with two real SGLang CPU servers behind a real router (smg 1.13.0, round-robin), all launched
by one engine for the module (the most servers this suite runs at once: two).

Checked: candidate sets arrive through the router exactly as directly (against HF float32, as in test_sglang.py),
both workers serve traffic (counted by each worker's own `sglang:num_requests_total` Prometheus counter, served
at /metrics with --enable-metrics), a second engine connected by `router_url` finds the workers through the
router and reports (aborts) samples whose kept set exceeds max_candidates, a bucketed distributed weight sync
(and the disk fallback) reaches both workers, and killing one worker mid-rollout lets it finish through the
other. The kill runs last: it leaves one worker.
"""

import os
import re
import shutil
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import requests
import torch
from sglang_checks import (
    PROMPTS,
    TOL,
    changed_model,
    check_candidates,
    group_members,
    listening,
    log_size,
    require_sglang,
    tiny_model,
    wait_for_prefills,
)

from topp_rl.engines.serving.net import free_port
from topp_rl.engines.serving.process import group_alive
from topp_rl.engines.serving.weights import iter_buckets
from topp_rl.models import save_model
from topp_rl.ops import sampling_candidates
from topp_rl.rollout import SampleStatus, SamplingParams

pytestmark = pytest.mark.sglang
require_sglang(module=True)

from topp_rl.engines.sglang import SGLangEngine  # noqa: E402

MAX_CANDIDATES = 64  # the launched servers get --sampling-mask-max-tokens 65
BUCKET_BYTES = 64 * 1024  # the 0.56 MB test model goes out in several buckets
SEQ = [1, 5, 9, 14, 20, 33, 7, 60, 61, 62]  # fixed sequence whose prompt log-probs each worker recomputes


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def model_dir(model, tmp_path_factory) -> Path:
    return save_model(model, None, tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = SGLangEngine(
        model_path=model_dir,
        num_servers=2,
        router_policy="round_robin",  # cache_aware would keep these few, similar prompts on one worker
        max_candidates=MAX_CANDIDATES,
        weight_sync="distributed",
        weight_bucket_bytes=BUCKET_BYTES,
        progress=False,
        server_kwargs={"extra_args": ("--enable-metrics",)},
    )
    yield eng
    eng.close()


def _requests_served(url: str) -> float:
    """The worker's own count of finished generate requests (its Prometheus counter)."""
    text = requests.get(f"{url}/metrics", timeout=10).text
    found = re.search(r"^sglang:num_requests_total\{[^}]*\} ([0-9.e+]+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_router_passes_exact_candidate_sets_and_both_workers_serve(engine, model):
    assert engine.router_url == engine.launched_router.url and len(engine.urls) == 2
    before = {url: _requests_served(url) for url in engine.urls}
    sizes, total = [], 0
    for params in (
        SamplingParams(temperature=1.0, top_p=0.7, max_new_tokens=8, n=3),
        SamplingParams(temperature=0.7, top_p=0.95, top_k=20, max_new_tokens=8, n=2),
    ):
        samples = engine.generate(PROMPTS, params, seed=11)
        total += len(samples)
        assert [s.prompt_ids for s in samples] == [p for p in PROMPTS for _ in range(params.n)]  # prompt-major
        assert not any(s.metadata["candidate_overflow"] for s in samples)  # all sets here fit in 64
        sizes += check_candidates(samples, model, params)
    assert len(sizes) >= 100 and len(set(sizes)) > 1 and max(sizes) <= MAX_CANDIDATES
    served = {url: _requests_served(url) - before[url] for url in engine.urls}
    assert sum(served.values()) == total, served  # every sample once, no retries
    assert all(n >= total / 4 for n in served.values()), f"round-robin left a worker idle: {served}"
    # The router's listeners (HTTP and Prometheus) bind loopback only.
    found = listening(set(group_members(engine.launched_router.pid)))
    assert len(found) == 2 and all(addr.is_loopback for addr, _ in found), found


def test_connected_router_finds_workers_and_aborts_overflowing_samples(engine, model, model_dir):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=6, n=3)
    with SGLangEngine(
        router_url=engine.router_url, model_path=model_dir, max_candidates=16, progress=False
    ) as eng:
        assert sorted(eng.urls) == sorted(engine.urls) and eng.server is None
        samples = eng.generate(PROMPTS, params)
    with torch.no_grad():  # the first token's set depends on the prompt only: 14, 42, 32 ids for these three
        first = [sampling_candidates(model(input_ids=torch.tensor([p])).logits[0, -1:].float(), temperature=1.0,
                                     top_p=0.9, top_k=0, min_p=0.0).row_lengths().item() for p in PROMPTS]  # fmt: skip
    assert first[0] <= 16 < min(first[1:])
    kept = []
    for i, s in enumerate(samples):
        overflow = s.metadata["candidate_overflow"]
        if first[i // params.n] > 16:
            assert overflow  # never cut to the cap
        if overflow:
            assert s.status is SampleStatus.ABORTED and s.response_length == 0
            assert "candidate set larger than max_candidates=16" in s.metadata["finish_reason"]["message"]
        else:
            kept.append(s)
    assert sum(s.metadata["candidate_overflow"] for s in samples) >= 6
    sizes = check_candidates(kept, model, params)  # the sets that fit are exact, as without a cap
    assert all(n <= 16 for n in sizes)
    with pytest.raises(
        ValueError, match=r"needs 101 .* --sampling-mask-max-tokens 101 or set max_candidates <= 64"
    ):
        SGLangEngine(router_url=engine.router_url, model_path=model_dir, max_candidates=100, progress=False)


def _prompt_log_probs(url: str) -> torch.Tensor:
    """The worker's log-probs of SEQ[1:] given the prefix (raw, T=1), through /generate's input logprobs."""
    body = {"input_ids": SEQ, "sampling_params": {"max_new_tokens": 1}, "return_logprob": True,
            "logprob_start_len": 0}  # fmt: skip
    meta = requests.post(f"{url}/generate", json=body, timeout=60).json()["meta_info"]
    return torch.tensor([lp for lp, _, *_ in meta["input_token_logprobs"][1:]])


def _hf_prompt_log_probs(model) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([SEQ])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1)[torch.arange(len(SEQ) - 1), torch.tensor(SEQ[1:])]


def test_weight_sync_reaches_every_worker_in_buckets(engine, model):
    changed = changed_model(model)
    stats = engine.update_weights(changed.named_parameters())
    nbytes = sum(p.numel() * p.element_size() for p in changed.parameters())
    assert stats.method == "distributed" and stats.workers == tuple(engine.urls) and stats.bytes == nbytes
    assert stats.buckets == len(list(iter_buckets(changed.named_parameters(), BUCKET_BYTES))) > 1
    assert 0 < stats.seconds < 60 and engine.last_sync is stats
    want, old = _hf_prompt_log_probs(changed), _hf_prompt_log_probs(model)
    for url in engine.urls:  # each worker directly, not through the router
        got = _prompt_log_probs(url)
        assert torch.allclose(got, want, atol=TOL) and (got - old).abs().max() > 1e-2
        version = requests.get(f"{url}/get_model_info", timeout=10).json()["weight_version"]
        assert version == stats.version
    engine.weight_sync = "disk"  # the fallback restores the initial weights on both
    try:
        stats = engine.update_weights(model.named_parameters())
    finally:
        engine.weight_sync = "distributed"
    assert stats.method == "disk" and stats.bytes == nbytes and stats.workers == tuple(engine.urls)
    for url in engine.urls:
        assert torch.allclose(_prompt_log_probs(url), old, atol=TOL)


def test_a_router_whose_drawn_port_another_process_bound_starts_on_another(engine, tmp_path, monkeypatch, capfd):
    """The race `_start_on_port` answers, forced: the first port drawn for a router is bound (and listened on) by
    this process before smg binds it; smg fails its bind, and the router starts again on a fresh port."""
    from topp_rl.engines.serving import process
    from topp_rl.engines.sglang.router import SGLangRouter

    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        held.listen()
        taken = held.getsockname()[1]
        draws = iter([taken])
        monkeypatch.setattr(process, "free_port", lambda host: next(draws, None) or free_port(host))
        with SGLangRouter(engine.urls, workdir=tmp_path, startup_timeout_s=120) as router:
            assert router.port != taken and not router.failed
            assert requests.get(f"{router.url}/readiness", timeout=30).json()["healthy_workers"] == 2
    assert f"another process bound port {taken} first; starting again on another port" in capfd.readouterr().err


def test_killing_a_worker_mid_rollout_finishes_through_the_other(engine, model, capfd):
    victim, survivor = engine.servers[1], engine.servers[0]
    before = _requests_served(survivor.url)
    params = SamplingParams(temperature=1.0, top_p=0.7, max_new_tokens=64, n=8)
    result = {}
    engine.extra_sampling_params = {"ignore_eos": True}  # every sample runs 64 tokens: ~3 s on 2 cores
    offset = log_size(victim.log_path)
    try:
        worker = threading.Thread(target=lambda: result.update(samples=engine.generate(PROMPTS, params)))
        worker.start()
        # Kill the victim once it logged a prefill of its share: it then holds requests with 64 tokens each to
        # decode. An event, not a time: its Prometheus gauge of running requests is refreshed only every 40 decode
        # steps, and a poll of it missed the decode on a loaded machine ("the victim never started decoding").
        wait_for_prefills(victim.log_path, offset=offset, seqs=1)
        os.killpg(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        worker.join(timeout=300)
    finally:
        engine.extra_sampling_params = {}
    elapsed = time.monotonic() - killed
    assert not worker.is_alive(), f"rollout still running {elapsed:.0f} s after the kill"
    # The death was reported when it happened (the watcher), not at close (issue 18 part 6k). The watcher polls
    # every 0.5 s, and the retried rollout may finish first on a loaded machine: wait for its report, bounded.
    assert victim.exit_reported.wait(timeout=60), f"no exit report {time.monotonic() - killed:.0f} s after the kill"
    reported = f"[topp_rl] SGLang server {victim.url} (pid {victim.pid}) exited with status -9 (signal SIGKILL) while in use"
    err = capfd.readouterr().err
    assert any(line.startswith(reported) for line in err.splitlines()), err[-2000:]
    assert victim.failed
    samples = result["samples"]
    assert [s.status for s in samples] == [SampleStatus.TRUNCATED] * 24
    assert all(s.response_length == 64 for s in samples)
    check_candidates(samples, model, params)
    # The survivor finished more than its round-robin half: the victim's requests were retried on it.
    assert _requests_served(survivor.url) - before > 12
    # The next weight sync goes to the survivor alone (a new broadcast group without the dead worker).
    stats = engine.update_weights(changed_model(model).named_parameters())
    assert stats.workers == (survivor.url,)
    assert torch.allclose(
        _prompt_log_probs(survivor.url), _hf_prompt_log_probs(changed_model(model)), atol=TOL
    )
    groups = [engine.launched_router.pid, survivor.pid, victim.pid]
    workdir = engine.workdir
    engine.close()
    assert not any(group_alive(g) for g in groups)
    # The killed server failed: its log is kept (and only logs are).
    kept = sorted(p.relative_to(workdir).as_posix() for p in workdir.rglob("*") if p.is_file())
    assert "server-1/server.log" in kept and all(k.endswith(".log") for k in kept), kept
    shutil.rmtree(workdir)
