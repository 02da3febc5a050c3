"""An engine-neutral HTTP client for inference servers: bounded, retried, streamed JSON calls (`HTTPClient`).

No silent hangs: every wait is bounded, separately (`Timeouts`): connect, first byte (a base plus an allowance
per prompt + new token of a /generate, per GB of weights of an update), and the whole request (first-byte bound
+ `transfer_s`, checked between body chunks). A timeout is not retried (a hung server does not recover by
asking again): it raises `RequestTimeoutError` naming the server, the call and the wait. Connection errors and
5xx are retried with bounded exponential backoff (`Retries`; on top of a router's own retries on another
worker). While calls wait, one line per server and call goes to stderr every `progress_interval_s` (`Waits`).
The engine names its servers in every message (`label`, e.g. "SGLang"); the endpoints are the engine's own.
"""

import contextlib
import difflib
import json
import math
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Protocol, TypeVar

import requests
import urllib3
from tqdm.auto import tqdm


class RequestError(RuntimeError):
    """A request that still failed (connection error or 5xx) after every retry."""


class RequestTimeoutError(RequestError):
    """A server that accepted a request but did not answer within its bound (not retried)."""


@dataclass(frozen=True)
class Bound:
    """Time limits of one request: until the first response byte, and for the whole request."""

    first_byte_s: float
    total_s: float
    how: str  # how first_byte_s was derived, for the error message


# The longest any one wait may be bounded by, and the most retries of a call: a larger value is a unit mistake
# (milliseconds for seconds) or a way to wait forever, and is refused.
MAX_WAIT_S = 86_400.0  # a day
MAX_RETRIES = 100


def is_seconds(value: Any, *, zero_ok: bool) -> bool:
    """A finite number of seconds in (0, MAX_WAIT_S] (or [0, MAX_WAIT_S] when `zero_ok`); bools are not numbers."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return False
    return (value >= 0 if zero_ok else value > 0) and value <= MAX_WAIT_S


@dataclass(frozen=True)
class Timeouts:
    """Every wait on a server, in seconds (the config's `rollout.engine.timeouts.*`). Bases must be > 0, the
    per-token / per-GB allowances >= 0, each finite and at most `MAX_WAIT_S`: every wait needs a finite bound."""

    connect_s: float = 10.0
    first_byte_s: float = 60.0  # + per_token_s x (prompt + max_new_tokens) of a /generate
    per_token_s: float = 0.5
    transfer_s: float = 60.0  # added to the first-byte bound for the whole request
    weight_update_s: float = 120.0  # + per_gb_s x GB of a weight-update call
    per_gb_s: float = 60.0

    ALLOWANCES: ClassVar[tuple[str, ...]] = ("per_token_s", "per_gb_s")  # may be 0; the bases may not

    def __post_init__(self) -> None:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        bad = {k: v for k, v in values.items() if not is_seconds(v, zero_ok=k in self.ALLOWANCES)}
        if bad:
            raise ValueError(
                f"timeouts {bad} out of range: bases must be > 0, per-token / per-GB allowances >= 0, each a finite "
                f"number of seconds <= {MAX_WAIT_S:g} (every wait needs a finite bound); pass values in that range"
            )

    def call(self, *, tokens: int = 0) -> Bound:
        """A /generate's (or a small call's) limits, scaled with its tokens."""
        first = self.first_byte_s + self.per_token_s * tokens
        how = f"timeouts.first_byte_s {self.first_byte_s:g} + timeouts.per_token_s {self.per_token_s:g} x {tokens} "
        how += "tokens"
        return Bound(first_byte_s=first, total_s=first + self.transfer_s, how=how)

    def weights(self, weight_bytes: int) -> Bound:
        """A weight-update call's limits (a bucket, a checkpoint load, pause / resume), scaled with its bytes."""
        gb = weight_bytes / 1e9
        first = self.weight_update_s + self.per_gb_s * gb
        how = f"timeouts.weight_update_s {self.weight_update_s:g} + timeouts.per_gb_s {self.per_gb_s:g} x {gb:.3f} GB"
        return Bound(first_byte_s=first, total_s=first + self.transfer_s, how=how)


