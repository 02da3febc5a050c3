"""A launched engine's work dir (server logs, weight copies of a disk sync, rendezvous files), owned by one process.

`make_workdir` makes `root/<prefix><pid>-<random>` (root: the system temp dir) and records its owner; it first
cleans what engines of dead processes left under `root` with the same prefix, keeping their logs, the evidence of
why they died.
"""

import os
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

_OWNER_FILE = "owner"  # "<pid> <start time>" of the process that made the work dir


def make_workdir(root: str | os.PathLike | None = None, *, prefix: str) -> Path:
    """A fresh dir `root/<prefix><pid>-<random>` owned by this process, after sweeping stale ones (`sweep_stale_workdirs`)."""
    root = Path(root) if root is not None else Path(tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    sweep_stale_workdirs(root, prefix=prefix)
    path = root / f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir()
    (path / _OWNER_FILE).write_text(_owner_id(os.getpid()))
    return path


def remove_workdir(path: Path, *, keep_log: bool) -> None:
    """Remove the work dir; with `keep_log`, everything but the logs (`server.log`, `server-<k>/server.log` of
    several servers, `router.log`) and the dirs holding them."""
    logs = [p for p in path.rglob("*.log") if p.is_file()] if keep_log and path.is_dir() else []
    if not logs:
        shutil.rmtree(path, ignore_errors=True)
        return
    for entry in sorted(path.rglob("*"), key=lambda p: len(p.parts), reverse=True):  # deepest first
        if entry in logs or (entry.is_dir() and any(log.is_relative_to(entry) for log in logs)):
            continue
        shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)


def sweep_stale_workdirs(root: Path, *, prefix: str) -> list[Path]:
    """Clean the work dirs under `root` whose owner process is gone (pid dead, or reused by another process)."""
    stale = []
    for path in root.glob(f"{prefix}*"):
        try:
            pid_s, start = (path / _OWNER_FILE).read_text().split()
        except (OSError, ValueError):
            continue  # not ours, or only a kept log left
        if _owner_id(int(pid_s)) != f"{pid_s} {start}":
            remove_workdir(path, keep_log=True)
            stale.append(path)
    return stale


def _owner_id(pid: int) -> str:
    """'<pid> <start time in clock ticks>' (a reused pid has another start time); '' when pid is gone."""
    try:
        return f"{pid} {Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[19]}"
    except (OSError, IndexError):
        if sys.platform == "linux":
            return ""
    try:  # no /proc: the pid alone
        os.kill(pid, 0)
        return f"{pid} 0"
    except ProcessLookupError:
        return ""
    except PermissionError:
        return f"{pid} 0"
