"""Colocated mode on a real SGLang 0.5.23 CPU server (`ColocatedSGLangEngine`): the step's calls in their order
(generate, release, resume weights, push by tensor handles, resume KV cache, generate), every one of them recorded
and compared with `tests/data/sglang_colocated_protocol.json`, the recorded protocol the CPU-only tests replay
(`tests/test_colocate.py`). A CPU server has no memory saver (torch_memory_saver is CUDA-only): it takes the memory
calls and frees nothing; what is checked here is the order, that the pushed weights (over shared memory) are the
ones served (raw log-probs equal HF's float32 recomputation under them), that a generate while released is refused
before any request leaves, and that an out-of-order call is refused.

`TOPP_RL_RECORD_PROTOCOL=1` rewrites the recorded protocol from this server instead of comparing with it.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, train_env
from sglang_checks import PROMPTS, TOL, changed_model, hf_logits, require_sglang, tiny_model

from topp_rl.models import save_model
from topp_rl.rollout import SamplingParams

pytestmark = pytest.mark.sglang
require_sglang(module=True)

from topp_rl.engines.sglang import ColocatedSGLangEngine  # noqa: E402

PROTOCOL = Path(__file__).parent / "data" / "sglang_colocated_protocol.json"
PARAMS = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=5)
BUCKET = 200_000  # bytes: the tiny model's 560 kB of weights go in three buckets


def served_by(samples, model) -> bool:
    """Every raw log-prob the server recorded is `model`'s (HF, float32) on the same tokens."""
    for s in samples:
        scaled = torch.log_softmax(hf_logits(model, s), -1)
        want = scaled[torch.arange(s.response_length), torch.tensor(s.response_ids)]
        if not torch.allclose(torch.tensor(s.rollout_raw_log_probs), want, atol=TOL):
            return False
    return True


def recorded(engine) -> list[dict]:
    """From now on, each call the engine sends: its path and body (the tensor handles, which change every time, as
    their count) with the server's status; /generate bodies as the path alone."""
    calls: list[dict] = []
    send = engine.client.call

    def call(method, url, path, body, bound):
        status, text = send(method, url, path, body, bound)
        entry = {"path": path, "status": status}
        if path != "/generate":
            shown = dict(body or {})
            if "serialized_named_tensors" in shown:
                shown["serialized_named_tensors"] = len(shown["serialized_named_tensors"])
            entry |= {"body": shown, "answer": json.loads(text)}
        calls.append(entry)
        return status, text

    engine.client.call = call
    return calls


def test_a_colocated_step_follows_the_recorded_protocol_and_serves_the_pushed_weights(tmp_path):
    model = tiny_model()
    changed = changed_model(model)
    with ColocatedSGLangEngine(model_path=save_model(model, None, tmp_path / "m"), progress=False,
                               weight_bucket_bytes=BUCKET, workdir=tmp_path / "engine") as engine:
        assert engine.weight_sync == "tensor" and engine.tp_sizes == {engine.urls[0]: 1}
        calls = recorded(engine)
        assert served_by(engine.generate(PROMPTS, PARAMS), model)
        engine.release_memory()
        sent = len(calls)
        with pytest.raises(RuntimeError, match="generate on colocated SGLang servers whose memory is released"):
            engine.generate(PROMPTS, PARAMS)
        with pytest.raises(RuntimeError, match="release_memory called twice"):
            engine.release_memory()
        assert len(calls) == sent  # refused before any request left
        stats = engine.update_weights(changed.named_parameters())
        assert (stats.method, stats.buckets, stats.bytes) == ("tensor", 3, sum(
            p.numel() * p.element_size() for p in changed.parameters()))
        after = engine.generate(PROMPTS, PARAMS)
        assert served_by(after, changed) and not served_by(after, model)
        engine.release_memory()
        engine.update_weights(model.named_parameters())
        assert served_by(engine.generate(PROMPTS, PARAMS), model)
    if os.environ.get("TOPP_RL_RECORD_PROTOCOL") == "1":
        PROTOCOL.parent.mkdir(exist_ok=True)
        PROTOCOL.write_text(json.dumps(calls, indent=1) + "\n")
    assert calls == json.loads(PROTOCOL.read_text())


def test_the_gpu_placement_check_script_runs_its_round_trip_on_a_cpu_server(tmp_path):
    """scripts/gpu_placement_check.py (gpu_check.sh's placement and colocated checks) with --cpu: the same round
    trip on a CPU server, so the GPU script's own logic is exercised here."""
    done = subprocess.run([sys.executable, "scripts/gpu_placement_check.py", "--cpu"], cwd=ROOT, env=train_env(PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "gpu_placement_check: OK (CPU)" in done.stdout
