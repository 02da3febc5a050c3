"""The trained policy as an HF checkpoint directory: `<run dir>/hf/` during training, and a command for a
checkpoint: `python -m topp_rl.export CKPT OUT_DIR` (a file, or a sharded `parallel=fsdp` checkpoint, whose
shards are assembled into full tensors in the one process).

An export directory holds `config.json` + `model.safetensors` (full weights under HF names), the tokenizer,
`generation_config.json` with the rollout's sampling settings, and the manifest `topp_rl_export.json`: the global
`step`, the `source` (the checkpoint's path for the command, "training" for `HFExport`), the rollout settings as
configured and the `files` written. `transformers.AutoModelForCausalLM.from_pretrained` loads it; SGLang serves it
(`--sampling-defaults model` takes temperature / top_p / top_k / min_p from the generation config).

Departure: the rollout's `top_k=0` (no top-k) is written as top_k = vocabulary size. HF reads 0 as "off" but
SGLang rejects it (it wants -1, which HF would clamp to top_k=1, greedy); the vocabulary size means "off" in both.

During training (`HFExport`) the weights come from `PolicyModule.hf_named_tensors()`, a TP collective for the
Megatron backbone, so every rank walks the export and only global rank 0 writes. The command rebuilds the model
skeleton and tokenizer from the config stored in the checkpoint (`checkpoint["topp_rl"]["config"]`) and loads
the state dict's `policy.model.<HF name>` weights, which both backends write; it reads the checkpoint with
torch's safe loader (`weights_only=True`), so a crafted file is refused instead of running code.

An export replaces its target, so the target must be absent, an empty dir, or a previous export (a dir whose
`topp_rl_export.json` lists every file in it); a file, a dir holding anything else, a dir that is or contains the
checkpoint or the run dir, and a dir inside `<run dir>/checkpoints` are refused at start, naming the rule. The
export is staged next to its target as `.<name>.<pid>.<hex>.tmp` and renamed in; the previous export is renamed to
such a name and removed last. The next export of that target removes (and reports) the copies of a writer that
died. A write that fails (disk full) names the path, the space needed and the space free, and changes nothing.
A LoRA export writes the merged model and the adapters (PEFT's format) to two dirs, which must lie apart (neither
is nor holds the other, `check_adapter_dir_apart`): refused at start otherwise, as the merged model's write
would replace the adapters' files, and transformers would apply adapter files found beside a merged model twice.
"""

import argparse
import copy
import json
import os
import pickle
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from transformers import GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

from topp_rl.parallel.dtensor import full_tensor
from topp_rl.run.adapters import write_adapter_dir, write_checkpoint_adapter
from topp_rl.run.checkpoint import RECORD_KEY, CheckpointReadError, mib, read_checkpoint, temp_path
from topp_rl.run.export_target import (
    INFO_FILE,
    ExportWriteError,
    check_adapter_dir_apart,
    check_target,
    remove_stale_exports,
    swap_in,
)
from topp_rl.run.sharded_checkpoint import is_sharded, read_meta, read_tensors, saved_keys
from topp_rl.trainer.lora import adapt_checkpoint_model, adapter_dir_for, base_keys_from_model, hf_tensors

POLICY_PREFIX = "policy.model."  # a checkpoint's policy weights: policy.model.<HF name> (both backends)
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "max_new_tokens")


def generation_config(rollout: Mapping[str, Any], *, vocab_size: int,
                      tokenizer: PreTrainedTokenizerBase) -> GenerationConfig:
    """Sampling as the rollout did it: temperature, top_p, top_k (0 -> vocab_size), min_p, max_new_tokens;
    stops at the tokenizer's EOS and the rollout's stop_token_ids."""
    stops = [t for t in [tokenizer.eos_token_id, *(rollout.get("stop_token_ids") or ())] if t is not None]
    return GenerationConfig(
        do_sample=True, temperature=float(rollout["temperature"]), top_p=float(rollout["top_p"]),
        top_k=int(rollout["top_k"]) or int(vocab_size), min_p=float(rollout["min_p"]),
        max_new_tokens=int(rollout["max_new_tokens"]), eos_token_id=list(dict.fromkeys(stops)) or None,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
    )


