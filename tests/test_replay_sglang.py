"""Record and replay with a real SGLang server (on CPU it ignores seeds: its rollouts cannot be reproduced from a
seed, only from a recording). A run recorded on the server and its replay with no engine train bit for bit alike:
the same metrics and the same final weights."""

import pytest
import torch
from helpers import compose_cfg, metric_columns
from safetensors.torch import load_file
from sglang_checks import require_sglang

from topp_rl.rollout.record import read_step
from topp_rl.train import train

pytestmark = [pytest.mark.sglang, pytest.mark.slow]
require_sglang(module=True)

# The entropy bonus gives every step a gradient: on CPU, whether SGLang's unseeded rollouts draw a reward is chance.
RUN = ["trainer.max_steps=3", "rollout.prompts_per_step=4", "rollout.n_samples=4", "logger=csv", "algo.entropy_coeff=0.01"]


def test_a_recorded_sglang_run_replays_exactly(tmp_path, tiny_sglang_url):
    recording, replay = tmp_path / "record", tmp_path / "replay"
    train(compose_cfg(recording, *RUN, "rollout=sglang", f"rollout.engine.urls=['{tiny_sglang_url}']",
                      "rollout.record=true"))
    train(compose_cfg(replay, *RUN, "rollout=replay", f"rollout.path={recording / 'rollouts'}"))

    recorded, replayed = metric_columns(recording), metric_columns(replay)
    exact = {k: v for k, v in recorded.items() if not k.startswith("perf/")}  # perf/*: timings
    assert {k: replayed.get(k) for k in exact} == exact
    assert len(exact["train/loss"]) == 3 and all(v > 0 for v in exact["train/grad_norm"])
    weights, again = (load_file(str(d / "hf" / "model.safetensors")) for d in (recording, replay))
    assert weights.keys() == again.keys() and all(torch.equal(weights[k], again[k]) for k in weights)
    own = read_step(recording / "rollouts" / "step_000000.dp0.safetensors")
    assert len(own) == 16 and all(s.candidates is not None for s in own)  # SGLang's kept sets, recorded
