"""A real SGLang server launched by a separate "trainer" process: hung (SIGSTOP) it fails a client within the
configured bounds, and SIGKILL of the trainer takes the whole server process group with it; the disk-sync copy
the killed trainer left behind is cleaned at the next start. One server start for all of it."""

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sglang_checks import require_sglang

import topp_rl
from topp_rl.engines.serving.process import group_alive
from topp_rl.engines.sglang.server import make_workdir
from topp_rl.models import build_tiny_model, save_model
from topp_rl.rollout import SamplingParams

pytestmark = [pytest.mark.sglang, pytest.mark.subprocess]  # the trainer is a process of its own
require_sglang(module=True)

from topp_rl.engines.serving import RequestTimeoutError  # noqa: E402
from topp_rl.engines.sglang import SGLangEngine  # noqa: E402

# The trainer: launches a server, reports it, and on "go" dies (SIGKILL from the test) inside a disk weight sync.
TRAINER = """
import json, sys, time
from pathlib import Path
import torch
from topp_rl.engines.sglang import SGLangEngine
from topp_rl.engines.serving.weights import write_checkpoint
engine = SGLangEngine(model_path=sys.argv[1], workdir=sys.argv[2], progress=False)
print(json.dumps({"url": engine.urls[0], "pgid": engine.server.pid, "workdir": str(engine.workdir)}), flush=True)
sys.stdin.readline()
with write_checkpoint([("w", torch.zeros(8))], config_dir=Path(sys.argv[1]), parent=engine.workdir) as path:
    print(path, flush=True)
    time.sleep(600)
"""


def _readline(proc: subprocess.Popen, timeout_s: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"the trainer said nothing within {timeout_s} s (exit code {proc.poll()})"
    return proc.stdout.readline()


def _members(pgid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        try:
            if (
                entry.isdigit()
                and int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid
            ):
                out.append(int(entry))
        except OSError:
            pass
    return out


def test_hung_server_times_out_and_killed_trainer_leaves_no_server(tmp_path, capfd):
    model = build_tiny_model("qwen2", vocab_size=256, hidden=32, layers=1, tie_embeddings=False)
    model_dir = save_model(model, None, tmp_path / "model")
    root = tmp_path / "engines"
    env = {**os.environ, "PYTHONPATH": str(Path(topp_rl.__file__).parents[1])}
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(model_dir), str(root)], env=env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    pgid = None
    try:
        info = json.loads(_readline(trainer, 240))
        pgid, url = info["pgid"], info["url"]
        assert len(_members(pgid)) >= 4  # watchdog, HTTP server, scheduler, detokenizer

        # A hung server: every wait ends within its bound, naming the server and the call.
        client = SGLangEngine(urls=[url], model_path=model_dir, workdir=tmp_path / "client", progress=False,
                              timeouts={"first_byte_s": 2.0, "per_token_s": 0.05, "transfer_s": 1.0,
                                        "weight_update_s": 2.0, "per_gb_s": 0.0}, progress_interval_s=0.5)  # fmt: skip
        os.killpg(pgid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(
                RequestTimeoutError, match=rf"^SGLang server {url}: POST /generate got no complete "
            ):
                client.generate([[1, 2, 3]], SamplingParams(max_new_tokens=17))
            # At least the bound (waited for it); the upper bound only catches a hang (a loaded machine is slow,
            # and that a timeout is not retried is checked by counting connections in test_sglang_client).
            assert 2.0 + 0.05 * 20 <= time.monotonic() - start < 2.0 + 0.05 * 20 + 60
            start = time.monotonic()
            # A sync's first call to the worker, pausing its generation, is bounded like the weight push itself.
            with pytest.raises(RequestTimeoutError, match=rf"{url}: POST /pause_generation .*per_gb"):
                client.update_weights(model.named_parameters())
            assert 2.0 <= time.monotonic() - start < 2.0 + 60
        finally:
            os.killpg(pgid, signal.SIGCONT)
        client.close()
        lines = [
            ln
            for ln in capfd.readouterr().err.splitlines()
            if ln.startswith(f"[topp_rl] SGLang server {url}")
        ]
        assert any("POST /generate waiting" in ln for ln in lines)
        assert any("POST /pause_generation waiting" in ln for ln in lines)

        # SIGKILL the trainer mid disk sync: the watchdog takes the server's whole group down.
        trainer.stdin.write("go\n")
        trainer.stdin.flush()
        weights = Path(_readline(trainer, 30).strip())
        assert weights.parent == Path(info["workdir"]) and (weights / "model.safetensors").is_file()
        members = _members(pgid)
        trainer.kill()
        trainer.wait(timeout=10)
        deadline = time.monotonic() + 10
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [pid for pid in members if Path(f"/proc/{pid}").exists()]
        assert not group_alive(pgid), f"server processes left after the trainer's SIGKILL: {left}"
        # The next start (any engine under the same root) removes the dead trainer's copy, keeps its log.
        make_workdir(root)
        assert sorted(p.name for p in Path(info["workdir"]).iterdir()) == ["server.log"]
    finally:
        if trainer.poll() is None:
            trainer.kill()
        if pgid is not None and group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)
