"""The run's own console lines in `<run dir>/train.log` too, beside Lightning's: what a run prints (the layout, the
placement, sample lines, evaluations, the summary, a refusal) is what a user looks for in its log afterwards.

`console_to_log` copies, while a run lasts, every complete line written to stdout, and the lines of stderr that the
project writes (`[topp_rl] ...`, `error: ...`), to the `topp_rl.console` logger at INFO: Hydra's job logging sends
INFO to train.log only (its console handler is at WARNING), so nothing is shown twice. Progress bars redraw with
carriage returns: only what follows a line's last `\\r` counts, and a bar's frames on stderr are never copied.
"""

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from typing import TextIO

LOG = logging.getLogger("topp_rl.console")
PROJECT_PREFIXES = ("[topp_rl]", "error:")


class _LineCopy:
    """A text stream that writes through to `stream` and hands each complete line that `keep` accepts to `LOG`."""

    def __init__(self, stream: TextIO, keep: Callable[[str], bool]) -> None:
        self._stream, self._keep, self._partial = stream, keep, ""

    def write(self, text: str) -> int:
        written = self._stream.write(text)
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            shown = line.rsplit("\r", 1)[-1].rstrip()
            if shown and self._keep(shown):
                LOG.info(shown)
        return written

    def __getattr__(self, name: str):  # flush, fileno, isatty, encoding, ...: the wrapped stream's
        return getattr(self._stream, name)


@contextlib.contextmanager
def console_to_log() -> Iterator[None]:
    stdout, stderr = sys.stdout, sys.stderr
    sys.stdout = _LineCopy(stdout, lambda line: True)
    sys.stderr = _LineCopy(stderr, lambda line: line.startswith(PROJECT_PREFIXES))
    try:
        yield
    finally:
        sys.stdout, sys.stderr = stdout, stderr
