"""Rollouts recorded to disk (`rollout.record=true`) and read back (`read_step`; `rollout=replay` trains on them).

Layout of a recording, `<run dir>/rollouts/`:
- `manifest.json`: the format version, the policy it was sampled for (tokenizer name, a hash of its vocabulary,
  its length, the model's vocab size and family) and the settings that decide which prompts each step draws and
  how they are scored (seed, prompts per step, samples per prompt, sampling, task, dynamic sampling), plus the
  data-parallel size and `rollout.max_staleness` of the recording run;
- one safetensors file per generation call of each data-parallel rank: `step_000042.dp0.safetensors` (the
  step's own prompts), `step_000042.dp0.round1.safetensors`... (its refill rounds, `data.refill`). Written by
  the rank that generated them (each DP rank its own files: no gather, no rank holding every rank's samples),
  after the rewards, before advantages and packing.

A step file holds the scored samples as flat tensors, ragged fields concatenated over the samples with their
lengths beside them (CSR): `prompt_ids` / `response_ids` (int64), `loss_mask` (int8), `log_probs` (the rollout's
masked log-probs) and `raw_log_probs` (full-vocabulary, for the samples that have them) as float64, exactly what
the engine recorded; `candidate_lengths` / `candidate_ids` (int32: the kept set of every token, row after row);
`routes` (MoE experts per fed token); and `ticket_prompt_ids` / `ticket_prompt_lengths`, the prompts the call
was given (a replay checks its own against them). Its safetensors metadata holds `step`, `dp_rank`, `round`,
`seed` (the call's generation seed, which a replay looks it up by) and `samples`: JSON with one entry per
sample field that is not a tensor (lengths, status, index, group index, reward, weight versions, metadata; the
layout of `topp_rl.rollout.broadcast.samples_to_state`). No pickle: a file is read with `safetensors` and `json`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from topp_rl.data.sample import Sample
from topp_rl.rollout.broadcast import samples_from_state, samples_to_state

FORMAT = "topp_rl.rollouts"
VERSION = 1
MANIFEST = "manifest.json"


@dataclass(frozen=True, kw_only=True)
class PolicyIdentity:
    """What a recording must share with the run that replays it: token ids mean the same tokens to both."""

    tokenizer: str  # the tokenizer's name or path ("" for one built in code)
    vocab_hash: str  # sha256 of the tokenizer's (token, id) pairs
    tokenizer_size: int  # len(tokenizer)
    vocab_size: int  # the model's embedding rows
    family: str  # the model's config.model_type

    @classmethod
    def of(cls, model: Any, tokenizer: Any) -> PolicyIdentity:
        pairs = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
        return cls(tokenizer=str(getattr(tokenizer, "name_or_path", "") or ""),
                   vocab_hash=hashlib.sha256(json.dumps(pairs).encode()).hexdigest(),
                   tokenizer_size=len(tokenizer), vocab_size=int(model.config.vocab_size),
                   family=str(model.config.model_type))

    def differences(self, other: PolicyIdentity) -> list[str]:
        """`field: recorded X, this run Y` for each field that differs (`self`: the recording's)."""
        mine, theirs = asdict(self), asdict(other)
        return [f"{key}: recorded {mine[key]!r}, this run {theirs[key]!r}" for key in mine if mine[key] != theirs[key]]


@dataclass(frozen=True, kw_only=True)
class Manifest:
    identity: PolicyIdentity
    settings: dict[str, Any]  # key -> resolved value (`recorded_settings`)
    dp_size: int
    max_staleness: int

    def write(self, directory: Path) -> None:
        _write_atomic(directory / MANIFEST, lambda tmp: tmp.write_text(json.dumps(
            {"format": FORMAT, "version": VERSION, **asdict(self)}, indent=1, sort_keys=True)))

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        path = Path(directory) / MANIFEST
        if not path.is_file():
            raise ValueError(f"config rollout.path={str(directory)!r}: holds no {MANIFEST}; point it at the "
                             "rollouts/ directory of a run recorded with rollout.record=true")
        data = json.loads(path.read_text())
        _check_format(data, path)
        return cls(identity=PolicyIdentity(**data["identity"]), settings=data["settings"],
                   dp_size=int(data["dp_size"]), max_staleness=int(data["max_staleness"]))


def step_file(directory: Path, *, step: int, dp_rank: int, round: int = 0) -> Path:
    suffix = "" if round == 0 else f".round{round}"
    return Path(directory) / f"step_{step:06d}.dp{dp_rank}{suffix}.safetensors"


def write_step(path: Path, samples: list[Sample], *, prompts: list[list[int]], step: int, dp_rank: int,
               round: int, seed: int) -> None:
    """One generation call's scored samples (and the prompts it was given) to `path`, atomically."""
    state = samples_to_state(samples)
    tensors = dict(state["tensors"])
    tensors["ticket_prompt_ids"] = torch.tensor([t for p in prompts for t in p], dtype=torch.int64)
    tensors["ticket_prompt_lengths"] = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
    try:
        header = json.dumps(state["header"])
    except TypeError as err:
        raise ValueError(f"rollout.record: step {step}'s sample metadata holds a value JSON cannot store ({err}); "
                         "keep sample metadata to numbers, strings, lists and dicts, or set "
                         "rollout.record=false") from None
    metadata = {"format": FORMAT, "version": str(VERSION), "step": str(step), "dp_rank": str(dp_rank),
                "round": str(round), "seed": str(seed), "samples": header}
    _write_atomic(path, lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
                                              metadata=metadata))


