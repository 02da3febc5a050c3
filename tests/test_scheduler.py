"""rollout.max_staleness=K: generations up to K weight updates ahead of training, the staleness rule, its
metrics, and checkpoints that hold every generation in flight."""

import threading

import lightning as L
import pytest
import torch
from helpers import column, compose_cfg, read_metrics

from topp_rl.data.sample import Sample
from topp_rl.engines.embedded import EmbeddedEngine
from topp_rl.models import build_char_tokenizer, build_tiny_model
from topp_rl.parallel.collectives import DataParallelCollectives
from topp_rl.rollout import RolloutDataModule, SamplingParams
from topp_rl.rollout.broadcast import samples_from_state
from topp_rl.rollout.packing import pack_samples
from topp_rl.rollout.scheduler import check_staleness_key, drop_stale_groups, staleness_stats
from topp_rl.tasks import CopyDigitTask
from topp_rl.train import build_run, fit

TOK = build_char_tokenizer()
AHEAD = ("rollout.max_staleness=2", "rollout.engine.share_weights=false", "algo.loss.tis_cap=2.0", "logger=csv",
         "rollout.prompts_per_step=4", "rollout.n_samples=4")


class _Capture(L.Callback):
    """Each trained step's samples: (rollout step, [(group, index, prompt, response, log-probs, versions)])."""

    def __init__(self) -> None:
        self.steps = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.steps.append((batch.step, [(s.group_index, s.index, s.prompt_ids, s.response_ids, s.rollout_log_probs,
                                         s.token_versions()) for s in batch.samples]))


def _fit(tmp_path, *overrides):
    run = build_run(compose_cfg(tmp_path, *AHEAD, *overrides))
    capture = _Capture()
    run.trainer.callbacks.append(capture)
    fit(run)
    return run, capture.steps


def test_two_updates_ahead_trains_every_step_within_the_bound_and_logs_the_staleness(tmp_path):
    run, steps = _fit(tmp_path, "trainer.max_steps=5")
    rows = read_metrics(tmp_path)
    most, mean = column(rows, "rollout/staleness_max"), column(rows, "rollout/staleness_mean")
    # Step s's generation starts once step s - 2 is taken (the weights of s - 2 are in the engine) and ends before
    # step s is taken: 0 <= staleness <= min(s, 2). Where in that range depends on timing (whole responses: an
    # update waits for the generation in flight, which may or may not have started).
    assert all(0 <= m <= min(s, 2) for s, m in enumerate(most)) and most[0] == 0.0
    assert mean == column(rows, "rollout/weight_staleness") and all(a <= b for a, b in zip(mean, most, strict=True))
    assert column(rows, "rollout/dropped_stale") == [0.0] * 5
    assert column(rows, "rollout/partial_frac") == [0.0] * 5  # whole responses: one version per sample
    assert [step for step, _ in steps] == [0, 1, 2, 3, 4]
    trained = [max(v for *_, versions in samples for v in versions) + m
               for (_, samples), m in zip(steps, most, strict=True)]
    assert trained == [1, 2, 3, 4, 5]  # the start push is version 1, each step's push one more
    # The tokens of the trained weights (step 0's at least) are on-policy to float32 rounding.
    current = column(rows, "train/rollout_logprob_abs_diff_current")
    assert 1 <= len(current) <= 5 and max(current) <= 1e-5
    assert column(rows, "health/mismatch_alarm") == [0.0] * 5


def test_a_resume_trains_the_generations_its_checkpoint_held_none_twice_none_lost(tmp_path):
    """The final checkpoint of a 2-step run holds the generations of steps 2 and 3 (two updates ahead); the run
    resumed from it trains exactly those samples, then generates step 4 itself: every (step, sample index) once."""
    _, first = _fit(tmp_path, "trainer.max_steps=2", "checkpoint.every_n_steps=2")
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["RolloutDataModule"]
    assert state["step"] == 2 and sorted(state["in_flight"][0]["steps"]) == [2, 3]
    held = {step: samples_from_state(entry["samples"]) for step, entry in state["in_flight"][0]["steps"].items()}
    _, resumed = _fit(tmp_path, "trainer.max_steps=5", "checkpoint.every_n_steps=2", "ckpt_path=last")
    assert [step for step, _ in first + resumed] == [0, 1, 2, 3, 4]
    for step, samples in resumed[:2]:  # the checkpoint's generations (unnumbered), bit for bit, versions included
        assert [sample[2:] for sample in samples] == [(s.prompt_ids, s.response_ids, s.rollout_log_probs,
                                                       s.token_versions()) for s in held[step]], step
    ids = [(step, index) for step, samples in first + resumed for _, index, *_ in samples]
    assert len(ids) == len(set(ids)) == 5 * 16


