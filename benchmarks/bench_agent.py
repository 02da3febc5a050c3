"""The agent loop's speed (issue 37 part 8): trajectories and model tokens per second through `AgentLoopStep` on
the lookup task, and what batching the turns of a step's trajectories into one engine call per round buys.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_agent.py [--part scale|batching|all] [--engines embedded,sglang]
        [--reps 5] [--baseline REV] [--json out.json]
    (with sglang: under `flock /tmp/topp_rl_sglang.lock`, it launches one CPU server)

Model: the training default (conf/model/tiny.yaml: qwen2, vocab 128, hidden 64, 2 layers, seed 0, the char
tokenizer). Workloads (the lookup environment, 2 model turns, top_p 0.9, one prompt per trajectory):
- `lookup`: task=lookup as configured (1 token per model turn, sync environment methods: worker threads);
- `lookup-32`: 32 tokens per model turn (no stop id: every turn has all 32), so decoding has work to batch;
- `lookup-async`: `lookup` with the same episodes behind `async def` methods (no worker threads).
Parts:
- scale: 1, 8 and 32 concurrent trajectories (one step of that many), per engine (the embedded engine, then a
  real SGLang server on CPU, up only for its rows: the loop's concurrent requests); trajectories/s, model
  tokens/s, and the share of the step's time spent inside `engine.generate` (the rest is the loop's);
- batching: 16 trajectories as one step (each round one engine call for all of them) against the same 16 one at
  a time (16 steps of one), on the embedded engine; the median ratio of their times per rep (the arms' order
  rotating) and the ratio of each arm's best rep;
  the same ratio of the time spent inside the engine alone (what the engine's batching allows); `--baseline REV`
  adds the agent loop as it was at git revision REV (its step, trajectory and environment modules), interleaved;
- profile: lookup at 16 trajectories, the time inside the engine and inside the loop's per-turn bookkeeping
  (`Trajectory.add_model_turn`, `Sample.append_response_tokens` and its argument checks) per model turn.
Every figure: `--reps` repeats, the median (the spread is in the JSON); the load average before and after.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

from topp_rl.data import SamplingParams
from topp_rl.engines.base import RolloutEngine
from topp_rl.engines.embedded import EmbeddedEngine
from topp_rl.models import build_tiny
from topp_rl.rollout.agent_step import AgentLoopStep
from topp_rl.tasks.lookup import LookupEnvironment, LookupTask

ROOT = Path(__file__).resolve().parents[1]
CONCURRENCY = (1, 8, 32)
BATCHED = 16


class AsyncLookup:
    """The lookup environment with `async def` methods: run on the loop's event loop, not on worker threads."""

    async def start(self, record):
        return AsyncLookupEpisode(LookupEnvironment().start(record))


class AsyncLookupEpisode:
    def __init__(self, episode) -> None:
        self.episode = episode

    async def respond(self, turn):
        return self.episode.respond(turn)

    async def reward(self):
        return self.episode.reward()


def _step(environment) -> AgentLoopStep:
    return AgentLoopStep(environment=environment, max_turns=2, max_trajectory_tokens=128)


STEP = _step(LookupEnvironment())
# name -> (tokens per model turn, environment): task=lookup's (sync methods, on worker threads), with 32-token
# turns, and the same episodes as `async def` (no threads)
WORKLOADS = {"lookup": (1, LookupEnvironment), "lookup-32": (32, LookupEnvironment),
             "lookup-async": (1, AsyncLookup)}


def _records(task: LookupTask, tok, count: int, first: int = 0) -> list:
    return [task.prompt(first + i, tok) for i in range(count)]


class Timed(RolloutEngine):
    """The engine, with the time spent inside its `generate` calls summed (the rest of a step is the loop's)."""

    def __init__(self, inner: RolloutEngine) -> None:
        self.inner, self.seconds, self.calls = inner, 0.0, 0
        self.vocab_size, self.records_routes = inner.vocab_size, False
        self.shares_trainer_weights, self.shared_by_ranks, self.max_candidates = False, False, inner.max_candidates

    def generate(self, prompts, params, *, seed=None):
        start = time.perf_counter()
        try:
            return self.inner.generate(prompts, params, seed=seed)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1

    def update_weights(self, named_tensors) -> None: ...

    def close(self) -> None: ...


def loop_at(rev: str) -> type:
    """`AgentLoopStep` as it was at git revision `rev`: its module, the trajectory's and the environment's loaded
    from `git show`, each one's imports of the others redirected to the `rev` copies."""
    modules: dict[str, types.ModuleType] = {}
    for name in ("topp_rl.tasks.environment", "topp_rl.rollout.trajectory", "topp_rl.rollout.agent_step"):
        path = name.replace(".", "/") + ".py"
        source = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout
        for dep, module in modules.items():
            source = source.replace(f"from {dep} import", f"from {module.__name__} import")
        module = types.ModuleType(f"_at_{rev}_{name.rsplit('.', 1)[1]}")
        sys.modules[module.__name__] = module  # dataclasses look their module up
        exec(compile(source, f"{rev}:{path}", "exec"), module.__dict__)
        modules[name] = module
    return modules["topp_rl.rollout.agent_step"].AgentLoopStep


