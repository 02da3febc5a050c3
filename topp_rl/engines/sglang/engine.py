"""`SGLangEngine`: rollouts from real SGLang servers over their native HTTP API, with exact candidate sets.

One `/generate` request per sample (`input_ids`, `sampling_params`, `return_logprob`, `return_sampling_mask`),
sent concurrently from a thread pool: through the router (smg) when there is one, else round-robin over the
server URLs. Per response token the Sample gets:
- the candidate set: SGLang's sampling mask (the ids its sampler kept), decoded by `topp_rl.engines.sglang.wire`,
  from our compact base64 arrays when the server carries `patches/sglang` (detected by a probe request),
  else from SGLang's nested JSON lists;
- `rollout_log_probs`: SGLang's `output_token_sampling_logprobs`, the sampled token's log-prob renormalised
  over the kept set;
- `rollout_raw_log_probs`: SGLang's `output_token_logprobs` (log_softmax(logits / T) before truncation).
Departures from SGLang's defaults: the mask needs a finite top_k, so a request without one (top_k=0), or with
one above `max_candidates`, is sent as top_k = max_candidates + 1 (at most the vocab size), and launched servers
get `--sampling-mask-max-tokens` = that. A sample whose kept set exceeds `max_candidates` at any token (it
arrives as a full row of max_candidates + 1 ids) is never cut to the cap: it is ABORTED, with
`metadata["candidate_overflow"] = True` and the reason; so is one SGLang itself aborts for a set over its cap
(HTTP 400). A set of at most max_candidates ids is exactly the one the user's parameters keep. An untruncated
request (top_p=1, top_k=0, min_p=0) asks for no mask (the set is the whole vocabulary) and records no
candidates, its renormalised log-prob being the raw one. A seed is forwarded as a per-sample `sampling_seed`
(seed, index); SGLang honours it only on servers started with `--enable-deterministic-inference`, which its CPU
torch_native backend rejects, so on CPU a seed does not reproduce a rollout (and with min_p > 0 no seed is
sent: SGLang's seeded sampler asserts on min-p). Connection errors and 5xx are retried with bounded exponential
backoff (on top of the router's own retries on another worker); an aborted request yields an empty Sample with
status "aborted", never a half-filled one.

Control calls (weight updates, pause / continue) go to every worker directly; smg does not route them.

No silent hangs: every wait is bounded, separately: connect (`connect_timeout_s`), first byte (a base plus an
allowance per prompt + new token of a /generate, per GB of weights of an update), and the whole request (first
byte bound + `transfer_timeout_s`). A timeout is not retried (a hung server does not recover by asking again):
it raises `SGLangTimeoutError` naming the server, the call and the wait. While calls wait, one line per server
and call is printed every `progress_interval_s`. At connect time each server's model is checked against the
policy's (vocab size, architectures), so a server serving another model fails here, not at the first push.
"""

import contextlib
import json
import re
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import requests
import torch
import urllib3
from tqdm.auto import tqdm

from topp_rl.data.params import SamplingParams
from topp_rl.data.sample import Sample, SampleStatus
from topp_rl.engines.base import RolloutEngine, check_prompts
from topp_rl.engines.sglang.router import SGLangRouter, check_policy, router_workers
from topp_rl.engines.sglang.server import SGLangServer, make_workdir, remove_workdir
from topp_rl.engines.sglang.weights import DistributedWeightSender, write_checkpoint
from topp_rl.engines.sglang.wire import IDS_KEY, decode_candidates

WireMode = Literal["auto", "b64", "nested"]
_FINISH_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED}
_SEED_STRIDE = 1_000_003  # sampling_seed = seed * stride + sample index: distinct per sample, same per rerun
_VOCAB_PROBE_ID = 2**31 - 1  # SGLang rejects it in token_ids_logprob, naming its vocab size (checked before
# the scheduler: an out-of-vocabulary *input* id would crash the server instead)
_VOCAB_RANGE = re.compile(r"valid range is \[0, (\d+)\)")
# SGLang's own abort when a realised set exceeds --sampling-mask-max-tokens (HTTP 400 on a non-streamed
# /generate; on GPU, from top-k cutoff ties): `get_sampling_mask_finish_reason` in its batch_result_processor.
_SGLANG_OVERFLOW = "Sampling support exceeds --sampling-mask-max-tokens"


class SGLangRequestError(RuntimeError):
    """A request that still failed (connection error or 5xx) after every retry."""


