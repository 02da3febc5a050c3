"""`RewardService` (issue 22 part 2) against a real HTTP server on 127.0.0.1 (ThreadingHTTPServer in a thread):
the JSON schema both ways, batching, concurrent batches, retries, bounded timeouts, the errors that name the URL
and the response, overlap with the other reward terms, and a short training run on CPU."""

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers import column, compose_cfg, read_metrics

from topp_rl.data import PromptRecord
from topp_rl.tasks import RewardService
from topp_rl.tasks.rewards import RewardError, RewardSet

WAIT_S = 20  # an upper bound on waits for events a working client causes at once


def length_score(completion: str) -> float:
    return len(completion) / 4


class ScoreServer(ThreadingHTTPServer):
    """Scores each completion by its length / 4; `plan` holds (status, body) answers to give first, in order;
    `barrier` (when set) holds each request until that many are in flight; `hold` keeps requests unanswered."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[dict] = []
        self.plan: list[tuple[int, str]] = []
        self.barrier: threading.Barrier | None = None
        self.hold = threading.Event()  # cleared: answer; set: keep the request open until `release`
        self.release = threading.Event()
        self.received = threading.Event()
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/score"


class _Handler(BaseHTTPRequestHandler):
    server: ScoreServer

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        with server.lock:
            server.requests.append(request)
            planned = server.plan.pop(0) if server.plan else None
        server.received.set()
        if server.hold.is_set():
            server.release.wait(WAIT_S)
        status, body = planned or (200, json.dumps({"scores": [length_score(c) for c in request["completions"]]}))
        if server.barrier is not None:
            try:
                server.barrier.wait(WAIT_S)
            except threading.BrokenBarrierError:
                status, body = 500, "the batches came one at a time"
        self.send_response(status)
        self.send_header("Content-Length", str(len(body.encode())))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args) -> None:  # quiet test output
        pass


@pytest.fixture
def server():
    srv = ScoreServer()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.release.set()
        srv.shutdown()
        srv.server_close()
        thread.join(WAIT_S)


def _records(n: int) -> list[PromptRecord]:
    return [PromptRecord(index=i, text=f"p{i}:", prompt_ids=[1], answer=str(i), data={"row": i}) for i in range(n)]


COMPLETIONS = ["a", "bb", "ccc", "dddd", "eeeee"]


def test_schema_batches_and_concurrency(server):
    """Five samples in batches of 2: three requests, up to 3 in flight at once (the barrier proves it), the scores
    back in order; the request holds prompts, completions, answers and the rows."""
    server.barrier = threading.Barrier(3)
    service = RewardService(url=server.url, batch_size=2, max_concurrency=3)
    assert service(COMPLETIONS, _records(5)) == [length_score(c) for c in COMPLETIONS]
    by_first = sorted(server.requests, key=lambda r: r["prompts"][0])
    assert by_first[0] == {"prompts": ["p0:", "p1:"], "completions": ["a", "bb"], "answers": ["0", "1"],
                           "data": [{"row": 0}, {"row": 1}]}
    assert [len(r["completions"]) for r in by_first] == [2, 2, 1]
    server.barrier, server.requests[:] = None, []
    assert RewardService(url=server.url, send_data=False)(["x"], _records(1)) == [0.25]
    assert server.requests == [{"prompts": ["p0:"], "completions": ["x"], "answers": ["0"]}]
    assert service([], []) == []


def test_retries_and_errors_name_the_url_and_the_response(server):
    service = RewardService(url=server.url, retries=2, backoff_s=0.01)
    server.plan = [(503, "warming up"), (429, "slow down")]  # retried, then answered
    assert service(["abcd"], _records(1)) == [1.0]
    assert len(server.requests) == 3
    cases = [
        ((400, "no field 'completions'"), r"failed on a batch of 1 samples after 1 attempt\(s\): HTTP 400, body "
         r"\"no field 'completions'\""),
        ((200, "not json"), r"answered 'not json' to a batch of 1 samples; it must answer JSON \{\"scores\": "
         r"\[\.\.\.\]\} with 1 values"),
        ((200, '{"scores": [1.0, 2.0]}'), r"answered '\{\"scores\": \[1.0, 2.0\]\}' to a batch of 1 samples"),
        ((200, '{"score": 1.0}'), r"answered '\{\"score\": 1.0\}'"),
    ]
    for answer, message in cases:
        server.plan, server.requests[:] = [answer], []
        with pytest.raises(RewardError, match=rf"reward service {server.url} {message}"):
            service(["x"], _records(1))
        assert len(server.requests) == 1  # not retried
    server.plan, server.requests[:] = [(500, "boom")] * 3, []
    with pytest.raises(RewardError, match=r"after 3 attempt\(s\): HTTP 500, body 'boom'; check that the service"):
        service(["x"], _records(1))
    assert len(server.requests) == 3
    # Per-sample dicts follow the reward-function rule inside a reward set: "score" summed, the rest logged.
    server.plan = [(200, '{"scores": [{"score": 0.5, "judge_len": 3}, {"score": 2, "judge_len": 1}]}')]
    totals, parts = RewardSet.from_config([{"fn": service, "name": "remote"}])(["x", "y"], _records(2), [7, 8])
    assert totals == [0.5, 2.0]
    assert parts == [{"remote": 0.5, "remote/judge_len": 3.0}, {"remote": 2.0, "remote/judge_len": 1.0}]
    server.plan = [(200, '{"scores": ["high"]}')]
    with pytest.raises(RewardError, match=r"function remote returned 'high' \(str\) for sample 7"):
        RewardSet.from_config([{"fn": service, "name": "remote"}])(["x"], _records(1), [7])


def test_timeouts_and_refused_connections_are_bounded(server):
    server.hold.set()  # the server keeps every request open until the test ends
    service = RewardService(url=server.url, timeout_s=0.2, retries=1, backoff_s=0.01)
    with pytest.raises(RewardError, match=rf"reward service {server.url} failed .* after 2 attempt\(s\): "
                       r"(TimeoutError|URLError): .*timed out"):
        service(["x"], _records(1))
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/score"
    with pytest.raises(RewardError, match=rf"reward service {closed} failed .* after 1 attempt\(s\): URLError: "
                       r".*[Rr]efused"):
        RewardService(url=closed, retries=0)(["x"], _records(1))
    for kwargs, message in (({"url": "localhost:8000"}, "must be an http:// or https:// URL"),
                            ({"url": server.url, "timeout_s": 0}, r"need batch_size, max_concurrency >= 1")):
        with pytest.raises(ValueError, match=message):
            RewardService(**kwargs)


def test_the_service_scores_while_the_other_terms_compute(server, tmp_path):
    """A function term listed first waits until the service has the step's request: it returns only because the
    set sent the request before calling it (a sequential set would time out here)."""
    reward_file = tmp_path / "waits.py"
    reward_file.write_text(
        "import threading\nreceived = None\n\n"
        "def waits(response, record):\n"
        f"    if not received.wait({WAIT_S}):\n"
        "        raise TimeoutError('the service got no request while this term ran')\n"
        "    return 1.0\n"
    )
    rewards = RewardSet.from_config([
        f"{reward_file}:waits", {"_target_": "topp_rl.tasks.RewardService", "url": server.url, "name": "remote"}
    ])
    rewards.terms[0].fn.__globals__["received"] = server.received
    totals, parts = rewards(["ab", "abcd"], _records(2), [0, 1])
    assert totals == [1.5, 2.0] and parts == [{"waits": 1.0, "remote": 0.5}, {"waits": 1.0, "remote": 1.0}]


def test_an_http_reward_run_trains_on_cpu(server, tmp_path):
    """Issue 22: an HTTP-reward run trains in the suite. Each step sends its 4 samples in one request, and
    rollout/reward_mean is twice (the entry's weight) the mean of the scores the server returned for that step."""
    from topp_rl.train import train

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{d}:", "answer": str(d)}) + "\n" for d in range(8)))
    out = tmp_path / "run"
    # the documented form with a weight and a name: the service node sits under fn
    node = f"{{_target_: topp_rl.tasks.RewardService, url: '{server.url}', timeout_s: 30}}"
    entry = f"{{fn: {node}, weight: 2.0, name: judge}}"
    train(compose_cfg(out, "task=dataset", f"task.path={data}", f"task.rewards=[{entry}]",
                      f"task.cache_dir={tmp_path / 'cache'}", "logger=csv"))
    assert [len(r["completions"]) for r in server.requests] == [4, 4]
    prompts = {f"{d}:" for d in range(8)}
    for request in server.requests:
        assert set(request["prompts"]) <= prompts
        assert request["answers"] == [p.rstrip(":") for p in request["prompts"]]
        assert request["data"] == [{"prompt": p, "answer": a} for p, a in zip(request["prompts"], request["answers"],
                                                                              strict=True)]
    means = [sum(map(length_score, r["completions"])) / 4 for r in server.requests]
    metrics = read_metrics(out)
    assert column(metrics, "rollout/reward_mean") == pytest.approx([2 * m for m in means], rel=1e-6)
    assert column(metrics, "rollout/reward/judge_mean") == pytest.approx(means, rel=1e-6)
