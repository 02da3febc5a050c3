"""`MegatronStrategy`: Lightning's DDP strategy with megatron-core tensor / context / expert parallelism (CPU or GPU).

What it adds to `DDPStrategy`:
- `setup_distributed`: after the process group, `parallel_state.initialize_model_parallel(tp, cp, ep)` (kept after
  `fit`, so the backbone can still export; the next setup re-initialises it);
- `setup_environment`: builds this rank's `ParallelLayout` once from the process groups it just created and
  hands the module `MegatronBackbone`s for that layout, holding the weights of its `HFBackbone` policy (and
  reference), through `PolicyModule.use_backbones`; configs, engines and tests keep building plain HF models;
- data-parallel sampler kwargs from the DP rank / size (TP and CP ranks of one DP replica see the same data),
  also handed to a `RolloutDataModule` that was built without explicit `dp_rank` / `dp_size`;
- `rollout_peers()`: the tensor-and-context-parallel group, whose first rank alone runs the rollout engine and
  broadcasts the samples to the others (`topp_rl.rollout.broadcast`);
- no DDP wrapper: each backward's gradient increment is summed over the data-parallel-with-context-parallel
  group (`grads.GradSync`), MoE experts' over the expert-data-parallel group (they already hold the sum over the
  tokens of their TP x EP group); torch DDP would average, and would need one backward per forward;
- `distributed_optimizer=True`: megatron-core's DDP + `DistributedOptimizer` instead (`dist_opt.ShardedOptimizer`,
  ZeRO-1: optimizer state sharded over DP x CP), wrapped around the module's own torch optimizer after
  `setup_optimizers`; the backbone hands its gradient clipping to it (at any pp; not with an fp16 loss scale);
- checkpoints hold the FULL model under HF names (gathered over TP), the same keys as an `HFBackbone` run, so
  weights resume at any TP; optimizer
  state is saved per TP rank and restores at the saved TP only (a different TP raises ValueError); with the
  distributed optimizer, per rank, restoring at the same world / TP / CP.

Pipeline parallelism (`pp_size` > 1): megatron's pipeline groups; each rank's backbone holds its stage and runs
megatron-core's 1F1B schedule (`topp_rl.megatron.pipeline`), so the data-parallel gradient sums run around the
schedule (`MegatronBackbone.use_grad_syncs`) instead of in the backward hooks; the rollout peers are all ranks of
a data-parallel replica (TP x CP x PP); checkpoints still hold the full model under HF names (every stage's
weights, gathered), and the optimizer state per (PP, EP, TP) rank, named by parameter, restores at the saved TP / EP
and any pp (`stage_state`). With the distributed optimizer the schedule's backward passes fill megatron's DDP
buffers and its reduce-scatter runs once per step after the schedule (the tied embedding's copies summed in the
buffers, `dist_opt.TiedCopy`); its sharded state restores at the saved (world, tp, cp, pp) only. An fp16 loss
scale (`LossScaledFP16`) reaches the schedule as megatron's `grad_scale_func` (`MegatronBackbone.use_loss_scale`),
which scales the last stage's loss before its backward; the plugin makes every rank skip an overflowing step
together. Virtual (interleaved) pipeline stages (`vpp_size` > 1): megatron's interleaved schedule over vpp model
chunks per rank (`topp_rl.megatron.chunks`); the data module then packs at least pp micro-batches a step
(`min_micro_batches`, what that schedule needs); the optimizer state's names are global, so it restores at another
vpp too; the distributed optimizer and MoE models are refused with them (megatron's DDP would wrap each chunk;
the MoE figures cross once per stage and micro-batch).

Departures from NeMo's MegatronStrategy: no `dist_checkpointing` (CUDA-only in megatron-core 0.16); gradient
clipping goes through the backbone's TP-aware `clip_grad_norm_`.

Seams: the module reaches the backbone only through the `Backbone` protocol; its `hf_named_tensors()` (for
`WeightSync`) and `clip_grad_norm_` gather / reduce over TP, so every rank must call them; `RolloutDataModule`
reads the data-parallel rank and size from `distributed_sampler_kwargs`, so TP / CP peers draw the same prompts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

from topp_rl.megatron.backbone import CP_MODES, MegatronBackbone, cp_mode_refusal
from topp_rl.megatron.dist_opt import ShardedOptimizer, tied_copy
from topp_rl.megatron.grads import GradSync, is_expert_param
from topp_rl.megatron.stage_state import global_param_names, restage
from topp_rl.parallel import ParallelLayout
from topp_rl.parallel.capabilities import WEIGHTS_ONLY_WAY_OUT, Layout, StrategyCapabilities
from topp_rl.parallel.peers import RolloutPeers
from topp_rl.parallel.plan import ParallelPlan, check_sizes, check_virtual_stages
from topp_rl.trainer.backbone import HFBackbone
from topp_rl.trainer.precision import LossScaledFP16

_MODEL_SLOTS = ("policy", "reference", "teacher")


VPP_DIST_OPT_REFUSAL = (
    "parallel.distributed_optimizer=true with parallel.vpp_size={vpp}: the sharded optimizer wraps one model per "
    "rank in megatron's DDP, and virtual stages hold a list of chunks (not wired yet); set "
    "parallel.distributed_optimizer=false or parallel.vpp_size=1")


class MegatronStrategy(StrategyCapabilities, DDPStrategy):
    """DDPStrategy + megatron-core TP x CP (see module docstring)."""

    strategy_name = "megatron"
    cp_modes = CP_MODES

    def __init__(self, *, tp_size: int = 1, cp_size: int = 1, ep_size: int = 1, pp_size: int = 1, vpp_size: int = 1,
                 cp_mode: str = "zigzag", moe_aux_loss_coeff: float = 0.0, distributed_optimizer: bool = False,
                 seed: int = 0, **kwargs: Any) -> None:
        check_sizes(tp=tp_size, cp=cp_size, ep=ep_size, pp=pp_size)  # the rest once the world size is known
        check_virtual_stages(pp_size, vpp_size)
        if cp_size > 1 and cp_mode not in self.cp_modes:
            raise ValueError(cp_mode_refusal(cp_mode))
        if not isinstance(distributed_optimizer, bool):
            raise ValueError(f"MegatronStrategy distributed_optimizer={distributed_optimizer!r} must be true or false")
        if vpp_size > 1 and distributed_optimizer:
            raise ValueError(VPP_DIST_OPT_REFUSAL.format(vpp=vpp_size))
        super().__init__(**kwargs)
        self.distributed_optimizer = distributed_optimizer
        self.tp_size, self.cp_size, self.ep_size, self.cp_mode, self.seed = tp_size, cp_size, ep_size, cp_mode, seed
        self.pp_size, self.vpp_size = pp_size, vpp_size
        self.plan: ParallelPlan | None = None  # the sizes checked against the world size, in setup_distributed
        self.moe_aux_loss_coeff = moe_aux_loss_coeff
        self.layout: ParallelLayout | None = None  # built once in setup_environment, from the process groups
        self._grad_syncs: list[GradSync] = []

    @classmethod
    def resume_refusal(cls, saved: Layout, wanted: Layout) -> str | None:
        """What `load_optimizer_state_dict` would refuse, asked at start from the two configs: the optimizer state
        restores at the saved TP / EP sizes (any cp, pp, vpp and device count); the sharded optimizer's at the
        saved (world, tp, cp, pp) and setting only."""
        if (saved.tp, saved.ep) != (wanted.tp, wanted.ep):
            return ("the optimizer state is stored per TP x EP rank and restores at the saved tp_size and ep_size "
                    "only (cp_size, pp_size, vpp_size and the device count may change)")
        if saved.distributed_optimizer != wanted.distributed_optimizer:
            return ("the optimizer state is sharded with parallel.distributed_optimizer=true and whole without it: "
                    "it restores at the saved setting only")
        sharded = (saved.world, saved.cp, saved.pp), (wanted.world, wanted.cp, wanted.pp)
        if saved.distributed_optimizer and sharded[0] != sharded[1] and None not in (saved.world, wanted.world):
            return ("the distributed optimizer's sharded state restores at the saved (world size, cp_size, pp_size) "
                    "only")
        return None

    # ---- process groups -------------------------------------------------------------------------------------
    def setup_distributed(self) -> None:
        super().setup_distributed()
        from megatron.core import parallel_state as ps

        self.plan = ParallelPlan(world=dist.get_world_size(), tp=self.tp_size, cp=self.cp_size, ep=self.ep_size,
                                 pp=self.pp_size, vpp=self.vpp_size, cp_mode=self.cp_mode)
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=self.tp_size, context_parallel_size=self.cp_size,
                                     expert_model_parallel_size=self.ep_size,
                                     pipeline_model_parallel_size=self.pp_size,
                                     virtual_pipeline_model_parallel_size=self.vpp_size if self.vpp_size > 1 else None)
        self._replica_group = _replica_group(self.plan) if self.pp_size > 1 else None

    @property
    def dp_size(self) -> int:
        assert self.plan is not None, "dp_size is known once setup_distributed built the plan"
        return self.plan.dp

    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank(with_context_parallel=False)

    @property
    def min_micro_batches(self) -> int:
        """The fewest micro-batches a step may pack: megatron's interleaved schedule (virtual stages) runs at least
        pp_size (`pipeline.microbatch_group_size`); 1 otherwise."""
        return self.pp_size if self.vpp_size > 1 else 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    def rollout_peers(self) -> RolloutPeers:
        """This rank's TP x CP (x PP) peers (they train on one rollout) and their source, the replica's first rank."""
        from megatron.core import parallel_state as ps

        if self.plan.model_parallel == 1:
            return RolloutPeers()
        group = self._replica_group if self.pp_size > 1 else ps.get_tensor_and_context_parallel_group()
        return RolloutPeers(group=group, source=dist.get_global_rank(group, 0))

    # ---- model ----------------------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        super().setup_environment()
        module = self.lightning_module
        if module is not None:
            self.convert_module(module)

    def convert_module(self, module) -> None:
        """Build this rank's layout and hand the module Megatron backbones with its HF weights."""
        self.layout = ParallelLayout.from_megatron(module.policy.layout.vocab_size, cp_mode=self.cp_mode)
        policy = self._megatron(module.policy, "policy")
        reference = self._megatron(module.reference, "reference") if module.reference is not None else None
        teacher = self._megatron(module.teacher, "teacher") if module.teacher is not None else None
        module.use_backbones(policy=policy, reference=reference, teacher=teacher)

    def _megatron(self, backbone, slot: str) -> MegatronBackbone:
        if isinstance(backbone, MegatronBackbone):
            if backbone.layout != self.layout:
                raise ValueError(
                    f"the module's {slot} is a MegatronBackbone for {backbone.layout}, but this strategy runs "
                    f"{self.layout}; build it with the strategy's layout or pass an HFBackbone"
                )
            return backbone
        if not isinstance(backbone, HFBackbone):
            raise TypeError(
                f"MegatronStrategy converts HFBackbone policies, got a {type(backbone).__name__} as {slot}; wrap "
                "the HF model as topp_rl.trainer.backbone.HFBackbone(model)"
            )
        # routing_replay travels with the backbone it was configured on (policy and reference alike).
        return MegatronBackbone.from_hf(backbone.model, layout=self.layout, seed=self.seed,
                                        moe_aux_loss_coeff=self.moe_aux_loss_coeff,
                                        routing_replay=backbone.routing_replay)

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model  # no DDP wrapper: gradients are summed in post_backward

    def configure_ddp(self) -> None:
        from megatron.core import parallel_state as ps

        named = list(self.lightning_module.policy.model.named_parameters())
        dense = [p for n, p in named if not is_expert_param(n)]
        experts = [p for n, p in named if is_expert_param(n)]
        if self.distributed_optimizer:
            if experts:
                raise ValueError(
                    f"parallel.distributed_optimizer=true supports dense models only; this model has "
                    f"{len(experts)} MoE expert parameters (they would need a second sharded optimizer over the "
                    "expert-data-parallel group); set parallel.distributed_optimizer=false"
                )
            return  # megatron's DDP reduces the gradients (setup_optimizers)
        self._grad_syncs = [GradSync(dense, ps.get_data_parallel_group(with_context_parallel=True))]
        if experts:
            self._grad_syncs.append(GradSync(experts, ps.get_expert_data_parallel_group()))
        if self.pp_size > 1:  # megatron's schedule runs the backward passes: the backbone runs the sums around it
            self.lightning_module.policy.use_grad_syncs(self._grad_syncs)
            self._grad_syncs = []

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)
        policy = self.lightning_module.policy
        fp16 = isinstance(self.precision_plugin, LossScaledFP16)
        if self.distributed_optimizer:
            if fp16:
                raise ValueError(
                    "parallel.distributed_optimizer=true with an fp16 loss scale (trainer=cpu_fp16 / gpu_fp16): the "
                    "scaler unscales the optimizer's gradients before the clip, and the sharded optimizer's shards "
                    "receive theirs only in the clip; train in fp32 or bf16, or set parallel.distributed_optimizer=false"
                )
            (optimizer,) = self.optimizers  # PolicyModule configures one; its LambdaLR keeps driving it
            sharded = ShardedOptimizer(policy.model, optimizer, tied=tied_copy(policy))
            policy.use_grad_owner(sharded)
            self.optimizers = [sharded]
        if fp16 and self.pp_size > 1:  # megatron's schedule runs the backward passes: it applies the loss scale
            policy.use_loss_scale(self.precision_plugin.scaler.scale)

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        for sync in self._grad_syncs:
            sync.before()

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        for sync in self._grad_syncs:
            sync.after()

    # ---- checkpoints ----------------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Full weights under `<slot>.model.<HF name>`, the keys of an `HFBackbone` module's checkpoint (a TP
        collective: Lightning calls it on every rank)."""
        module = self.lightning_module
        state = {}
        for name, tensor in module.state_dict().items():
            if name.split(".", 1)[0] not in _backbone_slots(module):
                state[name] = tensor
        for slot in _backbone_slots(module):
            for name, tensor in getattr(module, slot).hf_named_tensors():
                state[f"{slot}.model.{name}"] = tensor.clone()
        return state

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:

        module, state = self.lightning_module, checkpoint["state_dict"]
        slots = _backbone_slots(module)
        rest = {k: v for k, v in state.items() if k.split(".", 1)[0] not in slots}
        module.load_state_dict(rest, strict=False)
        for slot in slots:
            backbone = getattr(module, slot)
            prefix = slot + ".model."
            hf_state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            if backbone.hf_config.tie_word_embeddings:
                hf_state.setdefault("lm_head.weight", hf_state["model.embed_tokens.weight"])
            backbone.load_hf_state(hf_state)  # the layout's TP / EP shards, every model chunk

    def _layout_key(self) -> tuple[int, int, int, int]:
        return dist.get_world_size(), self.tp_size, self.cp_size, self.pp_size

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """Every (EP, TP) rank's optimizer state (moments of its shards and experts), gathered to all ranks (over
        the TP group, or the whole world with EP: EP ranks differ across data-parallel ranks). Ranks with the same
        (EP, TP) coordinates hold equal states (data-parallel replicas)."""
        local = super().optimizer_state(optimizer)
        layout = self.layout
        if self.distributed_optimizer:  # every rank holds its own shard
            per_rank: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, local)
            return {"megatron_distributed_optimizer": self._layout_key(), "per_rank": per_rank}
        sizes = {"megatron_tp_size": self.tp_size, "megatron_ep_size": self.ep_size, "megatron_pp_size": self.pp_size,
                 "megatron_vpp_size": self.vpp_size}
        # with each state, its parameters' names (global layer indices): it restores at another pp size (`restage`)
        local = (self._optimizer_names(local), local)
        if self.pp_size > 1:  # every (PP, EP, TP) rank's state, to every rank (EP ranks hold different experts)
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, ((layout.pp_rank, layout.ep_rank, layout.tp_rank), local))
            by_rank = dict(gathered)
            named = [by_rank[(p, e, t)] for p in range(self.pp_size) for e in range(self.ep_size)
                     for t in range(self.tp_size)]
            return {**sizes, "per_pp_tp_rank": [s for _, s in named], "param_names": [n for n, _ in named]}
        if self.ep_size > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, ((layout.ep_rank, layout.tp_rank), local))
            named = [dict(gathered)[(e, t)] for e in range(self.ep_size) for t in range(self.tp_size)]
        elif self.tp_size > 1:
            named = [None] * self.tp_size
            dist.all_gather_object(named, local, group=layout.tp_group)
        else:
            named = [local]
        return {**sizes, "per_tp_rank": [s for _, s in named], "param_names": [n for n, _ in named]}

    def _optimizer_names(self, state: dict[str, Any]) -> list[str]:
        policy = self.lightning_module.policy
        names = global_param_names(policy)
        if [len(names)] != [len(g["params"]) for g in state["param_groups"]]:
            raise RuntimeError(f"the optimizer holds {[len(g['params']) for g in state['param_groups']]} parameters, "
                               f"the policy {len(names)} trainable ones: PolicyModule.configure_optimizers changed")
        return names

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        wrapped = []
        for state in checkpoint["optimizer_states"]:
            if self.distributed_optimizer or "megatron_distributed_optimizer" in state:
                wrapped.append(self._sharded_state(state))
                continue
            saved = (state.get("megatron_tp_size"), state.get("megatron_ep_size", 1), state.get("megatron_pp_size", 1))
            pipeline_changed = saved[2] != self.pp_size or state.get("megatron_vpp_size", 1) != self.vpp_size
            if saved[:2] == (self.tp_size, self.ep_size) and pipeline_changed and "param_names" in state:
                wrapped.append(self._restaged(state, saved_pp=saved[2]))
                continue
            if saved != (self.tp_size, self.ep_size, self.pp_size):
                # pp alone may change, for states saved with their parameters' names (not before issue 38)
                what = "the saved sizes" if saved[:2] != (self.tp_size, self.ep_size) else (
                    "the saved pp_size (this checkpoint predates the parameter names that let its optimizer state "
                    "restore at another pp_size)")
                raise ValueError(
                    f"optimizer state was saved at (tp_size, ep_size, pp_size)={saved}, this run has "
                    f"{(self.tp_size, self.ep_size, self.pp_size)}; resume at {what}, or {WEIGHTS_ONLY_WAY_OUT}"
                )
            if pipeline_changed:  # vpp alone, without names: a rank's parameters are other layers
                raise ValueError(
                    f"optimizer state was saved at parallel.vpp_size={state.get('megatron_vpp_size', 1)}, this run has "
                    f"{self.vpp_size}; resume at the saved vpp_size (this checkpoint predates the parameter names "
                    f"that let its optimizer state restore at another one), or {WEIGHTS_ONLY_WAY_OUT}"
                )
            if self.pp_size > 1:
                wrapped.append(state["per_pp_tp_rank"][self._stage_entry(self.layout.pp_rank)])
                continue
            wrapped.append(state["per_tp_rank"][self.layout.ep_rank * self.tp_size + self.layout.tp_rank])
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": wrapped})

    def _restaged(self, state: dict[str, Any], *, saved_pp: int) -> dict[str, Any]:
        """This rank's state from a checkpoint saved at another pp size (same TP / EP): the saved stages of this
        (EP, TP) rank merged by parameter name and split along this run's stages (`stage_state.restage`)."""
        layout, tp = self.layout, self.tp_size
        if saved_pp > 1:
            entries = [self._stage_entry(p) for p in range(saved_pp)]
            states = state["per_pp_tp_rank"]
        else:
            entries, states = [layout.ep_rank * tp + layout.tp_rank], state["per_tp_rank"]
        saved = [(state["param_names"][i], states[i]) for i in entries]
        policy = self.lightning_module.policy
        return restage(saved, global_param_names(policy))

    def _stage_entry(self, pp_rank: int) -> int:
        """Index in a pipelined checkpoint's `per_pp_tp_rank` (ordered by PP, EP, TP rank) of stage `pp_rank`'s
        state at this rank's EP and TP coordinates."""
        return (pp_rank * self.ep_size + self.layout.ep_rank) * self.tp_size + self.layout.tp_rank

    def _sharded_state(self, state: dict[str, Any]) -> dict[str, Any]:
        saved, this = state.get("megatron_distributed_optimizer"), self._layout_key()
        if saved is not None and len(saved) == 3:  # saved before pipeline parallelism existed: pp = 1
            saved = (*saved, 1)
        if saved != this or not self.distributed_optimizer:
            where = "without parallel.distributed_optimizer" if saved is None else f"at (world, tp, cp, pp)={saved}"
            raise ValueError(
                f"optimizer state was saved {where}, this run has (world, tp, cp, pp)={this} and "
                f"distributed_optimizer={self.distributed_optimizer}: sharded optimizer state restores only at "
                f"the saved layout and setting; resume with them, or {WEIGHTS_ONLY_WAY_OUT}"
            )
        return state["per_rank"][dist.get_rank()]


def _replica_group(plan: ParallelPlan) -> dist.ProcessGroup:
    """The ranks of this rank's data-parallel replica (TP x CP x PP: they train on one rollout). Every rank creates
    every replica's group, in data-parallel rank order (`new_group` is collective over the world)."""
    from megatron.core import parallel_state as ps

    dp_ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(dp_ranks, ps.get_data_parallel_rank(with_context_parallel=False))
    mine = None
    for dp in range(plan.dp):
        group = dist.new_group([r for r, d in enumerate(dp_ranks) if d == dp])
        if dp == dp_ranks[dist.get_rank()]:
            mine = group
    return mine


def _backbone_slots(module) -> list[str]:
    return [s for s in _MODEL_SLOTS if isinstance(getattr(module, s, None), MegatronBackbone)]
