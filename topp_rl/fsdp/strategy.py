"""`FSDPStrategy`: Lightning's DDP strategy with the HF backbone sharded by FSDP2 over every rank (CPU gloo or GPU).

Why not Lightning's `ModelParallelStrategy`: it shards inside `LightningModule.configure_model` (the FSDP code
would live in `PolicyModule`, whose backbones strategies hand over through `use_backbones`), its sharded
checkpoint directory is rewritten in place (a SIGKILL mid-save leaves no complete `last.ckpt`), and its mesh is
2-D (dp x tp) with tp defaulting to the devices of a node. This subclass
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
- checkpoints: sharded, torch.distributed.checkpoint (`topp_rl.run.sharded_checkpoint`: `last.ckpt` a symlink to a
  data directory, switched atomically): each rank writes its own shards of the weights (under the keys of an
  unsharded `PolicyModule`, so `python -m topp_rl.export` reads them like any checkpoint) and of AdamW's state
  (keyed by parameter name); nothing is gathered. DCP reshards on load, so a run resumes at any world size.
  Restored after setup (`restore_checkpoint_after_setup`), into the sharded module and its optimizer. A
  single-file checkpoint (another parallel config's) is refused at start (`topp_rl.run.rundir`) with the way over.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from topp_rl.fsdp.backbone import shard_backbone
from topp_rl.parallel.capabilities import StrategyCapabilities
from topp_rl.parallel.plan import ParallelPlan
from topp_rl.run.checkpoint import CheckpointWriteError
from topp_rl.run.sharded_checkpoint import (
    data_dir_for,
    discard_unpublished,
    finish_save,
    is_sharded,
    load_shards,
    read_meta,
    single_file_refusal,
    write_shards,
)
from topp_rl.trainer.backbone import HFBackbone

_SLOTS = ("policy", "reference", "teacher")


def mixed_precision_policy(precision: str, device_type: str) -> MixedPrecisionPolicy | None:
    """FSDP2's policy for Lightning's `precision` on `device_type` (see module docstring): bf16 gathers with float32
    gradient reduction for `bf16-mixed` on GPU, else None (float32 gathers; autocast, if any, is the plugin's)."""
    if precision == "bf16-mixed" and device_type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


class FSDPStrategy(StrategyCapabilities, DDPStrategy):
    """DDPStrategy + FSDP2 sharding of the HF backbones (see module docstring)."""

    strategy_name = "fsdp2"
    writes_sharded_checkpoints = adapts_lora = shards_hf_backbone = True

    def __init__(self, *, cpu_offload: bool = False, **kwargs: Any) -> None:
        if not isinstance(cpu_offload, bool):
            raise ValueError(f"FSDPStrategy cpu_offload={cpu_offload!r} must be true or false")
        super().__init__(**kwargs)
        self.cpu_offload = cpu_offload
        self.plan: ParallelPlan | None = None  # built in setup_distributed, once the world size is known

    def setup_distributed(self) -> None:
        super().setup_distributed()
        self.plan = ParallelPlan(world=dist.get_world_size(), fsdp=True)  # every rank data-parallel: dp = world

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
            backbones[slot] = None if backbone is None else shard_backbone(  # a LoraBackbone: FSDPLoraBackbone
                backbone, mesh=mesh, cpu_offload=self.cpu_offload, mp_policy=mp_policy
            )
        module.use_backbones(**backbones)  # a shared embedded engine learns of it from `WeightSync.on_fit_start`

    # ---- checkpoints: sharded (torch.distributed.checkpoint), see topp_rl.run.sharded_checkpoint ------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the shards load into the sharded module and the optimizer built over it

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # `load_checkpoint` restores it, resharded

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's shards (DTensors, no gather) under the keys of an unsharded module (`policy.model.<HF
        name>`, ...): the names `python -m topp_rl.export` and an `HFBackbone` run use."""
        return {_unsharded_name(name): tensor for name, tensor in self.lightning_module.state_dict().items()}

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """This rank's shards of AdamW's state, keyed by parameter name (DCP reshards them to any world size)."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        return get_optimizer_state_dict(self.lightning_module.policy, optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """Every rank writes its shards into a new data directory, rank 0 the rest (`meta.pt`) and then points
        `filepath` (a symlink) at it: a checkpoint path always names a complete checkpoint. A failure on any rank
        raises `CheckpointWriteError` (the file, the cause) on every rank and removes the new data directory."""
        if storage_options is not None:
            raise ValueError(f"parallel=fsdp writes local sharded checkpoints; storage_options={storage_options!r} "
                             "is not supported: drop it")
        link = Path(self.broadcast(str(filepath)))
        data_dir = Path(self.broadcast(str(data_dir_for(link, checkpoint["global_step"]))))  # rank 0's name
        shards = {"state_dict": checkpoint.pop("state_dict")}
        shards |= {f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))}
        try:
            write_shards(shards, data_dir, link=link)  # a failure on any rank raises on every rank
        except CheckpointWriteError:
            if self.is_global_zero:  # every rank is past its writes: DCP's save ends in a collective
                discard_unpublished(link, data_dir)
            raise
        failure = None
        if self.is_global_zero:
            try:
                finish_save(checkpoint, data_dir, link=link)
            except CheckpointWriteError as err:
                failure = err
        # Rank 0's outcome, to every rank (also the barrier): no rank is left waiting for a rank 0 that failed.
        message = self.broadcast(None if failure is None else str(failure))
        if failure is not None:
            raise failure
        if message is not None:
            raise CheckpointWriteError(message)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Weights and optimizer state read into this rank's shards (at any world size), the rest returned."""
        path = Path(checkpoint_path)
        if not is_sharded(path):
            raise ValueError(single_file_refusal(path))
        module = self.lightning_module
        shards = {"state_dict": self.lightning_module_state_dict()}
        load_shards(shards, path)  # a damaged checkpoint: CheckpointReadError naming the file
        module.load_state_dict({_sharded_name(k): v for k, v in shards["state_dict"].items()})
        for i, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{i}"
            state = {key: get_optimizer_state_dict(module.policy, optimizer)}  # the shapes to read into
            load_shards(state, path)
            set_optimizer_state_dict(module.policy, optimizer, state[key])
        return read_meta(path)

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        pass  # `load_checkpoint` loaded the shards

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model  # no DDP wrapper: FSDP2 reduce-scatters the gradients


def _unsharded_name(name: str) -> str:
    """`policy.inner.model.x` (the sharded module's key) -> `policy.model.x` (an unsharded PolicyModule's)."""
    slot, _, rest = name.partition(".")
    return f"{slot}.{rest.removeprefix('inner.')}" if slot in _SLOTS and rest.startswith("inner.") else name


def _sharded_name(name: str) -> str:
    slot, _, rest = name.partition(".")
    return f"{slot}.inner.{rest}" if slot in _SLOTS else name
