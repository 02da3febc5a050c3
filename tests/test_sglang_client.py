"""`SGLangEngine` / `SGLangServer` behaviour that needs no SGLang server: bounded waits against a TCP server that
accepts and never answers (or trickles), the explicit SGLang-python setting, and the stale work-dir sweep."""

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sglang_checks import require_sglang

import topp_rl
from topp_rl.engines.serving import RequestError, RequestTimeoutError, Retries, Timeouts
from topp_rl.engines.serving.client import error_message
from topp_rl.engines.sglang import SGLangEngine
from topp_rl.engines.sglang.protocol import SGLANG_OVERFLOW, overflow_sample
from topp_rl.engines.sglang.server import SGLANG_PYTHON_ENV, SGLangServer, make_workdir


class _HungServer:
    """127.0.0.1 TCP server that accepts every connection and then never answers ("silent"), or sends a
    response head and then one body byte every 0.2 s forever ("trickle"), as a hung or stalled server does."""

    def __init__(self, mode: str) -> None:
        self.mode, self._conns, self._stop = mode, [], threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            if self.mode == "trickle":
                threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        try:
            conn.recv(65536)
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
            )
            while not self._stop.wait(0.2):
                conn.sendall(b" ")
        except OSError:
            pass

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        for conn in self._conns:
            conn.close()


@pytest.mark.parametrize("mode", ["silent", "trickle"])
def test_hung_server_fails_within_its_bound_naming_server_and_call(mode, tmp_path, capfd):
    server = _HungServer(mode)
    start = time.monotonic()
    try:
        with pytest.raises(RequestTimeoutError) as err:
            SGLangEngine(urls=[server.url], vocab_size=64, workdir=tmp_path, progress_interval_s=0.5,
                         timeouts={"first_byte_s": 1.5, "transfer_s": 1.0}, retries={"max_retries": 4})  # fmt: skip
    finally:
        server.close()
    waited = time.monotonic() - start
    # silent: the first-byte bound (1.5 s); trickle: the whole-request bound (1.5 + 1.0 s). No retries: one
    # connection (counted by the server, not inferred from a tight upper time bound that a loaded machine breaks).
    assert (1.5 if mode == "silent" else 2.5) <= waited < 60
    assert len(server._conns) == 1
    message = str(err.value)
    assert message.startswith(f"SGLang server {server.url}: GET /server_info got no complete answer after ")
    assert "first-byte bound 1.5 s = timeouts.first_byte_s 1.5 + timeouts.per_token_s 0.5 x 0 tokens" in message
    assert "whole request 2.5 s" in message
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("[topp_rl] SGLang server")]
    assert lines and all(f"{server.url}: GET /server_info waiting" in ln for ln in lines)
    assert list(tmp_path.iterdir()) == []  # the engine's work dir went with it


def test_bad_timeouts_are_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"timeouts \{'connect_s': 0\} out of range"):
        SGLangEngine(urls=["http://127.0.0.1:1"], vocab_size=64, workdir=tmp_path, timeouts={"connect_s": 0})


def test_timeouts_and_retries_give_the_bounds_and_delays():
    timeouts = Timeouts(first_byte_s=30, per_token_s=0.25, transfer_s=10)
    call = timeouts.call(tokens=40)
    assert (call.first_byte_s, call.total_s) == (40.0, 50.0)
    assert call.how == "timeouts.first_byte_s 30 + timeouts.per_token_s 0.25 x 40 tokens"
    update = timeouts.weights(2 * 10**9)  # defaults: 120 s + 60 s per GB
    assert (update.first_byte_s, update.total_s) == (240.0, 250.0)
    assert update.how == "timeouts.weight_update_s 120 + timeouts.per_gb_s 60 x 2.000 GB"
    assert [Retries(backoff_s=0.5, max_backoff_s=3).delay(k) for k in range(5)] == [0, 0.5, 1, 2, 3]
    with pytest.raises(ValueError, match=r"timeouts \{'per_token_s': -1\} out of range"):
        Timeouts(per_token_s=-1)
    with pytest.raises(ValueError, match=r"max_retries \(-1\) must be an integer >= 0, backoff_s \(0.5\)"):
        Retries(max_retries=-1)


