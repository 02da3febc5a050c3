"""rollout=vllm's config: it composes and validates (partial rollouts included); truncated sampling without a
bounded top_k and a top_k above max_candidates are refused at start naming the key and the way out (before the model
loads and the server starts); every numeric key it ships has a range."""

import pytest
from helpers import compose_config

from topp_rl.config import ENGINE_NUMBERS, validate_config


@pytest.mark.parametrize("overrides", [
    [], ["rollout.top_p=0.9", "rollout.top_k=20"], ["rollout.top_k=1"], ["rollout.min_p=0.1", "rollout.top_k=50"],
    ["rollout.temperature=0.7"], ["rollout.max_staleness=1", "rollout.partial_rollouts=true", "rollout.top_k=20"],
    ["rollout.engine.weight_sync=distributed"],
], ids=["default", "top_p_top_k", "greedy", "min_p_top_k", "untruncated", "partial_rollouts", "distributed"])
def test_vllm_configs_that_can_work_pass(overrides, tmp_path):
    validate_config(compose_config(tmp_path, "rollout=vllm", *overrides))


@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.top_p=0.9"], r"config rollout.top_k=0: must be in \[1, rollout.max_candidates=4096\] with rollout=vllm "
     r"and top_p=0.9.*set rollout.top_k \(e.g. rollout.top_k=20\), or use rollout=sglang"),
    (["rollout.min_p=0.1"], r"config rollout.top_k=0: must be in \[1, rollout.max_candidates=4096\]"),
    (["rollout.top_p=0.9", "rollout.top_k=64", "rollout.max_candidates=32"],
     r"config rollout.top_k=64: must be in \[1, rollout.max_candidates=32\]"),
    (["rollout.engine.kept_sets=native", "rollout.top_k=20"],
     r"kept_sets=native with a launched server: the launched servers are vLLM's CPU build"),
    (["rollout.engine.kept_sets=native", "rollout.engine.urls=[http://127.0.0.1:1]"],
     r"config rollout.top_k=0: must be in \[1, rollout.max_candidates=4096\] with rollout.engine.kept_sets=native"),
    (["rollout.engine.kept_sets=masks"], r"rollout.engine.kept_sets='masks': choose one of auto, native, logprobs"),
    (["rollout.engine.num_servers=0"], r"config rollout.engine.num_servers=0"),
    (["rollout.engine.weight_sync=tensor"], r"config rollout.engine.weight_sync='tensor': must be null or one of disk, "
     r"distributed with rollout=vllm"),
])
def test_what_vllm_cannot_do_is_refused_at_start(overrides, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        validate_config(compose_config(tmp_path, "rollout=vllm", *overrides))


def test_other_engines_keep_unbounded_top_p(tmp_path):
    validate_config(compose_config(tmp_path, "rollout=sglang", "rollout.top_p=0.9"))


def test_every_numeric_key_of_rollout_vllm_has_a_range(tmp_path):
    engine = compose_config(tmp_path, "rollout=vllm").rollout.engine
    numeric = ["rollout.engine.progress_interval_s"]  # max_candidates interpolates rollout.max_candidates (checked)
    numeric += [f"rollout.engine.timeouts.{k}" for k in engine.timeouts] + [f"rollout.engine.retries.{k}"
                                                                           for k in engine.retries]  # fmt: skip
    assert len(numeric) == 10 and not set(numeric) - set(ENGINE_NUMBERS)
