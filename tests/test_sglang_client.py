"""`SGLangEngine` / `SGLangServer` behaviour that needs no SGLang server: bounded waits against a TCP server that
accepts and never answers (or trickles), the explicit SGLang-python setting, and the stale work-dir sweep."""

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import topp_rl
from topp_rl.rollout.sglang import SGLangEngine, SGLangTimeoutError
from topp_rl.rollout.sglang_server import SGLANG_PYTHON_ENV, SGLangServer, make_workdir


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
        with pytest.raises(SGLangTimeoutError) as err:
            SGLangEngine(urls=[server.url], vocab_size=64, workdir=tmp_path, first_byte_timeout_s=1.5,
                         transfer_timeout_s=1.0, progress_interval_s=0.5, max_retries=4)  # fmt: skip
    finally:
        server.close()
    waited = time.monotonic() - start
    # silent: the first-byte bound (1.5 s); trickle: the whole-request bound (1.5 + 1.0 s). No retries.
    assert (1.5 if mode == "silent" else 2.5) <= waited < (3.0 if mode == "silent" else 4.0)
    message = str(err.value)
    assert message.startswith(f"SGLang server {server.url}: GET /server_info got no complete answer after ")
    assert "first-byte bound 1.5 s = first_byte_timeout_s 1.5 + per_token_timeout_s 0.5 x 0 tokens" in message
    assert "whole request 2.5 s" in message
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("[topp_rl] SGLang server")]
    assert lines and all(f"{server.url}: GET /server_info waiting" in ln for ln in lines)
    assert list(tmp_path.iterdir()) == []  # the engine's work dir went with it


def test_bad_timeouts_are_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"timeouts \{'connect_timeout_s': 0\} out of range"):
        SGLangEngine(urls=["http://127.0.0.1:1"], vocab_size=64, workdir=tmp_path, connect_timeout_s=0)


def test_sglang_python_is_an_explicit_setting(tmp_path, monkeypatch):
    monkeypatch.delenv(SGLANG_PYTHON_ENV, raising=False)
    with pytest.raises(
        ValueError, match=f"pass python= .*or set {SGLANG_PYTHON_ENV}.*scripts/setup_sglang.sh"
    ):
        SGLangServer(tmp_path)
    with pytest.raises(ValueError, match=r"python= \(/no/such/python\) is not a file.*setup_sglang.sh"):
        SGLangServer(tmp_path, python="/no/such/python")


def test_work_dir_of_a_dead_process_is_cleaned_at_next_start(tmp_path):
    """A killed trainer leaves its disk-sync copy behind; the next engine start removes it, keeps the log."""
    code = (
        "import sys; from topp_rl.rollout.sglang_server import make_workdir; p = make_workdir(sys.argv[1]); "
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
