"""Stopping a run on SIGTERM / SIGINT: every rank stops after the same step, one consistent checkpoint is saved
(by `LastCheckpoint`), and no rank waits forever.

Lightning 2.6's SIGTERM handler broadcasts from rank 0 inside the handler. A Python signal handler runs between
two bytecodes of whatever the main thread was doing, so on two ranks that broadcast lands at different points
of the step's collectives (an FSDP all-gather on one rank, a barrier on the other) and gloo waits forever (seen:
both ranks of a `parallel=fsdp` run blocked in `broadcast` under `_sigterm_notifier_fn`). `StopOnSignal`
replaces it for the run:
- the handler only records the signal (a second Ctrl-C during the step still exits at once, unsaved; once the
  step ended and the stop's save began, it waits for the save: cutting a save keeps nothing new, and a rank leaving
  a collective save mid-way leaves its peers waiting);
- at every step boundary the ranks all-reduce (max) the signal each received, so a signal to any rank (rank 0
  alone: `kill PID`, `timeout`; the whole group: Ctrl-C, a SLURM time limit, a preemption) stops all of them
  after the same step; Lightning's own check at the end of that step then raises `SIGTERMException` on every
  rank, where `LastCheckpoint` saves and `exit_status_on_signal` turns it into exit status 128 + signal;
- a watchdog bounds the stop: a rank that has not finished stopping `timeout_s` after its signal (or after the
  agreement, on a rank that received none) has a peer that is hung, dead or in a very long step; it says so and
  exits 128 + signal without a new checkpoint. Every checkpoint write is atomic (a file renamed into place, a
  sharded dir published by switching a symlink), so `last.ckpt` still names the last complete checkpoint.

The watchdog is armed from a thread woken through `signal.set_wakeup_fd`, not from the Python handler: the
handler runs only when the main thread returns to the interpreter, which a rank blocked in a collective with a
hung peer never does.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

from topp_rl.run.checkpoint import LastCheckpoint, RunInterrupted
from topp_rl.run.rundir import read_record
from topp_rl.run.sweep import run_dir_override

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopOnSignal(Callback):
    """Agree across ranks on the step to stop after when any rank gets SIGTERM or SIGINT (see module docstring).

    `signum`: the signal the ranks agreed to stop on (None while none came). `timeout_s`: how long a rank may take
    from its signal (or the agreement) to the end of `Trainer.fit` before the watchdog exits it.
    """

    def __init__(self, *, run_dir: str | Path, timeout_s: float = 600.0) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
            raise ValueError(f"checkpoint.stop_timeout_s ({timeout_s!r}) must be a number of seconds > 0: how long "
                             "a rank may take to finish its step and save after a SIGTERM / Ctrl-C; e.g. 600")
        self.run_dir = Path(run_dir)
        self.timeout_s = float(timeout_s)
        self.received: int | None = None  # the first stop signal this rank got
        self.signum: int | None = None  # the one the ranks agreed on
        self._rank = 0
        self._saver: LastCheckpoint | None = None  # the run's checkpoint writer: is a save being written?
        self._told_saving = False
        self._previous_handlers: dict[int, Any] = {}
        self._previous_wakeup_fd: int | None = None
        self._wakeup_write: int | None = None
        self._watchdog: threading.Timer | None = None
        self._lock = threading.Lock()

    # ---- handlers: installed for the training loop, replacing Lightning's (registered just before) -------------
    def on_train_start(self, trainer, pl_module) -> None:
        self._rank = trainer.global_rank
        self._saver = _callback(trainer, LastCheckpoint)
        if threading.current_thread() is threading.main_thread():  # signal handlers can be set there only
            self._install()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.close()

    def close(self) -> None:
        """Disarm the watchdog and give the process its signal handling back; idempotent. Kept through the save
        on a stop (a second SIGTERM then changes nothing). Lightning's teardown has by then put back the handlers
        it found before `fit`: ours are restored only where they are still installed."""
        self.disarm()
        if self._wakeup_write is None:
            return
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        os.close(self._wakeup_write)  # the watcher thread reads end-of-file and exits
        self._wakeup_write = None
        for signum, handler in self._previous_handlers.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, handler)
        self._previous_handlers = {}

    def _install(self) -> None:
        for signum in STOP_SIGNALS:
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
        read_fd, self._wakeup_write = os.pipe()
        os.set_blocking(self._wakeup_write, False)
        self._previous_wakeup_fd = signal.set_wakeup_fd(self._wakeup_write, warn_on_full_buffer=False)
        threading.Thread(target=self._watch_wakeups, args=(read_fd,), name="topp_rl-stop-signals",
                         daemon=True).start()

    def _on_signal(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signum
            unsaved = " (Ctrl-C again to exit now, unsaved)" if signum == signal.SIGINT else ""
            print(f"\n[topp_rl]{self._rank_tag()} {_name(signum)}: saving a checkpoint after the current "
                  f"step{unsaved}", flush=True)
        elif signum == signal.SIGINT and self.received == signal.SIGINT:
            if self._stop_is_saving():
                self._say_saving()
                return
            raise KeyboardInterrupt("second Ctrl-C: exiting now, without a checkpoint of the current step")

    def _stop_is_saving(self) -> bool:
        """The step is over and the stop's save under way (agreed on, or the periodic save of the stop's step)."""
        return self.signum is not None or (self._saver is not None and self._saver.saving)

    def _say_saving(self) -> None:
        if not self._told_saving:
            self._told_saving = True
            print(f"\n[topp_rl]{self._rank_tag()} Ctrl-C again during the stop: finishing the checkpoint save first "
                  f"(a cut save keeps nothing new; checkpoint.stop_timeout_s={self.timeout_s:g} bounds it, and kill "
                  f"-9 {os.getpid()} abandons it, last.ckpt still naming the last complete checkpoint)", flush=True)

    def _watch_wakeups(self, read_fd: int) -> None:
        """The wakeup fd gets one byte per signal, written by the C-level handler even while the main thread is
        blocked: arm the watchdog from here."""
        with os.fdopen(read_fd, "rb", buffering=0) as wakeups:
            while chunk := wakeups.read(64):
                for signum in chunk:
                    if signum in STOP_SIGNALS:
                        self._arm_watchdog(signum)

    # ---- the agreement, once per step ------------------------------------------------------------------------
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        agreed = self._agree(trainer)
        if agreed and self.signum is None:
            self.signum = agreed
            self._arm_watchdog(agreed)
            # Lightning's own flag (what its handler sets): its check at the end of this step raises
            # SIGTERMException on every rank, after the step's bookkeeping, where the loops' state is complete.
            trainer._signal_connector.received_sigterm = True

    def _agree(self, trainer) -> int:
        """The largest signal number any rank received (0: none); every rank calls it at the same point."""
        received = self.received or 0
        if trainer.world_size == 1 or not dist.is_initialized():
            return received
        # On the strategy's device: NCCL reduces CUDA tensors only; gloo CPU ones. The gradient plays no part.
        flag = torch.tensor([received], dtype=torch.int32, device=trainer.strategy.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    # ---- the watchdog --------------------------------------------------------------------------------------------
    def _arm_watchdog(self, signum: int) -> None:
        with self._lock:
            if self._watchdog is None:
                self._watchdog = threading.Timer(self.timeout_s, self._give_up, args=(signum,))
                self._watchdog.daemon = True
                self._watchdog.start()

    def disarm(self) -> None:
        """The stop finished (or the run ended otherwise): no exit from the watchdog any more."""
        with self._lock:
            if self._watchdog is not None:
                self._watchdog.cancel()
                self._watchdog = None

    def _give_up(self, signum: int) -> None:
        last = self.run_dir / "checkpoints" / "last.ckpt"
        several = dist.is_initialized() and dist.get_world_size() > 1
        why = ("another rank is hung, dead or still in a long step" if several else "the run is still in a long step "
               "(an environment's or agent's call ends within rollout.step.env_timeout_s / agent_timeout_s)")
        print(f"[topp_rl]{self._rank_tag()} {_name(signum)} came and this rank has not finished stopping within "
              f"checkpoint.stop_timeout_s={self.timeout_s:g} s: {why}. "
              f"Exiting now (status {128 + signum}) without a new checkpoint; {_last_checkpoint(last)}. Raise "
              "checkpoint.stop_timeout_s if a step and its save take longer than that.",
              file=sys.stderr, flush=True)
        os._exit(128 + signum)  # the main thread may be blocked in a collective: nothing else would end it

    def _rank_tag(self) -> str:
        return f" rank {self._rank}:" if dist.is_initialized() and dist.get_world_size() > 1 else ""


def _name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def _last_checkpoint(last: Path) -> str:
    """What a resume would find, for the watchdog's message."""
    if not last.exists():
        return f"there is no checkpoint to resume from ({last} does not exist)"
    try:
        step = read_record(last)[1]
    except Exception as err:  # the message must still go out
        return f"{last} could not be read ({type(err).__name__}: {err})"
    return (f"the last complete checkpoint, {last} (step {step}), is kept: resume with "
            f"{run_dir_override(last.parent.parent)} ckpt_path=last (the run's overrides come from its dir)")


def _callback(trainer, kind: type[Callback]) -> Any:
    return next((c for c in trainer.callbacks if isinstance(c, kind)), None)


@contextmanager
def exit_status_on_signal(trainer) -> Iterator[None]:
    """Turn Lightning's `SIGTERMException` (a SystemExit with status 0) into `RunInterrupted` (128 + signal), and
    close the run's `StopOnSignal` (its watchdog bounds everything up to here)."""
    stopper: StopOnSignal | None = _callback(trainer, StopOnSignal)
    try:
        yield
    except SIGTERMException:
        signum = stopper.signum if stopper is not None and stopper.signum else signal.SIGTERM
        saver: LastCheckpoint | None = _callback(trainer, LastCheckpoint)
        if saver is not None and saver.saved_step == trainer.global_step:
            err = saver.interrupted(trainer.global_step, signum)
        else:
            err = RunInterrupted(signum, f"[topp_rl] stopped by {signal.Signals(signum).name} after step "
                                         f"{trainer.global_step}; no checkpoint saved (exit status {128 + signum})")
        if trainer.is_global_zero:
            print(err.message, file=sys.stderr, flush=True)
        raise err from None
    finally:
        if stopper is not None:
            stopper.close()
