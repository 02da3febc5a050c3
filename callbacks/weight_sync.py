"""`WeightSync`: push the policy's weights to the rollout engine after every optimisation round.

The engine is `trainer.datamodule.engine`, present on the rank that generates for its TP x CP group and None
on that rank's peers, which still walk the export: it is a TP collective. The weights come from the module's
`hf_named_tensors()` (the
`topp_rl.trainer.backbone.WeightSource` protocol, which `PolicyModule` implements by delegating to its backbone; a
sharded backbone gathers its TP shards there, collectively). Tensors go out under their HF names, detached but
neither copied nor cast (the engine decides its dtype), as a lazy iterator so no second copy of the model is
built. Weights are also pushed once at train start, so a run resumed from a checkpoint does not sample with the
initial weights. Each step's push is timed and its bytes counted (`perf/weight_sync_s`,
`perf/weight_sync_bytes`, over the ranks that push).
"""

import time
from collections.abc import Iterable, Iterator
from typing import Protocol, runtime_checkable

import torch
from lightning.pytorch.callbacks import Callback

from topp_rl.callbacks._common import log_metrics
from topp_rl.engines.base import RolloutEngine
from topp_rl.trainer.backbone import WeightSource
from topp_rl.trainer.module import PolicyModule


@runtime_checkable
class EngineHolder(Protocol):
    """A datamodule that samples with a rollout engine (`RolloutDataModule`)."""

    engine: RolloutEngine | None  # None on the TP x CP peers of the rank that generates


class WeightSync(Callback):
    def __init__(self, *, sync_on_start: bool = True) -> None:
        self.sync_on_start = sync_on_start
        self.pushes = 0

    @staticmethod
    def engine(trainer) -> RolloutEngine | None:
        datamodule = trainer.datamodule
        if not (isinstance(datamodule, EngineHolder) and isinstance(datamodule.engine, RolloutEngine | None)):
            raise ValueError(
                f"WeightSync needs trainer.datamodule.engine (a RolloutEngine), but the datamodule is "
                f"{type(datamodule).__name__}; fit with a RolloutDataModule (or drop WeightSync from the callbacks)"
            )
        return datamodule.engine

    @staticmethod
    def source(pl_module) -> WeightSource:
        if not isinstance(pl_module, WeightSource):
            raise TypeError(
                f"WeightSync exports weights through hf_named_tensors(), which {type(pl_module).__name__} does "
                "not define; use topp_rl.trainer.module.PolicyModule (or implement topp_rl.trainer.backbone.WeightSource)"
            )
        return pl_module

    def push(self, trainer, pl_module) -> dict[str, tuple[float, float]]:
        """Push the weights; (sum, count) pairs of this rank's push time and bytes (count 0 without an engine)."""
        engine = self.engine(trainer)
        start, counter = time.perf_counter(), _ByteCounter()
        with torch.no_grad():
            named = counter.wrap(self.source(pl_module).hf_named_tensors())
            if engine is None:
                for _ in named:  # a TP collective: take part in the gathers, drop the tensors
                    pass
                return {"perf/weight_sync_s": (0.0, 0.0), "perf/weight_sync_bytes": (0.0, 0.0)}
            engine.update_weights(named)
        self.pushes += 1
        return {"perf/weight_sync_s": (time.perf_counter() - start, 1.0),
                "perf/weight_sync_bytes": (float(counter.bytes), 1.0)}

    def on_fit_start(self, trainer, pl_module) -> None:
        """A shared embedded engine samples with the policy's own module; a strategy that sharded it (FSDP2, in its
        setup, which runs before this hook) leaves it whole only inside `gathered()`, so every generate runs there."""
        engine = self.engine(trainer)
        policy = pl_module.policy if isinstance(pl_module, PolicyModule) else None
        if engine is not None and engine.shares_trainer_weights and policy is not None and policy.shards_weights:
            if engine.model is not policy.model:
                raise ValueError("the shared embedded engine samples with another module than the policy; build it "
                                 "from the policy (rollout.engine.share_weights=true) or give it its own copy (false)")
            engine.sample_sharded(policy.gathered)

    def on_train_start(self, trainer, pl_module) -> None:
        self.engine(trainer), self.source(pl_module)  # fail at start, not after the first step
        if self.sync_on_start:
            self.push(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        log_metrics(trainer, self.push(trainer, pl_module))


class _ByteCounter:
    """Counts the bytes of the tensors an iterator yields, as the engine consumes them."""

    def __init__(self) -> None:
        self.bytes = 0

    def wrap(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named:
            self.bytes += tensor.numel() * tensor.element_size()
            yield name, tensor
