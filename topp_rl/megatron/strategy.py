"""`MegatronStrategy`: Lightning's DDP strategy with megatron-core tensor / context parallelism (CPU or GPU).

What it adds to `DDPStrategy`:
- `setup_distributed`: after the process group, `parallel_state.initialize_model_parallel(tp, cp)` (kept after
  `fit`, so the backbone can still export; the next setup re-initialises it);
- `setup_environment`: swaps the module's HF `policy` (and `reference`) for `MegatronBackbone`s holding the same
  weights, so configs, engines and tests keep building plain HF models;
- data-parallel sampler kwargs from the DP rank / size (TP and CP ranks of one DP replica see the same data),
  also handed to a `RolloutDataModule` that was built without explicit `dp_rank` / `dp_size`;
- no DDP wrapper: each backward's gradient increment is summed over the data-parallel-with-context-parallel
  group (`grads.GradSync`); torch DDP would average, and would need one backward per forward;
- checkpoints hold the FULL model under HF names (gathered over TP), so weights resume at any TP; optimizer
  state is saved per TP rank and restores at the saved TP only (a different TP raises ValueError).

Departures from NeMo's MegatronStrategy: no pipeline parallelism, no distributed optimizer, no
`dist_checkpointing` (CUDA-only in megatron-core 0.16); gradient clipping goes through the backbone's
TP-aware `clip_grad_norm_`.

Seams: `PolicyModule.hf_named_tensors()` (for `WeightSync`) and `PolicyModule.clip_and_norm()` delegate to the
backbone, whose versions gather / reduce over TP, so every rank must call them; `RolloutDataModule` reads the
data-parallel rank and size from `distributed_sampler_kwargs`, so TP / CP peers draw the same prompts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

from topp_rl.megatron.backbone import MegatronBackbone
from topp_rl.megatron.grads import GradSync

_MODEL_SLOTS = ("policy", "reference")


class MegatronStrategy(DDPStrategy):
    """DDPStrategy + megatron-core TP x CP (see module docstring)."""

    strategy_name = "megatron"

    def __init__(self, *, tp_size: int = 1, cp_size: int = 1, seed: int = 0, **kwargs: Any) -> None:
        for name, value in (("tp_size", tp_size), ("cp_size", cp_size)):
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"MegatronStrategy {name}={value!r} must be an int >= 1; use 1 to disable it")
        super().__init__(**kwargs)
        self.tp_size, self.cp_size, self.seed = tp_size, cp_size, seed
        self._grad_sync: GradSync | None = None

    # ---- process groups -------------------------------------------------------------------------------------
    def setup_distributed(self) -> None:
        super().setup_distributed()
        from megatron.core import parallel_state as ps

        world = dist.get_world_size()
        if world % (self.tp_size * self.cp_size):
            raise ValueError(
                f"world size {world} is not divisible by tp_size * cp_size = {self.tp_size * self.cp_size}; "
                "set trainer.devices to a multiple of it"
            )
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=self.tp_size, context_parallel_size=self.cp_size)

    @property
    def dp_size(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_world_size(with_context_parallel=False)

    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank(with_context_parallel=False)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    # ---- model ----------------------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        super().setup_environment()
        module = self.lightning_module
        if module is not None:
            self.convert_module(module)

    def convert_module(self, module: torch.nn.Module) -> None:
        """HF `policy` / `reference` -> MegatronBackbone (same weights), plus the module adapters."""
        for slot in _MODEL_SLOTS:
            model = getattr(module, slot, None)
            if model is not None and not isinstance(model, MegatronBackbone):
                backbone = MegatronBackbone.from_hf(model, tp_size=self.tp_size, cp_size=self.cp_size, seed=self.seed)
                if slot == "reference":
                    backbone.requires_grad_(False).eval()
                setattr(module, slot, backbone)
        if hasattr(module, "_layout"):
            module._layout = None  # rebuilt lazily by ParallelLayout.from_megatron

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model  # no DDP wrapper: gradients are summed in post_backward

    def configure_ddp(self) -> None:
        from megatron.core import parallel_state as ps

        params = list(self.lightning_module.policy.parameters())
        self._grad_sync = GradSync(params, ps.get_data_parallel_group(with_context_parallel=True))

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        if self._grad_sync is not None:
            self._grad_sync.before()

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if self._grad_sync is not None:
            self._grad_sync.after()

    # ---- checkpoints ----------------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Full weights under `<slot>.<HF name>` (a TP collective: Lightning calls it on every rank)."""
        module = self.lightning_module
        state = {}
        for name, tensor in module.state_dict().items():
            if name.split(".", 1)[0] not in _backbone_slots(module):
                state[name] = tensor
        for slot in _backbone_slots(module):
            for name, tensor in getattr(module, slot).hf_named_tensors():
                state[f"{slot}.{name}"] = tensor.clone()
        return state

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        from megatron.core import parallel_state as ps

        from topp_rl.megatron.convert import load_hf_into

        module, state = self.lightning_module, checkpoint["state_dict"]
        slots = _backbone_slots(module)
        rest = {k: v for k, v in state.items() if k.split(".", 1)[0] not in slots}
        module.load_state_dict(rest, strict=False)
        for slot in slots:
            backbone = getattr(module, slot)
            prefix = slot + "."
            hf_state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            if backbone.hf_config.tie_word_embeddings:
                hf_state.setdefault("lm_head.weight", hf_state["model.embed_tokens.weight"])
            load_hf_into(backbone.model, hf_state, backbone.hf_config, tp_size=self.tp_size,
                         tp_rank=ps.get_tensor_model_parallel_rank())

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """Every TP rank's optimizer state (moments of its shards), gathered to all ranks of the TP group."""
        from megatron.core import parallel_state as ps

        local = super().optimizer_state(optimizer)
        states: list[Any] = [None] * self.tp_size
        group = ps.get_tensor_model_parallel_group()
        if self.tp_size > 1:
            dist.all_gather_object(states, local, group=group)
        else:
            states = [local]
        return {"megatron_tp_size": self.tp_size, "per_tp_rank": states}

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        from megatron.core import parallel_state as ps

        wrapped = []
        for state in checkpoint["optimizer_states"]:
            saved_tp = state.get("megatron_tp_size")
            if saved_tp != self.tp_size:
                raise ValueError(
                    f"optimizer state was saved at tp_size={saved_tp}, this run has tp_size={self.tp_size}; "
                    "resume at the saved TP size (model weights alone load at any TP: use weights_only)"
                )
            wrapped.append(state["per_tp_rank"][ps.get_tensor_model_parallel_rank()])
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": wrapped})


def _backbone_slots(module) -> list[str]:
    return [s for s in _MODEL_SLOTS if isinstance(getattr(module, s, None), MegatronBackbone)]
