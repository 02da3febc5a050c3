"""`SGLangEngine`: rollouts from real SGLang servers over their native HTTP API, with exact candidate sets.

One `/generate` request per sample, sent concurrently from a thread pool: through the router (smg) when there is
one, else round-robin over the server URLs. The engine is a facade over its parts, each tested on its own:
- `fleet.py`: where the workers are (launched, behind a router, or given) and the connect-time checks;
- `protocol.py`: the codec, SamplingParams -> request body and answer -> Sample (candidate sets, overflow, seeds);
- `weights.py`: weight sync (pause, push from disk or by broadcast, resume) into every worker directly, between
  rollouts (`update_weights`) or with requests in flight (`update_weights_in_flight`, partial rollouts);
and over the engine-neutral serving layer (`topp_rl.engines.serving`): bounded, retried HTTP calls (`Timeouts`,
`Retries`, the wait lines, the request errors), process groups, the candidate wire format, the weight broadcast.
"""

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from topp_rl.data.params import SamplingParams
from topp_rl.data.routes import MoeRouting
from topp_rl.data.sample import Sample
from topp_rl.engines.base import InFlightUpdates, ReleasesMemory, RolloutEngine, check_prompts
from topp_rl.engines.serving.client import HTTPClient, Retries, Timeouts, gather, limits_from
from topp_rl.engines.serving.weights import WeightSyncStats
from topp_rl.engines.sglang.colocate import MemoryCycle, without_memory_saver
from topp_rl.engines.sglang.fleet import Fleet, WireMode, worker_mode
from topp_rl.engines.sglang.protocol import Codec, ServerOverflow, generate_answer
from topp_rl.engines.sglang.router import SGLangRouter, check_policy
from topp_rl.engines.sglang.routes import check_capture_device, with_route_capture
from topp_rl.engines.sglang.server import SGLangServer, make_workdir
from topp_rl.engines.sglang.weights import InFlightPause, SyncMethod, WeightSync, without_prefix_cache
from topp_rl.models import save_model
from topp_rl.models.moe import moe_routing
from topp_rl.parallel.placement import Server


