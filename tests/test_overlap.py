"""rollout.overlap: step k + 1 generated while step k trains, exactly one weight update behind, and recorded."""

import copy
import itertools
import threading

import lightning as L
import pytest
import torch
from helpers import compose_cfg, read_metrics

from topp_rl.engines import VersionedEngine
from topp_rl.engines.embedded import EmbeddedEngine
from topp_rl.models import build_tiny_model
from topp_rl.rollout import SamplingParams
from topp_rl.rollout.scheduler import RolloutScheduler
from topp_rl.train import build_run, fit

OVERLAP = ("rollout.overlap=true", "rollout.engine.share_weights=false", "algo.loss.tis_cap=2.0",
           "trainer.max_steps=4", "logger=csv", "rollout.prompts_per_step=8", "rollout.n_samples=8")


class _Capture(L.Callback):
    """Each step's batch samples and the policy's weights the step starts from (before its update)."""

    def __init__(self) -> None:
        self.samples, self.weights = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.samples.append(batch.samples)
        self.weights.append(copy.deepcopy(pl_module.policy.model.state_dict()))


def _regenerate(model, weights, ticket, params):
    model.load_state_dict(weights)
    engine = EmbeddedEngine(model, progress=False)
    return engine.generate([r.prompt_ids for r in ticket.records], params, seed=ticket.seed)


def test_overlap_trains_each_step_on_the_rollout_of_the_weights_one_update_back(tmp_path, capfd):
    cfg = compose_cfg(tmp_path, *OVERLAP)
    run = build_run(cfg)
    capture = _Capture()
    run.trainer.callbacks.append(capture)
    fit(run)
    dm = run.datamodule
    model = copy.deepcopy(run.module.policy.model)
    for step, samples in enumerate(capture.samples):
        # Step 0 is generated in place (weights W0); step k >= 1 beside step k - 1, with the weights step k - 1
        # started from: W(k-1). The start push is version 1, each step's push one more.
        source = capture.weights[max(step - 1, 0)]
        expected = _regenerate(model, source, dm.ticket(step), dm.params)
        assert [s.response_ids for s in samples] == [s.response_ids for s in expected], step
        assert [s.rollout_log_probs for s in samples] == [s.rollout_log_probs for s in expected], step
        assert {s.weight_version for s in samples} == {max(step, 1)}, step
    for before, after in itertools.pairwise(capture.weights):  # every step did move the weights
        assert any(not torch.equal(before[k], after[k]) for k in before)
    rows = [r for r in read_metrics(tmp_path) if r.get("rollout/weight_staleness")]
    assert [float(r["rollout/weight_staleness"]) for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert all(float(r["perf/rollout_wait_s"]) >= 0 for r in rows)
    tis = [float(r["train/tis_weight_mean"]) for r in read_metrics(tmp_path) if r.get("train/tis_weight_mean")]
    assert tis[0] == pytest.approx(1.0, abs=1e-5) and all(abs(w - 1) > 1e-5 for w in tis[1:])  # off-policy
    # The alarm knows the staleness is intended: once it fired on every overlap run (mismatch 0.14-0.16).
    mismatch = [float(r["train/rollout_logprob_abs_diff"]) for r in read_metrics(tmp_path)
                if r.get("train/rollout_logprob_abs_diff")]
    assert mismatch[0] <= 1e-5 and min(mismatch[1:]) > 1e-3
    alarms = [float(r["health/mismatch_alarm"]) for r in read_metrics(tmp_path) if r.get("health/mismatch_alarm")]
    assert alarms == [0.0] * 4
    assert "not sampling with the trained weights" not in capfd.readouterr().err


def test_versioned_engine_stamps_the_weights_that_sampled():
    """A push from another thread waits for the generation in flight; whichever wins the lock, each batch's
    weight_version names the weights that produced it."""
    model = build_tiny_model(vocab_size=96, seed=0, initializer_range=0.2)
    engine = VersionedEngine(EmbeddedEngine(model, progress=False))
    new = {n: p + 0.05 * torch.randn_like(p) for n, p in model.state_dict().items()}
    params = SamplingParams(top_p=0.9, max_new_tokens=6, n=2)
    prompts = [[1, 5, 6], [1, 7]]
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("s", engine.generate(prompts, params, seed=3)))
    thread.start()
    engine.update_weights(new.items())
    thread.join()
    after = engine.generate(prompts, params, seed=3)
    assert engine.version == 1 and {s.weight_version for s in after} == {1}
    (version,) = {s.weight_version for s in out["s"]}
    reference = copy.deepcopy(model)
    if version == 1:
        reference.load_state_dict(new)
    again = EmbeddedEngine(reference, progress=False).generate(prompts, params, seed=3)
    assert [s.rollout_log_probs for s in out["s"]] == [s.rollout_log_probs for s in again]


