"""`SGLangEngine` against a real SGLang 0.5.23 server on CPU (its own venv, built by scripts/setup_sglang.sh).

One server for the module (patched with patches/sglang, float32). The unpatched wire path is the same server
answering without the patch's request flag (the nested JSON lists then come from SGLang's own, untouched code).
SGLang's CPU backend cannot sample deterministically (no seeds), so both wire paths are checked against the same
reference instead of against each other: the same weights in HF transformers, float32, run on prompt + response,
with `topp_rl.ops.sampling_candidates` (SGLang's rule) on its logits.
"""

import os
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests
import torch
from sglang_checks import (
    PROMPTS,
    TOL,
    VOCAB,
    changed_model,
    check_candidates,
    hf_logits,
    listening,
    log_size,
    pgid,
    require_sglang,
    tiny_model,
    wait_for_prefills,
)  # fmt: skip

from topp_rl.engines.serving.net import free_port
from topp_rl.engines.serving.process import group_alive
from topp_rl.engines.serving.wire import decode_candidates
from topp_rl.models import build_char_tokenizer, build_tiny_model, save_model
from topp_rl.rollout import SampleStatus, SamplingParams
from topp_rl.rollout.datamodule import RolloutDataModule
from topp_rl.tasks import CopyDigitTask

pytestmark = pytest.mark.sglang
require_sglang(module=True)

from topp_rl.engines.serving import RequestError  # noqa: E402
from topp_rl.engines.sglang import SGLangEngine  # noqa: E402


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
        progress=False,
        server_kwargs={"max_total_tokens": 16384},
    )
    yield eng
    eng.close()


def test_patched_server_detected(engine):
    assert engine.patched, "the setup script applies patches/sglang; the probe must see candidate_ids_b64"
    params = SamplingParams(temperature=0.9, top_p=0.8, top_k=40, max_new_tokens=4)
    body = engine.codec.payload(PROMPTS[0], params, seed=None, index=0)
    compact = requests.post(f"{engine.urls[0]}/generate", json=body, timeout=60).json()["meta_info"]
    # The compact arrays come from the server (not a client-side re-encoding), one row per output token.
    assert "candidate_ids_b64" in compact and "output_token_sampling_mask" not in compact
    assert compact["output_token_sampling_mask_length"] == 4
    # "support" mode: one renormalised log-prob per kept id, row by row, next to the compact rows.
    support = requests.post(f"{engine.urls[0]}/generate", json={**body, "sampling_logprobs_mode": "support"},
                            timeout=60).json()["meta_info"]  # fmt: skip
    cands = decode_candidates(support, num_tokens=4, vocab_size=VOCAB)
    rows = support["output_token_sampling_logprobs"]
    assert [len(r) for r in rows] == cands.row_lengths().tolist()
    assert all(abs(torch.tensor(r).exp().sum().item() - 1) < 1e-4 for r in rows)  # each row renormalised
    body.pop("return_sampling_mask_b64")
    nested = requests.post(f"{engine.urls[0]}/generate", json=body, timeout=60).json()["meta_info"]
    assert "candidate_ids_b64" not in nested and len(nested["output_token_sampling_mask"]) == 4


@pytest.fixture(params=["b64", "nested"])
def wire(request, engine):
    """Run a test on the compact (patched) and on SGLang's nested-list wire path of the same server."""
    engine.patched = request.param == "b64"
    yield request.param
    engine.patched = True


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_p=0.7, top_k=0, max_new_tokens=8, n=3),
        SamplingParams(temperature=0.7, top_p=0.95, top_k=20, max_new_tokens=8, n=2),
        SamplingParams(temperature=1.3, top_p=1.0, top_k=0, min_p=0.05, max_new_tokens=8, n=2),
    ],
    ids=["top_p", "top_p+top_k", "min_p"],
)
def test_candidates_and_log_probs_match_hf_recomputation(engine, model, params, wire):
    samples = engine.generate(PROMPTS, params, seed=11)
    assert [s.prompt_ids for s in samples] == [p for p in PROMPTS for _ in range(params.n)]  # prompt-major
    sizes = check_candidates(samples, model, params)
    checked = len(sizes)
    assert checked >= 20 and min(sizes) >= 1
    assert len(set(sizes)) > 1, "the test model should produce candidate sets of varied sizes"


def test_untruncated_request_records_no_candidates(engine, model):
    (s,) = engine.generate(PROMPTS[:1], SamplingParams(temperature=1.0, max_new_tokens=5), seed=3)
    assert s.candidates is None  # the whole vocabulary: unrestricted
    scaled = torch.log_softmax(hf_logits(model, s), dim=-1)
    want = scaled[torch.arange(s.response_length), torch.tensor(s.response_ids)]
    assert torch.allclose(torch.tensor(s.rollout_log_probs), want, atol=TOL)
    assert s.rollout_log_probs == s.rollout_raw_log_probs


