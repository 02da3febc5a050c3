"""Colocated SGLang servers (`rollout.engine.placement=colocated`): on the trainer ranks' own GPUs, giving their
memory back while the trainer trains.

A step's calls to every server, in this order (`MemoryCycle` is the only code that issues the memory calls):

    generate ...           the step's rollouts: every refill round, every agent turn
    release                /release_memory_occupation {}: KV cache, weights and CUDA graphs leave the GPU
    (the trainer trains in that memory)
    resume weights         /resume_memory_occupation {"tags": ["weights"]}: room for the weights only
    push                   /update_weights_from_tensor per bucket, from the trainer ranks on the same GPUs
    resume KV cache        /resume_memory_occupation {"tags": ["kv_cache", "cuda_graph"]}
    generate ...

The KV cache comes back after the push, so it and the pushed buckets are never on the GPU together. The released
weights are not kept anywhere (SGLang's memory saver drops them), which is why a generate between release and
push is refused rather than served. On a GPU the servers run SGLang's memory saver (`--enable-memory-saver`,
torch_memory_saver); a CPU server has none (the package is CUDA-only), takes the same calls and frees nothing:
the order, the push over shared memory and the flushed cache are the same, which is what the CPU tests check.
"""

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch

from topp_rl.data.params import SamplingParams
from topp_rl.data.sample import Sample
from topp_rl.engines.base import ReleasesMemory
from topp_rl.engines.serving.weights import WeightSyncStats
from topp_rl.engines.sglang.engine import SGLangEngine

RELEASE = "/release_memory_occupation"
RESUME = "/resume_memory_occupation"
WEIGHTS = {"tags": ["weights"]}
KV_CACHE = {"tags": ["kv_cache", "cuda_graph"]}  # everything the release took but the weights
T = TypeVar("T")
Call = Callable[[str, str, dict[str, Any]], Any]  # (worker URL, path, JSON body) -> answer


class MemoryCycle:
    """The order of a colocated server's memory calls around the trainer's step (module docstring), as a state:
    serving (the servers hold weights and KV cache) or released."""

    def __init__(self, call: Call) -> None:
        self._call = call
        self.released = False

    def release(self, workers: Sequence[str]) -> None:
        """Once the step's generations are done: every server gives its memory back."""
        if self.released:
            raise RuntimeError("release_memory called twice without a weight update in between; the servers' "
                               "memory is already released (a step releases once, after its last generate)")
        for url in workers:
            self._call(url, RELEASE, {})
        self.released = True

    def update(self, workers: Sequence[str], push: Callable[[], T]) -> T:
        """The weight update: weights' memory back, `push()`, KV cache back (just `push()` while serving: the
        start of a run, before any release)."""
        if not self.released:
            return push()
        for url in workers:
            self._call(url, RESUME, WEIGHTS)
        out = push()
        for url in workers:
            self._call(url, RESUME, KV_CACHE)
        self.released = False
        return out

    def check_serving(self) -> None:
        if self.released:
            raise RuntimeError(
                "generate on colocated SGLang servers whose memory is released (after release_memory, before the "
                "next update_weights): their weights are gone until the trainer pushes them; push first"
            )


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
        missing = [url for url, info in self.fleet.infos.items()
                   if info.get("device") != "cpu" and not info.get("enable_memory_saver")]
        if missing:
            raise ValueError(
                f"colocated SGLang servers {missing} run without the memory saver, so they could not give the "
                "trainer their memory; launch them with --enable-memory-saver (the colocated launch adds it; "
                "torch_memory_saver must be installed: scripts/setup_sglang.sh --gpu)"
            )

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, seed: int | None = None) -> list[Sample]:
        self.cycle.check_serving()
        return super().generate(prompts, params, seed=seed)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightSyncStats:
        return self.cycle.update(self.fleet.live_workers(self.client), lambda: super(
            ColocatedSGLangEngine, self).update_weights(named_tensors))

    def release_memory(self) -> None:
        self.cycle.release(self.fleet.live_workers(self.client))
