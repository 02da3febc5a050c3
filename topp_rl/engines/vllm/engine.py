"""`VLLMEngine`: rollouts from real vLLM servers over their token-id route, with exact kept sets.

One `/inference/v1/generate` request per sample, sent concurrently from a thread pool, round-robin over the
workers. The parts: `server.py` (a launched CPU server), `protocol.py` (the codec: SamplingParams -> request,
answer -> Sample with the kept sets read from vLLM's processed log-probs), `weights.py` (weight sync from disk);
on the engine-neutral serving layer (`topp_rl.engines.serving`): bounded, retried HTTP calls, process groups, the
work dir, the weight checkpoint, the answers' weight versions and the overflow rule.

Weight updates land between rollouts (`update_weights`: the requests in flight, none between steps, are aborted) or
with requests in flight (`update_weights_in_flight`, partial rollouts: `/pause?mode=keep`; they continue under the
new weights, recomputing their KV, and each answer's `weight_versions` spans say which tokens each version sampled).

Workers come from one of two modes: launch (`model_path`, no `urls`: one server launched here, bound to loopback,
stopped on `close()`), or `urls` (running vLLM servers started with the flags and environment `VLLMServer` passes,
e.g. on GPUs). At connect every worker is probed once: the token-id route answers, the control routes exist, and a
top_k=1 request's second log-prob is -inf (the server reports processed log-probs, so the kept sets are exact).
The probe's answer also says whether the worker returns native sampling masks (`--return-sampling-mask`, vLLM's
GPU V2 runner): `kept_sets` decides from it (`auto`: native where every worker offers them, else the top-(k+1)
log-probs), and one line on stderr says which route the run takes.
"""

import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from topp_rl.data.params import SamplingParams
from topp_rl.data.sample import Sample
from topp_rl.engines.base import InFlightUpdates, RolloutEngine, check_prompts
from topp_rl.engines.serving.client import HTTPClient, Retries, Timeouts, gather, limits_from, parse_answer
from topp_rl.engines.serving.weights import WeightSyncStats
from topp_rl.engines.serving.workdir import remove_workdir
from topp_rl.engines.vllm import protocol
from topp_rl.engines.vllm.server import VLLMServer, make_vllm_workdir
from topp_rl.engines.vllm.weights import WeightSync
from topp_rl.models import save_model
from topp_rl.models.moe import moe_routing

KEPT_SETS = ("auto", "native", "logprobs")  # how the kept sets are read: asked of the servers, or forced

# Head sizes vLLM 0.32's CPU attention supports (`CPUAttentionBackend.get_supported_head_sizes`): another fails at the
# first request ("Unsupported CPU attention configuration").
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


