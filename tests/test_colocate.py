"""Colocated mode without a server: the step's calls replayed against the protocol recorded from a real SGLang 0.5.23
server (`tests/data/sglang_colocated_protocol.json`, checked live by tests/test_sglang_colocated.py), the tensor
handles a push sends (they load, equal, in a process that is not ours), a colocated server's launch settings, and
what a colocated run refuses at start."""

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import compose_config
from sglang_checks import changed_model, tiny_model
from torch.multiprocessing import reductions

from topp_rl.config import engine_placement_mode, placement_of, validate_config, weight_sync_of
from topp_rl.engines.serving.client import HTTPClient, Retries, Timeouts
from topp_rl.engines.sglang.colocate import MemoryCycle, without_memory_saver
from topp_rl.engines.sglang.engine import ColocatedSGLangEngine
from topp_rl.engines.sglang.server import gpu_launch_args, visible_devices
from topp_rl.engines.sglang.weights import CUDA_DEVICE_ARG, WeightSync, shared_payload, with_device_uuid
from topp_rl.train import engine_settings, placement_kwargs

PROTOCOL = json.loads((Path(__file__).parent / "data" / "sglang_colocated_protocol.json").read_text())
URL = "http://127.0.0.1:1"  # never reached: the replay answers
BUCKET = 200_000  # as when the protocol was recorded: three buckets of the tiny model


class Replay:
    """Answers each call with the recorded server's answer, after checking it is the recorded call (path, body)."""

    def __init__(self, calls: list[dict]) -> None:
        self.calls = [c for c in calls if c["path"] != "/generate"]
        self.generates = [i for i, c in enumerate(c for c in calls if c["path"] == "/generate")]
        self.done = 0

    def __call__(self, method, url, path, body, bound):
        want = self.calls[self.done]
        shown = dict(body)
        if "serialized_named_tensors" in shown:
            shown["serialized_named_tensors"] = len(shown["serialized_named_tensors"])
        assert (method, url, path, shown) == ("POST", URL, want["path"], want["body"]), f"call {self.done}"
        self.done += 1
        return want["status"], json.dumps(want["answer"])


def test_two_colocated_steps_send_exactly_the_recorded_calls(tmp_path):
    model = tiny_model()
    client = HTTPClient(timeouts=Timeouts(), retries=Retries(), label="SGLang")
    replay = client.call = Replay(PROTOCOL)
    weights = WeightSync(client, bucket_bytes=BUCKET, host="127.0.0.1", workdir=tmp_path)
    cycle = MemoryCycle(weights.control)
    for pushed in (changed_model(model), model):
        cycle.check_serving()  # the step's generations
        cycle.release([URL])
        with pytest.raises(RuntimeError, match="whose memory is released"):
            cycle.check_serving()
        stats = cycle.update([URL], lambda m=pushed: weights.update(m.named_parameters(), [URL], method="tensor",
                                                                     config_dir=None, tp_sizes={URL: 1}))
        assert (stats.method, stats.buckets) == ("tensor", 3)
    assert replay.done == len(replay.calls)  # every recorded call, none more
    client.close()


