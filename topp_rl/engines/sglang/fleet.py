"""The workers of one `SGLangEngine`, and the checks made before the first rollout.

Exactly one of three modes (`worker_mode`): servers launched here (`Fleet.launch`: N servers at once and, when
N > 1 or asked, a router (smg) in front of them; owned, stopped on `close`), a running router (its healthy
workers through `GET /workers`), or running servers by URL. Then, per worker directly (not through the router,
which does not route control calls either), `Fleet.connect` checks the served model against the policy's (vocab
size, architectures: a server serving another model fails here, not at the first weight push), the mask cap
(`--sampling-mask-max-tokens`) and whether it carries `patches/sglang` (a probe request); and that a router
passes the candidate sets through. The fleet also names the processes behind an error (`serving.client.ProcessNotes`).
"""

import json
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

from topp_rl.engines.serving.client import HTTPClient, RequestError
from topp_rl.engines.sglang import protocol
from topp_rl.engines.sglang.router import SGLangRouter, router_workers
from topp_rl.engines.sglang.server import SGLangServer, remove_workdir

WireMode = Literal["auto", "b64", "nested"]
WorkerMode = Literal["urls", "router_url", "launch"]


class Fleet:
    """Where the workers are (`urls`, `router_url`), the owned processes (`servers`, `launched_router`) and the
    model they serve (`model_path`, `vocab_size`, resolved at `connect` when not given)."""

    def __init__(
        self, *, workdir: Path, model_path: Path | None, vocab_size: int, max_candidates: int
    ) -> None:
        self.workdir, self.model_path, self.vocab_size = workdir, model_path, vocab_size
        self.max_candidates = max_candidates
        self.urls: list[str] = []
        self.router_url: str | None = None
        self.servers: list[SGLangServer] = []
        self.launched_router: SGLangRouter | None = None
        self.mask_max_tokens = 0
        self.infos: dict[str, dict[str, Any]] = {}  # each worker's /server_info at connect (its launch settings)
        self.keep_log = False  # a launched process failed: its log stays when the work dir goes

    @property
    def mask_cap(self) -> int:
        return protocol.mask_cap(self.max_candidates, self.vocab_size)

    # ---- where the workers come from ------------------------------------------------------------------------
    def launch(
        self, n: int, *, router: bool, server_kwargs: dict[str, Any], router_policy: str,
        router_kwargs: dict[str, Any], slots: Sequence[dict[str, Any]] | None = None,
    ) -> None:  # fmt: skip
        """`n` servers started at once (each ~20 s on CPU, mostly imports), then the router when `n > 1` or
        `router`; any failure stops them all (at `close`) and keeps the failed log. `slots`: each server's own
        launch settings (its GPUs, memory fraction, memory saver: the placement plan's), added to `server_kwargs`."""
        self.vocab_size = self.vocab_size or config_vocab_size(self.model_path)
        kwargs = {"sampling_mask_max_tokens": self.mask_cap, **server_kwargs}
        slots = list(slots) if slots is not None else [{}] * n
        if len(slots) != n:
            raise ValueError(f"{len(slots)} placed server slots for num_servers={n}; the placement plan gives each "
                             "launched server its slot")
        dirs = [self.workdir] if n == 1 else [self.workdir / f"server-{k}" for k in range(n)]
        for d in dirs:
            d.mkdir(exist_ok=True)
        with ThreadPoolExecutor(max_workers=n, thread_name_prefix="sglang-launch") as ex:
            futures = [ex.submit(SGLangServer, self.model_path, workdir=d, **kwargs, **slot)
                       for d, slot in zip(dirs, slots, strict=True)]
        errors = []
        for fut in futures:
            try:
                self.servers.append(fut.result())
            except BaseException as err:  # noqa: BLE001 - re-raised below, after the others are kept for close()
                errors.append(err)
        if errors:
            self.keep_log = True  # a server did not come up: its log (named in the error) stays
            raise errors[0]
        self.urls = [srv.url for srv in self.servers]
        if n > 1 or router:
            try:
                self.launched_router = SGLangRouter(self.urls, workdir=self.workdir, python=self.servers[0].python,
                                                    host=self.servers[0].host, policy=router_policy, **router_kwargs)  # fmt: skip
            except BaseException:
                self.keep_log = True
                raise
            self.router_url = self.launched_router.url

    def use_urls(self, urls: Sequence[str]) -> None:
        self.urls = [u.rstrip("/") for u in urls]

    def join_router(self, client: HTTPClient, router_url: str) -> None:
        self.router_url = router_url.rstrip("/")
        self.urls = self.discover_workers(client)

    def discover_workers(self, client: HTTPClient) -> list[str]:
        """The router's healthy workers (`GET /workers`)."""
        found = router_workers(client.get(self.router_url, "/workers"), healthy_only=True)
        if not found:
            raise RuntimeError(
                f"the SGLang router {self.router_url} lists no healthy worker (GET /workers); start workers and "
                "register them with it (smg launch --worker-urls ...), or connect to servers with urls=[...]"
            )
        return found

    def live_workers(self, client: HTTPClient) -> list[str]:
        """The workers to update: the launched servers still running (one that exited is named and skipped:
        the router stops routing to it), the router's healthy workers now, or the given URLs."""
        if self.servers:
            codes = {srv.url: srv.returncode for srv in self.servers}  # polled once: the same view below
            for srv in self.servers:
                if codes[srv.url] is not None:
                    print(f"[topp_rl] SGLang server {srv.url} exited (code {codes[srv.url]}, log {srv.log_path}); "
                          "weights go to the others", file=sys.stderr, flush=True)  # fmt: skip
            targets = [url for url, code in codes.items() if code is None]
        else:
            targets = self.discover_workers(client) if self.router_url is not None else list(self.urls)
        if not targets:
            raise RequestError(f"no SGLang worker left to update (all of {self.urls} exited)")
        return targets

    # ---- connect-time checks --------------------------------------------------------------------------------
    def connect(self, client: HTTPClient, *, wire: WireMode, prefix_cache: bool = True) -> bool:
        """Per worker (directly, not through the router): served model, mask cap, patch and, with `prefix_cache`
        false, that it runs without SGLang's prefix (radix) cache; then that the router passes the candidate sets
        through. Returns whether the compact (b64) wire format is used."""
        infos = [client.get(url, "/server_info") for url in self.urls]
        self.infos = dict(zip(self.urls, infos, strict=True))
        cached = [url for url, info in zip(self.urls, infos, strict=True) if not info.get("disable_radix_cache")]
        if not prefix_cache and cached:
            raise ValueError(
                f"pause_mode='in_place' but SGLang servers {cached} run with a prefix (radix) cache: the KV an update "
                "leaves behind (computed by the old weights) would serve later requests sharing a prefix, a GRPO "
                "group's prompt; start them with --disable-radix-cache, or use pause_mode='retract'"
            )
        if self.model_path is None:
            self.model_path = Path(infos[0]["model_path"])
        if not self.vocab_size:
            self.vocab_size = config_vocab_size(self.model_path)
        for url in self.urls:
            self._check_served_model(client, url)
        caps = [int(i.get("sampling_mask_max_tokens") or 0) for i in infos]
        self.mask_max_tokens = min(caps)
        if self.mask_max_tokens < self.mask_cap:
            small = [u for u, c in zip(self.urls, caps, strict=True) if c < self.mask_cap]
            raise ValueError(
                f"SGLang servers {small} record at most {self.mask_max_tokens} candidates "
                f"(--sampling-mask-max-tokens), but max_candidates={self.max_candidates} needs {self.mask_cap} "
                "(one more, to tell an overflowing set from a full one); start them with "
                f"--sampling-mask-max-tokens {self.mask_cap} or set max_candidates <= {self.mask_max_tokens - 1}"
            )
        probe = protocol.probe_body(b64=True)
        patched = [
            protocol.has_candidates(client.post(url, "/generate", probe), b64=True) for url in self.urls
        ]
        if wire == "b64" and not all(patched):
            bad = [u for u, p in zip(self.urls, patched, strict=True) if not p]
            raise ValueError(
                f"wire='b64' but servers {bad} lack the topp_rl patch (patches/sglang); "
                "build them with scripts/setup_sglang.sh or pass wire='auto'"
            )
        b64 = all(patched) and wire != "nested"
        if self.router_url is not None:
            self._check_router_passes_masks(client, b64=b64)
        return b64

    def _check_router_passes_masks(self, client: HTTPClient, *, b64: bool) -> None:
        """smg re-serialises /generate through a fixed struct; releases before 1.5.0 drop our top-level fields."""
        answer = client.post(self.router_url, "/generate", protocol.probe_body(b64=b64))
        if not protocol.has_candidates(answer, b64=b64):
            raise ValueError(
                f"the router {self.router_url} dropped the candidate sets (return_sampling_mask"
                f"{'_b64' if b64 else ''} did not reach the worker, or its answer lost them); use smg "
                ">= 1.5.0 (scripts/setup_sglang.sh pins 1.13.0) or connect to the servers with urls=[...]"
            )

    def _check_served_model(self, client: HTTPClient, url: str) -> None:
        """The server must serve the policy's model: same vocab size and architectures (else the candidate ids
        mean other tokens, and a weight push with the policy's names and shapes fails or kills the server)."""
        served_arch = client.get(url, "/model_info").get("architectures")
        config = Path(self.model_path or "") / "config.json"
        policy_arch = json.loads(config.read_text()).get("architectures") if config.is_file() else None
        probe, bound = protocol.vocab_probe_body(), client.timeouts.call(tokens=2)
        status, text = client.call("POST", url, "/generate", probe, bound)
        vocab = protocol.served_vocab(status, text)
        if vocab is None:
            raise RuntimeError(
                f"SGLang server {url} did not report its vocab size (HTTP {status}: {text[:300]}); "
                "this client expects SGLang 0.5.23 (scripts/setup_sglang.sh)"
            )
        problems = []
        if vocab != self.vocab_size:
            problems.append(f"vocab size {vocab} (policy: {self.vocab_size})")
        if policy_arch and served_arch and list(served_arch) != list(policy_arch):
            problems.append(f"architectures {served_arch} (policy: {policy_arch})")
        if problems:
            raise ValueError(
                f"SGLang server {url} serves another model than the policy: {'; '.join(problems)}; start it with "
                f"--model-path {self.model_path} (the policy's checkpoint) or point urls= at a server that does"
            )

    # ---- what an error names (serving.client.ProcessNotes) ------------------------------------------------------------
    def exit_note(self) -> str:
        """Why a launched server stopped answering, when it is because it exited (not a network problem)."""
        return "".join(f"; the launched server {srv.url} exited (code {srv.returncode}), its log: {srv.log_path}"
                       for srv in self.servers if srv.returncode is not None)  # fmt: skip

    def logs_of(self, url: str) -> list[str]:
        return [str(srv.log_path) for srv in self.servers if srv.url == url or url == self.router_url]

    def close(self) -> None:
        """Stop the owned router, then the servers (in parallel); remove the work dir, keeping a failed log."""
        if self.launched_router is not None:  # first: it would health-check the servers going down
            self.launched_router.stop()
            self.keep_log |= self.launched_router.failed
            self.launched_router = None
        with ThreadPoolExecutor(max_workers=max(1, len(self.servers))) as ex:
            list(ex.map(lambda srv: srv.stop(), self.servers))
        self.keep_log |= any(srv.failed for srv in self.servers)
        self.servers = []
        remove_workdir(self.workdir, keep_log=self.keep_log)


