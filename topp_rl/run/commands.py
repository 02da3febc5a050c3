"""Commands a run prints for the user to type next, written so they work as printed from where the run started:
`topp-rl ...` after `topp-rl train` (the script's path when PATH finds no `topp-rl` or another one), else the
interpreter that ran the run, `<python> -m ...` (a bare `python` may lack the project's packages, or not exist).
"""

import os
import shlex
import shutil
import sys
from pathlib import Path

CLI_NAME = "topp-rl"  # pyproject's console script


def report_command(*, argv0: str | None = None, python: str | None = None) -> str:
    """The command that plots a run (reads its csv/), as this process was started: `topp-rl report` when it is
    the `topp-rl` script (its path unless PATH finds that same script), else `<this python> -m topp_rl.report`;
    paths below the working directory are written relative to it."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    if Path(argv0).name == CLI_NAME:
        on_path = shutil.which(CLI_NAME)
        same = on_path is not None and Path(on_path).resolve() == Path(argv0).resolve()
        return f"{CLI_NAME if same else _shell_path(argv0)} report"
    return f"{_shell_path(python or sys.executable)} -m topp_rl.report"


def _shell_path(path: str) -> str:
    """`path` relative to the working directory when below it (`.venv/bin/python`), else absolute; shell-quoted."""
    absolute = Path(os.path.abspath(path))
    try:
        shown = str(absolute.relative_to(Path.cwd()))
    except ValueError:
        shown = str(absolute)
    return shlex.quote(shown if "/" in shown or shown == str(absolute) else f"./{shown}")