def test_an_update_before_any_release_is_the_push_alone_and_a_second_release_is_refused():
    calls = []
    cycle = MemoryCycle(lambda url, path, body: calls.append((url, path, body)))
    assert cycle.update(["a", "b"], lambda: "pushed") == "pushed" and calls == []  # the run's start push
    cycle.release(["a", "b"])
    with pytest.raises(RuntimeError, match="release_memory called twice without a weight update"):
        cycle.release(["a", "b"])
    cycle.update(["a", "b"], lambda: calls.append("push"))
    assert calls == [("a", "/release_memory_occupation", {}), ("b", "/release_memory_occupation", {}),
                     ("a", "/resume_memory_occupation", {"tags": ["weights"]}),
                     ("b", "/resume_memory_occupation", {"tags": ["weights"]}), "push",
                     ("a", "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}),
                     ("b", "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})]


LOAD = """
import base64, sys, torch, torch.multiprocessing
from multiprocessing.reduction import ForkingPickler
named = ForkingPickler.loads(base64.b64decode(sys.stdin.read()))
torch.save({name: t.clone() for name, t in named}, sys.argv[1])
"""


@pytest.mark.subprocess
def test_a_pushed_bucket_loads_equal_in_another_process_and_leaves_the_trainers_tensors_alone(tmp_path):
    params = dict(tiny_model().named_parameters())
    storages = {name: p.untyped_storage().data_ptr() for name, p in params.items()}
    with shared_payload(list(params.items())) as payload:
        subprocess.run([sys.executable, "-c", LOAD, str(tmp_path / "got.pt")], input=payload, text=True, check=True,
                       timeout=120)
    got = torch.load(tmp_path / "got.pt")
    assert got.keys() == params.keys() and all(torch.equal(got[n], p) for n, p in params.items())
    assert {name: p.untyped_storage().data_ptr() for name, p in params.items()} == storages  # copied, not moved
    assert not any(p.is_shared() for p in params.values())


def test_a_placed_server_gets_its_gpus_fraction_and_memory_saver():
    assert gpu_launch_args("cuda", (4, 5), mem_fraction=0.4, memory_saver=True) == (
        "--base-gpu-id", "0", "--tp-size", "2", "--mem-fraction-static", "0.4", "--enable-memory-saver")
    assert gpu_launch_args("cpu", (), mem_fraction=None, memory_saver=False) == ()
    with pytest.raises(ValueError, match=r"device='cpu' with gpus=\[0\].* \(the memory saver, torch_memory_saver, is "
                                         r"CUDA-only"):
        gpu_launch_args("cpu", (0,), mem_fraction=None, memory_saver=True)
    assert visible_devices((4, 5), None) == "4,5"
    assert visible_devices((1, 2), "2,3,6,7") == "3,6"  # ids among the GPUs this process sees
    with pytest.raises(ValueError, match=r"gpus=\[4\]: this process sees 2 GPU\(s\) \(CUDA_VISIBLE_DEVICES=0,1\)"):
        visible_devices((4,), "0,1")


def test_a_gpu_server_without_the_memory_saver_is_named_and_a_cpu_one_passes():
    infos = {"http://a": {"device": "cuda", "enable_memory_saver": False},
             "http://b": {"device": "cuda", "enable_memory_saver": True}, "http://c": {"device": "cpu"}}
    assert without_memory_saver(infos) == ["http://a"]


def test_the_colocated_engine_refuses_connected_servers_and_a_broadcast_sync():
    with pytest.raises(ValueError, match="placement=colocated launches its servers on the trainer's own devices"):
        ColocatedSGLangEngine(urls=["http://127.0.0.1:1"])
    with pytest.raises(ValueError, match="weight_sync='distributed' with rollout.engine.placement=colocated"):
        ColocatedSGLangEngine(model_path="/nonexistent", weight_sync="distributed")


GPU8 = ["rollout=sglang", "trainer=gpu", "parallel=fsdp", "trainer.devices=8"]


def test_each_rank_engine_gets_its_replicas_servers_and_the_mode(tmp_path):
    cfg = compose_config(tmp_path, *GPU8)
    validate_config(cfg)
    (server,) = placement_kwargs(cfg)(0)["placed"]
    assert placement_kwargs(cfg)(0)["colocated"] and (server.gpus, server.pushed_by) == ((0,), 0)
    with pytest.raises(RuntimeError, match="gives data-parallel replica 3's servers to rank 3, but rank 0 builds"):
        placement_kwargs(cfg)(3)  # this process is rank 0
    cpu = compose_config(tmp_path, "rollout=sglang", "rollout.engine.placement=colocated")
    validate_config(cpu)
    assert (placement_of(cpu), engine_placement_mode(cpu), placement_kwargs(cpu)(0)) == (None, "colocated",
                                                                                       {"colocated": True})
    assert placement_kwargs(compose_config(tmp_path, "rollout=sglang"))(0) == {}  # CPU default: the plain launch
    assert placement_kwargs(compose_config(tmp_path))(0) == {}  # the embedded engine


@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.max_staleness=1"], r"rollout.max_staleness=1: must be 0 with rollout.engine.placement=colocated"),
    (["rollout.overlap=true"], r"rollout.max_staleness=1: must be 0 with rollout.engine.placement=colocated"),
    (["rollout.engine.weight_sync=distributed"], r"weight_sync='distributed': must be tensor, disk or null"),
    (["rollout.engine.tp_size=2"], r"rollout.engine.tp_size=2: must be 1 on a CPU run"),
    (["rollout.engine.urls=[http://127.0.0.1:1]"], r"placement='colocated': must be null with rollout.engine.urls"),
], ids=["ahead", "overlap", "broadcast", "cpu tp", "connected"])
def test_a_colocated_run_that_cannot_work_is_refused_at_start(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        validate_config(compose_config(tmp_path, "rollout=sglang", "rollout.engine.placement=colocated", *overrides))
    with pytest.raises(ValueError, match=r"placement='disaggregated': must be null or colocated on a CPU run"):
        validate_config(compose_config(tmp_path, "rollout=sglang", "rollout.engine.placement=disaggregated"))
    with pytest.raises(ValueError, match=r"weight_sync='tensor': must be disk, distributed or null unless"):
        validate_config(compose_config(tmp_path, "rollout=sglang", "rollout.engine.weight_sync=tensor"))


def test_a_null_weight_sync_follows_the_placement(tmp_path):
    def resolved(*overrides):
        cfg = compose_config(tmp_path, "rollout=sglang", *overrides)
        validate_config(cfg)
        return weight_sync_of(cfg), engine_settings(cfg)["weight_sync"]

    assert resolved() == ("disk", "disk")  # CPU, plain launch: as before
    assert resolved("rollout.engine.placement=colocated") == ("tensor", "tensor")
    assert resolved(*GPU8) == ("tensor", "tensor")  # GPUs, no gpus named: colocated
    assert resolved(*GPU8[:3], "trainer.devices=4", "rollout.engine.gpus=4-7") == ("distributed", "distributed")
    assert resolved(*GPU8[:3], "trainer.devices=4", "rollout.engine.gpus=4-7",
                    "rollout.engine.weight_sync=disk") == ("disk", "disk")  # an explicit choice stays


def test_a_cuda_tensor_names_its_device_by_uuid_where_torch_rebuilds_it():
    """A server sees its GPUs renumbered (its CUDA_VISIBLE_DEVICES), so a pushed CUDA tensor names its device by
    UUID, in the argument torch's `rebuild_cuda_tensor` reads the device from (checked against this torch)."""
    assert list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)[CUDA_DEVICE_ARG] == "storage_device"
    args = tuple(range(15))
    assert with_device_uuid(args, "GPU-1234") == (0, 1, 2, 3, 4, 5, "GPU-1234", *range(7, 15))
