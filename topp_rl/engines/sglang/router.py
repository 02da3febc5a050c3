"""Launch and stop the SGLang model gateway (`smg launch`, PyPI `smg`) in front of SGLang workers.

The router is the one URL generation goes through; its load-balancing policy is a config choice (`cache_aware`,
smg's default, sends requests sharing a prefix, e.g. a GRPO group, to the same worker; `round_robin` spreads
them evenly). It runs from the SGLang venv (`scripts/setup_sglang.sh` installs `smg` there) as
`python -m smg launch`, behind the same watchdog as the servers (`process.spawn_group`): it dies with the
trainer and `stop()` kills its process group.

smg does not route control calls (weight updates, pause / continue, flush): the engine sends those to every
worker directly, found through `router_workers` (`GET /workers`).
Listeners: the router's HTTP port and its Prometheus port both bind `host` (smg binds 0.0.0.0 for both unless
told otherwise).
Retries: a request that fails on a worker (connection refused or reset: a dead worker) is retried by the router
on another one, at most `max_retries` times with backoff capped at `max_backoff_ms`; the client's own bounded
retries (`SGLangEngine.max_retries`) come on top, so a dead worker never hangs a rollout.
"""

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import requests

from topp_rl.engines.serving.net import free_port
from topp_rl.engines.serving.process import LoggedProcessGroup, spawn_group
from topp_rl.engines.sglang.server import require_sglang_python

# smg 1.13's policies for a regular (not prefill/decode-disaggregated) fleet; "manual" and "passthrough" need
# routing headers this client does not send.
ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "least_load", "consistent_hashing",
                   "prefix_hash")  # fmt: skip


def check_policy(policy: str) -> str:
    if policy not in ROUTER_POLICIES:
        raise ValueError(f"router_policy ({policy!r}) must be one of {list(ROUTER_POLICIES)}")
    return policy


class SGLangRouter(LoggedProcessGroup):
    """One smg router process group at `self.url` in front of `worker_urls`; a context manager.

    Ready once smg reports every worker healthy (`GET /readiness`). `log_path` (`workdir/router.log`) is kept
    when it failed."""

    label = "SGLang router"

    def __init__(
        self,
        worker_urls: Sequence[str],
        *,
        workdir: str | Path,
        python: str | Path | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        policy: str = "cache_aware",
        max_retries: int = 3,
        max_backoff_ms: int = 2000,
        health_check_interval_s: int = 5,
        startup_timeout_s: float = 60.0,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        if not worker_urls:
            raise ValueError("SGLangRouter needs at least one worker URL")
        if max_retries < 0 or max_backoff_ms < 1 or health_check_interval_s < 1:
            raise ValueError(
                f"router max_retries ({max_retries}) must be >= 0, max_backoff_ms ({max_backoff_ms}) and "
                f"health_check_interval_s ({health_check_interval_s}) >= 1"
            )
        python = require_sglang_python(python)
        self.worker_urls = list(worker_urls)
        self.log_path = Path(workdir) / "router.log"

        def command() -> list[str]:  # on the port `_start_on_port` sets
            return [
                str(python), "-m", "smg", "launch",
                "--worker-urls", *self.worker_urls,
                "--policy", check_policy(policy),
                "--host", host, "--port", str(self.port),
                "--prometheus-host", host, "--prometheus-port", str(free_port(host)),
                "--disable-tokenizer-autoload",  # token ids in, token ids out: no tokenizer in the router
                # Router retries: 1 + max_retries attempts, the backoff capped (smg's default cap is 30 s).
                *(("--retry-max-retries", str(max_retries + 1)) if max_retries else ("--disable-retries",)),
                "--retry-max-backoff-ms", str(max_backoff_ms),
                "--health-check-interval-secs", str(health_check_interval_s),
                *extra_args,
            ]  # fmt: skip

        self._start_on_port(host, port, lambda: spawn_group(python, command(), log=self._log, env=_router_env()),
                            lambda: self._wait_ready(startup_timeout_s))  # fmt: skip

    def _wait_ready(self, timeout_s: float) -> None:
        start, last = time.monotonic(), "no answer"
        while time.monotonic() - start < timeout_s:
            self._raise_if_port_taken()  # smg exits when its bind fails
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"SGLang router {self.url} exited with code {self._proc.returncode} while starting; "
                    f"log: {self.log_path}; last lines:\n{self.log_tail()}"
                )
            try:
                resp = requests.get(f"{self.url}/readiness", timeout=(2, 5))
                last = f"HTTP {resp.status_code}: {resp.text[:200]}"
                if resp.ok and resp.json().get("healthy_workers") == len(self.worker_urls):
                    return
            except requests.RequestException as err:
                last = type(err).__name__
            time.sleep(0.5)
        raise TimeoutError(
            f"SGLang router {self.url} did not report its {len(self.worker_urls)} workers healthy within "
            f"{timeout_s:.0f} s (startup_timeout_s; last answer: {last}); log: {self.log_path}"
        )

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after `timeout_s`; idempotent."""
        self._stop_group(timeout_s)

    def __enter__(self) -> "SGLangRouter":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def router_workers(workers_json: dict[str, Any], *, healthy_only: bool) -> list[str]:
    """Worker URLs from the body of smg's `GET /workers` (`{"workers": [{"url", "is_healthy", ...}]}`)."""
    workers = workers_json.get("workers")
    if not isinstance(workers, list):
        raise RuntimeError(f"the router's GET /workers answered {str(workers_json)[:300]}, not a worker list")
    return [w["url"].rstrip("/") for w in workers if w.get("is_healthy") or not healthy_only]


def _router_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # our venv's packages must not shadow the SGLang venv's
    return env
