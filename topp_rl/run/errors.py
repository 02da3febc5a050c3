"""Errors for people: a mistake in the config, the data, a reward, an agent or an environment that the project
refuses on purpose prints one clean message (the value, the constraint, the fix) and exits with status 2; the
traceback is for bugs, and for anyone who asks (`HYDRA_FULL_ERROR=1`).

"On purpose" is what the project raises itself (the innermost frame is in `topp_rl`) as a `ValueError` (the
project's kind for a bad setting or input), `FileNotFoundError`, `TimeoutError`, `FloatingPointError` or
`RuntimeError` (a server that exited, a step whose every sample failed: each names its log or its cause). Anything
else (an `AttributeError`, a `KeyError`, an error raised inside a user's own reward or agent code) keeps its
traceback: there the traceback is the useful part. Hydra wraps errors of the objects it builds
(`InstantiationException`); the cause is what is judged and shown.
"""

import os
import sys
import traceback
from pathlib import Path

from hydra.errors import InstantiationException

PACKAGE = Path(__file__).resolve().parents[1]
ON_PURPOSE = (ValueError, FileNotFoundError, TimeoutError, FloatingPointError, RuntimeError)
SHOW_TRACEBACK = "HYDRA_FULL_ERROR"


def refusal(err: BaseException) -> BaseException | None:
    """The error to show without a traceback (`err`, or the cause Hydra wrapped), or None for one that keeps it."""
    while isinstance(err, InstantiationException) and err.__cause__ is not None:
        err = err.__cause__
    if not isinstance(err, ON_PURPOSE) or err.__traceback__ is None:
        return None
    innermost = traceback.extract_tb(err.__traceback__)[-1]
    return err if Path(innermost.filename).resolve().is_relative_to(PACKAGE) else None


def exit_cleanly_on_refusal(err: BaseException) -> None:
    """Print a refusal's message and exit 2 (nothing when `err` is not one, or `HYDRA_FULL_ERROR=1` asks for the
    traceback: the caller re-raises)."""
    shown = refusal(err)
    if shown is None or os.environ.get(SHOW_TRACEBACK) == "1":
        return
    print(f"error: {shown}\n(the traceback: run again with {SHOW_TRACEBACK}=1)", file=sys.stderr, flush=True)
    sys.exit(2)