def test_scheduler_starts_k_steps_ahead_hands_over_only_its_own_step_and_reraises():
    ahead = RolloutScheduler(2)
    assert ahead.take(0) is None  # nothing started ahead of the first step: it is generated in place
    started = []
    ahead.start_ahead(0, lambda step: started.append(step) or [f"s{step}"], concurrent=False)
    assert ahead.steps_in_flight == [1, 2]
    samples, seconds = ahead.take(1)
    assert samples == ["s1"] and seconds >= 0
    ahead.start_ahead(1, lambda step: [f"again{step}"], concurrent=False)  # step 2 is in flight: only 3 starts
    assert ahead.steps_in_flight == [2, 3] and ahead.take(2)[0] == ["s2"] and started == [1, 2]
    assert ahead.take(4) is None and ahead.steps_in_flight == []  # step 3 was passed over: dropped

    def fail(step):
        raise RuntimeError(f"engine down at {step}")

    ahead.start_ahead(4, fail, concurrent=False)
    with pytest.raises(RuntimeError, match="engine down at 5"):
        ahead.take(5)
    ahead.put(7, ["seven"], 1.5)  # restored from a checkpoint
    assert ahead.take(7) == (["seven"], 1.5)
    ahead.close()
    with pytest.raises(ValueError, match=r"max_staleness=0 must be an integer >= 1 \(0: no scheduler\)"):
        RolloutScheduler(0)


def test_a_restored_engine_does_not_count_the_resend_of_its_checkpoint_weights():
    model = build_tiny_model(vocab_size=96, seed=0)
    engine = VersionedEngine(EmbeddedEngine(model, progress=False))
    weights = list(model.state_dict().items())
    engine.restore(7)
    engine.update_weights(weights)  # the resumed run's start push: the checkpoint's weights, version 7
    assert engine.version == 7
    engine.update_weights(weights)  # the first step's push: a new version
    assert engine.version == 8


def test_partial_updates_stamp_the_versions_the_wrapper_counts_a_restore_included():
    """With partial rollouts the engine stamps each token with the version the wrapper hands it: a restored run's
    resend keeps the checkpoint's version, the next push is one more."""
    model = build_tiny_model(vocab_size=96, seed=0)
    weights = list(model.state_dict().items())
    params = SamplingParams(top_p=0.9, max_new_tokens=4, n=2)
    with pytest.raises(ValueError, match=r"rollout.partial_rollouts=true needs an engine whose weight updates land "
                                         r"between decode steps, but EmbeddedEngine cannot"):
        VersionedEngine(EmbeddedEngine(model, progress=False), partial=True)
    engine = VersionedEngine(EmbeddedEngine(model, batching="continuous", progress=False), partial=True)
    try:
        assert engine.concurrent
        engine.restore(7)
        engine.update_weights(weights)  # the resumed run's start push: version 7 again
        samples = engine.generate([[1, 5, 6]], params, seed=3)
        assert engine.version == 7 and {v for s in samples for v in s.token_versions()} == {7}
        engine.update_weights(weights)
        samples = engine.generate([[1, 5, 6]], params, seed=3)
        assert engine.version == 8 and {s.weight_version for s in samples} == {8}
    finally:
        engine.close()


def test_scheduler_restores_its_own_checkpoint_state_and_the_one_step_overlap_format():
    from topp_rl.rollout.broadcast import samples_to_state

    model = build_tiny_model(vocab_size=96, seed=0)
    engine = VersionedEngine(EmbeddedEngine(model, progress=False))
    samples = EmbeddedEngine(model, progress=False).generate([[1, 5]], SamplingParams(max_new_tokens=3, n=2), seed=1)
    ahead = RolloutScheduler(2)
    ahead.put(4, samples, 0.5)
    ahead.put(5, samples[:1], 0.25)
    state = ahead.state(4, engine)
    assert sorted(state["steps"]) == [4, 5] and state["engine_version"] == 0
    restored = RolloutScheduler(2)
    restored.restore(state, 4, engine)
    assert [s.response_ids for s in restored.take(4)[0]] == [s.response_ids for s in samples]
    old = {"step": 7, "samples": samples_to_state(samples), "seconds": 1.0, "engine_version": 3}  # rollout.overlap's
    restored.restore(old, 7, engine)
    assert restored.take(7)[1] == 1.0 and engine.version == 3
    with pytest.raises(ValueError, match=r"checkpoint holds the rollouts in flight for steps \[7\], but its data "
                                         r"position is step 6"):
        RolloutScheduler(1).restore(old, 6, engine)
