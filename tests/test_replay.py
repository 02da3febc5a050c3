"""Record and replay (`rollout.record=true`, `rollout=replay`): the step files hold every sample field exactly, a
replay of a recorded run trains with the same metrics and ends with the same weights bit for bit, and what a
replay cannot honour is refused at start naming the numbers."""

import json
import os
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from helpers import compose_cfg, metric_columns
from safetensors import safe_open
from safetensors.torch import load_file

from topp_rl.config import validate_config
from topp_rl.data.prompt import PromptRecord
from topp_rl.data.sample import Sample, SampleStatus
from topp_rl.ops import Candidates
from topp_rl.rollout.record import read_call, read_header, read_step, step_file, write_step
from topp_rl.rollout.replay import ReplayEngine, recorded_steps
from topp_rl.rollout.tickets import RolloutTicket
from topp_rl.train import build_run, fit, train

# Three steps of 4 prompts x 4 samples, each recorded and replayed: with dynamic sampling (every step drops
# zero-variance groups and refills, one round each with seed 0), an MoE policy trained with the recorded routes,
# and the multi-turn agent loop (environment turns in the recorded samples, rewards from the environment).
BASE = ["trainer.max_steps=3", "rollout.prompts_per_step=4", "rollout.n_samples=4", "logger=csv"]
RUNS = {
    "refill": [*BASE, "data.drop_zero_variance_groups=true", "data.refill=true"],
    "moe_routes": [*BASE, "model.family=qwen3_moe", "rollout.routing_replay=true"],
    "agent": [*BASE, "task=lookup", "rollout.max_new_tokens=3"],
}
RUN = RUNS["refill"]


def _sample(*, index: int, with_raw: bool) -> Sample:
    s = Sample(prompt_ids=[1, 2, 3], index=index, group_index=index // 2, reward=0.25 * index,
               metadata={"finish_reason": {"type": "length"}, "rewards": {"digit": 1.0}})
    cands = Candidates(ids=torch.tensor([5, 9, 7, 5], dtype=torch.int32), offsets=torch.tensor([0, 2, 4],
                                                                                              dtype=torch.int32))
    s.append_response_tokens([9, 5], log_probs=[-0.1234567890123456789, -1e-300], candidates=cands,
                             raw_log_probs=[-2.5, -3.0000000000000004] if with_raw else None, versions=[3, 4])
    s.append_response_tokens([11], trainable=False)  # a tool's token: empty candidate row, loss mask 0
    s.routes = torch.arange(5 * 2 * 2, dtype=torch.uint8).view(5, 2, 2)  # prompt + response - 1 fed tokens
    s.check_lengths()
    return s


def test_step_file_round_trips_every_field(tmp_path):
    samples = [_sample(index=0, with_raw=True), _sample(index=1, with_raw=False),
               Sample(prompt_ids=[4], index=2, group_index=1, status=SampleStatus.ABORTED)]
    path = step_file(tmp_path, step=7, dp_rank=1, round=2)
    assert path.name == "step_000007.dp1.round2.safetensors"
    write_step(path, samples, prompts=[[1, 2, 3], [4]], step=7, dp_rank=1, round=2, seed=12345)

    back, prompts = read_call(path)
    assert prompts == [[1, 2, 3], [4]]
    fields = ("prompt_ids", "response_ids", "loss_mask", "rollout_log_probs", "rollout_raw_log_probs", "reward",
              "group_index", "index", "status", "metadata", "weight_version", "weight_versions")
    for a, b in zip(samples, back, strict=True):
        assert {f: getattr(a, f) for f in fields} == {f: getattr(b, f) for f in fields}  # floats bit for bit
        assert (a.candidates is None) == (b.candidates is None)
        if a.candidates is not None:
            assert torch.equal(a.candidates.ids, b.candidates.ids)
            assert torch.equal(a.candidates.offsets, b.candidates.offsets)
        assert (a.routes is None) == (b.routes is None)
        if a.routes is not None:
            assert a.routes.dtype == b.routes.dtype and torch.equal(a.routes, b.routes)
    assert back[0].rollout_log_probs[1] == -1e-300 and back[0].weight_versions == [3, 4, 4]
    assert [s.status for s in read_step(path)] == [SampleStatus.COMPLETED] * 2 + [SampleStatus.ABORTED]

    # The documented format: plain safetensors tensors (CSR where ragged) and JSON metadata, no pickle.
    header = read_header(path)
    assert {k: header[k] for k in ("step", "dp_rank", "round", "seed")} == {
        "step": "7", "dp_rank": "1", "round": "2", "seed": "12345"}
    assert json.loads(header["samples"])["response_lengths"] == [3, 3, 0]
    tensors = load_file(str(path))
    assert tensors["candidate_lengths"].tolist() == [2, 2, 0, 2, 2, 0]
    assert tensors["log_probs"].dtype == torch.float64 and tensors["ticket_prompt_lengths"].tolist() == [3, 1]
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(tensors)