def test_stop_token_and_length_status(engine):
    stops = tuple(range(0, VOCAB, 2))  # even ids stop: about half the mass at every step
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12, n=4, stop_token_ids=stops)
    samples = engine.generate(PROMPTS, params)
    for s in samples:
        hits = [i for i, t in enumerate(s.response_ids) if t in stops]
        if s.status is SampleStatus.COMPLETED:
            assert hits == [s.response_length - 1]  # stops right after the first stop id, which is kept
        else:
            assert s.status is SampleStatus.TRUNCATED and s.response_length == 12 and not hits
        assert s.candidates.num_rows == s.response_length == len(s.rollout_log_probs) == len(s.loss_mask)
    assert any(s.status is SampleStatus.COMPLETED for s in samples)
    (long,) = engine.generate(PROMPTS[:1], SamplingParams(top_p=0.9, max_new_tokens=7))
    assert long.status is SampleStatus.TRUNCATED and long.response_length == 7


def _assert_follows(samples, model) -> None:
    """The server's raw log-probs are those of `model` (HF, float32) on the same tokens."""
    for s in samples:
        scaled = torch.log_softmax(hf_logits(model, s), -1)
        want = scaled[torch.arange(s.response_length), torch.tensor(s.response_ids)]
        assert torch.allclose(torch.tensor(s.rollout_raw_log_probs), want, atol=TOL)


@pytest.mark.parametrize("sync", ["disk", "distributed"])
def test_weight_sync_changes_and_restores_outputs(engine, model, sync):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=5)
    changed = changed_model(model)
    engine.weight_sync = sync
    try:
        engine.update_weights(changed.named_parameters())
        after = engine.generate(PROMPTS, params)
        _assert_follows(after, changed)
        with pytest.raises(AssertionError):
            _assert_follows(after, model)
        engine.update_weights(model.named_parameters())
        _assert_follows(engine.generate(PROMPTS, params), model)
        if sync == "distributed":  # the weight-sync group is up: its store and gloo sockets are listening
            _assert_loopback_only(engine)
    finally:
        engine.weight_sync = "disk"


def _assert_loopback_only(engine) -> None:
    """No socket of the trainer (this process) or of the server's process group listens beyond loopback."""
    server = [int(p) for p in os.listdir("/proc") if p.isdigit() and pgid(int(p)) == engine.server.pid]
    found = listening({os.getpid(), *server})
    assert len(server) >= 3 and len({pid for _, pid in found}) >= 2, f"too few listeners seen: {found}"
    wide = [(addr, pid) for addr, pid in found if not addr.is_loopback]
    assert not wide, f"listening beyond loopback (address, pid): {wide}"
    assert engine.weights.distributed is not None  # the check ran while the weight-sync group exists


def _abort_while(engine, generate, *, requests_sent: int) -> None:
    """Run `generate` in a thread, abort every request on the server once it logged their prefills (an event:
    a fixed 1.5 s delay aborted nothing when the requests arrived late on a loaded machine), and wait for it."""
    engine.extra_sampling_params = {"ignore_eos": True}  # runs far past the abort (3000 tokens, >= 6 s here)
    offset = log_size(engine.server.log_path)
    try:
        worker = threading.Thread(target=generate)
        worker.start()
        wait_for_prefills(engine.server.log_path, offset=offset, seqs=requests_sent)
        requests.post(f"{engine.urls[0]}/abort_request", json={"abort_all": True}, timeout=30)
        worker.join(timeout=300)
        assert not worker.is_alive(), "generate still running 300 s after the abort"
    finally:
        engine.extra_sampling_params = {}


def test_aborted_requests_give_empty_aborted_samples(engine):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=3000, n=2)
    result = {}
    _abort_while(engine, lambda: result.update(samples=engine.generate(PROMPTS[:1], params)), requests_sent=2)
    samples = result["samples"]
    assert [s.status for s in samples] == [SampleStatus.ABORTED] * 2
    for s in samples:
        assert s.response_length == 0 and s.rollout_log_probs == [] and s.loss_mask == []
        assert s.prompt_ids == PROMPTS[0]


def test_step_with_every_sample_aborted_fails_naming_the_aborts(engine):
    tokenizer = build_char_tokenizer()
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=3000, n=2)
    dm = RolloutDataModule(engine=engine, task=CopyDigitTask(), tokenizer=tokenizer, params=params,
                           prompts_per_step=1)  # fmt: skip
    errors = []

    def step() -> None:
        try:
            dm.rollout(dm.ticket(0))
        except RuntimeError as err:
            errors.append(err)

    _abort_while(engine, step, requests_sent=2)
    (err,) = errors
    assert str(err).startswith("rollout step 0: 2 of 2 samples on this rank were aborted by the engine ")
    assert "ckpt_path=last" in str(err) and dm.step == 0  # not advanced: a resume regenerates step 0


