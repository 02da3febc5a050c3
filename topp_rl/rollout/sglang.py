"""`SGLangEngine`: rollouts from real SGLang servers over their native HTTP API, with exact candidate sets.

One `/generate` request per sample (`input_ids`, `sampling_params`, `return_logprob`, `return_sampling_mask`),
sent concurrently from a thread pool, round-robin over the server URLs. Per response token the Sample gets:
- the candidate set: SGLang's sampling mask (the ids its sampler kept), decoded by `topp_rl.rollout.wire`,
  from our compact base64 arrays when the server carries `patches/sglang` (detected by a probe request),
  else from SGLang's nested JSON lists;
- `rollout_log_probs`: SGLang's `output_token_sampling_logprobs`, the sampled token's log-prob renormalised
  over the kept set;
- `rollout_raw_log_probs`: SGLang's `output_token_logprobs` (log_softmax(logits / T) before truncation).
Departures from SGLang's defaults: `top_k=0` (no top-k) is sent as top_k = vocab size, because the sampling
mask needs a finite top_k (the server is started with `--sampling-mask-max-tokens` = vocab size); an untruncated
request (top_p=1, top_k=0, min_p=0) asks for no mask (the set is the whole vocabulary) and records no candidates,
its renormalised log-prob being the raw one. A seed is forwarded as a per-sample `sampling_seed` (seed, index);
SGLang honours it only on servers started with `--enable-deterministic-inference`, which its CPU torch_native
backend rejects, so on CPU a seed does not reproduce a rollout (and with min_p > 0 no seed is sent: SGLang's
seeded sampler asserts on min-p). Connection errors and 5xx are retried with bounded exponential backoff; an
aborted request yields an empty Sample with status "aborted", never a half-filled one.

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

from topp_rl.rollout.engine import RolloutEngine, check_prompts
from topp_rl.rollout.params import SamplingParams
from topp_rl.rollout.sample import Sample, SampleStatus
from topp_rl.rollout.sglang_server import SGLangServer, make_workdir, remove_workdir
from topp_rl.rollout.sglang_weights import DistributedWeightSender, write_checkpoint
from topp_rl.rollout.wire import IDS_KEY, decode_candidates

WireMode = Literal["auto", "b64", "nested"]
_FINISH_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED}
_SEED_STRIDE = 1_000_003  # sampling_seed = seed * stride + sample index: distinct per sample, same per rerun
_VOCAB_PROBE_ID = 2**31 - 1  # SGLang rejects it in token_ids_logprob, naming its vocab size (checked before
# the scheduler: an out-of-vocabulary *input* id would crash the server instead)
_VOCAB_RANGE = re.compile(r"valid range is \[0, (\d+)\)")


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


class SGLangEngine(RolloutEngine):
    """Rollouts from SGLang servers at `urls`, or from one server it launches on `model_path` (then owned)."""

    def __init__(
        self,
        *,
        urls: Sequence[str] | None = None,
        model_path: str | Path | None = None,
        vocab_size: int | None = None,
        record_candidates: bool = True,
        record_raw_log_probs: bool = True,
        wire: WireMode = "auto",
        weight_sync: Literal["disk", "distributed"] = "disk",
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
        if not urls and model_path is None:
            raise ValueError("SGLangEngine needs urls=[...] of running servers or model_path= to launch one")
        if wire not in ("auto", "b64", "nested"):
            raise ValueError(f"wire ({wire!r}) must be 'auto', 'b64' or 'nested'")
        if weight_sync not in ("disk", "distributed"):
            raise ValueError(f"weight_sync ({weight_sync!r}) must be 'disk' or 'distributed'")
        if max_concurrency < 1 or max_retries < 0:
            raise ValueError(
                f"max_concurrency ({max_concurrency}) must be >= 1, max_retries ({max_retries}) >= 0"
            )
        _check_timeouts(
            bases={"connect_timeout_s": connect_timeout_s, "first_byte_timeout_s": first_byte_timeout_s,
                   "transfer_timeout_s": transfer_timeout_s, "weight_update_timeout_s": weight_update_timeout_s},
            allowances={"per_token_timeout_s": per_token_timeout_s, "per_gb_timeout_s": per_gb_timeout_s},
        )  # fmt: skip
        self.model_path = Path(model_path) if model_path is not None else None
        self.record_candidates = record_candidates
        self.record_raw_log_probs = record_raw_log_probs
        self.weight_sync = weight_sync
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
        self.server: SGLangServer | None = None
        self.vocab_size = vocab_size or 0
        self._keep_log = False
        # Server log, disk-sync checkpoints and rendezvous files; removed on close (a failed server's log kept).
        self.workdir = make_workdir(workdir)
        try:
            if urls:
                self.urls = [u.rstrip("/") for u in urls]
            else:
                self.vocab_size = vocab_size or _config_vocab_size(self.model_path)
                kwargs = {"sampling_mask_max_tokens": self.vocab_size, "progress_interval_s": progress_interval_s,
                          **(server_kwargs or {})}  # fmt: skip
                try:
                    self.server = SGLangServer(self.model_path, workdir=self.workdir, **kwargs)
                except BaseException:
                    self._keep_log = True  # the server did not come up: its log (named in the error) stays
                    raise
                self.urls = [self.server.url]
            self._connect(wire)
        except BaseException:
            self.close()
            raise

    @classmethod
    def for_policy(cls, *, model, tokenizer, workdir: Path, **kwargs) -> "SGLangEngine":
        """The config factory (`rollout.engine`): a server launched on the policy's initial weights, written
        once to `workdir/init` (SGLang loads weights from disk); its log and weight copies live under `workdir`."""
        from topp_rl.models import save_model

        path = save_model(model, tokenizer, Path(workdir) / "init")
        return cls(model_path=path, vocab_size=int(model.config.vocab_size), workdir=workdir, **kwargs)

    # ---- connection -------------------------------------------------------------------------------------
    def _connect(self, wire: WireMode) -> None:
        infos = [self._get(url, "/server_info") for url in self.urls]
        if self.model_path is None:
            self.model_path = Path(infos[0]["model_path"])
        if not self.vocab_size:
            self.vocab_size = _config_vocab_size(self.model_path)
        for url in self.urls:
            self._check_served_model(url)
        self.mask_max_tokens = min(int(i.get("sampling_mask_max_tokens") or 0) for i in infos)
        patched = [self._probe_patched(url) for url in self.urls]
        if wire == "b64" and not all(patched):
            bad = [u for u, p in zip(self.urls, patched, strict=True) if not p]
            raise ValueError(
                f"wire='b64' but servers {bad} lack the topp_rl patch (patches/sglang); "
                "build them with scripts/setup_sglang.sh or pass wire='auto'"
            )
        self.patched = all(patched) and wire != "nested"

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
        out = self._post(
            url,
            "/generate",
            {
                "input_ids": [0],
                "sampling_params": {"max_new_tokens": 1, "top_k": 2, "temperature": 1.0},
                "return_sampling_mask": True,
                "return_sampling_mask_b64": True,
            },
        )
        return IDS_KEY in out["meta_info"]

    # ---- generation -------------------------------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, seed: int | None = None
    ) -> list[Sample]:
        check_prompts(prompts, self.vocab_size)
        top_k = params.top_k or self.vocab_size
        wants_mask = params.truncates
        if wants_mask and top_k > self.mask_max_tokens:
            raise ValueError(
                f"top_k ({top_k}; 0 maps to the vocab size) exceeds the servers' --sampling-mask-max-tokens "
                f"({self.mask_max_tokens}); start them with --sampling-mask-max-tokens >= {top_k}"
            )
        expanded = [(g, p) for g, p in enumerate(prompts) for _ in range(params.n)]
        futures = [
            self._pool.submit(
                self._post,
                self.urls[i % len(self.urls)],
                "/generate",
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

    def _to_sample(self, prompt: list[int], out: dict[str, Any], *, wants_mask: bool) -> Sample:
        meta = out["meta_info"]
        reason = (meta.get("finish_reason") or {}).get("type")
        if reason not in _FINISH_STATUS:
            # "abort" (or no reason at all): keep nothing of a partial response.
            return Sample(
                prompt_ids=prompt,
                status=SampleStatus.ABORTED,
                metadata={"finish_reason": meta.get("finish_reason")},
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
        else:
            log_probs, cands = raw, None  # untruncated: the renormalised distribution is the full one
        sample = Sample(
            prompt_ids=prompt,
            status=_FINISH_STATUS[reason],
            metadata={"weight_version": meta.get("weight_version")},
        )
        sample.append_response_tokens(
            tokens,
            log_probs,
            cands if self.record_candidates else None,
            raw_log_probs=raw if self.record_raw_log_probs else None,
        )
        return sample

    # ---- weights ----------------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors into every server: from a temp checkpoint dir (`weight_sync="disk"`) or by
        broadcast over a torch.distributed group (`"distributed"`, gloo on CPU, nccl on CUDA)."""
        named = [(name, t.detach()) for name, t in named_tensors]
        if not named:
            raise ValueError(
                "update_weights got no tensors; pass model.named_parameters() or a state_dict's items"
            )
        bound = self._bound(weight_bytes=sum(t.numel() * t.element_size() for _, t in named))
        if self.weight_sync == "distributed":
            if self._distributed is None:
                post = lambda url, path, body: self._post(url, path, body, bound)  # noqa: E731
                self._distributed = DistributedWeightSender(
                    self.urls, post=post, host=self.weight_sync_host, timeout_s=bound.total_s
                )
            self._distributed.send(named)
            return
        with write_checkpoint(named, config_dir=self.model_path, parent=self.workdir) as path:
            for url in self.urls:
                body = {"model_path": str(path), "flush_cache": True}
                self._post(url, "/update_weights_from_disk", body, bound)

    # ---- HTTP -------------------------------------------------------------------------------------------
    def _bound(self, *, tokens: int = 0, weight_bytes: int = 0) -> _Bound:
        """A request's limits: a /generate scales with its tokens, a weight update with its bytes."""
        if weight_bytes:
            gb = weight_bytes / 1e9
            first = self.weight_update_timeout_s + self.per_gb_timeout_s * gb
            how = f"weight_update_timeout_s {self.weight_update_timeout_s:g} + per_gb_timeout_s "
            how += f"{self.per_gb_timeout_s:g} x {gb:.3f} GB"
        else:
            first = self.first_byte_timeout_s + self.per_token_timeout_s * tokens
            how = f"first_byte_timeout_s {self.first_byte_timeout_s:g} + per_token_timeout_s "
            how += f"{self.per_token_timeout_s:g} x {tokens} tokens"
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
        """JSON request; 4xx raise ValueError, a reported failure RuntimeError."""
        status, text = self._call(method, url, path, body, bound)
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
        if self.server is None or self.server._proc.poll() is None:
            return ""
        return f"; the launched server exited (code {self.server._proc.returncode}), its log: {self.server.log_path}"

    def _timeout_message(self, method: str, url: str, path: str, bound: _Bound, start: float) -> str:
        log = f"; its log: {self.server.log_path}" if self.server is not None else ""
        return (
            f"SGLang server {url}: {method} {path} got no complete answer after {time.monotonic() - start:.1f} s "
            f"(first-byte bound {bound.first_byte_s:.1f} s = {bound.how}; whole request {bound.total_s:.1f} s); "
            f"the server is hung or overloaded (stopped, or its scheduler died){log}; if it is only slow, raise "
            "those timeouts"
        )

    def close(self) -> None:
        """Stop the owned server (whole process group), release the client threads and remove the work dir
        (a failed server's log is kept); idempotent."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._waits.close()
        if self._distributed is not None:
            self._distributed.close()
            self._distributed = None
        if self.server is not None:
            self.server.stop()
            self._keep_log |= self.server.failed
            self.server = None
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
