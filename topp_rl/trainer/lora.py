"""LoRA adapters (PEFT) on the HF backbone: `module.lora.rank > 0` trains low-rank adapters on a frozen base.

- `LoraSettings`: the validated `module.lora` node (rank, alpha, dropout, target modules).
- `LoraBackbone`: an `HFBackbone` over a PEFT-adapted model. Only the adapter weights require gradients, so only
  they reach the optimizer (`PolicyModule.configure_optimizers` takes the parameters that require grad). It
  `has_frozen_base`: the KL reference is the policy's own base with the adapters disabled (PEFT's `disable_adapter()`),
  so no second copy of the model is held. Its `hf_named_tensors` are the MERGED weights under the plain HF names
  (W + B @ A * alpha / rank for each adapted linear layer, every other weight as it is): what a server that was
  started without LoRA (SGLang on CPU, see docs/lora.md) and an HF export need.

PEFT injects its layers into the HF model in place (`q_proj` becomes a `lora.Linear` holding `base_layer` and
`lora_A` / `lora_B`), so the embedded engine that shares the policy's module samples with the adapted weights.
Checkpoints hold the adapters (`policy.model.<HF path>.lora_A.default.weight`, ...) and their optimizer state, not
the base: `drop_base` / `restore_base` (called from `PolicyModule`'s checkpoint hooks) leave it out and put the
run's own base back on load, after checking its digest (`base_digest`) against the one saved.

FSDP composes: `FSDPStrategy` shards a `LoraBackbone` as `topp_rl.fsdp.backbone.FSDPLoraBackbone` (each rank
holds 1/world of the base and of the adapters, and AdamW state for its adapter shards only; the reference is the
sharded base, adapters disabled; `merged_named_tensors(model, full_tensor)` gathers each base weight and its A / B
before merging). Its sharded checkpoints hold the base's shards too (no `drop_base`).

Departures: LoRA dropout is refused (> 0): the policy is scored in eval mode so that its log-probs equal the
rollout's, where dropout would be off anyway. Megatron backbones are refused at start.
PEFT costs about 5 s to import here, so it is imported only when LoRA is on.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from topp_rl.parallel.capabilities import capabilities_of
from topp_rl.trainer.backbone import HFBackbone

ADAPTER = "default"  # PEFT's name of the one adapter a run trains
BASE_RECORD = "topp_rl_lora_base"  # a checkpoint key: the digest of the base its state dict leaves out
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KEYS = ("rank", "alpha", "dropout", "target_modules")


@dataclass(frozen=True)
class LoraSettings:
    """`module.lora`: rank r (0: off), alpha (None: 2 r), dropout (must be 0), the target linear layers' names."""

    rank: int = 0
    alpha: float | None = None
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"module.lora.rank={self.rank!r}: must be an integer >= 0 (0: LoRA off); use e.g. "
                             "module.lora.rank=16")
        if self.alpha is not None and not (isinstance(self.alpha, int | float) and self.alpha > 0):
            raise ValueError(f"module.lora.alpha={self.alpha!r}: must be > 0, or null for 2 x rank")
        if self.dropout != 0:
            raise ValueError(
                f"module.lora.dropout={self.dropout!r}: must be 0. The policy is scored in eval mode so that its "
                "log-probs equal the rollout's (the on-policy ratio is exactly 1), which turns dropout off: a "
                "nonzero value would never be applied. Set module.lora.dropout=0"
            )
        if not self.target_modules or not all(isinstance(t, str) and t for t in self.target_modules):
            raise ValueError(f"module.lora.target_modules={list(self.target_modules)!r}: must be a non-empty list of "
                             f"linear layer names, e.g. {list(DEFAULT_TARGETS)}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """alpha / rank: the factor of B @ A in the adapted weight."""
        return self.lora_alpha / self.rank

    @property
    def lora_alpha(self) -> float:
        return float(self.alpha) if self.alpha is not None else 2.0 * self.rank

    @classmethod
    def from_config(cls, node: Mapping[str, Any] | DictConfig | None) -> LoraSettings:
        if node is None:
            return cls()
        values = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
        unknown = sorted(set(values) - set(KEYS))
        if unknown:
            raise ValueError(f"module.lora.{unknown[0]}: not a LoRA setting; the keys are {', '.join(KEYS)}")
        if "target_modules" in values:
            targets = values["target_modules"]
            values["target_modules"] = (targets,) if isinstance(targets, str) else tuple(targets or ())
        return cls(**values)


def check_lora_config(cfg: DictConfig) -> LoraSettings:
    """The run's `module.lora`, refused at start where the run cannot honour it (a Megatron strategy)."""
    settings = LoraSettings.from_config(cfg.module.get("lora"))
    target = cfg.parallel.strategy.get("_target_") if cfg.parallel.get("strategy") else None
    if settings.enabled and target is not None and not capabilities_of(get_class(target)).adapts_lora:
        raise ValueError(
            f"module.lora.rank={settings.rank} with a parallel strategy ({target}): LoRA runs on the HF backbone "
            "(Megatron's sharded layers are not adapted); use parallel=none or parallel=fsdp, or train the full "
            "model (module.lora.rank=0) with this strategy"
        )
    return settings


def apply_lora(model: nn.Module, settings: LoraSettings):
    """Inject LoRA layers into `model` in place and freeze everything else; returns the `PeftModel` around it.

    B starts at zero (PEFT's default), so the adapted model equals the base until the first update."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import Linear as LoraLinear

    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in settings.target_modules if t not in present]
    if missing:
        raise ValueError(
            f"module.lora.target_modules names {missing}, which {type(model).__name__} does not have (its layer "
            f"names include {sorted(n for n in present if n.endswith('proj'))}); drop them or name existing layers"
        )
    config = LoraConfig(r=settings.rank, lora_alpha=settings.lora_alpha, lora_dropout=0.0,
                        target_modules=list(settings.target_modules), bias="none")
    with warnings.catch_warnings():  # PEFT 0.21 reads transformers 5's deprecated is_gradient_checkpointing
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*deprecated", category=FutureWarning)
        peft_model = get_peft_model(model, config, adapter_name=ADAPTER)
    layers = adapter_layers(model)
    wrong = [name for name, layer in layers.items() if type(layer) is not LoraLinear]
    if wrong:
        raise ValueError(f"module.lora.target_modules adapted {wrong[0]} as a {type(layers[wrong[0]]).__name__}; "
                         "topp_rl's merged weight sync supports LoRA on nn.Linear layers only: target linear layers")
    return peft_model


def has_adapters(model: nn.Module) -> bool:
    """Whether PEFT layers were injected into `model` (False without importing PEFT when nothing imported it)."""
    return "peft" in sys.modules and bool(adapter_layers(model))


def adapter_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The PEFT layers of `model` by module path (`model.layers.0.self_attn.q_proj`)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, BaseTunerLayer)}


def as_is(t: Tensor) -> Tensor:
    """The `full` of an unsharded model: each tensor is whole already."""
    return t


def delta_weight(layer: nn.Module, full: Callable[[Tensor], Tensor] = as_is) -> Tensor:
    """B @ A * alpha / rank of one `lora.Linear` ([out, in], the base weight's shape); `full` makes a sharded
    A / B whole (FSDP: an all-gather each)."""
    a, b = full(layer.lora_A[ADAPTER].weight), full(layer.lora_B[ADAPTER].weight)
    return (b @ a) * layer.scaling[ADAPTER]


def merged_named_tensors(model: nn.Module, full: Callable[[Tensor], Tensor] = as_is) -> Iterator[tuple[str, Tensor]]:
    """(plain HF name, tensor) of an adapted model as if merged: `<path>.base_layer.weight` + `delta_weight` under
    `<path>.weight`, the adapters' own weights left out, every other weight as it is (detached, not copied).
    `full` makes each sharded tensor whole (`topp_rl.fsdp.backbone.full_tensor`: collectives in the order of
    `named_parameters`, so every rank must walk the whole iterator)."""
    layers = adapter_layers(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            path, sep, leaf = name.rpartition(".base_layer.")
            if sep:
                tensor = full(param.detach())
                if leaf == "weight":
                    tensor = tensor + delta_weight(layers[path], full).to(tensor.dtype)
                yield f"{path}.{leaf}", tensor
            elif ".lora_A." not in name and ".lora_B." not in name:
                yield name, full(param.detach())


class _PeftHandle:
    """Holds the `PeftModel` outside nn.Module registration: registered, its parameters (the backbone's own)
    would appear twice in the state dict under a second prefix."""

    def __init__(self, peft_model) -> None:
        self.peft_model = peft_model


class LoraBackbone(HFBackbone):
    """`HFBackbone` over a PEFT-adapted model (see the module docstring): a frozen base whose checkpoints leave it out."""

    has_frozen_base = True

    def __init__(self, peft_model, *, settings: LoraSettings, **kwargs) -> None:
        super().__init__(peft_model.get_base_model(), **kwargs)
        self.settings = settings
        self._peft = _PeftHandle(peft_model)
        self._base_digest: str | None = None  # computed on first use: the base is frozen

    @property
    def peft_model(self):
        return self._peft.peft_model

    def base_weights(self) -> contextlib.AbstractContextManager[None]:
        """The frozen base for the block (adapters disabled: PEFT's `disable_adapter()`), then the adapters again."""
        return self.peft_model.disable_adapter()

    def hf_named_tensors(self) -> Iterator[tuple[str, Tensor]]:
        return merged_named_tensors(self.model)

    def merged_model(self) -> nn.Module:
        """A plain HF model holding the merged weights (a copy: PEFT's `merge_and_unload()` on a deep copy)."""
        return copy.deepcopy(self.peft_model).merge_and_unload()

    def drop_base(self, state_dict: dict[str, Tensor], *, prefix: str) -> dict[str, Any]:
        """Remove the frozen base's entries (`prefix` + `model.<name>`) from a checkpoint's state dict in place;
        the record `restore_base` needs (the base's digest). The adapters stay."""
        for key in [k for k in state_dict if k.startswith(prefix) and not _is_adapter_key(k)]:
            del state_dict[key]
        return {"digest": self._digest()}

    def restore_base(self, state_dict: dict[str, Tensor], record: Mapping[str, Any], *, prefix: str) -> None:
        """Put this module's own base weights back into a checkpoint's state dict written by `drop_base`, after
        checking that they are the base the checkpoint was trained on."""
        check_base_digest(record, base_digest(self.model), where="the run's model")
        for name, tensor in self.state_dict().items():
            state_dict.setdefault(prefix + name, tensor)

    def _digest(self) -> str:
        if self._base_digest is None:
            self._base_digest = base_digest(self.model)
        return self._base_digest


def _is_adapter_key(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def base_digest(model: nn.Module) -> str:
    """BLAKE2b of the frozen base: every state-dict entry of `model` but the adapters, with names, dtypes, shapes."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(model.state_dict().items()):
        if _is_adapter_key(name):
            continue
        t = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.view(torch.uint8).numpy() if t.numel() else b"")
    return digest.hexdigest()


def check_base_digest(record: Mapping[str, Any], digest: str, *, where: str) -> None:
    if record.get("digest") != digest:
        raise ValueError(
            f"this LoRA checkpoint holds the adapters only and was trained on a base model whose weights differ from "
            f"{where} (digest {record.get('digest')} vs {digest}): the model config (model.*) or the files it reads "
            "changed since training; restore the original base model, or start a new run"
        )


def base_keys_from_model(model: nn.Module, checkpoint: Mapping[str, Any]) -> set[str]:
    """For a LoRA checkpoint written without its base (`BASE_RECORD`): the base keys `model` (rebuilt from the
    run config, adapters injected) supplies itself, after checking its digest; an empty set otherwise."""
    record = checkpoint.get(BASE_RECORD)
    if record is None:
        return set()
    check_base_digest(record, base_digest(model), where="the model rebuilt from the checkpoint's config")
    return {k for k in model.state_dict() if not _is_adapter_key(k)}


def build_policy_backbone(policy: nn.Module, settings: LoraSettings, **kwargs) -> HFBackbone:
    """`HFBackbone(policy)`, or with LoRA on, a `LoraBackbone` after injecting the adapters into `policy`."""
    if not settings.enabled:
        return HFBackbone(policy, **kwargs)
    check_lora_rank(policy, settings)
    return LoraBackbone(apply_lora(policy, settings), settings=settings, **kwargs)


def check_lora_rank(model: nn.Module, settings: LoraSettings) -> None:
    """A rank above an adapted layer's smaller dimension adds no capacity there (B @ A cannot exceed that rank)
    but costs rank x (in + out) weights per layer: rank 100000 on the 64-wide tiny model ran 230x slower. Refused
    at start (training only: a checkpoint's own settings are rebuilt as they were)."""
    layers = [(min(m.in_features, m.out_features), name, m) for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in settings.target_modules]
    if not layers:
        return  # no target layer: apply_lora names the missing ones
    smallest, name, layer = min(layers, key=lambda entry: entry[0])
    if settings.rank > smallest:
        raise ValueError(
            f"module.lora.rank={settings.rank}: must be <= {smallest}, the smallest dimension of the adapted layers "
            f"({name}: {layer.in_features} -> {layer.out_features}); a larger rank adds no capacity (B @ A has rank "
            f"<= {smallest} there), only compute and memory. Set module.lora.rank={smallest} or less (e.g. "
            f"{min(16, smallest)}), or drop the narrow layers from module.lora.target_modules"
        )


def engine_model_factory(backbone: HFBackbone, *, shares_weights: bool):
    """What the rollout engine is built on: None (the policy itself) unless LoRA is on and the engine keeps its
    own weights (SGLang, `share_weights=false`): then a callable making the plain merged model, called when the
    engine is built so that no extra copy is held before."""
    if not isinstance(backbone, LoraBackbone) or shares_weights:
        return None
    return backbone.merged_model


def adapt_checkpoint_model(model: nn.Module, cfg: DictConfig) -> None:
    """Inject the adapters of the run config's `module.lora` into `model` (a skeleton a LoRA checkpoint's
    `policy.model.*` weights are loaded into); nothing when LoRA was off."""
    settings = LoraSettings.from_config(cfg.get("module", {}).get("lora"))
    if settings.enabled:
        apply_lora(model, settings)


def hf_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(plain HF name, tensor) of `model`: its parameters, or merged (`merged_named_tensors`) when adapted."""
    if has_adapters(model):
        return merged_named_tensors(model)
    return ((n, p.detach()) for n, p in model.named_parameters())


# ----- export: the adapter directory in PEFT's format -----
def adapter_dir_for(out_dir: str | os.PathLike) -> Path:
    """Where the adapters go beside a merged export: `<out_dir>_adapter` (a sibling, not inside: transformers
    would read an adapter_config.json inside the merged model's dir as an adapter to load onto another base)."""
    out = Path(out_dir)
    return out.with_name(out.name + "_adapter")


def lora_settings_of(model: nn.Module) -> LoraSettings | None:
    """The settings PEFT injected `model`'s adapters with (None without adapters)."""
    if not has_adapters(model):
        return None
    config = model.peft_config[ADAPTER]
    return LoraSettings(rank=config.r, alpha=float(config.lora_alpha), target_modules=tuple(sorted(config.target_modules)))
