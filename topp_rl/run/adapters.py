"""A LoRA run's adapters as a PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`),
staged and swapped in under the export's target rules (`topp_rl.run.export_target`)."""

import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from topp_rl.run.checkpoint import temp_path
from topp_rl.run.export_target import INFO_FILE, check_target, remove_stale_exports, swap_in
from topp_rl.trainer.lora import (
    ADAPTER,
    adapter_dir_for,
    adapter_layers,
    as_is,
    has_adapters,
    lora_settings_of,
)


def write_adapter_dir(model: nn.Module, out_dir: str | os.PathLike, *, info: Mapping[str, Any],
                      full: Callable[[Tensor], Tensor] = as_is, write: bool = True) -> Path:
    """Write `model`'s adapters (an HF model with PEFT layers injected) as a PEFT adapter directory:
    `adapter_config.json` (PEFT's `LoraConfig`) and `adapter_model.safetensors` (`base_model.model.<path>.lora_A
    .weight` / `.lora_B.weight`, PEFT's key format), plus the export manifest; `PeftModel.from_pretrained(base,
    out_dir)` loads it. Staged and swapped in like the merged export (`topp_rl.run.export`), with the same target rule.
    Sharded adapters (FSDP): every rank calls it (`full` gathers each A / B), the rank with `write` writes."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    settings = lora_settings_of(model)
    if settings is None:
        raise ValueError(f"no LoRA adapters to export to {out_dir}: the model has no PEFT layers")
    state = {}
    for path, layer in adapter_layers(model).items():
        for part in ("lora_A", "lora_B"):
            weight = full(getattr(layer, part)[ADAPTER].weight.detach())
            state[f"base_model.model.{path}.{part}.weight"] = weight.to("cpu").contiguous()
    if not write:
        # only the writing rank reads the target: it may be swapping in a previous export's dir right now
        return Path(out_dir).resolve()
    target = check_target(out_dir, name="export.adapter_dir")
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_exports(target)
    staged = temp_path(target)
    try:
        staged.mkdir()
        LoraConfig(r=settings.rank, lora_alpha=settings.lora_alpha, lora_dropout=0.0, bias="none",
                   target_modules=list(settings.target_modules),
                   base_model_name_or_path=model.config.name_or_path or None).save_pretrained(staged)
        save_file(state, str(staged / "adapter_model.safetensors"), metadata={"format": "pt"})
        files = sorted({p.name for p in staged.iterdir()} | {INFO_FILE})
        (staged / INFO_FILE).write_text(json.dumps({**info, "files": files}, indent=2, default=str) + "\n")
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    swap_in(staged, target)
    return target


def write_checkpoint_adapter(model: nn.Module, out_dir: str | os.PathLike, adapter_dir: str | os.PathLike | None, *,
                             info: Mapping[str, Any]) -> Path | None:
    """The adapter dir of a model rebuilt from a LoRA checkpoint (default `<out_dir>_adapter`), written; None
    for a model without adapters."""
    if not has_adapters(model):
        return None
    return write_adapter_dir(model, adapter_dir if adapter_dir is not None else adapter_dir_for(out_dir), info=info)
