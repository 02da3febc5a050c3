"""Signal soak: SIGTERM / SIGINT / SIGKILL at random moments of distributed `train.py` runs, then a resume; reports
how each stop ended and whether the resume continued at the right step with the uninterrupted run's rollouts.

    .venv/bin/python benchmarks/soak_signals.py [--layouts fsdp tp2 ...] [--trials 10] [--seed 0]
        [--json docs/results/signals/soak.json]

Per layout: one uninterrupted reference run, then `--trials` trials. Trial i sends kind i mod 5 (SIGTERM to
rank 0, SIGTERM to the group, SIGINT to the group, SIGINT to rank 0, SIGKILL to the group) at a moment drawn
uniformly from the `--window` seconds after every rank finished its first step (SIGKILL: after the first
periodic checkpoint, step 5, since it saves nothing itself). A run checkpoints every 5 steps. Then it resumes (`ckpt_path=last`) for 2 more steps. Per trial it records:
- `status`: the exit status (128 + signal expected; SIGKILL: -9) and `stop_s`, signal to exit;
- `same_step`: every rank's last trained step is the checkpoint's (signals only: all ranks stopped after it);
- `right_step`: the resume trained exactly the 2 steps after the checkpoint's, on every rank;
- `same_rollouts`: those steps' responses equal the reference run's on every rank;
- `ranks_gone_s`: from rank 0's exit until no process of the run's session is left; `leftover`: one was still
  there after 60 s (then killed).
`sglang_tp2` starts a real SGLang server per run start (TOPP_RL_SGLANG_PYTHON, scripts/setup_sglang.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "fsdp": ["parallel=fsdp", "trainer.devices=2"],
    "tp2": ["parallel=tp2"],
    "cp2": ["parallel=cp2"],
    "ep2": ["parallel=ep2", "model.family=qwen3_moe"],
    "dist_opt": ["parallel=tp2", "trainer.devices=4", "parallel.distributed_optimizer=true"],
    "sglang_tp2": ["parallel=tp2", "rollout=sglang"],
}
KINDS = [("SIGTERM", "rank0"), ("SIGTERM", "group"), ("SIGINT", "group"), ("SIGINT", "rank0"), ("SIGKILL", "group")]
RUN = ["rollout.prompts_per_step=2", "rollout.n_samples=2", "rollout.max_new_tokens=4", "rollout.top_p=0.9",
       "trainer.enable_progress_bar=false", "num_threads=1", "logger=none", "checkpoint.every_n_steps=5"]
EXPORT_OFF = ["export.hf=false"]


class RolloutDump(Callback):
    """One JSON line per step and rank (loaded by the runs through PYTHONPATH=benchmarks)."""

    def __init__(self, *, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        line = {"global_step": trainer.global_step, "responses": [s.response_ids for s in outputs["rollout"].samples]}
        with rank_file(self.path, trainer.global_rank).open("a") as f:
            f.write(json.dumps(line) + "\n")


def rank_file(path: Path, rank: int) -> Path:
    return path if rank == 0 else path.with_name(f"{path.name}.rank{rank}")


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def world(layout: list[str]) -> int:
    devices = [o.split("=", 1)[1] for o in layout if o.startswith("trainer.devices=")]
    return int(devices[0]) if devices else 2


def start(out: Path, dump: Path, layout: list[str], *extra: str, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "train.py", f"hydra.run.dir={out}", *RUN, *EXPORT_OFF, *layout,
           "+callbacks.dump._target_=soak_signals.RolloutDump", f"+callbacks.dump.path={dump}", *extra]
    env = dict(os.environ, WANDB_MODE="offline", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT / "benchmarks"))
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log.open("w"),
                            start_new_session=True)


def session_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def end_session(proc: subprocess.Popen, timeout: float) -> tuple[int | None, float | None]:
    """(rank 0's exit status or None on timeout, seconds from its exit until the last process of its session was
    gone, None if one was still there after 60 s: a leftover, then killed)."""
    try:
        status = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        status = None
    exited, gone = time.monotonic(), None
    while status is not None and time.monotonic() < exited + 60:
        if not session_alive(proc.pid):
            gone = round(time.monotonic() - exited, 1)
            break
        time.sleep(0.1)
    if gone is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return status, gone


def checkpoint_step(out: Path) -> int | None:
    from topp_rl.run.rundir import read_record

    last = out / "checkpoints" / "last.ckpt"
    return read_record(last)[1] if last.exists() else None


def trial(tmp: Path, layout: list[str], kind: tuple[str, str], moment: float, reference: list[list[dict]],
          steps: int) -> dict:
    out, dump = tmp / "run", tmp / "run.jsonl"
    ranks = world(layout)
    proc = start(out, dump, layout, f"trainer.max_steps={steps}", log=tmp / "run.log")
    signum = signal.Signals[kind[0]]
    # SIGKILL saves nothing: it is sent once a periodic checkpoint exists, so that there is something to resume
    ready = ((lambda: (out / "checkpoints" / "last.ckpt").exists()) if signum == signal.SIGKILL
             else (lambda: all(rank_file(dump, r).exists() for r in range(ranks))))
    deadline = time.monotonic() + 600
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(moment)
    sent = time.monotonic()
    if proc.poll() is None:
        (os.killpg if kind[1] == "group" else os.kill)(proc.pid, signum)
    status, ranks_gone_s = end_session(proc, timeout=600)
    record = {"kind": f"{kind[0]} {kind[1]}", "moment_s": round(moment, 2), "status": status,
              "stop_s": round(time.monotonic() - sent - (ranks_gone_s or 0), 1), "ranks_gone_s": ranks_gone_s,
              "leftover": ranks_gone_s is None}
    saved = checkpoint_step(out)
    record["saved_step"] = saved
    killed = [len(read_lines(rank_file(dump, r))) for r in range(ranks)]
    if signum != signal.SIGKILL:
        record["same_step"] = all(read_lines(rank_file(dump, r))[-1]["global_step"] == saved for r in range(ranks))
    if saved is None:  # killed before the first checkpoint: a fresh start is the resume
        return record
    resumed = start(out, dump, layout, f"trainer.max_steps={saved + 2}", "ckpt_path=last", log=tmp / "resume.log")
    record["resume_status"], _ = end_session(resumed, timeout=600)
    after = [read_lines(rank_file(dump, r))[killed[r]:] for r in range(ranks)]
    record["right_step"] = all([x["global_step"] for x in a] == [saved + 1, saved + 2] for a in after)
    record["same_rollouts"] = record["right_step"] and all(
        x["responses"] == reference[r][x["global_step"] - 1]["responses"] for r, a in enumerate(after) for x in a)
    return record


def expected_status(kind: str) -> int:
    name = kind.split()[0]
    return -9 if name == "SIGKILL" else 128 + signal.Signals[name]


def summarize(name: str, trials: list[dict]) -> dict:
    signals = [t for t in trials if not t["kind"].startswith("SIGKILL")]
    resumed = [t for t in trials if "right_step" in t]
    return {
        "layout": name, "trials": len(trials),
        "status_as_expected": sum(t["status"] == expected_status(t["kind"]) for t in trials),
        "signal_stops_same_step": sum(bool(t.get("same_step")) for t in signals), "signal_stops": len(signals),
        "max_signal_stop_s": max((t["stop_s"] for t in signals), default=None),
        "max_ranks_gone_s": max((t["ranks_gone_s"] or 0 for t in trials), default=None),
        "resumes": len(resumed), "right_step": sum(t["right_step"] for t in resumed),
        "same_rollouts": sum(t["same_rollouts"] for t in resumed),
        "leftovers": sum(t["leftover"] for t in trials),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--steps", type=int, default=60, help="max_steps of each run (signalled before its end)")
    parser.add_argument("--window", type=float, default=3.0, help="seconds after the first step to draw from")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node(),
              "load_average_start": os.getloadavg(), "args": {k: str(v) for k, v in vars(args).items()},
              "layouts": {}}
    for name in args.layouts:
        layout = LAYOUTS[name]
        with tempfile.TemporaryDirectory(prefix=f"soak-{name}-") as tmp:
            ref_dir = Path(tmp) / "reference"
            ref_dir.mkdir()
            ref = start(ref_dir / "run", ref_dir / "run.jsonl", layout, f"trainer.max_steps={args.steps + 5}",
                        log=ref_dir / "run.log")
            if end_session(ref, timeout=1200)[0] != 0:
                raise SystemExit(f"{name}: the reference run failed; see a rerun's log")
            reference = [read_lines(rank_file(ref_dir / "run.jsonl", r)) for r in range(world(layout))]
            trials = []
            for i in range(args.trials):
                kind, moment = KINDS[i % len(KINDS)], rng.uniform(0, args.window)
                trial_dir = Path(tmp) / f"trial{i}"
                trial_dir.mkdir()
                record = trial(trial_dir, layout, kind, moment, reference, args.steps)
                trials.append(record)
                print(f"[{name} {i + 1}/{args.trials}] {json.dumps(record)}", flush=True)
        summary = summarize(name, trials)
        print(f"[{name}] {json.dumps(summary)}", flush=True)
        result["layouts"][name] = {"summary": summary, "trials": trials}
        result["load_average_end"] = os.getloadavg()
        if args.json:  # after every layout: a long soak keeps what it measured
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