class SGLangTimeoutError(SGLangRequestError):
    """A server that accepted a request but did not answer within its bound (not retried)."""


@dataclass(frozen=True)
class _Bound:
    """Time limits of one request: until the first response byte, and for the whole request."""

    first_byte_s: float
    total_s: float
    how: str  # how first_byte_s was derived, for the error message


class _Deadline(Exception):
    pass


@dataclass(frozen=True)
class WeightSyncStats:
    """One `update_weights` call, as the trainer logs it (`perf/weight_sync_s`, `perf/weight_sync_bytes`)."""

    seconds: float  # wall time from pausing the workers to resuming them
    bytes: int  # tensor bytes pushed (every worker receives all of them)
    buckets: int  # broadcast buckets (distributed); 1 for a disk checkpoint
    workers: tuple[str, ...]  # the worker URLs updated
    method: str  # "distributed" or "disk"


@dataclass(frozen=True)
class _ServerOverflow:
    """SGLang aborted the request because a realised set exceeded its --sampling-mask-max-tokens."""

    message: str


class SGLangEngine(RolloutEngine):
    """Rollouts from SGLang workers, reached in one of three modes (exactly one; see `_mode`):
    - launch (`model_path`, no URLs): `num_servers` servers on `model_path`, and when `num_servers > 1` or
      `router=True` a router (smg) in front of them; all owned, bound to loopback, stopped on `close()`;
    - `router_url`: a running router; its workers are found through its `GET /workers`;
    - `urls`: running servers addressed directly, round-robin per sample (no router)."""

    def __init__(
        self,
        *,
        urls: Sequence[str] | None = None,
        router_url: str | None = None,
        model_path: str | Path | None = None,
        num_servers: int = 1,
        router: bool = False,
        router_policy: str = "cache_aware",
        router_kwargs: dict[str, Any] | None = None,
        max_candidates: int = 4096,
        vocab_size: int | None = None,
        record_candidates: bool = True,
        record_raw_log_probs: bool = True,
        wire: WireMode = "auto",
        weight_sync: Literal["disk", "distributed"] = "disk",
        weight_bucket_bytes: int = 512 * 2**20,
        max_concurrency: int = 64,
        max_retries: int = 4,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        connect_timeout_s: float = 10.0,
        first_byte_timeout_s: float = 60.0,
        per_token_timeout_s: float = 0.5,
        transfer_timeout_s: float = 60.0,
        weight_update_timeout_s: float = 120.0,
        per_gb_timeout_s: float = 60.0,
        progress: bool = True,
        progress_interval_s: float = 30.0,
        extra_sampling_params: dict[str, Any] | None = None,
        workdir: str | Path | None = None,
        weight_sync_host: str = "127.0.0.1",
        server_kwargs: dict[str, Any] | None = None,
    ) -> None:
        mode = _mode(urls=urls, router_url=router_url, model_path=model_path, num_servers=num_servers,
                     router=router)  # fmt: skip
        check_policy(router_policy)
        if wire not in ("auto", "b64", "nested"):
            raise ValueError(f"wire ({wire!r}) must be 'auto', 'b64' or 'nested'")
        if weight_sync not in ("disk", "distributed"):
            raise ValueError(f"weight_sync ({weight_sync!r}) must be 'disk' or 'distributed'")
        if max_concurrency < 1 or max_retries < 0:
            raise ValueError(
                f"max_concurrency ({max_concurrency}) must be >= 1, max_retries ({max_retries}) >= 0"
            )
        if max_candidates < 1 or weight_bucket_bytes < 1:
            raise ValueError(
                f"max_candidates ({max_candidates}) and weight_bucket_bytes ({weight_bucket_bytes}) must be >= 1 "
                "(defaults: 4096, SGLang's --sampling-mask-max-tokens default, and 512 MiB)"
            )
        _check_timeouts(
            bases={"connect_timeout_s": connect_timeout_s, "first_byte_timeout_s": first_byte_timeout_s,
                   "transfer_timeout_s": transfer_timeout_s, "weight_update_timeout_s": weight_update_timeout_s},
            allowances={"per_token_timeout_s": per_token_timeout_s, "per_gb_timeout_s": per_gb_timeout_s},
        )  # fmt: skip
        self.model_path = Path(model_path) if model_path is not None else None
        self.max_candidates = max_candidates
        self.record_candidates = record_candidates
        self.record_raw_log_probs = record_raw_log_probs
        self.weight_sync = weight_sync
        self.weight_bucket_bytes = weight_bucket_bytes
        self.weight_sync_host = weight_sync_host
        self.max_retries, self.backoff_s, self.max_backoff_s = max_retries, backoff_s, max_backoff_s
        self.connect_timeout_s, self.transfer_timeout_s = connect_timeout_s, transfer_timeout_s
        self.first_byte_timeout_s, self.per_token_timeout_s = first_byte_timeout_s, per_token_timeout_s
        self.weight_update_timeout_s, self.per_gb_timeout_s = weight_update_timeout_s, per_gb_timeout_s
        self.progress = progress
        # SGLang-only sampling keys (e.g. {"ignore_eos": True} for benchmarks), added to every request.
        self.extra_sampling_params = dict(extra_sampling_params or {})
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="sglang-client")
        self._waits = _Waits(progress_interval_s)
        self._distributed: DistributedWeightSender | None = None
        self._syncs = 0  # weight version served after the k-th sync: str(k) (SGLang's weight_version)
        self.last_sync: WeightSyncStats | None = None
        self.servers: list[SGLangServer] = []
        self.launched_router: SGLangRouter | None = None
        self.router_url: str | None = None
        self.vocab_size = vocab_size or 0
        self._keep_log = False
        # Server and router logs, disk-sync checkpoints and rendezvous files; removed on close (failed logs kept).
        self.workdir = make_workdir(workdir)
        try:
            if mode == "urls":
                self.urls = [u.rstrip("/") for u in urls]
            elif mode == "router_url":
                self.router_url = router_url.rstrip("/")
                self.urls = self._discover_workers()
            else:
                self.vocab_size = vocab_size or _config_vocab_size(self.model_path)
                self._launch_servers(
                    num_servers, {"progress_interval_s": progress_interval_s, **(server_kwargs or {})}
                )
                if num_servers > 1 or router:
                    self._launch_router(router_policy, router_kwargs or {})
            self._connect(wire)
        except BaseException:
            self.close()
            raise

    @classmethod
    def for_policy(
        cls, *, model, tokenizer, workdir: Path, share_weights: bool = False, **kwargs
    ) -> "SGLangEngine":
        """The config factory (`rollout.engine`): servers launched on the policy's initial weights, written
        once to `workdir/init` (SGLang loads weights from disk); their logs and weight copies live under `workdir`.
        A server always holds its own weights: `share_weights` (the embedded engine's option) must be false."""
        from topp_rl.models import save_model

        if share_weights:
            raise ValueError(
                "rollout.engine.share_weights=true: an SGLang server holds its own copy of the weights and cannot "
                "sample with the trainer's; set rollout.engine.share_weights=false (the rollout=sglang default)"
            )

        path = save_model(model, tokenizer, Path(workdir) / "init")
        return cls(model_path=path, vocab_size=int(model.config.vocab_size), workdir=workdir, **kwargs)

    @property
    def server(self) -> SGLangServer | None:
        """The first launched server (the only one unless num_servers > 1); None when connected."""
        return self.servers[0] if self.servers else None

    # ---- launch -----------------------------------------------------------------------------------------
    @property
    def _mask_cap(self) -> int:
        """The servers' --sampling-mask-max-tokens: one more than max_candidates, so a set cut at the cap (of
        max_candidates + 1 ids) tells an overflow apart from a set of exactly max_candidates."""
        return min(self.max_candidates + 1, self.vocab_size)

    def _launch_servers(self, n: int, kwargs: dict[str, Any]) -> None:
        """`n` servers started at once (each ~20 s on CPU, mostly imports); any failure stops them all."""
        kwargs = {"sampling_mask_max_tokens": self._mask_cap, **kwargs}
        dirs = [self.workdir] if n == 1 else [self.workdir / f"server-{k}" for k in range(n)]
        for d in dirs:
            d.mkdir(exist_ok=True)
        with ThreadPoolExecutor(max_workers=n, thread_name_prefix="sglang-launch") as ex:
            futures = [ex.submit(SGLangServer, self.model_path, workdir=d, **kwargs) for d in dirs]
        errors = []
        for fut in futures:
            try:
                self.servers.append(fut.result())
            except BaseException as err:  # noqa: BLE001 - re-raised below, after the others are kept for close()
                errors.append(err)
        if errors:
            self._keep_log = True  # a server did not come up: its log (named in the error) stays
            raise errors[0]
        self.urls = [srv.url for srv in self.servers]

    def _launch_router(self, policy: str, kwargs: dict[str, Any]) -> None:
        host = self.servers[0].host
        try:
            self.launched_router = SGLangRouter(
                self.urls,
                workdir=self.workdir,
                python=self.servers[0].python,
                host=host,
                policy=policy,
                **kwargs,
            )
        except BaseException:
            self._keep_log = True
            raise
        self.router_url = self.launched_router.url

    # ---- connection -------------------------------------------------------------------------------------
    def _discover_workers(self) -> list[str]:
        """The router's healthy workers (`GET /workers`)."""
        found = router_workers(self._get(self.router_url, "/workers"), healthy_only=True)
        if not found:
            raise RuntimeError(
                f"the SGLang router {self.router_url} lists no healthy worker (GET /workers); start workers and "
                "register them with it (smg launch --worker-urls ...), or connect to servers with urls=[...]"
            )
        return found

    def _connect(self, wire: WireMode) -> None:
        """Per worker (directly, not through the router): served model, mask cap and patch; then that the
        router passes the candidate sets through."""
        infos = [self._get(url, "/server_info") for url in self.urls]
        if self.model_path is None:
            self.model_path = Path(infos[0]["model_path"])
        if not self.vocab_size:
            self.vocab_size = _config_vocab_size(self.model_path)
        for url in self.urls:
            self._check_served_model(url)
        self.mask_max_tokens = min(int(i.get("sampling_mask_max_tokens") or 0) for i in infos)
        if self.mask_max_tokens < self._mask_cap:
            small = [u for u, i in zip(self.urls, infos, strict=True)
                     if int(i.get("sampling_mask_max_tokens") or 0) < self._mask_cap]  # fmt: skip
            raise ValueError(
                f"SGLang servers {small} record at most {self.mask_max_tokens} candidates "
                f"(--sampling-mask-max-tokens), but max_candidates={self.max_candidates} needs {self._mask_cap} "
                "(one more, to tell an overflowing set from a full one); start them with "
                f"--sampling-mask-max-tokens {self._mask_cap} or set max_candidates <= {self.mask_max_tokens - 1}"
            )
        patched = [self._probe_patched(url) for url in self.urls]
        if wire == "b64" and not all(patched):
            bad = [u for u, p in zip(self.urls, patched, strict=True) if not p]
            raise ValueError(
                f"wire='b64' but servers {bad} lack the topp_rl patch (patches/sglang); "
                "build them with scripts/setup_sglang.sh or pass wire='auto'"
            )
        self.patched = all(patched) and wire != "nested"
        if self.router_url is not None:
            self._check_router_passes_masks()

    def _check_router_passes_masks(self) -> None:
        """smg re-serialises /generate through a fixed struct; releases before 1.5.0 drop our top-level fields."""
        out = self._post(self.router_url, "/generate", self._probe_body(b64=self.patched))
        meta = out.get("meta_info", {})
        if (IDS_KEY if self.patched else "output_token_sampling_mask") not in meta:
            raise ValueError(
                f"the router {self.router_url} dropped the candidate sets (return_sampling_mask"
                f"{'_b64' if self.patched else ''} did not reach the worker, or its answer lost them); use smg "
                ">= 1.5.0 (scripts/setup_sglang.sh pins 1.13.0) or connect to the servers with urls=[...]"
            )

    def _check_served_model(self, url: str) -> None:
        """The server must serve the policy's model: same vocab size and architectures (else the candidate ids
        mean other tokens, and a weight push with the policy's names and shapes fails or kills the server)."""
        served_arch = self._get(url, "/model_info").get("architectures")
        config = Path(self.model_path or "") / "config.json"
        policy_arch = json.loads(config.read_text()).get("architectures") if config.is_file() else None
        served_vocab = self._served_vocab(url)
        problems = []
        if served_vocab != self.vocab_size:
            problems.append(f"vocab size {served_vocab} (policy: {self.vocab_size})")
        if policy_arch and served_arch and list(served_arch) != list(policy_arch):
            problems.append(f"architectures {served_arch} (policy: {policy_arch})")
        if problems:
            raise ValueError(
                f"SGLang server {url} serves another model than the policy: {'; '.join(problems)}; start it with "
                f"--model-path {self.model_path} (the policy's checkpoint) or point urls= at a server that does"
            )

    def _served_vocab(self, url: str) -> int:
        body = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1}, "return_logprob": True,
                "token_ids_logprob": [_VOCAB_PROBE_ID]}  # fmt: skip
        status, text = self._call("POST", url, "/generate", body, self._bound(tokens=2))
        found = _VOCAB_RANGE.search(text) if status == 400 else None
        if found is None:
            raise RuntimeError(
                f"SGLang server {url} did not report its vocab size (HTTP {status}: {text[:300]}); "
                "this client expects SGLang 0.5.23 (scripts/setup_sglang.sh)"
            )
        return int(found.group(1))

    def _probe_patched(self, url: str) -> bool:
        """One-token request asking for the compact mask: only a patched server answers with IDS_KEY."""
        return IDS_KEY in self._post(url, "/generate", self._probe_body(b64=True))["meta_info"]

    @staticmethod
    def _probe_body(*, b64: bool) -> dict[str, Any]:
        body = {
            "input_ids": [0],
            "sampling_params": {"max_new_tokens": 1, "top_k": 2, "temperature": 1.0},
            "return_sampling_mask": True,
        }
        return {**body, "return_sampling_mask_b64": True} if b64 else body

    # ---- generation -------------------------------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, seed: int | None = None
    ) -> list[Sample]:
        check_prompts(prompts, self.vocab_size)
        top_k = self._request_top_k(params)
        wants_mask = params.truncates
        # Through the router when there is one; the client's own round-robin is for direct URLs only.
        targets = [self.router_url] if self.router_url is not None else self.urls
        expanded = [(g, p) for g, p in enumerate(prompts) for _ in range(params.n)]
        futures = [
            self._pool.submit(
                self._generate_one,
                targets[i % len(targets)],
                self._payload(prompt, params, top_k=top_k, wants_mask=wants_mask, seed=seed, index=i),
                self._bound(tokens=len(prompt) + params.max_new_tokens),
            )
            for i, (_, prompt) in enumerate(expanded)
        ]
        bar = tqdm(total=len(futures), desc="sglang rollout", unit="sample", disable=not self.progress)
        try:
            for fut in as_completed(futures):  # the bar moves as responses arrive, in any order
                fut.result()  # the first failure raises here, before any Sample is built
                bar.update(1)
        finally:
            bar.close()
            for fut in futures:
                fut.cancel()
        samples = []
        for i, ((group, prompt), fut) in enumerate(zip(expanded, futures, strict=True)):
            sample = self._to_sample(prompt, fut.result(), wants_mask=wants_mask)
            sample.index, sample.group_index = i, group
            samples.append(sample)
        return samples

    def _request_top_k(self, params: SamplingParams) -> int:
        """The top_k sent: the user's when it bounds the set to max_candidates; else (no top-k, or a larger one)
        max_candidates + 1 (at most the vocab), so that a set exceeding max_candidates arrives as a full row of
        max_candidates + 1 ids and is reported (`_to_sample`), never silently cut to the cap. A set of at most
        max_candidates ids is exactly the one the user's parameters keep: the extra top-k cut did not bind."""
        if 0 < params.top_k <= self.max_candidates:
            return params.top_k
        return self._mask_cap

    def _generate_one(
        self, url: str, body: dict[str, Any], bound: _Bound
    ) -> dict[str, Any] | _ServerOverflow:
        status, text = self._call("POST", url, "/generate", body, bound)
        if status == 400 and _SGLANG_OVERFLOW in text:
            return _ServerOverflow(_error_message(text))
        return self._parse("POST", url, "/generate", status, text)

    def _payload(
        self,
        prompt: list[int],
        params: SamplingParams,
        *,
        top_k: int,
        wants_mask: bool,
        seed: int | None,
        index: int,
    ) -> dict[str, Any]:
        sampling = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": top_k if wants_mask else -1,
            "min_p": params.min_p,
            "max_new_tokens": params.max_new_tokens,
            "stop_token_ids": list(params.stop_token_ids),
        }
        clash = sampling.keys() & self.extra_sampling_params.keys()
        if clash:
            raise ValueError(
                f"extra_sampling_params sets {sorted(clash)}, which SamplingParams controls; set them there"
            )
        sampling.update(self.extra_sampling_params)
        if seed is not None and params.min_p == 0:
            sampling["sampling_seed"] = (seed * _SEED_STRIDE + index) % (2**63)
        payload = {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True}
        if wants_mask:
            payload["return_sampling_mask"] = True
            if self.patched:
                payload["return_sampling_mask_b64"] = True
        return payload

    def _to_sample(
        self, prompt: list[int], out: dict[str, Any] | _ServerOverflow, *, wants_mask: bool
    ) -> Sample:
        if isinstance(out, _ServerOverflow):
            return self._overflow_sample(prompt, out.message, weight_version=None)
        meta = out["meta_info"]
        reason = (meta.get("finish_reason") or {}).get("type")
        if reason not in _FINISH_STATUS:
            # "abort" (or no reason at all): keep nothing of a partial response.
            return Sample(
                prompt_ids=prompt,
                status=SampleStatus.ABORTED,
                metadata={"finish_reason": meta.get("finish_reason"), "candidate_overflow": False},
            )
        tokens = [int(t) for t in out["output_ids"]]
        raw = [float(lp) for lp, tok, *_ in meta["output_token_logprobs"]]
        raw_ids = [int(tok) for _, tok, *_ in meta["output_token_logprobs"]]
        if raw_ids != tokens:
            raise RuntimeError(
                f"SGLang returned output_token_logprobs for {raw_ids}, not the output ids {tokens}"
            )
        if wants_mask:
            log_probs = [float(x) for x in meta["output_token_sampling_logprobs"]]
            cands = decode_candidates(meta, num_tokens=len(tokens), vocab_size=self.vocab_size, tokens=tokens)
            if cands is None:
                raise RuntimeError("SGLang returned no sampling mask although the request asked for one")
            lengths = cands.row_lengths()
            if tokens and int(lengths.max()) > self.max_candidates:
                at = int(torch.argmax((lengths > self.max_candidates).int()))
                message = (f"candidate set larger than max_candidates={self.max_candidates} (response token {at} "
                           f"kept more than {self.max_candidates} ids); raise rollout.max_candidates, or bound the "
                           "set with top_k <= max_candidates")  # fmt: skip
                return self._overflow_sample(prompt, message, weight_version=meta.get("weight_version"))
        else:
            log_probs, cands = raw, None  # untruncated: the renormalised distribution is the full one
        sample = Sample(
            prompt_ids=prompt,
            status=_FINISH_STATUS[reason],
            metadata={"weight_version": meta.get("weight_version"), "candidate_overflow": False},
        )
        sample.append_response_tokens(
            tokens,
            log_probs,
            cands if self.record_candidates else None,
            raw_log_probs=raw if self.record_raw_log_probs else None,
        )
        return sample

    @staticmethod
    def _overflow_sample(prompt: list[int], message: str, *, weight_version: str | None) -> Sample:
        """The rule for a kept set larger than max_candidates: the sample is aborted (never trained on, never
        cut to the cap) and flagged, so the datamodule counts it (`rollout/candidate_overflow_frac`)."""
        return Sample(
            prompt_ids=prompt,
            status=SampleStatus.ABORTED,
            metadata={
                "candidate_overflow": True,
                "finish_reason": {"type": "abort", "message": message},
                "weight_version": weight_version,
            },
        )

    # ---- weights ----------------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightSyncStats:
        """Load HF-named tensors into every worker, each addressed directly (the router routes no control
        calls): pause its generation, push (broadcast in buckets of `weight_bucket_bytes` over a
        torch.distributed group, `weight_sync="distributed"`, gloo on CPU, nccl on CUDA; or one temp checkpoint
        for `/update_weights_from_disk`, `"disk"`), resume. Returns, and keeps as `last_sync`, its time and bytes."""
        start = time.monotonic()
        workers = self._sync_targets()
        version = str(self._syncs + 1)
        for (
            url
        ) in workers:  # "abort": a sample never mixes two weight versions (none is in flight between steps)
            self._post(url, "/pause_generation", {"mode": "abort"}, self._weight_bound(0))
        if self.weight_sync == "distributed":
            nbytes, buckets = self._sync_distributed(named_tensors, workers, version)
        else:
            nbytes, buckets = self._sync_disk(named_tensors, workers, version), 1
        for url in workers:
            self._post(url, "/continue_generation", {}, self._weight_bound(0))
        self._syncs += 1
        self.last_sync = WeightSyncStats(seconds=time.monotonic() - start, bytes=nbytes, buckets=buckets,
                                         workers=tuple(workers), method=self.weight_sync)  # fmt: skip
        return self.last_sync

    def _sync_targets(self) -> list[str]:
        """The workers to update: the launched servers still running (one that exited is named and skipped:
        the router stops routing to it), the router's healthy workers now, or the given URLs."""
        if self.servers:
            gone = [srv for srv in self.servers if srv._proc.poll() is not None]
            for srv in gone:
                print(f"[topp_rl] SGLang server {srv.url} exited (code {srv._proc.returncode}, log "
                      f"{srv.log_path}); weights go to the others", file=sys.stderr, flush=True)  # fmt: skip
            targets = [srv.url for srv in self.servers if srv not in gone]
        else:
            targets = self._discover_workers() if self.router_url is not None else list(self.urls)
        if not targets:
            raise SGLangRequestError(f"no SGLang worker left to update (all of {self.urls} exited)")
        return targets

    def _sync_distributed(
        self, named: Iterable[tuple[str, torch.Tensor]], workers: list[str], version: str
    ) -> tuple[int, int]:
        if self._distributed is not None and self._distributed.urls != workers:  # the fleet changed: regroup
            self._distributed.close()
            self._distributed = None
        if self._distributed is None:
            post = lambda url, path, body, nbytes: self._post(url, path, body, self._weight_bound(nbytes))  # noqa: E731
            self._distributed = DistributedWeightSender(
                workers, post=post, host=self.weight_sync_host, group_name=f"topp_rl_weights_{self._syncs}",
                timeout_s=self._weight_bound(self.weight_bucket_bytes).total_s,
            )  # fmt: skip
        return self._distributed.send(named, bucket_bytes=self.weight_bucket_bytes, version=version)

    def _sync_disk(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], workers: list[str], version: str
    ) -> int:
        named = [(name, t.detach()) for name, t in named_tensors]
        if not named:
            raise ValueError(
                "update_weights got no tensors; pass model.named_parameters() or a state_dict's items"
            )
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        bound = self._weight_bound(nbytes)
        body = {"flush_cache": True, "weight_version": version}
        with write_checkpoint(named, config_dir=self.model_path, parent=self.workdir) as path:
            futures = [self._pool.submit(self._post, url, "/update_weights_from_disk",
                                         {**body, "model_path": str(path)}, bound) for url in workers]  # fmt: skip
            for fut in futures:
                fut.result()
        return nbytes

    # ---- HTTP -------------------------------------------------------------------------------------------
    def _bound(self, *, tokens: int = 0) -> _Bound:
        """A /generate's (or a small call's) limits, scaled with its tokens."""
        first = self.first_byte_timeout_s + self.per_token_timeout_s * tokens
        how = f"first_byte_timeout_s {self.first_byte_timeout_s:g} + per_token_timeout_s "
        how += f"{self.per_token_timeout_s:g} x {tokens} tokens"
        return _Bound(first_byte_s=first, total_s=first + self.transfer_timeout_s, how=how)

    def _weight_bound(self, weight_bytes: int) -> _Bound:
        """A weight-update call's limits (a bucket, a checkpoint load, pause / resume), scaled with its bytes."""
        gb = weight_bytes / 1e9
        first = self.weight_update_timeout_s + self.per_gb_timeout_s * gb
        how = f"weight_update_timeout_s {self.weight_update_timeout_s:g} + per_gb_timeout_s "
        how += f"{self.per_gb_timeout_s:g} x {gb:.3f} GB"
        return _Bound(first_byte_s=first, total_s=first + self.transfer_timeout_s, how=how)

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        return session

    def _get(self, url: str, path: str) -> dict[str, Any]:
        return self._request("GET", url, path, None, self._bound())

    def _post(self, url: str, path: str, body: dict[str, Any], bound: _Bound | None = None) -> dict[str, Any]:
        return self._request("POST", url, path, body, bound or self._bound())

    def _request(
        self, method: str, url: str, path: str, body: dict[str, Any] | None, bound: _Bound
    ) -> dict[str, Any]:
        return self._parse(method, url, path, *self._call(method, url, path, body, bound))

    @staticmethod
    def _parse(method: str, url: str, path: str, status: int, text: str) -> dict[str, Any]:
        """JSON answer; 4xx raise ValueError, a reported failure RuntimeError."""
        if status >= 400:
            raise ValueError(
                f"SGLang at {url} rejected {method} {path} (HTTP {status}): {text[:500]}; "
                "check the request parameters against the server's flags"
            )
        data = json.loads(text)
        if isinstance(data, dict) and data.get("success") is False:
            raise RuntimeError(f"SGLang at {url} reported failure on {path}: {data.get('message')}")
        return data

    def _call(
        self, method: str, url: str, path: str, body: dict[str, Any] | None, bound: _Bound
    ) -> tuple[int, str]:
        """(status, body text) of one request below HTTP 500. Connection errors and 5xx are retried with
        exponential backoff; a server that accepted the request but missed `bound` raises at once."""
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)))
            start = time.monotonic()
            try:
                with self._waits.track(url, f"{method} {path}", bound.total_s):
                    status, text = self._send(method, url + path, body, bound, start)
            except (requests.ReadTimeout, _Deadline):
                raise SGLangTimeoutError(self._timeout_message(method, url, path, bound, start)) from None
            except requests.ConnectionError as err:  # refused, reset, connect timeout: it may be restarting
                last = f"{type(err).__name__}: {err}"
                continue
            if status >= 500:
                last = f"HTTP {status}: {text[:300]}"
                continue
            return status, text
        raise SGLangRequestError(
            f"{method} {url}{path} failed after {self.max_retries + 1} attempts; last error: {last}"
            + self._server_exit_note()
        )

    def _send(
        self, method: str, full_url: str, body: dict[str, Any] | None, bound: _Bound, start: float
    ) -> tuple[int, str]:
        """One attempt: headers within the first-byte bound, then the body in chunks, each chunk read bounded
        by the socket timeout and the whole request by `bound.total_s` (checked between chunks)."""
        timeout = (self.connect_timeout_s, bound.first_byte_s)
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
                raise requests.ConnectionError(
                    err
                ) from None  # reset mid-body: retried like a refused connection
            return resp.status_code, b"".join(chunks).decode("utf-8", errors="replace")

    def _server_exit_note(self) -> str:
        """Why a launched server stopped answering, when it is because it exited (not a network problem)."""
        gone = [srv for srv in self.servers if srv._proc.poll() is not None]
        return "".join(f"; the launched server {srv.url} exited (code {srv._proc.returncode}), its log: "
                       f"{srv.log_path}" for srv in gone)  # fmt: skip

    def _timeout_message(self, method: str, url: str, path: str, bound: _Bound, start: float) -> str:
        logs = [str(srv.log_path) for srv in self.servers if srv.url == url or url == self.router_url]
        log = f"; its log: {', '.join(logs)}" if logs else ""
        return (
            f"SGLang server {url}: {method} {path} got no complete answer after {time.monotonic() - start:.1f} s "
            f"(first-byte bound {bound.first_byte_s:.1f} s = {bound.how}; whole request {bound.total_s:.1f} s); "
            f"the server is hung or overloaded (stopped, or its scheduler died){log}; if it is only slow, raise "
            "those timeouts"
        )

    def close(self) -> None:
        """Stop the owned router and servers (whole process groups), release the client threads and remove
        the work dir (a failed server's or router's log is kept); idempotent."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._waits.close()
        if self._distributed is not None:
            self._distributed.close()
            self._distributed = None
        if self.launched_router is not None:  # first: it would health-check the servers going down
            self.launched_router.stop()
            self._keep_log |= self.launched_router.failed
            self.launched_router = None
        with ThreadPoolExecutor(max_workers=max(1, len(self.servers))) as ex:
            list(ex.map(lambda srv: srv.stop(), self.servers))
        self._keep_log |= any(srv.failed for srv in self.servers)
        self.servers = []
        remove_workdir(self.workdir, keep_log=self._keep_log)


class _Waits:
    """The calls in flight; while one waits longer than `interval_s`, a daemon thread prints one line per
    (server, call) every `interval_s`, so a slow or hung server is never silent. 0 turns the lines off."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
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
                self._thread = threading.Thread(target=self._run, daemon=True, name="sglang-waits")
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                del self._calls[id(key)]

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
                out.append(f"[topp_rl] SGLang server {url}: {call} waiting {now - start:.0f} s "
                           f"(bound {bound:.0f} s; {len(waits)} pending)")  # fmt: skip
        return out

    def close(self) -> None:
        self._stop.set()


def _check_timeouts(*, bases: dict[str, float], allowances: dict[str, float]) -> None:
    bad = {k: v for k, v in bases.items() if not v > 0} | {k: v for k, v in allowances.items() if not v >= 0}
    if bad:
        raise ValueError(
            f"timeouts {bad} out of range: bases must be > 0, per-token / per-GB allowances >= 0 (every wait "
            "needs a finite bound); pass positive values"
        )


def _mode(
    *, urls: Sequence[str] | None, router_url: str | None, model_path: Any, num_servers: int, router: bool
) -> Literal["urls", "router_url", "launch"]:
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


def _error_message(text: str) -> str:
    """The message of an SGLang / smg error body ({"error": {"message": ...}}), else the body itself."""
    try:
        error = json.loads(text).get("error")
        return str(error.get("message") if isinstance(error, dict) else error or text)
    except (ValueError, AttributeError):
        return text[:500]


def _config_vocab_size(model_path: Path | None) -> int:
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
