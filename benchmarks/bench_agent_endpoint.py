"""The endpoint's own cost: the same two-turn lookup workload through direct engine calls and through the
OpenAI-compatible endpoint (`rollout/step=endpoint`: HTTP, chat templating, the openai SDK, the batcher), seconds per
rollout step side by side.

    .venv/bin/python benchmarks/bench_agent_endpoint.py [--prompts 16] [--n 8] [--tokens 1 32] [--repeats 5]
        [--json out.json]

Workload: records of data/agent_lookup.jsonl ("?c"), `--prompts` x `--n` trajectories, the tiny model, the
embedded engine, top_p 0.9, `--tokens` new tokens per turn (each value a run of its own). Turn 1 answers the
chat-templated user turn; the tool says "=<value>"; turn 2 answers the extended ids.
- direct: two `engine.generate` calls per step on exact ids (turn 2's prompt = turn 1's prompt + its completion
  + the tool's turn, tokenised once), no HTTP: the agent loop's way. Each call runs on a worker thread, as the
  endpoint's batcher runs it (on this loaded 2-core box the embedded engine ran up to 10x slower on the main
  thread than on a fresh one, which would credit the endpoint with a speed-up it does not own).
- endpoint: `EndpointStep.generate` with the shipped agent (topp_rl.tasks.agents.lookup:lookup_agent, two
  `client.chat.completions.create` calls); the batcher also makes two engine calls per step.
The arms alternate (direct, endpoint, direct, ...), one warm-up step each first; medians over `--repeats`.
Endpoint overhead = (endpoint - direct) / endpoint: the share of the rollout's time that is the endpoint's own.
"""

import argparse
import dataclasses
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from topp_rl.data import SamplingParams
from topp_rl.engines.embedded import EmbeddedEngine
from topp_rl.models import build_char_tokenizer, build_tiny_model
from topp_rl.rollout.endpoint.batcher import round_seed
from topp_rl.rollout.endpoint.step import EndpointStep
from topp_rl.rollout.endpoint.wire import chat_prompt_ids
from topp_rl.tasks.agent_task import AgentTask

AGENT = "topp_rl.tasks.agents.lookup:lookup_agent"


def direct(engine, records, params, tok, *, seed: int) -> int:
    """The workload on exact ids; returns the tokens generated."""
    with ThreadPoolExecutor(1) as pool:  # a fresh worker thread per step, like the batcher's asyncio.to_thread
        return pool.submit(_direct, engine, records, params, tok, seed=seed).result()


def _direct(engine, records, params, tok, *, seed: int) -> int:
    turn = dataclasses.replace(params, n=1)
    first = [chat_prompt_ids({"messages": [{"role": "user", "content": r.text}]}, tok)
             for r in records for _ in range(params.n)]
    outs = engine.generate(first, turn, seed=round_seed(seed, 0))
    second = []
    for i, (ids, out) in enumerate(zip(first, outs, strict=True)):
        record = records[i // params.n]
        call = tok.decode(out.response_ids, skip_special_tokens=True)[:1]
        shown = record.data["table"].get(call) or "?"
        second.append(ids + out.response_ids + list(tok.encode(f"<eos>u:={shown}<eos>a:", add_special_tokens=False)))
    outs2 = engine.generate(second, turn, seed=round_seed(seed, 1))
    return sum(o.response_length for o in outs + outs2)


def endpoint(step, engine, records, params, tok, *, seed: int) -> int:
    samples = step.generate(engine, records, params, seed=seed, tokenizer=tok)
    return sum(sum(s.loss_mask) for s in samples)


def run(tokens: int, args) -> dict:
    tok = build_char_tokenizer()
    engine = EmbeddedEngine(build_tiny_model(tokenizer=tok, seed=0), progress=False)
    task = AgentTask(agent=AGENT, path="data/agent_lookup.jsonl")
    records = [task.prompt(i, tok) for i in range(args.prompts)]
    params = SamplingParams(top_p=0.9, max_new_tokens=tokens, n=args.n)
    step = EndpointStep(agent=AGENT, max_turns=2, max_trajectory_tokens=4 * tokens + 16)
    arms = {"direct": lambda s: direct(engine, records, params, tok, seed=s),
            "endpoint": lambda s: endpoint(step, engine, records, params, tok, seed=s)}
    times: dict[str, list[float]] = {a: [] for a in arms}
    generated: dict[str, list[int]] = {a: [] for a in arms}
    for r in range(args.repeats + 1):
        for arm, fn in arms.items():
            start = time.perf_counter()
            count = fn(r)
            if r:  # r == 0: warm-up
                times[arm].append(time.perf_counter() - start)
                generated[arm].append(count)
    med = {a: statistics.median(t) for a, t in times.items()}
    return {"tokens_per_turn": tokens, "median_s": med, "times_s": times, "model_tokens": generated,
            "overhead": (med["endpoint"] - med["direct"]) / med["endpoint"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    print(f"{args.prompts} prompts x n={args.n} trajectories, 2 turns, repeats={args.repeats}, "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(f"{'tokens/turn':>12}{'direct s':>10}{'endpoint s':>12}{'overhead':>10}")
    results = []
    for tokens in args.tokens:
        res = run(tokens, args)
        results.append(res)
        m = res["median_s"]
        print(f"{tokens:>12}{m['direct']:>10.3f}{m['endpoint']:>12.3f}{res['overhead']:>10.1%}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results},
                                        indent=1))


if __name__ == "__main__":
    main()
