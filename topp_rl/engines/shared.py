"""`SharedWorkersEngine`: the engine of one data-parallel rank among several whose engines reach the SAME workers
(SGLang servers given by `urls=[...]` or a running router: the config is the job's, so every rank connects to them).

A weight update pauses the workers with "abort", and SGLang serves one update at a time (two concurrent
`/update_weights_from_disk` calls crash its tokenizer manager; measured with SGLang 0.5.23). So one rank, the first
data-parallel source, pushes for all; the others walk the export without pushing (it may be a collective: FSDP
gathers, TP gathers), and every source then waits at a barrier of the sources, so none generates before the push
ended, and none is generating while it runs (every source reaches the update after its step's training, which
waited for its rollout).
"""

from collections.abc import Iterable

import torch
import torch.distributed as dist

from topp_rl.data.params import SamplingParams
from topp_rl.data.sample import Sample
from topp_rl.engines.base import EngineWrapper, RolloutEngine


class SharedWorkersEngine(EngineWrapper):
    """`engine` of one source among `group`'s, which share its workers; `pushes` on exactly one of them."""

    def __init__(self, engine: RolloutEngine, *, pushes: bool, group: dist.ProcessGroup) -> None:
        self.inner, self.pushes, self.group = engine, pushes, group
        self.vocab_size = engine.vocab_size

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, seed: int | None = None) -> list[Sample]:
        return self.inner.generate(prompts, params, seed=seed)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.pushes:
            self.inner.update_weights(named_tensors)
        else:
            for _ in named_tensors:  # take part in the export's gathers, push nothing
                pass
        dist.barrier(group=self.group)  # no source generates before the workers hold the new weights

    def close(self) -> None:
        self.inner.close()
