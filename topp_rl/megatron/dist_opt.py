"""megatron-core's distributed optimizer (ZeRO-1) for `MegatronStrategy` (`parallel.distributed_optimizer=true`).

`ShardedOptimizer` puts megatron-core's `DistributedDataParallel` (contiguous parameter / gradient buffers) and
`DistributedOptimizer` around the policy's `GPTModel` and the torch AdamW that the module's
`configure_optimizers` built. Per optimizer step:
1. backward passes accumulate every gradient into its buffer (`param.main_grad`; DDP's hooks leave `.grad` None),
   whoever runs them: the module's loop at pp = 1, megatron-core's pipeline schedule at pp > 1 (its backward
   passes fire the same hooks);
2. `clip_grad_norm_`: at pp > 1 with a tied embedding, the two copies' buffers (first stage's embedding, last
   stage's `output_layer.weight`) are summed over megatron's embedding group (`TiedCopy`, what megatron's
   `finalize_model_grads` does); then one reduce-scatter over the data-parallel-with-context-parallel group leaves
   each rank the SUMMED gradient of its 1/(dp x cp) buffer shard, then megatron's `clip_grad_norm` on the shards:
   squares summed over the whole world (megatron's intra-distributed-optimizer group: every TP, CP, DP and pipeline
   rank), TP-replicated parameters counted on TP rank 0 only, the last stage's tied copy not at all (megatron's
   `shared` attribute), which is the unsharded model's norm; same clip rule as torch (scale by
   max_norm / (norm + 1e-6) when below 1);
3. `step`: the torch optimizer updates this rank's shard only (its moments, and float32 master weights for a
   16-bit model, exist for the shard alone), then one all-gather refreshes every replica's weights.

The torch optimizer object is kept (megatron swaps its param groups to the shards), so the run's `LambdaLR`
(`topp_rl.trainer.schedule.LRSchedule`) keeps setting the lr of the groups megatron steps: the same lr per step.

Departures from megatron's own setup (`get_megatron_optimizer`, `finalize_model_grads`):
- gradients are summed, not averaged, over DP x CP (the DDP sees `calculate_per_token_loss=True`, scaling 1):
  the losses already divide by global token / sequence counts, as with `grads.GradSync`;
- checkpoints hold each rank's shard state (the torch optimizer's state dict, plus master weights when they are
  separate), gathered to every rank, instead of `dist_checkpointing` (CUDA-only in megatron-core 0.16); they
  restore at the same (world, TP, CP, PP) layout;
- no fp16 loss scale (`LossScaledFP16`, refused at start): the scaler unscales `.grad` of the optimizer's
  parameters before the clip, and here the shards receive their gradients only inside `clip_grad_norm_`;
- dense models only: MoE experts would need a second optimizer over the expert-data-parallel group.
On CPU the calls into megatron run under `cpu_shims.cuda_as_cpu` (its buffers and optimizer allocate on CUDA).
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from topp_rl.megatron.cpu_shims import cuda_as_cpu

# megatron's DistributedOptimizer asserts AdamW or its own `Adam`, which is transformer-engine's FusedAdam where TE
# is installed (torch's Adam only without TE / apex): AdamW is the one accepted everywhere.
SUPPORTED = (torch.optim.AdamW,)


@dataclass
class _Pending:
    """Whether this step's gradients were reduced and clipped (mutable: methods may run on Lightning's wrapper)."""

    grads_ready: bool = False


@dataclass(frozen=True)
class TiedCopy:
    """This pipeline stage's copy of a tied embedding (`MegatronBackbone.tied_copy`) and the group holding both
    copies (megatron's embedding group: the first and last stage of this pipeline). `counted`: whether the grad
    norm counts it (the first stage's copy; the last stage's is a duplicate)."""

    param: torch.nn.Parameter
    group: Any
    counted: bool


def tied_copy(backbone) -> TiedCopy | None:
    """A `MegatronBackbone`'s copy of a tied embedding at pp > 1 (None otherwise); the first stage's counts in the
    norm."""
    if backbone.tied_copy is None:
        return None
    from megatron.core import parallel_state as ps

    return TiedCopy(backbone.tied_copy, ps.get_embedding_group(), counted=backbone.layout.pp_rank == 0)


class ShardedOptimizer:
    """megatron-core DDP + DistributedOptimizer over `model` with `optimizer`'s hyper-parameters (module docstring).

    Quacks like a torch optimizer for Lightning and `PolicyModule` (`param_groups`, `state`, `zero_grad`, `step`,
    `state_dict`); `param_groups` hold this rank's shards. Attributes are only read in methods: Lightning's
    `LightningOptimizer` calls them with itself as `self` and forwards missing attributes here.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 tied: TiedCopy | None = None) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        if not isinstance(optimizer, SUPPORTED):
            raise ValueError(
                f"parallel.distributed_optimizer=true needs torch.optim.AdamW (megatron-core's DistributedOptimizer "
                f"shards only Adam state), got {type(optimizer).__name__}; set optimizer._target_=torch.optim.AdamW "
                "or parallel.distributed_optimizer=false"
            )
        dtype = next(model.parameters()).dtype
        if tied is not None and not tied.counted:
            tied.param.shared = True  # megatron's mark of a duplicate: its grad-norm filter skips it (module docstring)
        config = copy.copy(model.config)  # the model keeps its own; only the DDP sees the flag below
        config.calculate_per_token_loss = True  # sum over DP x CP: the losses divide by global counts
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=False,
                                                   overlap_param_gather=False, grad_reduce_in_fp32=True)
        opt_config = OptimizerConfig(optimizer="adam", use_distributed_optimizer=True, bf16=dtype != torch.float32,
                                     params_dtype=dtype, clip_grad=0.0)  # clipping: clip_grad_norm_ below
        group = ps.get_data_parallel_group(with_context_parallel=True)
        with cuda_as_cpu():
            self._ddp = DistributedDataParallel(config, ddp_config, model)
            self._megatron = DistributedOptimizer(
                optimizer, opt_config, None, None, model_chunks=[self._ddp],
                per_model_buffers={0: self._ddp.buffers}, data_parallel_group=group,
                data_parallel_group_gloo=None, data_parallel_group_idx=ps.get_data_parallel_rank(with_context_parallel=True),
                distributed_optimizer_instance_id=0,
            )
        # As get_megatron_optimizer sets them: grad statistics over every rank, TP duplicates counted once.
        self._megatron.grad_stats_parallel_group = ps.get_intra_distributed_optimizer_instance_group()
        self._megatron.tp_group = ps.get_tensor_model_parallel_group()
        self._pending = _Pending()
        self._tied = tied

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer stepping this rank's shards (its param groups carry the lr)."""
        return self._megatron.optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self._megatron.optimizer.param_groups

    @property
    def state(self):
        return self._megatron.optimizer.state

    @property
    def defaults(self) -> dict:
        return self._megatron.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        with cuda_as_cpu(), warnings.catch_warnings():
            # megatron clears .grad of its float32 shard views, which are not leaves: torch warns, harmlessly.
            warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
            self._ddp.zero_grad_buffer()
            self._megatron.zero_grad(set_to_none=set_to_none)
        self._pending.grads_ready = False

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Reduce-scatter the accumulated gradients, clip this rank's shards by the unsharded model's 2-norm (a
        collective over the world), return that norm before clipping."""
        if self._tied is not None:  # both copies get the sum of their gradients, as one weight would
            dist.all_reduce(self._tied.param.main_grad, group=self._tied.group)
        with cuda_as_cpu():
            self._ddp.finish_grad_sync()
            self._megatron.prepare_grads()
            norm = self._megatron.clip_grad_norm(max_norm)
        self._pending.grads_ready = True
        return float(norm)

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        if not self._pending.grads_ready:
            self.clip_grad_norm_(float("inf"))  # reduce the gradients: nothing else has
        with cuda_as_cpu():
            self._megatron.step_with_ready_grads()  # shard update + all-gather of the weights
        self._pending.grads_ready = False
        return loss

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard state: the torch optimizer's, plus float32 master weights for 16-bit models."""
        masters = [p.detach().clone() for g in self._megatron.shard_fp32_from_float16_groups for p in g]
        return {"optimizer": self._megatron.optimizer.state_dict(), "master_weights": masters}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._megatron.optimizer.load_state_dict(state["optimizer"])
        masters = [p for g in self._megatron.shard_fp32_from_float16_groups for p in g]
        if len(masters) != len(state["master_weights"]):
            raise ValueError(
                f"the checkpoint holds {len(state['master_weights'])} float32 master-weight shards, this run has "
                f"{len(masters)}; resume with the saved model dtype and layout"
            )
        with torch.no_grad():
            for p, saved in zip(masters, state["master_weights"], strict=True):
                p.copy_(saved)
            with cuda_as_cpu():
                self._megatron._copy_main_params_to_model_params()  # the model weights from the masters
                self._ddp.start_param_sync(force_sync=True)

    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer state (moments, step counters) and master-weight shards."""
        tensors = [v for s in self.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        tensors += [p for g in self._megatron.shard_fp32_from_float16_groups for p in g]
        return sum(t.numel() * t.element_size() for t in tensors)


def plain_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of a torch optimizer's state (for comparison with `ShardedOptimizer.state_bytes`)."""
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))
