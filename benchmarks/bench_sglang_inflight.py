"""Partial rollouts on a real SGLang CPU server: what each pause mode of `update_weights_in_flight` does to the
behaviour log-probs (docs/sglang.md, "Weight updates with requests in flight").

    PYTHONPATH=.:tests .venv/bin/python benchmarks/bench_sglang_inflight.py [--json out.json]

Per pause mode (retract on a server with its prefix cache, in_place on one launched without it, as the engine
does), per weight change (every tensor moved by `scale` x its std, chained: each update starts from the last):
4 requests of 96 tokens (2 prompts x 2, ignore_eos) with the update pushed once all are decoding, then 4 short
requests on the same prompts. Reported: the median switch position, the update's wall time (pause to resume), and
|recorded - dense fp32| of the log-probs (`topp_rl.ops.token_logprobs` over the recorded kept set, HF on prompt +
response under the weights of each token's version): max over the tokens before the switch, mean / max after it,
and max over the later requests. One server at a time, stopped on exit.
"""

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from sglang_checks import (
    PROMPTS,
    by_version,
    deviation,
    generate_across_update,
    hf_logits,
    perturbed,
    tiny_model,
)

from topp_rl.engines.sglang import SGLangEngine
from topp_rl.models import save_model
from topp_rl.rollout import SamplingParams

PARAMS = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=96, n=2)
LATER = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=16, n=2)
SCALES = (0.1, 0.01, 0.001)


def measure(engine: SGLangEngine, old, new, *, version: int) -> dict[str, float]:
    samples = generate_across_update(engine, PROMPTS[:2], PARAMS, new, version=version)
    before, after, switches = [], [], []
    for s in samples:
        at = s.token_versions().index(version)
        dev = deviation(s, by_version(old, new, at)(s), temperature=PARAMS.temperature)
        before.append(dev[:at])
        after.append(dev[at:])
        switches.append(at)
    later = [deviation(s, hf_logits(new, s), temperature=LATER.temperature) for s in engine.generate(PROMPTS[:2], LATER)]
    return {"switch_at": statistics.median(switches), "update_s": engine.last_sync.seconds,
            "before_max": float(torch.cat(before).max()), "after_mean": float(torch.cat(after).mean()),
            "after_max": float(torch.cat(after).max()), "later_max": float(torch.cat(later).max())}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    model, rows = tiny_model(), []
    with tempfile.TemporaryDirectory() as tmp:
        path = save_model(model, None, Path(tmp) / "model")
        for mode in ("retract", "in_place"):
            with SGLangEngine(model_path=path, pause_mode=mode, progress=False, workdir=tmp,
                              server_kwargs={"max_total_tokens": 16384},
                              extra_sampling_params={"ignore_eos": True}) as engine:  # fmt: skip
                old = model
                engine.update_weights(old.named_parameters())  # the launch weights, pushed: a fresh prefix cache
                engine.start_version(0)  # after a synchronous push: its tag (the sync count) becomes version 0
                for version, scale in enumerate(SCALES, start=1):
                    new = perturbed(old, seed=version, scale=scale)
                    rows.append({"mode": mode, "scale": scale, **measure(engine, old, new, version=version)})
                    print(json.dumps(rows[-1]), flush=True)
                    old = new
    print("| pause_mode | weight change | switch at | update s | before: max | after: mean | after: max | later: max |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['scale']} std | {r['switch_at']:.0f} | {r['update_s']:.3f} | {r['before_max']:.1e} "
              f"| {r['after_mean']:.1e} | {r['after_max']:.1e} | {r['later_max']:.1e} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