def test_the_staleness_rule_drops_whole_groups_older_than_k():
    def sample(group, versions):
        s = Sample(prompt_ids=[1], group_index=group)
        s.append_response_tokens(list(range(len(versions))), [-0.5] * len(versions), versions=versions)
        return s

    samples = [sample(0, [5, 5]), sample(0, [3, 4]), sample(1, [4, 4]), sample(1, [4, 5]), sample(2, [6])]
    kept, dropped = drop_stale_groups(samples, trained_version=6, max_staleness=2)
    assert dropped == 1 and [s.group_index for s in kept] == [1, 1, 2]  # group 0 has a token 3 updates old
    stats = staleness_stats(kept, trained_version=6, dropped=dropped, dp=DataParallelCollectives())
    assert stats == {"rollout/staleness_mean": (2 + 2 + 2 + 1 + 0, 5.0), "rollout/staleness_max": (2.0, 1.0),
                     "rollout/partial_frac": (1.0, 3.0), "rollout/dropped_stale": (1.0, 1.0)}
    micro = pack_samples(kept, [0.0] * 3, max_tokens=64, trained_version=6)
    assert micro[0].staleness.tolist() == [2, 2, 2, 1, 0]


@pytest.mark.parametrize(("k", "overlap", "message"), [
    (-1, False, r"rollout.max_staleness=-1: must be an integer >= 0"),
    (True, False, r"rollout.max_staleness=True: must be an integer >= 0"),
    (2, True, r"rollout.overlap=True: must be false with rollout.max_staleness=2 \(overlap means max_staleness=1\)"),
    (0, "yes", r"rollout.overlap='yes': must be true or false"),
])
def test_staleness_keys_are_refused_naming_the_key(k, overlap, message):
    with pytest.raises(ValueError, match=message):
        check_staleness_key(k, overlap=overlap)
    assert check_staleness_key(0, overlap=True) == 1 and check_staleness_key(3, overlap=False) == 3


def test_partial_rollouts_continue_across_an_update_and_pack_each_tokens_staleness():
    """The datamodule two updates ahead over the continuous embedded engine: step 0 is taken, steps 1 and 2 start;
    the decode loop is held a few decode steps into them until the trainer's push is requested, so the push
    lands mid-response. Step 1's samples then span two versions (each token stamped), the packed staleness is 1
    for its tokens before the update and 0 after, and the step's metrics count the partial samples."""
    model = build_tiny_model(tokenizer=TOK, seed=0, initializer_range=0.2)
    engine = EmbeddedEngine(model, batching="continuous", eos_token_id=TOK.eos_token_id,
                            pad_token_id=TOK.pad_token_id, progress=False)
    dm = RolloutDataModule(engine=engine, task=CopyDigitTask(), tokenizer=TOK, prompts_per_step=2,
                           params=SamplingParams(top_p=0.9, max_new_tokens=12, n=2), max_tokens_per_micro_batch=64,
                           max_staleness=2, partial_rollouts=True)
    versioned, loop = dm.engine, engine.loop
    reached, ahead_from = threading.Event(), []

    def hold(steps: int) -> None:  # once: 3 decode steps into the generations ahead, wait for the push
        if dm._ahead.steps_in_flight and not ahead_from:
            ahead_from.append(steps)  # the first boundary after steps 1 and 2 were submitted: none of theirs ran
        if ahead_from and steps == ahead_from[0] + 3 and not reached.is_set():
            reached.set()
            with loop.cond:
                loop.cond.wait_for(lambda: loop.pause_requests > 0, timeout=300)

    loop.boundary_hook = hold
    try:
        step0 = dm.on_before_batch_transfer(dm.ticket(0), 0)  # generated in place, then steps 1 and 2 start
        assert step0.stats["rollout/staleness_max"] == (0.0, 1.0)
        assert reached.wait(300), "the generations ahead never reached their third decode step"
        new = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}
        versioned.update_weights(new.items())  # the trainer's push after step 0: lands mid-response
        step1 = dm.on_before_batch_transfer(dm.ticket(1), 1)
    finally:
        loop.boundary_hook = None
        dm.close_engine()
        engine.close()
    assert versioned.version == 1
    spanning = [s for s in step1.samples if s.spans_versions]
    assert spanning, "no response was in flight at the update"
    for s in spanning:  # the old weights' tokens, then the new weights' (how many of each: where it was admitted)
        old = s.token_versions().count(0)
        assert s.token_versions() == [0] * old + [1] * (s.response_length - old)
    staleness = torch.cat([mb.staleness for mb in step1.micro_batches])
    expected = torch.tensor([1 - v for s in step1.samples for v in s.token_versions()])
    assert torch.equal(staleness, expected) and set(staleness.tolist()) == {0, 1}
    partial, count = step1.stats["rollout/partial_frac"]
    assert partial == len(spanning) and count == len(step1.samples)
    assert step1.stats["rollout/staleness_max"] == (1.0, 1.0)