def _model_config(hf_config: PretrainedConfig, dtype: torch.dtype) -> PretrainedConfig:
    """A copy naming its architecture (SGLang picks the model class from `architectures`) and weight dtype."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = copy.deepcopy(hf_config)
    if not config.architectures:  # a config built in memory (from_config) names none
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.dtype = dtype
    return config


def write_hf_dir(named_tensors: Iterable[tuple[str, Tensor]], out_dir: str | os.PathLike, *,
                 hf_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, generation: GenerationConfig,
                 info: Mapping[str, Any], write: bool = True) -> Path | None:
    """Write an HF checkpoint directory of `named_tensors` (HF names, full tensors); returns its path.

    `out_dir` is checked again here (`check_target`): it may have changed since the run started. The manifest
    gets `info` plus `files`, the names written. Every rank must call this when the tensors come from a
    collective; ranks with `write=False` only take part in it and return None.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    if not write:
        for _ in named_tensors:  # take part in the collective, keep nothing (no CPU copy of the model here)
            pass
        return None
    state = {name: t.detach().to("cpu").contiguous() for name, t in named_tensors}
    if not state:
        raise ValueError(f"no weights to export to {out_dir}; the policy yielded no (name, tensor) pairs")
    target = check_target(out_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_exports(target)
    staged = temp_path(target)
    try:
        staged.mkdir()
        _model_config(hf_config, next(iter(state.values())).dtype).save_pretrained(staged)
        save_file(state, str(staged / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(staged)
        generation.save_pretrained(staged)
        files = sorted({p.name for p in staged.iterdir()} | {INFO_FILE})
        (staged / INFO_FILE).write_text(json.dumps({**info, "files": files}, indent=2, default=str) + "\n")
        mode = (staged / INFO_FILE).stat().st_mode & 0o777  # a plain new file's: the umask decides (0644 at 022)
        for path in staged.iterdir():
            path.chmod(mode)  # safetensors writes its file 0600
    except (OSError, SafetensorError) as err:  # safetensors reports a full disk as "I/O error: ... (os error 28)"
        shutil.rmtree(staged, ignore_errors=True)
        needed = sum(t.numel() * t.element_size() for t in state.values())
        free = shutil.disk_usage(target.parent).free
        raise ExportWriteError(
            f"could not write the export {target}: {type(err).__name__}: {err}; its weights need {mib(needed)} "
            f"({needed} bytes), {mib(free)} free in {target.parent}: free space there or export to a larger disk; "
            f"the checkpoint and the previous {target.name}, if any, are kept"
        ) from err
    except BaseException:  # any other error, KeyboardInterrupt: no staged copy left behind
        shutil.rmtree(staged, ignore_errors=True)
        raise
    swap_in(staged, target)
    return target


class HFExport(Callback):
    """Writes the policy to `dirpath` (an HF checkpoint directory) with every checkpoint and at train end.

    The checkpoint hook runs where Lightning builds the checkpoint (on every rank, after the step's update), so
    `hf/` holds the weights of `last.ckpt`. A train end at a step already exported writes nothing again.
    """

    def __init__(self, *, dirpath: str | os.PathLike, rollout: Mapping[str, Any], on_checkpoint: bool = True,
                 merge_lora: bool = True, adapter_dir: str | os.PathLike | None = None,
                 run_dir: str | os.PathLike | None = None) -> None:
        self.dirpath = check_target(dirpath, run_dir=run_dir, name="export.dir")  # at start, not at step 50
        self.rollout = {k: rollout[k] for k in (*SAMPLING_KEYS, "stop_token_ids") if k in rollout}
        self.on_checkpoint = on_checkpoint
        self.merge_lora = merge_lora
        # Checked at start like `dirpath`, LoRA or not (the policy is not known yet; absent is allowed).
        adapter_dir = adapter_dir if adapter_dir is not None else adapter_dir_for(self.dirpath)
        self.adapter_dir = check_target(adapter_dir, run_dir=run_dir, name="export.adapter_dir")
        if merge_lora:
            check_adapter_dir_apart(adapter_dir, dirpath, names=("export.adapter_dir", "export.dir"), fix=(
                "drop the export.adapter_dir override (the default is ${export.dir}_adapter) or name a dir apart "
                "from export.dir, or set export.merge_lora=false to write the adapters only"))
        self.exported_step: int | None = None
        self.exported_dirs: dict[str, Path] = {}  # "model" / "adapters" -> the dir written (the run's summary)

    def export(self, trainer, pl_module) -> Path | None:
        hf_config = pl_module.policy.hf_config
        tokenizer = trainer.datamodule.tokenizer
        info = {"step": trainer.global_step, "source": "training", "rollout": self.rollout}
        path = None
        lora = pl_module.policy.has_frozen_base  # a LoraBackbone, or sharded (FSDPLoraBackbone)
        if lora:  # every rank gathers sharded adapters (FSDP; a plain tensor is taken as it is), one rank writes
            path = write_adapter_dir(pl_module.policy.model, self.adapter_dir, info=info, full=full_tensor,
                                     write=trainer.is_global_zero)
            self.exported_dirs["adapters"] = self.adapter_dir
        if self.merge_lora or not lora:
            path = write_hf_dir(
                pl_module.hf_named_tensors(), self.dirpath, hf_config=hf_config, tokenizer=tokenizer,
                generation=generation_config(self.rollout, vocab_size=hf_config.vocab_size, tokenizer=tokenizer),
                info=info, write=trainer.is_global_zero,
            )
            self.exported_dirs["model"] = self.dirpath
        self.exported_step = trainer.global_step
        return path

    def on_fit_start(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            remove_stale_exports(self.dirpath)  # copies left by a run killed mid-export

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        if self.on_checkpoint:
            self.export(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.exported_step != trainer.global_step:
            self.export(trainer, pl_module)


# ----- the command: an existing checkpoint -----
def policy_state(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The policy's HF-named weights from a checkpoint's state dict (reference weights and the rest dropped)."""
    return {k[len(POLICY_PREFIX):]: v for k, v in state_dict.items() if k.startswith(POLICY_PREFIX)}


def policy_weights(checkpoint: Mapping[str, Any], path: Path, model: torch.nn.Module) -> dict[str, Tensor]:
    """The policy's HF-named weights: a file's state dict, or a sharded checkpoint's shards (`parallel=fsdp`)
    assembled into full tensors shaped like `model`'s, for every weight the checkpoint holds."""
    if not is_sharded(path):
        return policy_state(checkpoint.get("state_dict") or {})
    saved = saved_keys(path)
    template = {f"{POLICY_PREFIX}{name}": torch.empty_like(tensor) for name, tensor in model.state_dict().items()
                if f"state_dict.{POLICY_PREFIX}{name}" in saved}
    return policy_state(read_tensors(path, {"state_dict": template})["state_dict"])


def load_policy(checkpoint: Mapping[str, Any], path: Path):
    """(HF model holding the checkpoint's policy weights, tokenizer, resolved run config)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf


    config = (checkpoint.get(RECORD_KEY) or {}).get("config")
    if not config:
        raise ValueError(
            f"{path} holds no run config (checkpoint[{RECORD_KEY!r}]['config']); export needs it to rebuild the "
            "model: pass a checkpoint written by topp_rl's train.py (<run dir>/checkpoints/last.ckpt)"
        )
    cfg = OmegaConf.create(config)
    model, tokenizer = instantiate(cfg.model)
    model.float()  # train.py trains the float32 copy: the checkpoint's tensors are float32
    adapt_checkpoint_model(model, cfg)  # module.lora on: inject the adapters, so their weights load too
    state = policy_weights(checkpoint, path, model)
    if not state:
        raise ValueError(
            f"{path} has no {POLICY_PREFIX}* weights in its state_dict; pass a topp_rl training checkpoint"
        )
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()  # Megatron omits the tied head
    tied |= base_keys_from_model(model, checkpoint)  # a LoRA checkpoint leaves its base out
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"{path}: the policy weights do not fit the model {cfg.model.get('_target_')} rebuilt from its config "
            f"(missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}); was the model "
            "config changed after training? Export with the checkpoint's own topp_rl version and config"
        )
    model.tie_weights()
    return model, tokenizer, cfg


def read_checkpoint_safely(path: Path) -> dict[str, Any]:
    """A checkpoint read with torch's safe loader (`weights_only=True`: tensors and plain values only), so a
    crafted file cannot run code; mmap: the optimizer state is not read into memory."""

    try:
        if is_sharded(path):
            return read_meta(path)  # the weights are read by `policy_weights`
        return read_checkpoint(path, map_location="cpu", weights_only=True, mmap=True)
    except CheckpointReadError as err:
        cause = err.__cause__
        if not (isinstance(cause, pickle.UnpicklingError) and "weights only load failed" in str(cause).lower()):
            raise
        lines = [line.strip() for line in str(cause).splitlines()]
        reason = next((line for line in lines if "GLOBAL" in line), lines[0])  # the refused global, named
        raise ValueError(
            f"checkpoint {path} holds objects torch's safe loader refuses ({reason}); loading them could run code, "
            "so export reads tensors and plain values only: pass a checkpoint written by topp_rl's train.py"
        ) from None


def export_checkpoint(ckpt_path: str | os.PathLike, out_dir: str | os.PathLike, *, merge_lora: bool = True,
                      adapter_dir: str | os.PathLike | None = None) -> Path:
    """Write the HF checkpoint directory of a training checkpoint's policy (HF or Megatron backend); returns the
    model's dir, or for a LoRA checkpoint without `merge_lora` the adapter dir (`export_checkpoint_dirs`)."""
    return next(iter(export_checkpoint_dirs(ckpt_path, out_dir, merge_lora=merge_lora,
                                            adapter_dir=adapter_dir).values()))


def export_checkpoint_dirs(ckpt_path: str | os.PathLike, out_dir: str | os.PathLike, *, merge_lora: bool = True,
                           adapter_dir: str | os.PathLike | None = None) -> dict[str, Path]:
    """`export_checkpoint`, returning every dir written: "model" (the plain or merged model) and / or "adapters".

    The manifest records the checkpoint (`source`, resolved) and its global step (`step`). A LoRA run's checkpoint
    also writes its adapters to `adapter_dir` (default `<out_dir>_adapter`, PEFT's format) and, with `merge_lora`,
    the merged model to `out_dir`; without it, the adapter dir only. With `merge_lora`, an `adapter_dir` that is,
    contains or lies inside `out_dir` is refused before the checkpoint is read (`check_adapter_dir_apart`)."""
    ckpt_path = Path(ckpt_path)
    if not (ckpt_path.is_file() or is_sharded(ckpt_path)):
        raise ValueError(f"checkpoint {ckpt_path} does not exist; pass a file such as <run dir>/checkpoints/last.ckpt")
    parent = Path(os.path.abspath(ckpt_path)).parent
    run_dir = parent.parent if parent.name == "checkpoints" else None  # <run dir>/checkpoints/<file>
    check_target(out_dir, checkpoint=ckpt_path, run_dir=run_dir)  # before the (long) load
    if merge_lora and adapter_dir is not None:
        check_adapter_dir_apart(adapter_dir, out_dir, names=("--adapter-dir", "the export target"), fix=(
            f"drop --adapter-dir (the default is {adapter_dir_for(out_dir)}) or pass a dir apart from {out_dir}, "
            f"or add --no-merge-lora to write the adapters only"))
    checkpoint = read_checkpoint_safely(ckpt_path)
    model, tokenizer, cfg = load_policy(checkpoint, ckpt_path)
    rollout = {k: cfg.rollout[k] for k in (*SAMPLING_KEYS, "stop_token_ids") if k in cfg.rollout}
    named = hf_tensors(model)  # the tied head appears once, as HF saves it; LoRA: merged, under the plain names
    info = {"step": checkpoint.get("global_step"), "source": str(ckpt_path.resolve()), "rollout": dict(rollout)}
    written = {}
    if lora_dir := write_checkpoint_adapter(model, out_dir, adapter_dir, info=info):
        written["adapters"] = lora_dir
        if not merge_lora:
            return written
    model_dir = write_hf_dir(
        named, out_dir, hf_config=model.config, tokenizer=tokenizer, info=info,
        generation=generation_config(rollout, vocab_size=model.config.vocab_size, tokenizer=tokenizer),
    )
    return {"model": model_dir, **written}


def main(argv: list[str] | None = None, *, prog: str = "python -m topp_rl.export") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])  # `topp-rl export` names itself
    parser.add_argument("ckpt", help="a training checkpoint, e.g. <run dir>/checkpoints/last.ckpt")
    parser.add_argument("out_dir", help="the HF checkpoint directory to write: absent, empty, or a previous export "
                                        "(which is replaced)")
    parser.add_argument("--adapter-dir", help="a LoRA run's adapter directory (PEFT format) to write; default "
                                              "<out_dir>_adapter")
    parser.add_argument("--no-merge-lora", action="store_true", help="a LoRA run: write the adapter dir only")
    args = parser.parse_args(argv)
    try:
        dirs = export_checkpoint_dirs(args.ckpt, args.out_dir, merge_lora=not args.no_merge_lora,
                                      adapter_dir=args.adapter_dir)
    except ValueError as err:
        parser.error(str(err))  # exit status 2 with the message, no traceback
    except ExportWriteError as err:
        parser.exit(1, f"{parser.prog}: error: {err}\n")
    info = json.loads((next(iter(dirs.values())) / INFO_FILE).read_text())
    print(f"[topp_rl] exported checkpoint {info['source']} (global step {info['step']}) to {written_dirs(dirs)}",
          flush=True)


def written_dirs(dirs: Mapping[str, Path]) -> str:
    """The dirs an export wrote, for its message: a plain model's dir alone, a LoRA run's each with what it holds."""
    if "adapters" not in dirs:
        return str(dirs["model"])
    held = {"model": "the merged model", "adapters": "the LoRA adapters, PEFT's format"}
    return " and ".join(f"{path} ({held[kind]})" for kind, path in dirs.items())

