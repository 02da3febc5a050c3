"""`WeightSync`: push the policy's weights to the rollout engine after every optimisation round.

The engine is `trainer.datamodule.engine`; ranks whose datamodule holds none (`None`) still run the export,
which may be collective, and drop the tensors. Tensors go
out under their HF names, detached but neither copied nor cast (the engine decides its dtype), as a lazy
iterator so no second copy of the model is built. A module that stores the policy in another layout (Megatron)
provides `hf_named_tensors()`; otherwise `pl_module.policy.named_parameters()` (an HF model) is used. Weights are
also pushed once at train start, so a run resumed from a checkpoint does not sample with the initial weights.
"""

from collections.abc import Iterator

import torch
from lightning.pytorch.callbacks import Callback


def hf_named_tensors(pl_module) -> Iterator[tuple[str, torch.Tensor]]:
    if hasattr(pl_module, "hf_named_tensors"):
        yield from pl_module.hf_named_tensors()
        return
    for name, param in pl_module.policy.named_parameters():
        yield name, param.detach()


class WeightSync(Callback):
    def __init__(self, *, sync_on_start: bool = True) -> None:
        self.sync_on_start = sync_on_start
        self.pushes = 0

    @staticmethod
    def engine(trainer):
        datamodule = trainer.datamodule
        if datamodule is None or not hasattr(datamodule, "engine"):
            raise ValueError(
                f"WeightSync needs trainer.datamodule.engine, but the datamodule is {type(datamodule).__name__}; "
                "fit with a RolloutDataModule (or drop WeightSync from the callbacks)"
            )
        return datamodule.engine

    def push(self, trainer, pl_module) -> None:
        engine = self.engine(trainer)
        with torch.no_grad():
            named = hf_named_tensors(pl_module)
            if engine is None:
                # Exporting can be collective (Megatron all-gathers TP shards layer by layer): ranks without an
                # engine still walk the export so the ranks with one do not hang.
                for _ in named:
                    pass
                return
            engine.update_weights(named)
        self.pushes += 1

    def on_train_start(self, trainer, pl_module) -> None:
        self.engine(trainer)  # fail at start, not after the first step
        if self.sync_on_start:
            self.push(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.push(trainer, pl_module)