def test_connect_rejects_a_server_serving_another_model(engine, model_dir, tmp_path):
    url = engine.urls[0]
    with pytest.raises(ValueError) as err:
        SGLangEngine(urls=[url], model_path=model_dir, vocab_size=VOCAB * 2, progress=False)
    assert str(err.value).startswith(
        f"SGLang server {url} serves another model than the policy: vocab size {VOCAB} (policy: {VOCAB * 2}); "
        f"start it with --model-path {model_dir}"
    )
    other = save_model(
        build_tiny_model("llama", vocab_size=256, hidden=32, layers=1), None, tmp_path / "llama"
    )
    with pytest.raises(ValueError, match=(
        rf"{url} serves another model than the policy: vocab size {VOCAB} \(policy: 256\); "
        r"architectures \['Qwen2ForCausalLM'\] \(policy: \['LlamaForCausalLM'\]\)"
    )):  # fmt: skip
        SGLangEngine(urls=[url], model_path=other, progress=False)


def test_bad_input_and_unreachable_server(engine):
    with pytest.raises(ValueError, match="outside the model vocabulary"):
        engine.generate([[VOCAB]], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="config.json does not exist"):
        SGLangEngine(model_path=Path(engine.model_path).parent / "no-such-model")
    start = time.monotonic()
    with pytest.raises(RequestError, match="after 3 attempts"):
        SGLangEngine(
            urls=[f"http://127.0.0.1:{free_port()}"], retries={"max_retries": 2, "backoff_s": 0.05}, vocab_size=VOCAB
        )
    assert time.monotonic() - start < 10


class _FlakyProxy(ThreadingHTTPServer):
    """Forwards to the real server, but answers the first `failures` POSTs to /generate with HTTP 503 (an
    overloaded server), which a real SGLang cannot be made to do on demand."""

    def __init__(self, target: str, failures: int) -> None:
        self.target, self.failures, self.served_503, self.forwarded_generate = target, failures, 0, 0
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _ProxyHandler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def _forward(self, method: str) -> None:
        proxy = self.server
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if method == "POST" and self.path == "/generate" and proxy.served_503 < proxy.failures:
            proxy.served_503 += 1
            status, payload = 503, b"overloaded"
        else:
            proxy.forwarded_generate += method == "POST" and self.path == "/generate"
            resp = requests.request(method, proxy.target + self.path, data=body or None,
                                    headers={"Content-Type": "application/json"}, timeout=60)  # fmt: skip
            status, payload = resp.status_code, resp.content
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:
        self._forward("GET")

    def do_POST(self) -> None:
        self._forward("POST")


def test_5xx_is_retried_with_backoff_and_urls_round_robin(engine, model_dir, model):
    proxy = _FlakyProxy(engine.urls[0], failures=3)
    try:
        client = SGLangEngine(urls=[proxy.url], model_path=model_dir, retries={"backoff_s": 0.01}, progress=False)
        with client:
            samples = client.generate(PROMPTS[:1], SamplingParams(top_p=0.9, max_new_tokens=4))
        assert proxy.served_503 == 3  # the probe at connect time and the rollout both went through retries
        assert samples[0].response_length == 4 and samples[0].candidates.num_rows == 4
        _assert_follows(samples, model)
        # Round-robin over two URLs (the proxy and the server itself): every other sample goes through the proxy.
        before = proxy.forwarded_generate
        with SGLangEngine(urls=[engine.urls[0], proxy.url], model_path=model_dir, progress=False) as both:
            both.generate(PROMPTS[:1], SamplingParams(top_p=0.9, max_new_tokens=2, n=6))
        assert (
            proxy.forwarded_generate - before == 2 + 3
        )  # connect-time probes (vocab, patch) + samples 1, 3, 5
        proxy.failures += 10  # more failures than retries: the error names the attempts and the last status
        with pytest.raises(RequestError, match="after 5 attempts.*HTTP 503"):
            SGLangEngine(urls=[proxy.url], model_path=model_dir, retries={"backoff_s": 0.01}, progress=False)
    finally:
        proxy.shutdown()
        proxy.server_close()


def test_server_process_group_and_work_dir_gone_after_close(engine):
    group = engine.server.pid
    members = [int(p) for p in os.listdir("/proc") if p.isdigit() and pgid(int(p)) == group]
    assert len(members) >= 4, (
        "watchdog, HTTP server, scheduler and detokenizer share the server's process group"
    )
    assert (
        engine.server.log_path == engine.workdir / "server.log" and engine.server.log_path.stat().st_size > 0
    )
    assert engine.workdir.parent == Path(tempfile.gettempdir())
    engine.close()
    assert not group_alive(group)
    assert not engine.workdir.exists()  # log, disk-sync copies and rendezvous file with it
    for pid in members:
        assert not Path(f"/proc/{pid}").exists() or _state(pid) == "Z"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
