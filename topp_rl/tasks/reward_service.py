"""`RewardService`: a reward term scored by an HTTP endpoint (JSON in, scores out), the remote reward of
OpenRLHF's `--remote_rm_url` kind.

Config: `task.rewards=[{_target_: topp_rl.tasks.RewardService, url: "http://host:port/score"}]`.

Request: `POST url` with `Content-Type: application/json`, one request per `batch_size` samples:
    {"prompts": [str, ...], "completions": [str, ...], "answers": [str | null, ...], "data": [object, ...]}
one entry per sample, in order (`data`: each sample's dataset row; left out with `send_data=false`).
Response: a 2xx status and
    {"scores": [value, ...]}
exactly one value per sample, in order: a number, or an object with a "score" number whose other numbers are
logged as `rollout/reward/<name>/<key>_mean` and not summed (the rule for a reward function's return value).

Concurrency: a step's batches go out up to `max_concurrency` at a time on the term's own threads, started before
the step's other reward terms run (`ScoresAsync`), so the service scores while they compute.

Failures: a connection error, a timeout (`timeout_s` for the connection and for each wait on the response), HTTP
429 or 5xx are retried `retries` times, after `backoff_s` seconds doubling each time; any other status, a body
that is not JSON, or "scores" of the wrong length fail at once. Each is a `RewardError` naming the URL, the
status and the start of the response body.
"""

import http.client
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from topp_rl.tasks.rewards import RewardError

if TYPE_CHECKING:
    from topp_rl.data import PromptRecord

BODY_CHARS = 300  # of a response body quoted in an error


class RewardService:
    """Scores a batch by POSTing it to `url` (batched, concurrent, bounded timeouts and retries)."""

    def __init__(
        self,
        *,
        url: str,
        batch_size: int = 64,
        max_concurrency: int = 4,
        timeout_s: float = 60.0,
        retries: int = 2,
        backoff_s: float = 1.0,
        send_data: bool = True,
        headers: Mapping[str, str] | None = None,
        name: str = "reward_service",
    ) -> None:
        parts = urllib.parse.urlsplit(str(url))
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"RewardService url ({url!r}) must be an http:// or https:// URL with a host")
        if batch_size < 1 or max_concurrency < 1 or retries < 0 or not timeout_s > 0 or backoff_s < 0:
            raise ValueError(
                f"RewardService(batch_size={batch_size}, max_concurrency={max_concurrency}, timeout_s={timeout_s}, "
                f"retries={retries}, backoff_s={backoff_s}): need batch_size, max_concurrency >= 1, timeout_s > 0, "
                "retries, backoff_s >= 0"
            )
        self.url, self.batch_size, self.max_concurrency = str(url), batch_size, max_concurrency
        self.timeout_s, self.retries, self.backoff_s = float(timeout_s), retries, float(backoff_s)
        self.send_data, self.headers, self.name = send_data, dict(headers or {}), name

    def __call__(self, responses: list[str], records: list["PromptRecord"]) -> list[Any]:
        return self.submit(responses, records).result()

    def submit(self, responses: list[str], records: list["PromptRecord"]) -> Future:
        """Start scoring; the Future holds one value per response, in order (or the first batch's error)."""
        batches = [
            (self.body(responses[i:i + self.batch_size], records[i:i + self.batch_size]),
             len(responses[i:i + self.batch_size]))
            for i in range(0, len(responses), self.batch_size)
        ]
        if not batches:
            done: Future = Future()
            done.set_result([])
            return done
        pool = ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(batches)),
                                  thread_name_prefix="reward-service")
        futures = [pool.submit(self.post, body, count) for body, count in batches]
        pool.shutdown(wait=False)  # the threads finish the queued batches, then end
        return _joined(futures)

    def body(self, responses: list[str], records: list["PromptRecord"]) -> bytes:
        """The JSON request for one batch."""
        request: dict[str, list] = {
            "prompts": [r.text for r in records],
            "completions": list(responses),
            "answers": [r.answer for r in records],
        }
        if self.send_data:
            request["data"] = [r.data for r in records]
        try:
            return json.dumps(request).encode()
        except (TypeError, ValueError) as err:
            raise RewardError(
                f"reward service {self.url}: the batch cannot be sent as JSON ({err}); a dataset row holds a value "
                "JSON has no type for: set send_data=false, or convert that column"
            ) from err

    def post(self, body: bytes, count: int) -> list[Any]:
        """The scores of one batch, retried on connection errors, timeouts, HTTP 429 and 5xx."""
        delay = self.backoff_s
        for attempt in range(1, self.retries + 2):
            try:
                status, text = self._send(body)
            except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as err:
                problem, retry = f"{type(err).__name__}: {getattr(err, 'reason', err)}", True
            else:
                if 200 <= status < 300:
                    return self._scores(text, count)
                problem, retry = f"HTTP {status}, body {text[:BODY_CHARS]!r}", status == 429 or status >= 500
            if not retry or attempt > self.retries:
                raise RewardError(
                    f"reward service {self.url} failed on a batch of {count} samples after {attempt} attempt(s): "
                    f"{problem}; check that the service runs and answers {{\"scores\": [...]}} (timeout_s="
                    f"{self.timeout_s:g}, retries={self.retries})"
                )
            time.sleep(delay)
            delay *= 2

    def _send(self, body: bytes) -> tuple[int, str]:
        request = urllib.request.Request(
            self.url, data=body, method="POST", headers={"Content-Type": "application/json", **self.headers}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.status, response.read().decode(errors="replace")
        except urllib.error.HTTPError as err:  # a status outside 2xx: its body says why
            return err.code, err.read().decode(errors="replace")

    def _scores(self, text: str, count: int) -> list[Any]:
        try:
            payload = json.loads(text)
        except ValueError:
            payload = None
        scores = payload.get("scores") if isinstance(payload, dict) else None
        if not isinstance(scores, list) or len(scores) != count:
            raise RewardError(
                f"reward service {self.url} answered {text[:BODY_CHARS]!r} to a batch of {count} samples; it must "
                f"answer JSON {{\"scores\": [...]}} with {count} values, one per sample in order"
            )
        return scores


def _joined(futures: list[Future]) -> Future:
    """One Future for the batches' values in order, set once every batch finished (the first error wins)."""
    joined: Future = Future()
    left = [len(futures)]
    lock = threading.Lock()

    def finished(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        try:
            joined.set_result([value for f in futures for value in f.result()])
        except BaseException as err:  # the batch's own error, raised where the set collects the values
            joined.set_exception(err)

    for future in futures:
        future.add_done_callback(finished)
    return joined
