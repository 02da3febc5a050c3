"""`serving.process.LoggedProcessGroup._start_on_port` and `serving.net.free_port`: a server whose HTTP bind fails
("address already in use"; the process may live on, as SGLang's does) is stopped at once, not after the startup
bound; on a port picked here it starts again on a fresh port, on a port the caller gave it is an error naming the
port. Real processes and sockets: the fake servers are Python one-liners that print uvicorn's bind error or serve
`/health`."""

import random
import socket
import sys
import time

import pytest

from topp_rl.engines.serving.launched import LaunchedServer
from topp_rl.engines.serving.net import PICK_RANGE, ephemeral_low, free_port
from topp_rl.engines.serving.process import PORT_TRIES, PortTaken, group_alive, spawn_group

BIND_FAILS = ("print('ERROR:    [Errno 98] error while attempting to bind on address (\\'127.0.0.1\\', 1): address "
              "already in use', flush=True); import time; time.sleep(600)")  # fmt: skip
SERVES_HEALTH = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


class FakeServer(LaunchedServer):
    """Its first `taken` starts print the bind error and hang; the next one serves `/health` on its port."""

    label = "test server"

    def __init__(self, tmp_path, started: list[tuple[int, int]], *, taken: int, port: int | None = None,
                 startup_timeout_s: float = 600) -> None:  # fmt: skip
        self.workdir, self._owns_workdir, self.failed = tmp_path, False, False
        self.log_path = tmp_path / "server.log"
        self.started = started  # (process group, port) of each start, also when the constructor raises

        def spawn():
            script = BIND_FAILS if len(self.started) < taken else SERVES_HEALTH
            proc = spawn_group(sys.executable, [sys.executable, "-c", script, str(self.port)], log=self._log, env={})
            self.started.append((proc.pid, self.port))
            return proc

        self._start_on_port("127.0.0.1", port, spawn, lambda: self._wait_ready(startup_timeout_s, 0))


def test_a_taken_picked_port_is_picked_again_and_the_failed_start_stopped(tmp_path):
    start = time.monotonic()
    with FakeServer(tmp_path, [], taken=1) as server:
        (first_group, first_port), (_, second_port) = server.started
        assert second_port != first_port and server.url == f"http://127.0.0.1:{second_port}"
        assert not group_alive(first_group)  # stopped when its bind failed, not left waiting for a shutdown
        assert not server.failed
    assert time.monotonic() - start < 300  # far below the 600 s bound: no start waited it out


def test_picked_ports_taken_every_time_fail_after_the_tries_and_a_given_port_at_once(tmp_path):
    picked, given = [], []
    with pytest.raises(PortTaken, match=rf"took port \d+ .*\(address already in use\).*{PORT_TRIES} picked ports"):
        FakeServer(tmp_path, picked, taken=PORT_TRIES)
    port = free_port()
    with pytest.raises(PortTaken, match=rf"port={port} was given: pass a free one, or none"):
        FakeServer(tmp_path, given, taken=1, port=port)
    assert len(picked) == PORT_TRIES and len({p for _, p in picked}) == PORT_TRIES
    assert [p for _, p in given] == [port]  # one start, on the given port
    assert not any(group_alive(pgid) for pgid, _ in picked + given)


def test_free_port_draws_below_the_kernels_ephemeral_range_from_the_os_randomness():
    ports = []
    for _ in range(2):
        random.seed(0)  # a seeded run (seed_everything) must not draw the same ports as the next one
        ports.append([free_port() for _ in range(5)])
    if min(PICK_RANGE[1], ephemeral_low()) - PICK_RANGE[0] >= 64:
        assert all(PICK_RANGE[0] <= p < min(PICK_RANGE[1], ephemeral_low()) for p in ports[0] + ports[1])
    assert ports[0] != ports[1]  # equal only with probability < 1e-20
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0][0]))  # free: a server can bind it