def worker_mode(
    *, urls: Any, router_url: str | None, model_path: Any, num_servers: int, router: bool
) -> WorkerMode:
    """Which of the three exclusive ways to reach the workers the arguments ask for; ValueError on a mix."""
    if not isinstance(num_servers, int) or num_servers < 1:
        raise ValueError(f"num_servers ({num_servers!r}) must be an integer >= 1")
    if urls and router_url:
        raise ValueError(
            f"urls ({list(urls)}) and router_url ({router_url!r}) are exclusive: pass the router's URL to go "
            "through it, or the servers' URLs to address them directly"
        )
    connect = "urls" if urls else "router_url" if router_url else None
    if connect and (num_servers != 1 or router):
        raise ValueError(
            f"{connect}= connects to running workers, but num_servers={num_servers}, router={router} ask to launch "
            f"them; drop {connect} to launch, or keep num_servers=1, router=false to connect"
        )
    if connect is None and model_path is None:
        raise ValueError(
            "SGLangEngine needs urls=[...] of running servers, router_url= of a running router, or model_path= "
            "to launch servers"
        )
    return connect or "launch"


def config_vocab_size(model_path: Path | None) -> int:
    config = Path(model_path or "") / "config.json"
    if not config.is_file():
        raise ValueError(
            f"cannot read the vocab size: {config} does not exist; pass vocab_size= or a local model_path"
        )
    cfg = json.loads(config.read_text())
    vocab = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size")
    if not vocab:
        raise ValueError(f"{config} has no vocab_size; pass vocab_size= to SGLangEngine")
    return int(vocab)