class SGLangEngine(RolloutEngine, InFlightUpdates):
    """Rollouts from SGLang workers, reached in one of three modes (exactly one; see `fleet.worker_mode`):
    - launch (`model_path`, no URLs): `num_servers` servers on `model_path`, and when `num_servers > 1` or
      `router=True` a router (smg) in front of them; all owned, bound to loopback, stopped on `close()`;
    - `router_url`: a running router; its workers are found through its `GET /workers`;
    - `urls`: running servers addressed directly, round-robin per sample (no router).
    `timeouts` and `retries`: a `Timeouts` / `Retries`, or a mapping of some of its fields (the config groups
    `rollout.engine.timeouts` / `rollout.engine.retries`; a key left out keeps its default).
    `pause_mode`: how `update_weights_in_flight` pauses the requests in flight, "retract" (their KV is recomputed
    under the new weights) or "in_place" (kept; docs/sglang.md, "Weight updates with requests in flight")."""

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
        routing: MoeRouting | None = None,
        wire: WireMode = "auto",
        weight_sync: SyncMethod | None = "disk",
        weight_bucket_bytes: int = 512 * 2**20,
        pause_mode: InFlightPause = "retract",
        max_concurrency: int = 64,
        timeouts: Timeouts | Mapping[str, float] | None = None,
        retries: Retries | Mapping[str, float] | None = None,
        progress: bool = True,
        progress_interval_s: float = 30.0,
        extra_sampling_params: dict[str, Any] | None = None,
        workdir: str | Path | None = None,
        weight_sync_host: str = "127.0.0.1",
        server_kwargs: dict[str, Any] | None = None,
        placed: Sequence[Server] | None = None,
    ) -> None:
        mode = worker_mode(urls=urls, router_url=router_url, model_path=model_path, num_servers=num_servers,
                           router=router)  # fmt: skip
        check_policy(router_policy)
        if wire not in ("auto", "b64", "nested"):
            raise ValueError(f"wire ({wire!r}) must be 'auto', 'b64' or 'nested'")
        weight_sync = weight_sync or "disk"  # null in the config: disk unless colocated (`ColocatedSGLangEngine`)
        if weight_sync not in ("disk", "distributed", "tensor"):
            raise ValueError(f"weight_sync ({weight_sync!r}) must be 'disk', 'distributed' or 'tensor'")
        if weight_sync == "tensor" and not self.colocated:
            raise ValueError(
                "weight_sync='tensor' hands the servers handles to the trainer's own memory (CUDA IPC, shared memory), "
                "so they must share its devices: set rollout.engine.placement=colocated, or use disk / distributed"
            )
        if placed is not None and (mode != "launch" or len(placed) != num_servers):
            raise ValueError(
                f"placed= gives {len(placed)} placed server(s) but the engine launches {num_servers if mode == 'launch' else 0}; "
                "the placement plan places exactly the servers this engine launches (rollout.engine.num_servers)"
            )
        if pause_mode not in ("retract", "in_place"):
            raise ValueError(
                f"pause_mode ({pause_mode!r}) must be 'retract' (the requests in flight recompute their KV under the "
                "new weights) or 'in_place' (they keep it)"
            )
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency ({max_concurrency}) must be >= 1")
        if max_candidates < 1 or weight_bucket_bytes < 1:
            raise ValueError(
                f"max_candidates ({max_candidates}) and weight_bucket_bytes ({weight_bucket_bytes}) must be >= 1 "
                "(defaults: 4096, SGLang's --sampling-mask-max-tokens default, and 512 MiB)"
            )
        self.timeouts = limits_from(Timeouts, timeouts, "timeouts")
        self.retries = limits_from(Retries, retries, "retries")
        self.max_candidates = max_candidates
        self.record_candidates, self.record_raw_log_probs = record_candidates, record_raw_log_probs
        # MoE: ask every /generate for the routed experts; launched servers get SGLang's capture flag.
        self.routing = routing
        server_kwargs = with_route_capture(server_kwargs or {}) if routing is not None and mode == "launch" \
            else server_kwargs
        if pause_mode == "in_place" and mode == "launch":
            server_kwargs = without_prefix_cache(server_kwargs or {})
        self.weight_sync, self.pause_mode = weight_sync, pause_mode
        self.version_at_start = 0  # the trainer's version of the weights before any in-flight update (start_version)
        self.connected = mode != "launch"
        self.progress = progress
        # SGLang-only sampling keys (e.g. {"ignore_eos": True} for benchmarks), added to every request.
        self.extra_sampling_params = dict(extra_sampling_params or {})
        # Whether the servers carry patches/sglang and `wire` allows the compact form (set at connect).
        self.patched = False
        self.last_sync: WeightSyncStats | None = None
        # Server and router logs, disk-sync checkpoints and rendezvous files; removed on close (failed logs kept).
        self.workdir = make_workdir(workdir)
        self.fleet = Fleet(workdir=self.workdir, model_path=Path(model_path) if model_path is not None else None,
                           vocab_size=vocab_size or 0, max_candidates=max_candidates)  # fmt: skip
        self.client = HTTPClient(timeouts=self.timeouts, retries=self.retries, max_concurrency=max_concurrency,
                                 progress_interval_s=progress_interval_s, notes=self.fleet, label="SGLang")  # fmt: skip
        self.weights = WeightSync(self.client, bucket_bytes=weight_bucket_bytes, host=weight_sync_host,
                                  workdir=self.workdir)  # fmt: skip
        try:
            if mode == "urls":
                self.fleet.use_urls(urls)
            elif mode == "router_url":
                self.fleet.join_router(self.client, router_url)
            else:
                self.fleet.launch(num_servers, router=router, router_policy=router_policy,
                                  router_kwargs=router_kwargs or {}, slots=self._slots(placed, server_kwargs),
                                  server_kwargs={"progress_interval_s": progress_interval_s, **(server_kwargs or {})})  # fmt: skip
            self.patched = self.fleet.connect(self.client, wire=wire, prefix_cache=pause_mode != "in_place")
        except BaseException:
            self.close()
            raise

    colocated = False  # on the trainer's own devices (`ColocatedSGLangEngine`)

    def _slots(self, placed: Sequence[Server] | None, server_kwargs: dict[str, Any] | None) -> list[dict] | None:
        """Each launched server's GPUs, memory fraction and memory saver (colocated servers on GPUs), from the
        placement plan's `placed` servers."""
        if placed is None:
            return None
        return [{"gpus": s.gpus, "mem_fraction": s.mem_fraction, "memory_saver": self.colocated} for s in placed]

    @classmethod
    def for_policy(
        cls, *, model, tokenizer, workdir: Path, share_weights: bool = False, record_routes: bool = True,
        colocated: bool = False, **kwargs,
    ) -> "SGLangEngine":  # fmt: skip
        """The config factory (`rollout.engine`): servers launched on the policy's initial weights, written
        once to `workdir/init` (SGLang loads weights from disk); their logs and weight copies live under `workdir`.
        A server always holds its own weights: `share_weights` (the embedded engine's option) must be false.
        `record_routes`: ask for the routed experts when the policy is an MoE model (`topp_rl.models.moe`).
        `colocated`: the servers share the trainer's devices (`ColocatedSGLangEngine`); `placed` (in `kwargs`):
        the placement plan's servers of this engine, on GPUs."""

        if share_weights:
            raise ValueError(
                "rollout.engine.share_weights=true: an SGLang server holds its own copy of the weights and cannot "
                "sample with the trainer's (colocated servers too: they share its devices, not its tensors); drop "
                "the key (it is rollout=embedded's option)"
            )

        routing = moe_routing(model) if record_routes else None
        if routing is not None and not (kwargs.get("urls") or kwargs.get("router_url")):  # servers launched here
            placed = "cuda" if kwargs.get("placed") else "cpu"
            check_capture_device((kwargs.get("server_kwargs") or {}).get("device") or placed)
        path = save_model(model, tokenizer, Path(workdir) / "init")
        engine_class = ColocatedSGLangEngine if colocated else cls
        engine = engine_class(model_path=path, vocab_size=int(model.config.vocab_size), workdir=workdir, routing=routing,
                     **kwargs)
        engine.max_context = getattr(model.config, "max_position_embeddings", None)  # the servers' context length
        return engine

    # ---- the fleet's state, read-only ----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.fleet.vocab_size

    @property
    def model_path(self) -> Path | None:
        return self.fleet.model_path

    # ---- capabilities (RolloutEngine) ---------------------------------------------------------------------
    shares_trainer_weights = False  # a server always holds its own copy
    max_candidates: int = 4096  # the class default; each engine keeps its own (`max_candidates=`)

    @property
    def shared_by_ranks(self) -> bool:
        """The workers were given (`urls`, `router_url`), not launched here: every data-parallel rank of the job
        connects to the same ones (`topp_rl.engines.shared`)."""
        return self.connected

    @property
    def records_routes(self) -> bool:
        return self.routing is not None

    @property
    def urls(self) -> list[str]:
        """The workers (the launched servers, the router's workers at connect time, or the given URLs)."""
        return self.fleet.urls

    @property
    def tp_sizes(self) -> dict[str, int]:
        """Each worker's TP ranks (its `/server_info` at connect)."""
        return {url: int(info.get("tp_size") or 1) for url, info in self.fleet.infos.items()}

    @property
    def router_url(self) -> str | None:
        return self.fleet.router_url

    @property
    def servers(self) -> list[SGLangServer]:
        return self.fleet.servers

    @property
    def launched_router(self) -> SGLangRouter | None:
        return self.fleet.launched_router

    @property
    def server(self) -> SGLangServer | None:
        """The first launched server (the only one unless num_servers > 1); None when connected."""
        return self.servers[0] if self.servers else None

    @property
    def codec(self) -> Codec:
        """The request / answer codec of the current settings (built per rollout: `patched` and
        `extra_sampling_params` may be changed between rollouts)."""
        return Codec(vocab_size=self.vocab_size, max_candidates=self.max_candidates, b64=self.patched,
                     record_candidates=self.record_candidates, record_raw_log_probs=self.record_raw_log_probs,
                     routing=self.routing, extra=dict(self.extra_sampling_params),
                     start_version=self.version_at_start)  # fmt: skip

    # ---- the RolloutEngine calls -----------------------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, seed: int | None = None
    ) -> list[Sample]:
        check_prompts(prompts, self.vocab_size)
        codec = self.codec
        # Through the router when there is one; the client's own round-robin is for direct URLs only.
        targets = [self.router_url] if self.router_url is not None else self.urls
        expanded = [(g, p) for g, p in enumerate(prompts) for _ in range(params.n)]
        futures = [
            self.client.submit(self._generate_one, targets[i % len(targets)],
                               codec.payload(prompt, params, seed=seed, index=i), len(prompt) + params.max_new_tokens)
            for i, (_, prompt) in enumerate(expanded)
        ]  # fmt: skip
        answers = gather(futures, desc="sglang rollout", progress=self.progress)
        return [codec.sample(prompt, answer, wants_mask=params.truncates)
                for (_, prompt), answer in zip(expanded, answers, strict=True)]

    def _generate_one(self, url: str, body: dict[str, Any], tokens: int) -> dict[str, Any] | ServerOverflow:
        status, text = self.client.call("POST", url, "/generate", body, self.timeouts.call(tokens=tokens))
        return generate_answer(url, status, text)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightSyncStats:
        """Load HF-named tensors into every live worker, each addressed directly (the router routes no control
        calls): pause its generation, push (broadcast in buckets of `weight_bucket_bytes` over a
        torch.distributed group, `weight_sync="distributed"`, gloo on CPU, nccl on CUDA; or one temp checkpoint
        for `/update_weights_from_disk`, `"disk"`), resume. Returns, and keeps as `last_sync`, its time and bytes."""
        workers = self.fleet.live_workers(self.client)
        self.last_sync = self.weights.update(named_tensors, workers, method=self.weight_sync,
                                             config_dir=self.model_path, tp_sizes=self.tp_sizes)  # fmt: skip
        return self.last_sync

    # ---- partial rollouts (InFlightUpdates) --------------------------------------------------------------------
    def update_weights_in_flight(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> WeightSyncStats:
        """`update_weights` with the requests in flight neither aborted nor waited for: each live worker is paused
        in `pause_mode`, the weights are pushed tagged `version` (SGLang's weight_version), and the workers
        continue; each answer's per-token version spans then say which tokens the new weights sampled."""
        workers = self.fleet.live_workers(self.client)
        self.last_sync = self.weights.update(named_tensors, workers, method=self.weight_sync,
                                             config_dir=self.model_path, pause=self.pause_mode,
                                             version=str(int(version)), tp_sizes=self.tp_sizes)  # fmt: skip
        return self.last_sync

    def start_version(self, version: int) -> None:
        """The trainer's version of the weights the workers hold now: every live worker's weight_version becomes
        `version` (replacing the launch weights' "default" or a synchronous push's count), so the tokens they
        sample before the next update record it. Call it after any synchronous `update_weights`."""
        self.version_at_start = int(version)
        for url in self.fleet.live_workers(self.client):
            self.client.post(url, "/update_weight_version",
                             {"new_version": str(self.version_at_start), "abort_all_requests": False})  # fmt: skip

    def close(self) -> None:
        """Stop the owned router and servers (whole process groups), release the client threads and remove
        the work dir (a failed server's or router's log is kept); idempotent."""
        self.client.close()
        self.weights.close()
        self.fleet.close()


class ColocatedSGLangEngine(SGLangEngine, ReleasesMemory):
    """`SGLangEngine` whose launched servers share the trainer's devices: `release_memory` after a step's rollouts,
    weights pushed by tensor handles (`weight_sync="tensor"`, the default here; `"disk"` also works) with the memory
    taken back around the push (`MemoryCycle`). Refused: servers it does not launch, a broadcast weight sync (it
    would put a trainer rank and a server on one GPU, which NCCL refuses), GPU servers without the memory saver."""

    colocated = True

    def __init__(self, *, weight_sync: str | None = None, **kwargs: Any) -> None:
        if kwargs.get("urls") or kwargs.get("router_url"):
            raise ValueError(
                "rollout.engine.placement=colocated launches its servers on the trainer's own devices, but urls / "
                "router_url name servers running elsewhere; drop them, or leave rollout.engine.placement null"
            )
        weight_sync = weight_sync or "tensor"
        if weight_sync == "distributed":
            raise ValueError(
                "rollout.engine.weight_sync='distributed' with rollout.engine.placement=colocated: a broadcast group "
                "would hold a trainer rank and a server on one GPU, which NCCL refuses; set weight_sync=null (tensor "
                "handles: CUDA IPC on GPUs, shared memory on CPU) or disk"
            )
        super().__init__(weight_sync=weight_sync, **kwargs)
        self.cycle = MemoryCycle(self.weights.control)
        try:
            self._check_memory_saver()
        except BaseException:
            self.close()
            raise

    def _check_memory_saver(self) -> None:
        if missing := without_memory_saver(self.fleet.infos):
            raise ValueError(
                f"colocated SGLang servers {missing} run without the memory saver, so they could not give the "
                "trainer their memory; launch them with --enable-memory-saver (the colocated launch adds it; "
                "torch_memory_saver must be installed: scripts/setup_sglang.sh --gpu)"
            )

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, seed: int | None = None) -> list[Sample]:
        self.cycle.check_serving()
        return super().generate(prompts, params, seed=seed)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightSyncStats:
        push = super().update_weights
        return self.cycle.update(self.fleet.live_workers(self.client), lambda: push(named_tensors))

    def release_memory(self) -> None:
        self.cycle.release(self.fleet.live_workers(self.client))
