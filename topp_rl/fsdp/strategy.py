"""`FSDPStrategy`: Lightning's DDP strategy with the HF backbone sharded by FSDP2 over every rank (CPU gloo or GPU).

Why not Lightning's `ModelParallelStrategy`: it shards inside `LightningModule.configure_model` (the FSDP code
would live in `PolicyModule`, whose backbones strategies hand over through `use_backbones`), its checkpoints are
torch.distributed.checkpoint directories (the project's `LastCheckpoint` writes one atomic `last.ckpt` file and
checks it on resume), and its mesh is 2-D (dp x tp) with tp defaulting to the devices of a node. This subclass
(like `MegatronStrategy`) keeps the DDP process-group, launcher and sampler handling and replaces the wrapper:
- `configure_ddp`: after the datamodule built its engines (a `share_weights=false` engine copied the full model
  already), shard the policy and the reference (`FSDPBackbone`) over a 1-D mesh of all ranks and hand them to the
  module; optimizers are built afterwards, over the shards (each rank holds 1/world of AdamW's moments). A shared
  embedded engine samples with the sharded module, gathered around each `generate` (`EmbeddedEngine.sample_sharded`).
- mixed precision (`mixed_precision_policy`): `trainer.precision=bf16-mixed` on GPU also gives FSDP2's own
  `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)`: each unit is all-gathered in bf16 (half the
  bytes and the transient memory of float32 gathers) and its gradients reduce-scattered in float32 into the float32
  shards; Lightning's autocast stays on around the step, so ops autocast keeps in float32 (softmax, log-softmax,
  norms) stay so. On CPU, and for every other precision, no policy: float32 gathers, and the plugin's autocast
  alone (as the unsharded HF backbone runs) — gloo all-gathers in bf16 would save little on one host.
- every rank is a data-parallel rank and its own rollout source (Lightning's DDP sampler kwargs; no `rollout_peers`).
- checkpoints: the FULL weights under the keys of an unsharded `PolicyModule` (so a checkpoint loads before the
  sharding, at any world size, and an `HFBackbone` run's checkpoint loads too) and the FULL optimizer state keyed by
  parameter name (`torch.distributed.checkpoint.state_dict`, world-size independent). Both are gathered on every
  rank; rank 0 writes. Resume at any world size; optimizer state saved by another strategy is refused.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from topp_rl.backbone import HFBackbone
from topp_rl.engines.embedded import EmbeddedEngine
from topp_rl.fsdp.backbone import FSDPBackbone, full_tensor

_SLOTS = ("policy", "reference")
_STATE_KEY = "fsdp_full_optimizer_state"


def mixed_precision_policy(precision: str, device_type: str) -> MixedPrecisionPolicy | None:
    """FSDP2's policy for Lightning's `precision` on `device_type` (see module docstring): bf16 gathers with float32
    gradient reduction for `bf16-mixed` on GPU, else None (float32 gathers; autocast, if any, is the plugin's)."""
    if precision == "bf16-mixed" and device_type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


class FSDPStrategy(DDPStrategy):
    """DDPStrategy + FSDP2 sharding of the HF backbones (see module docstring)."""

    strategy_name = "fsdp2"

    def __init__(self, *, cpu_offload: bool = False, **kwargs: Any) -> None:
        if not isinstance(cpu_offload, bool):
            raise ValueError(f"FSDPStrategy cpu_offload={cpu_offload!r} must be true or false")
        super().__init__(**kwargs)
        self.cpu_offload = cpu_offload

    def configure_ddp(self) -> None:
        if self.cpu_offload and self.root_device.type == "cpu":
            raise ValueError("parallel.cpu_offload=true on a CPU run: the weights already live in host memory; set "
                             "parallel.cpu_offload=false, or train on GPUs (trainer=gpu)")
        module = self.lightning_module
        mesh = init_device_mesh(self.root_device.type, (dist.get_world_size(),))
        mp_policy = mixed_precision_policy(str(self.precision_plugin.precision), self.root_device.type)
        backbones = {}
        for slot in _SLOTS:
            backbone = getattr(module, slot)
            if backbone is not None and not isinstance(backbone, HFBackbone):
                raise TypeError(f"FSDPStrategy shards HFBackbone policies, got a {type(backbone).__name__} as {slot}")
            backbones[slot] = None if backbone is None else FSDPBackbone(
                backbone, mesh=mesh, cpu_offload=self.cpu_offload, mp_policy=mp_policy
            )
        module.use_backbones(**backbones)
        self._share_with_engine(backbones["policy"])

    def _share_with_engine(self, policy: FSDPBackbone) -> None:
        """A shared embedded engine samples with the policy's HF module, now sharded: gather it per generate."""
        from topp_rl.rollout import RolloutDataModule

        datamodule = self.lightning_module.trainer.datamodule
        engine = datamodule.engine if isinstance(datamodule, RolloutDataModule) else None
        if isinstance(engine, EmbeddedEngine) and engine.share_weights:
            if engine.model is not policy.model:
                raise ValueError("the shared embedded engine samples with another module than the policy; build it "
                                 "from the policy (rollout.engine.share_weights=true) or give it its own copy (false)")
            engine.sample_sharded(policy.gathered)

    # ---- checkpoints: full tensors, world-size independent ---------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The unsharded module's state dict (`policy.model.<HF name>`, ...): an all-gather per tensor, on every rank."""
        state = {}
        for name, tensor in self.lightning_module.state_dict().items():
            slot, _, rest = name.partition(".")
            if slot in _SLOTS and rest.startswith("inner."):
                name = f"{slot}.{rest.removeprefix('inner.')}"
            state[name] = full_tensor(tensor).detach().cpu().clone()
        return state

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        options = StateDictOptions(full_state_dict=True)
        return {_STATE_KEY: get_optimizer_state_dict(self.lightning_module.policy, optimizer, options=options)}

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        options = StateDictOptions(full_state_dict=True)
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            if _STATE_KEY not in state:
                raise ValueError(
                    "the checkpoint's optimizer state was not saved under parallel=fsdp (its AdamW moments are keyed "
                    "by another layout); resume it with the parallel config that wrote it, or load its weights "
                    "alone (weights_only)"
                )
            set_optimizer_state_dict(self.lightning_module.policy, optimizer, state[_STATE_KEY], options=options)

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model  # no DDP wrapper: FSDP2 reduce-scatters the gradients
