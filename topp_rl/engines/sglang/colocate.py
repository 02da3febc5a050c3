"""Colocated SGLang servers (`rollout.engine.placement=colocated`): on the trainer ranks' own GPUs, giving their
memory back while the trainer trains.

A step's calls to every server, in this order (`MemoryCycle` is the only code that issues the memory calls; `engine.ColocatedSGLangEngine` drives it):

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

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

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


def without_memory_saver(infos: dict[str, dict[str, Any]]) -> list[str]:
    """The GPU servers (by `/server_info`) running without SGLang's memory saver: they could not release memory."""
    return [url for url, info in infos.items() if info.get("device") != "cpu" and not info.get("enable_memory_saver")]
