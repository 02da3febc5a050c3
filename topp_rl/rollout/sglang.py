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
"""

import json
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Literal

import requests
import torch
from tqdm.auto import tqdm

from topp_rl.rollout.engine import RolloutEngine, check_prompts
from topp_rl.rollout.params import SamplingParams
from topp_rl.rollout.sample import Sample, SampleStatus
from topp_rl.rollout.sglang_server import SGLangServer
from topp_rl.rollout.sglang_weights import DistributedWeightSender, write_checkpoint
from topp_rl.rollout.wire import IDS_KEY, decode_candidates

WireMode = Literal["auto", "b64", "nested"]
_FINISH_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED}
_SEED_STRIDE = 1_000_003  # sampling_seed = seed * stride + sample index: distinct per sample, same per rerun


class SGLangRequestError(RuntimeError):
    """A request that still failed (connection error or 5xx) after every retry."""


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
        request_timeout_s: float = 600.0,
        progress: bool = True,
        extra_sampling_params: dict[str, Any] | None = None,
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
        self.model_path = Path(model_path) if model_path is not None else None
        self.record_candidates = record_candidates
        self.record_raw_log_probs = record_raw_log_probs
        self.weight_sync = weight_sync
        self.max_retries, self.backoff_s, self.max_backoff_s = max_retries, backoff_s, max_backoff_s
        self.request_timeout_s = request_timeout_s
        self.progress = progress
        # SGLang-only sampling keys (e.g. {"ignore_eos": True} for benchmarks), added to every request.
        self.extra_sampling_params = dict(extra_sampling_params or {})
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="sglang-client")
        self._distributed: DistributedWeightSender | None = None
        self.server: SGLangServer | None = None
        self.vocab_size = vocab_size or 0
        if urls:
            self.urls = [u.rstrip("/") for u in urls]
        else:
            self.vocab_size = vocab_size or _config_vocab_size(self.model_path)
            kwargs = {"sampling_mask_max_tokens": self.vocab_size, **(server_kwargs or {})}
            self.server = SGLangServer(self.model_path, **kwargs)
            self.urls = [self.server.url]
        try:
            self._connect(wire)
        except BaseException:
            self.close()
            raise

    @classmethod
    def for_policy(cls, *, model, tokenizer, workdir: Path, **kwargs) -> "SGLangEngine":
        """The config factory (`rollout.engine`): a server launched on the policy's initial weights, written
        once to `workdir/init` (SGLang loads weights from disk)."""
        from topp_rl.models import save_model

        path = save_model(model, tokenizer, Path(workdir) / "init")
        return cls(model_path=path, vocab_size=int(model.config.vocab_size), **kwargs)

    # ---- connection -------------------------------------------------------------------------------------
    def _connect(self, wire: WireMode) -> None:
        infos = [self._get(url, "/server_info") for url in self.urls]
        if self.model_path is None:
            self.model_path = Path(infos[0]["model_path"])
        if not self.vocab_size:
            self.vocab_size = _config_vocab_size(self.model_path)
        self.mask_max_tokens = min(int(i.get("sampling_mask_max_tokens") or 0) for i in infos)
        patched = [self._probe_patched(url) for url in self.urls]
        if wire == "b64" and not all(patched):
            bad = [u for u, p in zip(self.urls, patched, strict=True) if not p]
            raise ValueError(
                f"wire='b64' but servers {bad} lack the topp_rl patch (patches/sglang); "
                "build them with scripts/setup_sglang.sh or pass wire='auto'"
            )
        self.patched = all(patched) and wire != "nested"

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
        if self.weight_sync == "distributed":
            if self._distributed is None:
                self._distributed = DistributedWeightSender(self.urls, post=self._post)
            self._distributed.send(named)
            return
        with write_checkpoint(named, config_dir=self.model_path) as path:
            for url in self.urls:
                self._post(url, "/update_weights_from_disk", {"model_path": str(path), "flush_cache": True})

    # ---- HTTP -------------------------------------------------------------------------------------------
    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        return session

    def _get(self, url: str, path: str) -> dict[str, Any]:
        return self._request("GET", url, path, None)

    def _post(self, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._request("POST", url, path, body)

    def _request(self, method: str, url: str, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        """JSON request; connection errors, timeouts and 5xx are retried with exponential backoff."""
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)))
            try:
                resp = self._session().request(method, url + path, json=body, timeout=self.request_timeout_s)
            except (requests.ConnectionError, requests.Timeout) as err:
                last = f"{type(err).__name__}: {err}"
                continue
            if resp.status_code >= 500:
                last = f"HTTP {resp.status_code}: {resp.text[:300]}"
                continue
            if resp.status_code >= 400:
                raise ValueError(
                    f"SGLang at {url} rejected {method} {path} (HTTP {resp.status_code}): {resp.text[:500]}; "
                    "check the request parameters against the server's flags"
                )
            data = resp.json()
            if isinstance(data, dict) and data.get("success") is False:
                raise RuntimeError(f"SGLang at {url} reported failure on {path}: {data.get('message')}")
            return data
        raise SGLangRequestError(
            f"{method} {url}{path} failed after {self.max_retries + 1} attempts; last error: {last}"
        )

    def close(self) -> None:
        """Stop the owned server (whole process group) and release the client threads; idempotent."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._distributed is not None:
            self._distributed.close()
            self._distributed = None
        if self.server is not None:
            self.server.stop()
            self.server = None


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