def _timed_step(engine: Timed, records, params, tok, seed: int, step: AgentLoopStep = STEP) -> dict:
    """One agent-loop step over `records` (one trajectory each): seconds, engine seconds, calls, model tokens."""
    engine.seconds, engine.calls = 0.0, 0
    start = time.perf_counter()
    samples = step.generate(engine, records, params, seed=seed, tokenizer=tok)
    seconds = time.perf_counter() - start
    failed = [s.metadata["env_error"] for s in samples if "env_error" in s.metadata]
    if failed:
        raise RuntimeError(f"{len(failed)} trajectories failed ({failed[0]}): the figures would not mean a step")
    return {"seconds": seconds, "engine_seconds": engine.seconds, "engine_calls": engine.calls,
            "model_tokens": sum(sum(s.loss_mask) for s in samples)}


def _params(turn_tokens: int) -> SamplingParams:
    return SamplingParams(top_p=0.9, max_new_tokens=turn_tokens, n=1)


def scale(engines: dict, task, tok, *, reps: int) -> list[dict]:
    """Per workload, number of trajectories and engine: one step of that many, `reps` times (engines alternate)."""
    rows = []
    for workload, (turn_tokens, env) in WORKLOADS.items():
        step = _step(env())
        for concurrency in CONCURRENCY:
            records = _records(task, tok, concurrency)
            runs: dict[str, list[dict]] = {name: [] for name in engines}
            for engine in engines.values():
                _timed_step(engine, records, _params(turn_tokens), tok, seed=0, step=step)  # warm-up
            for rep in range(reps):
                for name, engine in list(engines.items())[:: 1 if rep % 2 == 0 else -1]:
                    runs[name].append(_timed_step(engine, records, _params(turn_tokens), tok, seed=1 + rep,
                                                  step=step))
            for name, measured in runs.items():
                med = statistics.median(r["seconds"] for r in measured)
                tokens = statistics.median(r["model_tokens"] for r in measured)
                engine_share = statistics.median(r["engine_seconds"] / r["seconds"] for r in measured)
                rows.append({"workload": workload, "engine": name, "trajectories": concurrency, "seconds": med,
                             "trajectories_per_s": concurrency / med, "model_tokens_per_s": tokens / med,
                             "model_tokens": tokens, "engine_share": engine_share,
                             "engine_calls": measured[0]["engine_calls"],
                             "all_seconds": [r["seconds"] for r in measured]})
                print(f"scale {workload:<9} {name:<8} {concurrency:>2} trajectories: {med * 1e3:8.1f} ms/step, "
                      f"{concurrency / med:7.1f} trajectories/s, {tokens / med:8.1f} model tokens/s, "
                      f"{100 * engine_share:3.0f}% in the engine")
    return rows


def batching(engine: Timed, task, tok, *, reps: int, baseline: str | None) -> list[dict]:
    """16 trajectories: one step (turns batched per round) vs 16 steps of one, paired per rep; the engine's own
    time in each arm says how much of the ratio the engine's batching allows at all. With `baseline`, the loop at
    that git revision runs the same two arms, interleaved with this tree's."""
    rows = []
    records = _records(task, tok, BATCHED)
    base = loop_at(baseline) if baseline is not None else None
    for workload, (turn_tokens, env) in WORKLOADS.items():
        params = _params(turn_tokens)
        loops = {"": _step(env())}
        if base is not None:
            loops[f"{baseline}:"] = base(environment=env(), max_turns=2, max_trajectory_tokens=128)
        arms = {}
        for label, step in loops.items():
            arms[f"{label}batched"] = lambda rep, st=step, p=params: [_timed_step(engine, records, p, tok, rep, st)]
            arms[f"{label}one_at_a_time"] = lambda rep, st=step, p=params: [
                _timed_step(engine, [r], p, tok, rep, st) for r in records]
        for arm in arms.values():  # warm-up
            arm(0)
        times: dict[str, list[float]] = {name: [] for name in arms}
        engine_times: dict[str, list[float]] = {name: [] for name in arms}
        order = list(arms)
        for rep in range(reps):  # rotate which arm runs first
            for name in order[rep % len(order):] + order[: rep % len(order)]:
                steps = arms[name](rep + 1)
                times[name].append(sum(s["seconds"] for s in steps))
                engine_times[name].append(sum(s["engine_seconds"] for s in steps))
        for label in loops:
            ratios = [o / b for b, o in zip(times[f"{label}batched"], times[f"{label}one_at_a_time"], strict=True)]
            engine_ratios = [o / b for b, o in zip(engine_times[f"{label}batched"],
                                                   engine_times[f"{label}one_at_a_time"], strict=True)]
            # On this shared machine one rep can take a scheduling hiccup of tens of ms: the ratio of the best
            # reps of each arm is reported beside the median of paired ratios (as bench_sglang_scale.py does).
            best = {arm: min(times[f"{label}{arm}"]) for arm in ("batched", "one_at_a_time")}
            row = {"loop": label.rstrip(":") or "this tree", "workload": workload, "trajectories": BATCHED,
                   "batched_s": statistics.median(times[f"{label}batched"]),
                   "one_at_a_time_s": statistics.median(times[f"{label}one_at_a_time"]),
                   "speedup": statistics.median(ratios), "best_speedup": best["one_at_a_time"] / best["batched"],
                   "engine_only_speedup": statistics.median(engine_ratios),
                   "speedups": ratios, "times": {k: v for k, v in times.items() if k.startswith(label)}}
            rows.append(row)
            print(f"batching {row['loop']:<9} {workload:<9} {BATCHED} trajectories: batched "
                  f"{row['batched_s'] * 1e3:.1f} ms, one at a time {row['one_at_a_time_s'] * 1e3:.1f} ms: "
                  f"{row['speedup']:.2f}x (reps {min(ratios):.2f}-{max(ratios):.2f}x, best reps "
                  f"{row['best_speedup']:.2f}x); engine calls alone {row['engine_only_speedup']:.2f}x")
    return rows


