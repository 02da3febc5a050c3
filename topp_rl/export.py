"""The trained policy as an HF checkpoint directory: `<run dir>/hf/` during training, and a command for a
checkpoint file: `python -m topp_rl.export CKPT OUT_DIR`.

An export directory holds `config.json` + `model.safetensors` (full weights under HF names), the tokenizer,
`generation_config.json` with the rollout's sampling settings, and `topp_rl_export.json` (step, source and the
rollout settings as configured). `transformers.AutoModelForCausalLM.from_pretrained` loads it; SGLang serves it
(`--sampling-defaults model` takes temperature / top_p / top_k / min_p from the generation config).

Departure: the rollout's `top_k=0` (no top-k) is written as top_k = vocabulary size. HF reads 0 as "off" but
SGLang rejects it (it wants -1, which HF would clamp to top_k=1, greedy); the vocabulary size means "off" in both.

During training (`HFExport`) the weights come from `PolicyModule.hf_named_tensors()`, a TP collective for the
Megatron backbone, so every rank walks the export and only global rank 0 writes. The command rebuilds the model
skeleton and tokenizer from the config stored in the checkpoint (`checkpoint["topp_rl"]["config"]`) and loads
the state dict's `policy.model.<HF name>` weights, which both backends write. A directory is staged next to its
target and swapped in, so the target always holds one complete export.
"""

import argparse
import copy
import json
import os
import secrets
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from transformers import GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

POLICY_PREFIX = "policy.model."  # a checkpoint's policy weights: policy.model.<HF name> (both backends)
INFO_FILE = "topp_rl_export.json"
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


def _swap_in(staged: Path, target: Path) -> None:
    """Replace `target` by `staged` (same parent): the old export is renamed away first, removed last."""
    old = target.parent / f".{target.name}.{os.getpid()}.old"
    if target.exists():
        os.replace(target, old)
    os.replace(staged, target)
    shutil.rmtree(old, ignore_errors=True)


def write_hf_dir(named_tensors: Iterable[tuple[str, Tensor]], out_dir: str | os.PathLike, *,
                 hf_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, generation: GenerationConfig,
                 info: Mapping[str, Any], write: bool = True) -> Path | None:
    """Write an HF checkpoint directory of `named_tensors` (HF names, full tensors); returns its path.

    Every rank must call this when the tensors come from a collective; ranks with `write=False` only take part
    in it and return None.
    """
    from safetensors.torch import save_file

    if not write:
        for _ in named_tensors:  # take part in the collective, keep nothing (no CPU copy of the model here)
            pass
        return None
    state = {name: t.detach().to("cpu").contiguous() for name, t in named_tensors}
    if not state:
        raise ValueError(f"no weights to export to {out_dir}; the policy yielded no (name, tensor) pairs")
    target = Path(out_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.parent / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        staged.mkdir()
        _model_config(hf_config, next(iter(state.values())).dtype).save_pretrained(staged)
        save_file(state, str(staged / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(staged)
        generation.save_pretrained(staged)
        (staged / INFO_FILE).write_text(json.dumps(dict(info), indent=2, default=str) + "\n")
        _swap_in(staged, target)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return target


class HFExport(Callback):
    """Writes the policy to `dirpath` (an HF checkpoint directory) with every checkpoint and at train end.

    The checkpoint hook runs where Lightning builds the checkpoint (on every rank, after the step's update), so
    `hf/` holds the weights of `last.ckpt`. A train end at a step already exported writes nothing again.
    """

    def __init__(self, *, dirpath: str | os.PathLike, rollout: Mapping[str, Any], on_checkpoint: bool = True) -> None:
        self.dirpath = Path(dirpath)
        self.rollout = {k: rollout[k] for k in (*SAMPLING_KEYS, "stop_token_ids") if k in rollout}
        self.on_checkpoint = on_checkpoint
        self.exported_step: int | None = None

    def export(self, trainer, pl_module) -> Path | None:
        hf_config = pl_module.policy.hf_config
        tokenizer = trainer.datamodule.tokenizer
        path = write_hf_dir(
            pl_module.hf_named_tensors(), self.dirpath, hf_config=hf_config, tokenizer=tokenizer,
            generation=generation_config(self.rollout, vocab_size=hf_config.vocab_size, tokenizer=tokenizer),
            info={"step": trainer.global_step, "source": "training", "rollout": self.rollout},
            write=trainer.is_global_zero,
        )
        self.exported_step = trainer.global_step
        return path

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


def load_policy(checkpoint: Mapping[str, Any], path: Path):
    """(HF model holding the checkpoint's policy weights, tokenizer, resolved run config)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from topp_rl.checkpoint import RECORD_KEY

    config = (checkpoint.get(RECORD_KEY) or {}).get("config")
    if not config:
        raise ValueError(
            f"{path} holds no run config (checkpoint[{RECORD_KEY!r}]['config']); export needs it to rebuild the "
            "model: pass a checkpoint written by topp_rl's train.py (<run dir>/checkpoints/last.ckpt)"
        )
    cfg = OmegaConf.create(config)
    model, tokenizer = instantiate(cfg.model)
    model.float()  # train.py trains the float32 copy: the checkpoint's tensors are float32
    state = policy_state(checkpoint.get("state_dict") or {})
    if not state:
        raise ValueError(
            f"{path} has no {POLICY_PREFIX}* weights in its state_dict; pass a topp_rl training checkpoint"
        )
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()  # Megatron omits the tied head
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"{path}: the policy weights do not fit the model {cfg.model.get('_target_')} rebuilt from its config "
            f"(missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}); was the model "
            "config changed after training? Export with the checkpoint's own topp_rl version and config"
        )
    model.tie_weights()
    return model, tokenizer, cfg


def export_checkpoint(ckpt_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the HF checkpoint directory of a training checkpoint's policy (HF or Megatron backend)."""
    from topp_rl.checkpoint import read_checkpoint

    ckpt_path = Path(ckpt_path)
    if not ckpt_path.is_file():
        raise ValueError(f"checkpoint {ckpt_path} does not exist; pass a file such as <run dir>/checkpoints/last.ckpt")
    checkpoint = read_checkpoint(ckpt_path, map_location="cpu", weights_only=False)
    model, tokenizer, cfg = load_policy(checkpoint, ckpt_path)
    rollout = {k: cfg.rollout[k] for k in (*SAMPLING_KEYS, "stop_token_ids") if k in cfg.rollout}
    named = ((n, p.detach()) for n, p in model.named_parameters())  # the tied head appears once, as HF saves it
    info = {"step": checkpoint.get("global_step"), "source": str(ckpt_path.resolve()), "rollout": dict(rollout)}
    return write_hf_dir(
        named, out_dir, hf_config=model.config, tokenizer=tokenizer, info=info,
        generation=generation_config(rollout, vocab_size=model.config.vocab_size, tokenizer=tokenizer),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m topp_rl.export", description=__doc__.splitlines()[0])
    parser.add_argument("ckpt", help="a training checkpoint, e.g. <run dir>/checkpoints/last.ckpt")
    parser.add_argument("out_dir", help="the HF checkpoint directory to write (replaced if it exists)")
    args = parser.parse_args(argv)
    try:
        path = export_checkpoint(args.ckpt, args.out_dir)
    except ValueError as err:
        parser.error(str(err))  # exit status 2 with the message, no traceback
    print(path)


if __name__ == "__main__":
    main()