@pytest.fixture(scope="module")
def recordings(tmp_path_factory):
    """RUNS' recordings, made on first use: name -> the recording run's dir (the recording is its rollouts/)."""
    made = {}

    def record(name: str):
        if name not in made:
            made[name] = tmp_path_factory.mktemp(f"record_{name}")
            train(compose_cfg(made[name], *RUNS[name], "rollout.record=true"))
        return made[name]

    return record


@pytest.fixture
def recording(recordings):
    return recordings("refill")


@pytest.mark.parametrize("name", list(RUNS))
def test_replay_trains_exactly_like_the_recording(recordings, name, tmp_path):
    recording = recordings(name)
    rollouts = recording / "rollouts"
    assert recorded_steps(rollouts) == 3

    train(compose_cfg(tmp_path, *RUNS[name], "rollout=replay", f"rollout.path={rollouts}"))

    recorded, replayed = metric_columns(recording), metric_columns(tmp_path)
    # perf/* are timings (and the engine's decode counts: a replay decodes nothing); everything else is exact.
    exact = {k: v for k, v in recorded.items() if not k.startswith("perf/")}
    assert {k: replayed.get(k) for k in exact} == exact
    assert "perf/decode_batch_mean" not in replayed
    assert len(exact["train/loss"]) == 3 and any(v != 0 for v in exact["train/loss"])
    assert any(v > 0 for v in exact["train/grad_norm"])  # the weights moved: the final ones compare something
    weights, again = load_file(str(recording / "hf" / "model.safetensors")), load_file(
        str(tmp_path / "hf" / "model.safetensors"))
    assert weights.keys() == again.keys() and all(torch.equal(weights[k], again[k]) for k in weights)
    own = read_step(rollouts / "step_000000.dp0.safetensors")
    assert len(own) >= 16 and all(s.reward is not None for s in own)  # scored (a trajectory may split in two)
    if name == "moe_routes":
        assert all(s.routes is not None and s.routes.shape[0] == len(s.tokens) - 1 for s in own)
    if name == "agent":
        assert any(0 in s.loss_mask for s in own)  # the environment's tokens, recorded with the model's


def test_a_replay_resumes_where_it_stopped(recording, tmp_path):
    """A replay checkpointed after 2 steps and resumed for the third (the datamodule's step and refill count
    restored; each call looked up by its seed) ends with the recording's weights."""
    replay = [*RUN, "rollout=replay", f"rollout.path={recording / 'rollouts'}", "checkpoint.every_n_steps=1"]
    train(compose_cfg(tmp_path, *replay, "trainer.max_steps=2"))
    assert train(compose_cfg(tmp_path, *replay, "ckpt_path=last"))["steps"] == 3
    weights, again = (load_file(str(d / "hf" / "model.safetensors")) for d in (recording, tmp_path))
    assert all(torch.equal(weights[k], again[k]) for k in weights)


def test_a_call_the_recording_lacks_or_holds_for_other_prompts_stops_the_step(recording):
    engine = ReplayEngine(recording / "rollouts")
    header = read_header(recording / "rollouts" / "step_000001.dp0.safetensors")
    _, prompts = read_call(recording / "rollouts" / "step_000001.dp0.safetensors")
    records = [PromptRecord(index=i, text="", prompt_ids=p) for i, p in enumerate(prompts)]
    ticket = RolloutTicket(step=1, records=records, first_group=0, seed=int(header["seed"]))
    assert [s.prompt_ids for s in engine.replay(ticket)][::4] == prompts
    with pytest.raises(ValueError, match=r"no recorded generation for step 1 with seed 7 .*holds steps 0..2 recorded "
                                         r"at data-parallel size 1"):
        engine.replay(RolloutTicket(step=1, records=records, first_group=0, seed=7))
    other = [PromptRecord(index=0, text="", prompt_ids=[1, 2]), *records[1:]]
    with pytest.raises(ValueError, match=r"recorded for other prompts than this run's step 1 draws \(4 recorded, 4 "
                                         r"here, first differing at prompt 0\).*data-parallel size \(1\)"):
        engine.replay(RolloutTicket(step=1, records=other, first_group=0, seed=int(header["seed"])))