def read_header(path: Path) -> dict[str, str]:
    """A step file's metadata (step, dp_rank, round, seed, samples JSON), without reading its tensors."""
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    _check_format(metadata, path)
    return metadata


def read_step(path: Path) -> list[Sample]:
    """The samples of one step file, every field as it was recorded (log-probs bit for bit)."""
    return read_call(path)[0]


def read_call(path: Path) -> tuple[list[Sample], list[list[int]]]:
    """(the samples of one step file, the prompts the call was given)."""
    header = read_header(path)
    tensors = load_file(str(path))
    prompts = [p.tolist() for p in tensors.pop("ticket_prompt_ids").split(
        tensors.pop("ticket_prompt_lengths").tolist())]
    return samples_from_state({"header": json.loads(header["samples"]), "tensors": tensors}), prompts


def step_files(directory: Path) -> Iterator[Path]:
    return iter(sorted(Path(directory).glob("step_*.dp*.safetensors")))


class RolloutRecorder:
    """Writes each generation call's scored samples of this rank (`RolloutDataModule.generate`), and the manifest
    (data-parallel rank 0, at its first call)."""

    def __init__(self, directory: Path | str, *, manifest_of: Callable[[int], Manifest]) -> None:
        self.directory = Path(directory)
        self._manifest_of = manifest_of  # dp_size -> Manifest (the DP size is known once the trainer is set up)
        self._last: tuple[int, int] | None = None  # (step, round) of this rank's latest call

    def write(self, samples: list[Sample], *, prompts: list[list[int]], step: int, seed: int, dp_rank: int,
              dp_size: int) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        if dp_rank == 0 and self._last is None:
            self._manifest_of(dp_size).write(self.directory)
        # Calls come in step order: the step's own generation, then its refill rounds.
        round = self._last[1] + 1 if self._last is not None and self._last[0] == step else 0
        self._last = (step, round)
        write_step(step_file(self.directory, step=step, dp_rank=dp_rank, round=round), samples, prompts=prompts,
                   step=step, dp_rank=dp_rank, round=round, seed=seed)


# The settings that decide a step's prompts and how its samples are scored: a replay must match them.
RECORDED_KEYS = ("seed", "rollout.prompts_per_step", "rollout.n_samples", "rollout.temperature", "rollout.top_p",
                 "rollout.top_k", "rollout.min_p", "rollout.max_new_tokens", "rollout.stop_token_ids",
                 "rollout.max_turns", "rollout.max_trajectory_tokens", "rollout.step", "task",
                 "data.drop_zero_variance_groups", "data.refill", "data.max_refill_factor")


def recorded_settings(cfg: Any) -> dict[str, Any]:
    """`RECORDED_KEYS` of `cfg`, resolved to plain values (absent keys: None)."""
    out = {}
    for key in RECORDED_KEYS:
        value = OmegaConf.select(cfg, key, default=None)
        out[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    return out


def rollout_recorder(cfg: Any, model: Any, tokenizer: Any) -> RolloutRecorder | None:
    """The recorder of a run with `rollout.record=true` (under `<run dir>/rollouts`), else None."""
    if not cfg.rollout.get("record", False):
        return None
    identity, settings = PolicyIdentity.of(model, tokenizer), recorded_settings(cfg)
    staleness = max(int(cfg.rollout.get("max_staleness", 0)), int(bool(cfg.rollout.get("overlap", False))))

    def manifest_of(dp_size: int) -> Manifest:
        return Manifest(identity=identity, settings=settings, dp_size=dp_size, max_staleness=staleness)

    return RolloutRecorder(Path(cfg.paths.output_dir) / "rollouts", manifest_of=manifest_of)


def _check_format(metadata: dict, path: Path) -> None:
    if metadata.get("format") != FORMAT or int(metadata.get("version", -1)) != VERSION:
        raise ValueError(f"{path}: not a topp_rl rollout recording of format version {VERSION} (format="
                         f"{metadata.get('format')!r}, version={metadata.get('version')!r}); record it again with "
                         "this version's rollout.record=true")


def _write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """`write(tmp)` then rename onto `path`: a run killed mid-write leaves no half file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