class VLLMEngine(RolloutEngine, InFlightUpdates):
    """Rollouts from vLLM workers: launched here on `model_path` (one CPU server, `server_kwargs` to
    `VLLMServer`), or running ones at `urls` (then `model_path` or `vocab_size` names the model; `model_path` is
    also where a disk weight sync finds the config, and the servers must read the engine's work dir by path).
    `max_candidates`: the largest kept set recorded (top_k must not exceed it). `extra_sampling_params`: more keys
    of vLLM's `sampling_params` sent with every request (e.g. `{"ignore_eos": true}`), never one SamplingParams
    sets. `timeouts` / `retries`: as `SGLangEngine`'s (`rollout.engine.timeouts` / `retries`). `kept_sets`: `auto`
    (native masks where every worker returns them, else the top-(k+1) log-probs), `native` (refused at connect
    unless every worker returns them) or `logprobs`. `num_servers`: launched servers (round-robin per sample).
    `weight_sync`: `disk` (null too: a checkpoint in the work dir, read by the servers) or `distributed` (a
    broadcast group with the servers from `weight_sync_host`, in buckets of `weight_bucket_bytes`)."""

    shares_trainer_weights = False  # a server always holds its own copy
    max_candidates: int = 4096

    def __init__(
        self,
        *,
        urls: Sequence[str] | None = None,
        model_path: str | Path | None = None,
        vocab_size: int | None = None,
        max_candidates: int = 4096,
        record_candidates: bool = True,
        max_concurrency: int = 64,
        extra_sampling_params: Mapping[str, Any] | None = None,
        timeouts: Timeouts | Mapping[str, float] | None = None,
        retries: Retries | Mapping[str, float] | None = None,
        progress: bool = True,
        progress_interval_s: float = 30.0,
        workdir: str | Path | None = None,
        server_kwargs: dict[str, Any] | None = None,
        kept_sets: str = "auto",
        num_servers: int = 1,
        weight_sync: str | None = "disk",
        weight_bucket_bytes: int = 512 << 20,
        weight_sync_host: str = "127.0.0.1",
    ) -> None:
        if not urls and model_path is None:
            raise ValueError("VLLMEngine needs model_path= (a server is launched on it) or urls= (running servers)")
        if urls and server_kwargs:
            raise ValueError(f"server_kwargs={server_kwargs} configure a launched server, but urls= names running "
                             "ones; drop one of them")  # fmt: skip
        check_kept_sets(kept_sets, launched=not urls)
        if num_servers < 1 or (urls and num_servers != 1):
            raise ValueError(f"num_servers={num_servers}: launched servers, >= 1; with urls= the servers are the "
                             f"{len(urls or [])} given (leave num_servers at 1)")  # fmt: skip
        if max_candidates < 1 or max_concurrency < 1:
            raise ValueError(f"max_candidates ({max_candidates}) and max_concurrency ({max_concurrency}) must be >= 1")
        self.timeouts = limits_from(Timeouts, timeouts, "timeouts")
        self.retries = limits_from(Retries, retries, "retries")
        self.max_candidates, self.record_candidates, self.progress = max_candidates, record_candidates, progress
        self.model_path = Path(model_path) if model_path is not None else None
        self.extra_sampling_params = protocol.check_extra(extra_sampling_params)
        self._vocab_size = vocab_size or (config_vocab_size(self.model_path) if self.model_path is not None else 0)
        if not self._vocab_size:
            raise ValueError("VLLMEngine with urls= needs vocab_size= or model_path= (the served model's HF dir)")
        self.connected = bool(urls)
        self.version_at_start = 0  # the trainer's version of the weights before any in-flight update (start_version)
        self.last_sync: WeightSyncStats | None = None
        self.servers: list[VLLMServer] = []
        self.workdir = make_vllm_workdir(workdir)
        self.client = HTTPClient(timeouts=self.timeouts, retries=self.retries, max_concurrency=max_concurrency,
                                 progress_interval_s=progress_interval_s, label="vLLM")  # fmt: skip
        self.weights = WeightSync(self.client, workdir=self.workdir, method=weight_sync or "disk",
                                  bucket_bytes=weight_bucket_bytes, host=weight_sync_host)  # fmt: skip
        self._closed = False
        try:
            if urls:
                self.urls = [u.rstrip("/") for u in urls]
            else:
                kwargs = {"progress_interval_s": progress_interval_s, **(server_kwargs or {})}
                if kwargs.get("device", "cpu") != "cpu":
                    raise ValueError(f"server_kwargs.device={kwargs['device']!r}: the engine launches CPU servers "
                                     "only (GPU placement is SGLang's, rollout.engine.gpus); start GPU vLLM servers "
                                     "yourself (scripts/setup_vllm.sh --gpu) and pass rollout.engine.urls")  # fmt: skip
                if num_servers > 1 and kwargs.get("port") is not None:
                    raise ValueError(f"server_kwargs.port={kwargs['port']} with num_servers={num_servers}: servers "
                                     "need ports of their own; drop the port (free ones are picked)")  # fmt: skip
                for _ in range(num_servers):
                    self.servers.append(VLLMServer(self.model_path, max_logprobs=max_candidates + 1,
                                                   workdir=self.workdir, **kwargs))  # fmt: skip
                self.urls = [s.url for s in self.servers]
            native = [self._check_worker(url) for url in self.urls]
            self.native_masks = choose_kept_sets(kept_sets, dict(zip(self.urls, native, strict=True)))
            route = "native sampling masks" if self.native_masks else "read from the top-(top_k + 1) processed log-probs"
            print(f"[topp_rl] vLLM kept sets: {route} ({len(self.urls)} server(s), rollout.engine.kept_sets="
                  f"{kept_sets})", file=sys.stderr, flush=True)  # fmt: skip
        except BaseException:
            self.close()
            raise

    @classmethod
    def for_policy(
        cls, *, model, tokenizer, workdir: Path, share_weights: bool = False, record_routes: bool = False,
        **kwargs,
    ) -> "VLLMEngine":  # fmt: skip
        """The config factory (`rollout.engine`): a server launched on the policy's initial weights, written once
        to `workdir/init`; its log and weight copies live under `workdir`. Refused at start: `share_weights` (a
        server holds its own copy), routes of an MoE policy (vLLM returns them only from its GPU V2 runner), and on
        a launched CPU server a head size its attention lacks."""
        if share_weights:
            raise ValueError(
                "rollout.engine.share_weights=true: a vLLM server holds its own copy of the weights and cannot sample "
                "with the trainer's; drop the key (it is rollout=embedded's option)"
            )
        if record_routes and moe_routing(model) is not None:
            raise ValueError(
                "rollout.record_routes=true with an MoE model and rollout=vllm: vLLM returns routed experts only from "
                "its V2 model runner, which needs Triton on a GPU (refused on CPU); set rollout.record_routes=false "
                "and rollout.routing_replay=false, or use rollout=embedded"
            )
        if not kwargs.get("urls"):
            check_cpu_head_size(model.config)
        path = save_model(model, tokenizer, Path(workdir) / "init")
        engine = cls(model_path=path, vocab_size=int(model.config.vocab_size), workdir=workdir, **kwargs)
        engine.max_context = getattr(model.config, "max_position_embeddings", None)
        return engine

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def shared_by_ranks(self) -> bool:
        """The workers were given (`urls`), not launched here: every data-parallel rank reaches the same ones."""
        return self.connected

    @property
    def server(self) -> VLLMServer | None:
        return self.servers[0] if self.servers else None

    def _check_worker(self, url: str) -> bool:
        """One probe: the token-id route answers, and processed log-probs (top_k=1: the second entry is -inf unless
        it ties with the first, as every id does where a model's logits are flat). Returns whether the answer
        carries a native sampling mask."""
        body = {"token_ids": [1], "sampling_params": {"max_tokens": 1, "top_k": 1, "logprobs": 2, "detokenize": False},
                "output_mode": "tokens"}  # fmt: skip
        status, text = self.client.call("POST", url, protocol.GENERATE_PATH, body, self.timeouts.call(tokens=2))
        if status == 404:
            raise ValueError(f"vLLM server {url} has no {protocol.GENERATE_PATH}; start it with --enable-scale-out "
                             "(VLLMServer's flags)")  # fmt: skip
        answer = parse_answer("POST", url, protocol.GENERATE_PATH, status, text, label="vLLM")
        entries = answer["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        first, second = ([float(e["logprob"]) for e in entries if int(e["rank"]) == r] for r in (1, 2))
        if not (first and second) or protocol.NEG_INF < second[0] < first[0]:
            raise ValueError(f"vLLM server {url} reports log-probs before truncation (a top_k=1 request's second "
                             "log-prob is finite); start it with --logprobs-mode processed_logprobs")  # fmt: skip
        status, text = self.client.call("GET", url, "/is_paused", None, self.timeouts.call())
        if status == 404:
            raise ValueError(f"vLLM server {url} has no control routes (/pause, /collective_rpc); start it with "
                             "VLLM_SERVER_DEV_MODE=1 in its environment")  # fmt: skip
        return answer["choices"][0].get("sampling_mask") is not None

    # ---- the RolloutEngine calls -----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams, *, seed: int | None = None) -> list[Sample]:
        check_prompts(prompts, self.vocab_size)
        protocol.check_params(params, max_candidates=self.max_candidates, vocab_size=self.vocab_size,
                              native_masks=self.native_masks)  # fmt: skip
        codec = protocol.Codec(vocab_size=self.vocab_size, record_candidates=self.record_candidates,
                               start_version=self.version_at_start, native_masks=self.native_masks,
                               max_candidates=self.max_candidates)  # fmt: skip
        expanded = [prompt for prompt in prompts for _ in range(params.n)]
        futures = [
            self.client.submit(self._generate_one, self.urls[i % len(self.urls)],
                               protocol.payload(prompt, params, seed=seed, index=i, extra=self.extra_sampling_params,
                                                native_masks=self.native_masks),
                               len(prompt) + params.max_new_tokens)
            for i, prompt in enumerate(expanded)
        ]  # fmt: skip
        answers = gather(futures, desc="vllm rollout", progress=self.progress)
        return [codec.sample(prompt, answer, params) for prompt, answer in zip(expanded, answers, strict=True)]

    def _generate_one(self, url: str, body: dict[str, Any], tokens: int) -> dict[str, Any]:
        status, text = self.client.call("POST", url, protocol.GENERATE_PATH, body, self.timeouts.call(tokens=tokens))
        return parse_answer("POST", url, protocol.GENERATE_PATH, status, text, label="vLLM")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightSyncStats:
        """Load HF-named tensors into every worker from a temp checkpoint (`weights.WeightSync`: pause, reload with
        the tied-head refresh, prefix cache reset, version tag, resume). Returns, and keeps as `last_sync`, its
        time and bytes."""
        self.last_sync = self.weights.update(named_tensors, self.urls, config_dir=self.model_path)
        return self.last_sync

    # ---- partial rollouts (InFlightUpdates) --------------------------------------------------------------------
    def update_weights_in_flight(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> WeightSyncStats:
        """`update_weights` with the requests in flight neither aborted nor waited for: every worker is paused with
        `mode=keep` (vLLM preempts them and drops their KV), the weights are pushed tagged `version`, and after the
        resume they recompute prompt + tokens so far under the new weights and continue; each answer's per-token
        version spans then say which tokens the new weights sampled."""
        self.last_sync = self.weights.update(named_tensors, self.urls, config_dir=self.model_path,
                                             version=str(int(version)), pause="keep")  # fmt: skip
        return self.last_sync

    def start_version(self, version: int) -> None:
        """The trainer's version of the weights the workers hold now: every worker's weight version becomes
        `version` (replacing the launch weights' "default" or a synchronous push's count), so the tokens they
        sample before the next update record it."""
        self.version_at_start = int(version)
        for url in self.urls:
            self.weights.post(url, "/update_weight_version", {"new_version": str(self.version_at_start)})

    def close(self) -> None:
        """Stop the launched server (its whole process group), release the client threads and remove the work
        dir (a failed server's log is kept); idempotent."""
        if self._closed:
            return
        self._closed = True
        self.weights.close()
        self.client.close()
        failed = any(s.failed for s in self.servers)
        for server in self.servers:
            server.stop()
        self.servers = []
        remove_workdir(self.workdir, keep_log=failed)


def check_kept_sets(kept_sets: str, *, launched: bool) -> None:
    """Refuse an unknown `kept_sets`, and `native` on launched servers (vLLM's CPU build has no V2 runner)."""
    if kept_sets not in KEPT_SETS:
        raise ValueError(f"rollout.engine.kept_sets={kept_sets!r}: choose one of {', '.join(KEPT_SETS)}")
    if kept_sets == "native" and launched:
        raise ValueError(
            "rollout.engine.kept_sets=native with a launched server: the launched servers are vLLM's CPU build, whose "
            "sampling masks need the V2 model runner (Triton, a GPU); give running GPU servers started with "
            "--return-sampling-mask in rollout.engine.urls, or use kept_sets=auto / logprobs (top_k required)"
        )


def choose_kept_sets(kept_sets: str, native: Mapping[str, bool]) -> bool:
    """Whether the run reads native masks, from each worker's probe: `auto` takes them where every worker offers
    them; `native` needs them everywhere; `logprobs` never. Workers that disagree are refused (one run, one route)."""
    if len(set(native.values())) > 1:
        with_mask, without = ([url for url, has in native.items() if has is want] for want in (True, False))
        raise ValueError(f"vLLM servers {with_mask} return native sampling masks and {without} do not; start all "
                         "of them with or without --return-sampling-mask")  # fmt: skip
    offered = all(native.values())
    if kept_sets == "native" and not offered:
        raise ValueError(f"rollout.engine.kept_sets=native, but the vLLM servers {list(native)} return no sampling "
                         "masks; start them with --return-sampling-mask (vLLM >= 0.28, V2 model runner on a GPU), or "
                         "use kept_sets=auto / logprobs")  # fmt: skip
    return offered and kept_sets != "logprobs"


def config_vocab_size(model_path: Path) -> int:
    config = model_path / "config.json"
    if not config.is_file():
        raise ValueError(f"model_path ({model_path}) has no config.json; pass an HF checkpoint dir")
    return int(json.loads(config.read_text())["vocab_size"])


def check_cpu_head_size(config: Any) -> None:
    """Refuse a model whose attention head size vLLM's CPU attention lacks (it fails at the first request)."""
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head not in CPU_HEAD_SIZES:
        raise ValueError(
            f"rollout=vllm launches a CPU vLLM server, whose attention supports head sizes {list(CPU_HEAD_SIZES)}; "
            f"this model's is {head} (hidden_size {config.hidden_size} / {config.num_attention_heads} heads); use "
            f"fewer heads (the tiny model: model.heads=2 model.kv_heads=1 gives {config.hidden_size // 2}), or "
            "rollout=embedded / rollout=sglang"
        )
