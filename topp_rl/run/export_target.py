"""Where an export may write: the target is absent, an empty dir, or a previous export (a dir whose manifest
`topp_rl_export.json` lists every file in it); never the run, the checkpoint or a user's files. Staged writes are
swapped in, and the copies a dead writer left are removed (`topp_rl.run.export` for the whole story)."""

import json
import os
import re
import shutil
from pathlib import Path

from topp_rl.run.checkpoint import temp_path
from topp_rl.run.rundir import remove_stale_temps

INFO_FILE = "topp_rl_export.json"


class ExportWriteError(RuntimeError):
    """An export could not be written (disk full, ...); its target and the checkpoint are left as they were."""


def _forms(path: str | os.PathLike) -> set[Path]:
    """The absolute path as given and with its symlinks resolved (a link to a checkpoint protects both)."""
    return {Path(os.path.abspath(path)), Path(path).resolve()}


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


# Files of exports written before manifests listed them: weights, configs and the tokenizer's files.
_LEGACY_FILES = re.compile(r"(config|generation_config|topp_rl_export|special_tokens_map|added_tokens|vocab)\.json"
                           r"|model\.safetensors|tokenizer.*|merges\.txt|vocab\.txt|chat_template\.jinja")


def _export_files(manifest: Path) -> set[str] | None:
    """The names a previous export wrote (its manifest's `files`), or None if `manifest` is not an export's."""
    try:
        info = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict):
        return None
    if "files" not in info:  # an export written before manifests listed their files
        return {n.name for n in manifest.parent.iterdir() if _LEGACY_FILES.fullmatch(n.name)}
    return {str(n) for n in info["files"]} | {INFO_FILE}


def _foreign_entries(path: Path) -> list[str]:
    """What `path` (a dir) holds besides a previous export's own files; sub-dirs end in '/'."""
    entries = sorted(path.iterdir())
    allowed = _export_files(path / INFO_FILE) or set()
    return [e.name + "/" if e.is_dir() else e.name for e in entries if e.is_dir() or e.name not in allowed]


def check_target(target: str | os.PathLike, *, checkpoint: str | os.PathLike | None = None,
                 run_dir: str | os.PathLike | None = None, name: str = "export target") -> Path:
    """The target, resolved, if an export may replace it; else a ValueError naming it, the rule and the fix.

    The target must be absent, an empty dir, or a previous export (a dir whose manifest lists every file it holds).
    It may not be or contain `checkpoint` or `run_dir`, nor lie inside `<run_dir>/checkpoints`.
    """
    given = Path(target)
    path = given.resolve()
    if checkpoint is not None and any(_within(c, p) for c in _forms(checkpoint) for p in _forms(given)):
        raise ValueError(f"{name} {given} is or contains the checkpoint being exported ({checkpoint}); an export "
                         f"replaces its target, which would delete the checkpoint: choose a new or empty dir outside "
                         f"it, e.g. <run dir>/hf")
    if run_dir is not None:
        run_dir = Path(run_dir)
        if any(_within(r, p) for r in _forms(run_dir) for p in _forms(given)):
            raise ValueError(f"{name} {given} is or contains the run dir {run_dir}; an export replaces its target, "
                             f"which would delete the run's config, logs and checkpoints: use {run_dir / 'hf'} (the "
                             f"default) or another dir that holds no run")
        checkpoints = run_dir / "checkpoints"
        if any(_within(p, c) for c in _forms(checkpoints) for p in _forms(given)):
            raise ValueError(f"{name} {given} is inside the checkpoint dir {checkpoints}, which holds the run's "
                             f"checkpoints and their temp files only: use {run_dir / 'hf'} (the default)")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        where = "a file" if existing == path else f"below the file {existing}"
        raise ValueError(f"{name} {given} is {where}; pass the path of a new or empty directory, or of a previous "
                         f"export (a dir holding {INFO_FILE})")
    if path.is_dir() and (foreign := _foreign_entries(path)):
        listed = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise ValueError(f"{name} {given} holds files that are not a topp_rl export ({listed}); an export replaces "
                         f"its target, so it writes only to a new or empty dir or a previous export (marked by its "
                         f"{INFO_FILE}): choose an empty or new dir, or delete {given} yourself")
    return path


def _placement(path: str | os.PathLike, other: str | os.PathLike) -> str | None:
    """How `path` lies against `other` ("is", "is inside", "contains"), as given and resolved; None: apart."""
    mine, theirs = _forms(path), _forms(other)
    if mine & theirs:
        return "is"
    if any(_within(m, t) for m in mine for t in theirs):
        return "is inside"
    if any(_within(t, m) for m in mine for t in theirs):
        return "contains"
    return None


def check_adapter_dir_apart(adapter_dir: str | os.PathLike, model_dir: str | os.PathLike, *, names: tuple[str, str],
                            fix: str) -> None:
    """Refuse an adapter dir that is, contains or lies inside the merged model's dir, both being written: each
    export replaces its whole dir, so one write would delete the other's files (the adapters went silently when the
    dirs were equal). Side by side in one dir is not offered either: transformers' `from_pretrained` on a dir
    holding config.json and adapter_config.json loads the merged weights and then applies the adapters again."""
    if (where := _placement(adapter_dir, model_dir)) is None:
        return
    adapter_name, model_name = names
    raise ValueError(
        f"{adapter_name} {adapter_dir} {where} {model_name} {model_dir}: a LoRA export writes the adapters and "
        f"the merged model, each replacing its whole dir, and adapter files beside a merged model make "
        f"transformers apply the adapters twice, so the two dirs must be apart; {fix}"
    )


def remove_stale_exports(target: Path) -> list[Path]:
    """Remove the staged and replaced copies of `target` (`.<name>.<pid>.<hex>.tmp`) whose writer is gone."""
    return remove_stale_temps(target.parent, target=target.name) if target.parent.is_dir() else []


def swap_in(staged: Path, target: Path) -> None:
    """Replace `target` by `staged` (same parent). The previous export is renamed to a temp name first and removed
    last; a kill in between leaves it (and a kill between the renames, the new one too) under a temp name that
    the next export of `target` removes, reporting it."""
    old = temp_path(target) if target.exists() else None
    if old is not None:
        os.replace(target, old)
    try:
        os.replace(staged, target)
    except BaseException:
        if old is not None:
            os.replace(old, target)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)  # what a failure leaves, the next export removes