def where_the_time_goes(engine: Timed, task, tok, *, steps: int) -> dict:
    """lookup, 16 trajectories: per step, the time inside `engine.generate` and inside the loop's per-turn
    bookkeeping (timers around those methods, put back afterwards)."""
    import topp_rl.rollout.trajectory as trajectory
    from topp_rl.data.sample import Sample

    spent: dict[str, float] = {}
    methods = [(trajectory.Trajectory, "add_model_turn"), (trajectory.Trajectory, "add_env_output"),
               (Sample, "append_response_tokens"), (Sample, "_check_trainable_args")]
    originals = [(cls, name, getattr(cls, name)) for cls, name in methods]

    def timer(name, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
        return timed

    records, params = _records(task, tok, BATCHED), _params(1)
    _timed_step(engine, records, params, tok, seed=0)  # warm-up
    try:
        for cls, name, fn in originals:
            setattr(cls, name, timer(f"{cls.__name__}.{name}", fn))
        runs = [_timed_step(engine, records, params, tok, seed=1 + i) for i in range(steps)]
    finally:
        for cls, name, fn in originals:
            setattr(cls, name, fn)
    turns = sum(r["model_tokens"] for r in runs)  # one token per model turn
    row = {"workload": "lookup", "trajectories": BATCHED, "steps": steps,
           "step_ms": 1e3 * sum(r["seconds"] for r in runs) / steps,
           "engine_ms": 1e3 * sum(r["engine_seconds"] for r in runs) / steps,
           "model_turns_per_step": turns / steps,
           "per_model_turn_ms": {name: 1e3 * t / turns for name, t in spent.items()}}
    print(f"where the time goes (lookup, {BATCHED} trajectories, {steps} steps): {row['step_ms']:.1f} ms a step, "
          f"{row['engine_ms']:.1f} ms in the engine; per model turn: "
          + ", ".join(f"{k} {v:.3f} ms" for k, v in row["per_model_turn_ms"].items()))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["scale", "batching", "profile", "all"], default="all")
    ap.add_argument("--engines", default="embedded,sglang", help="for the scale part: embedded, sglang or both")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of this process (the embedded engine)")
    ap.add_argument("--batching-reps", type=int, help="repeats of the batching part (default: --reps)")
    ap.add_argument("--baseline", help="git revision whose agent loop the batching part also times (A/B)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = build_tiny(family="qwen2", vocab_size=128, hidden=64, layers=2, heads=4, kv_heads=2, seed=0)
    task = LookupTask(seed=0)
    out: dict = {"args": vars(args) | {"json": str(args.json)}, "load_average_before": os.getloadavg(),
                 "torch": torch.__version__, "cpus": os.cpu_count(), "machine": platform.processor(),
                 "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    embedded = Timed(EmbeddedEngine(model, eos_token_id=[], pad_token_id=tok.pad_token_id, progress=False))  # no stop
    names = args.engines.split(",")
    if args.part in ("scale", "all"):  # one engine at a time: a running server's process would load the others
        out["scale"] = scale({"embedded": embedded}, task, tok, reps=args.reps) if "embedded" in names else []
        if "sglang" in names:
            with tempfile.TemporaryDirectory() as tmp, _sglang(model, tok, Path(tmp)) as server:
                out["scale"] += scale({"sglang": Timed(server)}, task, tok, reps=args.reps)
    if args.part in ("profile", "all"):
        out["profile"] = where_the_time_goes(embedded, task, tok, steps=10 * args.reps)
    if args.part in ("batching", "all"):
        out["batching"] = batching(embedded, task, tok, reps=args.batching_reps or args.reps,
                                   baseline=args.baseline)
    out["load_average_after"] = os.getloadavg()
    print(f"load average before {out['load_average_before']}, after {out['load_average_after']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


def _sglang(model, tok, tmp: Path):
    """A launched SGLang server (CPU) on the same weights, sampling past stop ids."""
    from topp_rl.engines.sglang import SGLangEngine
    from topp_rl.models import save_model

    path = save_model(model, tok, tmp / "tiny")
    return SGLangEngine(model_path=path, progress=False, extra_sampling_params={"ignore_eos": True})


if __name__ == "__main__":
    sys.exit(main())