@dataclass(frozen=True)
class Retries:
    """Retries of a connection error or 5xx: `max_retries` more attempts, the k-th after
    min(max_backoff_s, backoff_s * 2**(k-1)) seconds."""

    max_retries: int = 4
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0

    def __post_init__(self) -> None:
        count = self.max_retries
        if not (isinstance(count, int) and not isinstance(count, bool) and 0 <= count <= MAX_RETRIES
                and is_seconds(self.backoff_s, zero_ok=True) and is_seconds(self.max_backoff_s, zero_ok=True)):
            raise ValueError(
                f"max_retries ({count!r}) must be an integer >= 0, backoff_s ({self.backoff_s!r}) and "
                f"max_backoff_s ({self.max_backoff_s!r}) >= 0; at most {MAX_RETRIES} retries and finite backoffs of "
                f"at most {MAX_WAIT_S:g} s"
            )

    def delay(self, attempt: int) -> float:
        """Seconds to wait before attempt `attempt` (0: the first, no wait)."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)) if attempt else 0.0


class ProcessNotes(Protocol):
    """What the client may add to an error about the processes behind a URL (the engine's `Fleet`)."""

    def exit_note(self) -> str: ...

    def logs_of(self, url: str) -> list[str]: ...


class _Deadline(Exception):
    pass


class HTTPClient:
    """JSON calls to inference servers over HTTP: one `requests.Session` per thread, a pool of `max_concurrency` threads for
    concurrent calls (`submit`), each call bounded by a `Bound` and retried per `retries`."""

    def __init__(
        self,
        *,
        timeouts: Timeouts,
        retries: Retries,
        max_concurrency: int = 64,
        progress_interval_s: float = 30.0,
        notes: ProcessNotes | None = None,
        label: str,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency ({max_concurrency}) must be >= 1")
        self.timeouts, self.retries, self.notes, self.label = timeouts, retries, notes, label
        self._local = threading.local()
        prefix = f"{label.lower()}-client"
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix=prefix)
        self.waits = Waits(progress_interval_s, label=label)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run `fn(*args)` on the client's thread pool."""
        return self._pool.submit(fn, *args)

    def get(self, url: str, path: str) -> dict[str, Any]:
        return self.request("GET", url, path, None, self.timeouts.call())

    def post(self, url: str, path: str, body: dict[str, Any], bound: Bound | None = None) -> dict[str, Any]:
        return self.request("POST", url, path, body, bound or self.timeouts.call())

    def request(
        self, method: str, url: str, path: str, body: dict[str, Any] | None, bound: Bound
    ) -> dict[str, Any]:
        """The JSON answer; 4xx raise ValueError, a reported failure RuntimeError (`parse_answer`)."""
        return parse_answer(method, url, path, *self.call(method, url, path, body, bound), label=self.label)

    def call(
        self, method: str, url: str, path: str, body: dict[str, Any] | None, bound: Bound
    ) -> tuple[int, str]:
        """(status, body text) of one request below HTTP 500. Connection errors and 5xx are retried with
        exponential backoff; a server that accepted the request but missed `bound` raises at once."""
        last = ""
        for attempt in range(self.retries.max_retries + 1):
            if attempt:
                time.sleep(self.retries.delay(attempt))
            start = time.monotonic()
            try:
                with self.waits.track(url, f"{method} {path}", bound.total_s):
                    status, text = self._send(method, url + path, body, bound, start)
            except (requests.ReadTimeout, _Deadline):
                raise RequestTimeoutError(self._timeout_message(method, url, path, bound, start)) from None
            except requests.ConnectionError as err:  # refused, reset, connect timeout: it may be restarting
                last = f"{type(err).__name__}: {err}"
                continue
            if status >= 500:
                last = f"HTTP {status}: {text[:300]}"
                continue
            return status, text
        raise RequestError(
            f"{method} {url}{path} failed after {self.retries.max_retries + 1} attempts; last error: {last}"
            + (self.notes.exit_note() if self.notes is not None else "")
        )

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        return session

    def _send(
        self, method: str, full_url: str, body: dict[str, Any] | None, bound: Bound, start: float
    ) -> tuple[int, str]:
        """One attempt: headers within the first-byte bound, then the body in chunks, each chunk read bounded
        by the socket timeout and the whole request by `bound.total_s` (checked between chunks)."""
        timeout = (self.timeouts.connect_s, bound.first_byte_s)
        with self._session().request(method, full_url, json=body, timeout=timeout, stream=True) as resp:
            chunks = []
            try:
                while chunk := resp.raw.read1(1 << 16, decode_content=True):  # returns what one recv got
                    chunks.append(chunk)
                    if time.monotonic() - start > bound.total_s:
                        raise _Deadline
            except urllib3.exceptions.ReadTimeoutError:
                raise _Deadline from None
            except urllib3.exceptions.ProtocolError as err:
                # reset mid-body: retried like a refused connection
                raise requests.ConnectionError(err) from None
            return resp.status_code, b"".join(chunks).decode("utf-8", errors="replace")

    def _timeout_message(self, method: str, url: str, path: str, bound: Bound, start: float) -> str:
        logs = self.notes.logs_of(url) if self.notes is not None else []
        log = f"; its log: {', '.join(logs)}" if logs else ""
        return (
            f"{self.label} server {url}: {method} {path} got no complete answer after {time.monotonic() - start:.1f} s "
            f"(first-byte bound {bound.first_byte_s:.1f} s = {bound.how}; whole request {bound.total_s:.1f} s); "
            f"the server is hung or overloaded (stopped, or its scheduler died){log}; if it is only slow, raise "
            "those timeouts"
        )

    def close(self) -> None:
        """Cancel queued calls and stop the wait lines; calls in flight end on their own bounds."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.waits.close()


class Waits:
    """The calls in flight; while one waits longer than `interval_s`, a daemon thread prints one line per
    (server, call) every `interval_s`, so a slow or hung server is never silent. 0 turns the lines off."""

    def __init__(self, interval_s: float, *, label: str) -> None:
        self.interval_s, self.label = interval_s, label
        self._calls: dict[int, tuple[str, str, float, float]] = {}  # id -> (url, call, start, bound)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def track(self, url: str, call: str, bound_s: float) -> Iterator[None]:
        key = object()
        with self._lock:
            self._calls[id(key)] = (url, call, time.monotonic(), bound_s)
            if self._thread is None and self.interval_s > 0:
                self._thread = threading.Thread(target=self._run, daemon=True, name=f"{self.label.lower()}-waits")
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                del self._calls[id(key)]

    def pending(self) -> int:
        """How many calls are in flight now."""
        with self._lock:
            return len(self._calls)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for line in self.lines():
                print(line, file=sys.stderr, flush=True)

    def lines(self) -> list[str]:
        now = time.monotonic()
        groups: dict[tuple[str, str], list[tuple[float, float]]] = {}
        with self._lock:
            for url, call, start, bound in self._calls.values():
                groups.setdefault((url, call), []).append((start, bound))
        out = []
        for (url, call), waits in sorted(groups.items()):
            start, bound = min(waits)
            if now - start >= self.interval_s:
                out.append(f"[topp_rl] {self.label} server {url}: {call} waiting {now - start:.0f} s "
                           f"(bound {bound:.0f} s; {len(waits)} pending)")  # fmt: skip
        return out

    def close(self) -> None:
        self._stop.set()


_Limits = TypeVar("_Limits", Timeouts, Retries)


def limits_from(kind: type[_Limits], given: _Limits | Mapping[str, Any] | None, name: str) -> _Limits:
    """`given` itself, or one built from a mapping of its fields (a config group such as
    `rollout.engine.timeouts`; a key missing keeps its default), or the defaults for None. A key that is not a
    field raises ValueError naming it and the valid ones."""
    if given is None:
        return kind()
    if isinstance(given, kind):
        return given
    if not isinstance(given, Mapping):
        raise ValueError(f"{name}= is a {type(given).__name__}; pass a {kind.__name__} or a mapping of its fields")
    check_group_keys(kind, given.keys(), name)
    return kind(**given)


def check_group_keys(kind: type, keys: Iterable[Any], name: str) -> None:
    """Every key of the group `name` must be a field of the dataclass `kind`; ValueError naming the first other."""
    valid = [f.name for f in fields(kind)]
    for key in keys:
        if key not in valid:
            near = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.5)
            raise ValueError(
                f"{name} has no key {key!r}: valid keys are {', '.join(valid)} ({kind.__name__}); "
                + (f"did you mean {near[0]!r}? " if near else "") + "fix the spelling, or drop the key"
            )

def parse_answer(method: str, url: str, path: str, status: int, text: str, *, label: str) -> dict[str, Any]:
    """JSON answer of a call below HTTP 500; 4xx raise ValueError, a reported failure RuntimeError."""
    if status >= 400:
        raise ValueError(
            f"{label} at {url} rejected {method} {path} (HTTP {status}): {text[:500]}; "
            "check the request parameters against the server's flags"
        )
    data = json.loads(text)
    if isinstance(data, dict) and data.get("success") is False:
        raise RuntimeError(f"{label} at {url} reported failure on {path}: {data.get('message')}")
    return data


def error_message(text: str) -> str:
    """The message of an error body in the OpenAI style ({"error": {"message": ...}}), else the body itself."""
    try:
        error = json.loads(text).get("error")
        return str(error.get("message") if isinstance(error, dict) else error or text)
    except (ValueError, AttributeError):
        return text[:500]


def gather(futures: list[Future], *, desc: str, progress: bool) -> list[Any]:
    """The futures' results in submission order, behind a progress bar (`desc`, shown when `progress`) that moves as
    they complete in any order. The first failure raises as soon as it completes, before any result is used; the
    calls not yet started are cancelled."""
    bar = tqdm(total=len(futures), desc=desc, unit="sample", disable=not progress)
    try:
        for fut in as_completed(futures):
            fut.result()
            bar.update(1)
    finally:
        bar.close()
        for fut in futures:
            fut.cancel()
    return [fut.result() for fut in futures]
