"""Partial rollouts on real SGLang 0.5.23 CPU servers: `SGLangEngine.update_weights_in_flight` with requests in
flight, which are neither aborted nor waited for and continue under the new weights, every token recording the
version that sampled it (SGLang's `weight_versions` spans).

The requests are held in flight by the servers' own pause, not by a race against their decoding
(`sglang_checks.generate_across_update`): the servers are paused in place before the requests are sent (they queue),
then resumed and paused again right after, until every server has logged the prefill of every request; each response
then has at least its first token from the old weights, and the update runs on the paused servers. A stall of this
process between a resume and its pause can still let a request finish: such a round puts the old weights back and
runs again, at most 3 rounds (`helpers.in_flight_rounds`). Measured: the first round lands, 1-6 tokens in, on a
quiet machine and with two or three busy processes beside the test on 2 cores. The reference is HF transformers in
float32 on prompt + response, each token under the weights of its recorded version, with `topp_rl.ops` over the
recorded kept set, within float32's bounds for 200-token responses (`helpers.fp32_bars`: per token, and on the
mean after the switch; a fixed 1e-4 is not a bound there):
- pause_mode="retract" (the default; two servers behind the router, distributed sync): every token is exact under
  its own version, the ones after the switch included (their KV is recomputed), and so are later requests sharing
  the prompt (the update flushed the prefix cache);
- pause_mode="in_place" (one server, launched without the prefix cache, disk sync): the tokens before the switch
  are exact, those after it are not (they attend to KV of the old weights: the recorded log-prob is that of the
  distribution that sampled them, not of the new weights alone), later requests are exact; a connected server
  with a prefix cache is refused.
"""

from pathlib import Path

import pytest
import requests
import torch
from helpers import fp32_bars, in_flight_rounds, version_switch
from sglang_checks import (
    PROMPTS,
    TOL,
    by_version,
    check_candidates,
    deviation,
    generate_across_update,
    perturbed,
    require_sglang,
    tiny_model,
)

from topp_rl.models import save_model
from topp_rl.rollout import SamplingParams

pytestmark = pytest.mark.sglang
require_sglang(module=True)

from topp_rl.engines.sglang import SGLangEngine  # noqa: E402

PROMPTS2 = PROMPTS[:2]
PARAMS = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=200, n=2)  # 4 requests, GRPO groups of 2
IGNORE_EOS = {"extra_sampling_params": {"ignore_eos": True}}  # every response runs to max_new_tokens
AFTER = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8, n=2)  # later requests, same prompts


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def model_dir(model, tmp_path_factory) -> Path:
    return save_model(model, None, tmp_path_factory.mktemp("tiny-qwen2"))


def switch(sample, old: int, new: int) -> int:
    return version_switch(sample, old, new, length=PARAMS.max_new_tokens)


def test_retract_continues_every_request_exact_under_each_tokens_version(model_dir, model):
    new = perturbed(model, seed=1)
    # Two servers behind the router, stopped before the next test: an idle SGLang CPU server keeps a core busy.
    with SGLangEngine(model_path=model_dir, num_servers=2, router_policy="round_robin", weight_sync="distributed",
                      progress=False, server_kwargs={"max_total_tokens": 16384}, **IGNORE_EOS) as eng:  # fmt: skip
        with pytest.raises(ValueError, match=r"pause_mode='in_place' but SGLang servers .* prefix \(radix\) cache"):
            SGLangEngine(urls=eng.urls, pause_mode="in_place", progress=False)
        eng.start_version(3)  # e.g. a resumed run: the launch weights ("default") are the trainer's version 3
        versions = [requests.get(f"{url}/model_info", timeout=10).json()["weight_version"] for url in eng.urls]
        assert versions == ["3", "3"]
        samples = in_flight_rounds(lambda: generate_across_update(eng, PROMPTS2, PARAMS, new, version=4),
                                   lambda: eng.update_weights_in_flight(model.named_parameters(), version=3), old=3)
        for s in samples:
            at = switch(s, 3, 4)
            logits = by_version(model, new, at)(s)
            per_token, mean = fp32_bars(model.config, s, logits)
            check_candidates([s], None, PARAMS, logits_of=lambda _, logits=logits: logits, tol=per_token)
            off = deviation(s, logits, temperature=PARAMS.temperature)
            assert float(off[at:].mean()) <= mean, (float(off[at:].mean()), mean)  # the KV recomputed, not kept
            print(f"switch at {at}: per token <= {float((off / per_token).max()):.3f} of its bar, "
                  f"the mean after it {float(off[at:].mean()) / mean:.3f} of its bar")
        assert eng.last_sync.version == "4" and len(eng.last_sync.workers) == 2  # both workers, directly
        later = eng.generate(PROMPTS2, AFTER)  # same prompts: a cached prefix of the old weights would show here
    assert {v for s in later for v in s.token_versions()} == {4}
    check_candidates(later, new, AFTER)


def test_in_place_keeps_old_kv_and_runs_without_a_prefix_cache(model_dir, model):
    new = perturbed(model, seed=2)
    # max_concurrency = the requests in flight: every client thread waits on a paused /generate, so the disk
    # push must not queue behind them on the client's pool.
    with SGLangEngine(model_path=model_dir, pause_mode="in_place", progress=False, max_concurrency=4,
                      server_kwargs={"max_total_tokens": 16384}, **IGNORE_EOS) as eng:  # fmt: skip
        assert requests.get(f"{eng.urls[0]}/server_info", timeout=10).json()["disable_radix_cache"] is True
        samples = in_flight_rounds(  # no start_version: the launch weights are version 0
            lambda: generate_across_update(eng, PROMPTS2, PARAMS, new, version=1),
            lambda: eng.update_weights_in_flight(model.named_parameters(), version=0), old=0)
        later = eng.generate(PROMPTS2, AFTER)
    after_switch = []
    for s in samples:
        at = switch(s, 0, 1)
        dev = deviation(s, by_version(model, new, at)(s), temperature=PARAMS.temperature)
        assert float(dev[:at].max()) <= TOL
        after_switch.append(dev[at:])
    # The old KV shows: far from the new weights alone (0.7-0.9 nats per token measured), never exact.
    assert float(torch.cat(after_switch).mean()) > 0.05
    assert {v for s in later for v in s.token_versions()} == {1}
    check_candidates(later, new, AFTER)