def test_refill_rounds_are_recorded_per_call(recording):
    rollouts = recording / "rollouts"
    names = sorted(p.name for p in rollouts.iterdir())
    assert names == ["manifest.json", *(f"step_00000{k}.dp0{r}.safetensors" for k in range(3)
                                        for r in (".round1", ""))]
    assert metric_columns(recording)["rollout/refill_rounds"] == [1.0] * 3
    # The step's own call holds its 4 prompts x 4 samples, scored; the refill round whole groups of 4 more.
    own, refill = read_step(rollouts / "step_000000.dp0.safetensors"), read_step(rollouts / names[1])
    assert len(own) == 16 and len(refill) % 4 == 0 and all(s.reward is not None for s in own + refill)
    manifest = json.loads((rollouts / "manifest.json").read_text())
    assert manifest["identity"]["family"] == "qwen2" and manifest["identity"]["vocab_size"] == 128
    assert manifest["dp_size"] == 1 and manifest["settings"]["rollout.top_p"] == 0.9


def _replay(recording, tmp_path, *overrides):
    return compose_cfg(tmp_path, *RUN, "rollout=replay", f"rollout.path={recording / 'rollouts'}", *overrides)


@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer.max_steps=5"], "config trainer.max_steps=5: must be <= 3 with rollout.path="),
    (["rollout.top_p=1.0"], "rollout.top_p: recorded 0.9, this run 1.0"),
    (["seed=1"], "seed: recorded 0, this run 1"),
    (["data.refill=false"], "data.refill: recorded True, this run False"),
    (["eval.every_n_steps=1"], "config eval.every_n_steps=1: must be 0 with rollout=replay"),
    (["rollout.max_staleness=2"], "rollout.max_staleness=2: must be 0"),
    (["rollout.overlap=true"], "rollout.max_staleness=1: must be 0"),
    (["rollout.max_staleness=1", "rollout.partial_rollouts=true"], "rollout.max_staleness=1: must be 0"),
    (["rollout.record=true"], "config rollout.record=True: must be false with rollout=replay"),
])
def test_replay_refuses_at_start(recording, tmp_path, overrides, message):
    with pytest.raises(ValueError) as err:
        validate_config(_replay(recording, tmp_path, *overrides))
    assert message in str(err.value)


def test_replay_refuses_a_missing_recording(tmp_path):
    cfg = compose_cfg(tmp_path, "rollout=replay")
    with pytest.raises(ValueError, match=r"config rollout.path='\?\?\?': must be the directory of a recording"):
        validate_config(cfg)
    with pytest.raises(ValueError, match="holds no manifest.json"):
        validate_config(compose_cfg(tmp_path, "rollout=replay", f"rollout.path={tmp_path}"))


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.vocab_size=256"], "vocab_size: recorded 128, this run 256"),
    (["model.family=llama"], "family: recorded 'qwen2', this run 'llama'"),
])
def test_replay_refuses_another_policy(recording, tmp_path, overrides, message):
    with pytest.raises(ValueError) as err:
        build_run(_replay(recording, tmp_path, *overrides))
    assert message in str(err.value)


def _fsdp_record_and_replay(rank: int, tmp: str) -> dict:
    """On each of 2 FSDP ranks: record RUNS["refill"], then replay it; rank 0 returns both runs' metrics."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # the group is up: Lightning only reads ranks
    fsdp = ("parallel=fsdp", "trainer.devices=2", "trainer.enable_progress_bar=false", "export.hf=false")
    recording, replay = Path(tmp) / "record", Path(tmp) / "replay"
    for out, extra in ((recording, ["rollout.record=true"]),
                       (replay, ["rollout=replay", f"rollout.path={recording / 'rollouts'}"])):
        run = build_run(compose_cfg(out, *RUN, *fsdp, *extra))
        fit(run)
    return {"recorded": metric_columns(recording), "replayed": metric_columns(replay)} if rank == 0 else {}


@pytest.mark.distributed
@pytest.mark.slow
def test_each_data_parallel_rank_records_and_replays_its_own_files(tmp_path):
    """FSDP on 2 ranks: each rank writes its own step files (dp0, dp1) and replays them; the replay's metrics are
    the recording's exactly."""
    (result, _) = run_distributed(_fsdp_record_and_replay, 2, str(tmp_path), timeout=600,
                                  preload=("topp_rl.train", "topp_rl.fsdp", "hydra"))
    rollouts = tmp_path / "record" / "rollouts"
    assert {p.name.split(".")[1] for p in rollouts.glob("step_*.safetensors")} == {"dp0", "dp1"}
    assert recorded_steps(rollouts) == 3 and json.loads((rollouts / "manifest.json").read_text())["dp_size"] == 2
    exact = {k: v for k, v in result["recorded"].items() if not k.startswith("perf/")}
    assert {k: result["replayed"].get(k) for k in exact} == exact
    assert any(v != 0 for v in exact["train/loss"])