def test_engine_builds_timeouts_and_retries_from_mappings_or_takes_them(tmp_path):
    kwargs = {"urls": ["http://127.0.0.1:1"], "vocab_size": 64, "workdir": tmp_path}
    with pytest.raises(ValueError, match=r"timeouts has no key 'connect_timeout_s': valid keys are connect_s, "
                       r"first_byte_s, per_token_s, transfer_s, weight_update_s, per_gb_s \(Timeouts\); did you "
                       r"mean 'connect_s'\? fix the spelling, or drop the key"):
        SGLangEngine(timeouts={"connect_timeout_s": 5}, **kwargs)
    with pytest.raises(ValueError, match=r"retries has no key 'attempts': valid keys are max_retries, backoff_s, "
                       r"max_backoff_s \(Retries\)"):
        SGLangEngine(retries={"attempts": 1}, **kwargs)
    with pytest.raises(ValueError, match=r"timeouts \{'first_byte_s': 0\} out of range"):
        SGLangEngine(timeouts={"first_byte_s": 0}, **kwargs)
    assert list(tmp_path.iterdir()) == []  # rejected before the work dir is made
    # A mapping of some fields or the objects: the same limits reach the client: one attempt, refused at once.
    mappings = {"retries": {"max_retries": 0}, "timeouts": {"connect_s": 2}}
    objects = {"retries": Retries(max_retries=0), "timeouts": Timeouts(connect_s=2)}
    for limits in (mappings, objects):
        with pytest.raises(RequestError, match=r"GET http://127.0.0.1:1/server_info failed after 1 attempt"):
            SGLangEngine(**kwargs, **limits)


def test_sglang_python_is_an_explicit_setting(tmp_path, monkeypatch):
    monkeypatch.delenv(SGLANG_PYTHON_ENV, raising=False)
    with pytest.raises(
        ValueError, match=f"pass python= .*or set {SGLANG_PYTHON_ENV}.*scripts/setup_sglang.sh"
    ):
        SGLangServer(tmp_path)
    with pytest.raises(ValueError, match=r"python= \(/no/such/python\) is not a file.*setup_sglang.sh"):
        SGLangServer(tmp_path, python="/no/such/python")


@pytest.mark.subprocess
def test_work_dir_of_a_dead_process_is_cleaned_at_next_start(tmp_path):
    """A killed trainer leaves its disk-sync copy behind; the next engine start removes it, keeps the log."""
    code = (
        "import sys; from topp_rl.engines.sglang.server import make_workdir; p = make_workdir(sys.argv[1]); "
        "(p / 'weights-x').mkdir(); (p / 'weights-x' / 'model.safetensors').write_bytes(b'w' * 1000); "
        "(p / 'server.log').write_text('why it died'); print(p)"
    )
    env = {"PYTHONPATH": str(Path(topp_rl.__file__).parents[1])}
    dead = Path(subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                               check=True, env=env).stdout.strip())  # fmt: skip
    live = make_workdir(tmp_path)  # ours (alive): untouched by its own sweep and by the next one
    (live / "weights-y").mkdir()
    make_workdir(tmp_path)
    assert sorted(p.name for p in dead.iterdir()) == ["server.log"]
    assert (dead / "server.log").read_text() == "why it died"
    assert (live / "weights-y").is_dir() and (live / "owner").is_file()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"urls": ["http://127.0.0.1:1"], "router_url": "http://127.0.0.1:2"},
         r"urls \(\['http://127.0.0.1:1'\]\) and router_url \('http://127.0.0.1:2'\) are exclusive"),
        ({"urls": ["http://127.0.0.1:1"], "num_servers": 2},
         r"urls= connects to running workers, but num_servers=2, router=False ask to launch them"),
        ({"router_url": "http://127.0.0.1:2", "router": True},
         r"router_url= connects to running workers, but num_servers=1, router=True ask to launch them"),
        ({"model_path": "m", "num_servers": 0}, r"num_servers \(0\) must be an integer >= 1"),
        ({"model_path": "m", "router_policy": "fastest"}, r"router_policy \('fastest'\) must be one of \["),
        ({"model_path": "m", "max_candidates": 0}, r"max_candidates \(0\) and weight_bucket_bytes"),
        ({}, r"needs urls=\[...\] of running servers, router_url= of a running router, or model_path="),
    ],
    ids=["urls+router_url", "urls+num_servers", "router_url+router", "num_servers", "policy", "max_candidates",
         "nothing"],
)  # fmt: skip
def test_worker_modes_are_exclusive_and_checked_before_anything_starts(kwargs, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        SGLangEngine(vocab_size=64, workdir=tmp_path, **kwargs)
    assert list(tmp_path.iterdir()) == []  # nothing launched, no work dir made


def test_sglangs_own_overflow_abort_is_recognised():
    """SGLang aborts a request whose realised set exceeds --sampling-mask-max-tokens (HTTP 400; on GPU from top-k
    ties, unreachable on CPU): the marker the client matches must be in SGLang's source, and the body's
    message is what the aborted sample reports."""
    python = require_sglang()
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    source = Path(site, "sglang/srt/managers/scheduler_components/batch_result_processor.py").read_text()
    assert f'"{SGLANG_OVERFLOW}=' in source
    body = (
        '{"error": {"message": "Sampling support exceeds --sampling-mask-max-tokens=65, commonly because"}}'
    )
    assert error_message(body).startswith(f"{SGLANG_OVERFLOW}=65")
    sample = overflow_sample([1, 2], error_message(body), weight_version=None)
    assert sample.status == "aborted" and sample.metadata["candidate_overflow"] is True
    assert sample.metadata["finish_reason"] == {"type": "abort", "message": error_message(body)}
