"""GPU checks of the placement plan and of colocated mode, run by scripts/gpu_check.sh (CUDA torch here, a CUDA
SGLang venv in $TOPP_RL_SGLANG_PYTHON from `scripts/setup_sglang.sh --gpu`, nvidia-smi on the PATH).

1. Placement: servers launched where `plan_placement` puts them (colocated on GPU 0 beside the trainer; with a
   second GPU also a disaggregated one on GPU 1) are read back: the GPUs their processes hold memory on
   (nvidia-smi), their `/server_info` (tp_size, base_gpu_id, mem_fraction_static), and their memory against
   mem_fraction_static x the GPU's total.
2. The colocated round trip on GPU 0, with the trainer's copy of the weights on the same GPU: generate, release
   (the server's memory on the GPU falls to under a quarter: SGLang's memory saver frees its weights, KV cache and
   CUDA graphs, its CUDA context stays), one SGD step of the trainer's copy, resume + push over CUDA IPC + resume
   the KV cache, generate: the masked log-probs (renormalised over each recorded kept set) of the bf16 server
   equal the float32 recomputation under the new weights within the bf16 bounds of gpu_check.sh's training runs
   (mean 1e-2, every token 1e-1), and are far from the old weights'.
   With a second GPU the disaggregated server gets the same push over NCCL and the same check.
"""

import argparse
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from topp_rl.data.params import SamplingParams
from topp_rl.engines.sglang import ColocatedSGLangEngine, SGLangEngine
from topp_rl.models import build_tiny_model, save_model
from topp_rl.parallel.placement import plan_placement
from topp_rl.parallel.plan import ParallelPlan

PROMPTS = [[1, 5, 9, 14, 20], [1, 33, 7], [1, 60, 61, 62, 63, 64, 65, 66]]
PARAMS = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=16, n=2)
MEAN_BOUND, TOKEN_BOUND = 1e-2, 1e-1  # bf16 serving vs a float32 recomputation: gpu_check.sh's bf16 bounds
SERVER = {"dtype": "bfloat16", "max_total_tokens": 8192}


def gpu_memory_mib(pids: set[int]) -> dict[int, int]:
    """MiB held by `pids` per GPU, by index among the GPUs this process sees (nvidia-smi numbers them physically)."""
    smi = ["nvidia-smi", "--format=csv,noheader,nounits"]
    uuids = dict(line.split(", ") for line in subprocess.check_output(
        [*smi, "--query-gpu=uuid,index"], text=True).splitlines())
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    order = [d.strip() for d in visible.split(",")] if visible else sorted(uuids.values(), key=int)
    held: dict[int, int] = {}
    for line in subprocess.check_output([*smi, "--query-compute-apps=pid,gpu_uuid,used_memory"], text=True).splitlines():
        pid, uuid, mib = line.split(", ")
        if int(pid) in pids:
            index = order.index(uuids[uuid])
            held[index] = held.get(index, 0) + int(mib)
    return held


def server_pids(engine: SGLangEngine) -> set[int]:
    """Every process of the engine's launched servers' process groups."""
    groups = {srv.pid for srv in engine.servers}
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[2]) in groups:
                    found.add(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found


def check_placed(engine: SGLangEngine, gpus: tuple[int, ...], fraction: float) -> int:
    """The server sits on exactly `gpus` with the planned settings; returns the MiB it holds there."""
    info = engine.fleet.infos[engine.urls[0]]
    assert (info["tp_size"], info["base_gpu_id"], info["mem_fraction_static"]) == (len(gpus), 0, fraction), info
    held = gpu_memory_mib(server_pids(engine))
    total = torch.cuda.get_device_properties(gpus[0]).total_memory / 2**20
    print(f"gpu_placement_check: server {engine.urls[0]} holds {held} MiB per GPU (planned: GPUs {list(gpus)}, "
          f"mem_fraction_static {fraction} of {total:.0f} MiB)")
    assert set(held) == set(gpus), f"server on GPUs {sorted(held)}, planned {list(gpus)}"
    assert all(mib <= fraction * total + 2048 for mib in held.values()), "more than its fraction (+2 GiB context)"
    return sum(held.values())


def log_prob_diffs(samples, model) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, |recorded - float32 recomputation| of the masked log-prob (renormalised over the recorded kept set)
    and of the raw one (over the whole vocabulary)."""
    device = next(model.parameters()).device
    masked, raw = [], []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids], device=device)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
        p = len(s.prompt_ids)
        scaled = torch.log_softmax(logits[p - 1:p - 1 + s.response_length] / PARAMS.temperature, -1).cpu()
        for i, tok in enumerate(s.response_ids):
            kept = s.candidates.ids[s.candidates.offsets[i]:s.candidates.offsets[i + 1]].long()
            masked.append(abs(float(scaled[i, tok] - torch.logsumexp(scaled[i, kept], 0)) - s.rollout_log_probs[i]))
            raw.append(abs(float(scaled[i, tok]) - s.rollout_raw_log_probs[i]))
    return torch.tensor(masked), torch.tensor(raw)


def train_step(model) -> None:
    """One SGD step of the trainer's copy (a next-token loss on the prompts), where it lives."""
    device = next(model.parameters()).device
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    for prompt in PROMPTS:
        ids = torch.tensor([prompt], device=device)
        model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def round_trip(engine: SGLangEngine, model, label: str, *, released: Callable[[], None] | None = None) -> None:
    """generate, [release], a training step, push, generate: the new samples follow the new weights."""
    old = [p.detach().clone() for p in model.parameters()]
    before, _ = log_prob_diffs(engine.generate(PROMPTS, PARAMS), model)
    if released is not None:
        released()
    train_step(model)
    engine.update_weights(model.named_parameters())
    samples = engine.generate(PROMPTS, PARAMS)
    masked, raw = log_prob_diffs(samples, model)
    with torch.no_grad():
        for p, o in zip(model.parameters(), old, strict=True):
            p.copy_(o)
        _, stale = log_prob_diffs(samples, model)
    print(f"gpu_placement_check: {label}: masked |diff| mean {masked.mean():.3g} max {masked.max():.3g} (before the "
          f"step {before.mean():.3g}); raw |diff| {raw.mean():.3g}, against the old weights {stale.mean():.3g}")
    assert before.mean() <= MEAN_BOUND and masked.mean() <= MEAN_BOUND and masked.max() <= TOKEN_BOUND
    assert stale.mean() > 10 * raw.mean(), "the generation does not follow the pushed weights"


def main(argv: list[str] | None = None) -> None:
    args = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args.add_argument("--cpu", action="store_true", help="the colocated round trip on a CPU server (float32, no "
                      "memory saver, no placement read-back): the script's own check, runnable anywhere")
    cpu = args.parse_args(argv).cpu
    root = Path(tempfile.mkdtemp(prefix="gpu_placement_check-"))
    try:
        check(root, cpu=cpu)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def check(root: Path, *, cpu: bool) -> None:
    device = "cpu" if cpu else "cuda:0"
    model = build_tiny_model("qwen2", vocab_size=512, hidden=64, layers=2, max_positions=4096,
                             initializer_range=0.4, seed=3)
    path = save_model(model, None, root / "model")
    model.to(device)
    if cpu:
        with ColocatedSGLangEngine(model_path=path, progress=False, workdir=root / "colocated") as engine:
            round_trip(engine, model, "colocated on CPU, shared memory", released=engine.release_memory)
        print("gpu_placement_check: OK (CPU)")
        return
    (colocated,) = plan_placement(ParallelPlan(world=1), nodes=1, devices=1, placement="colocated").servers
    with ColocatedSGLangEngine(model_path=path, placed=[colocated], server_kwargs=SERVER, progress=False,
                               workdir=root / "colocated") as engine:
        held = check_placed(engine, colocated.gpus, colocated.mem_fraction)

        def release() -> None:
            engine.release_memory()
            left = sum(gpu_memory_mib(server_pids(engine)).values())
            print(f"gpu_placement_check: colocated server released {held} -> {left} MiB")
            assert left < held / 4, "the server kept its memory through release_memory"

        round_trip(engine, model, "colocated on GPU 0, CUDA IPC", released=release)
    if torch.cuda.device_count() >= 2:
        (apart,) = plan_placement(ParallelPlan(world=1), nodes=1, devices=1, gpus="1").servers
        with SGLangEngine(model_path=path, placed=[apart], server_kwargs=SERVER, weight_sync="distributed",
                          progress=False, workdir=root / "disaggregated") as engine:
            check_placed(engine, apart.gpus, apart.mem_fraction)
            round_trip(engine, model, "disaggregated on GPU 1, NCCL")
    else:
        print("gpu_placement_check: one GPU: the disaggregated server needs a second one; skipped")
    print("gpu_placement_check: OK")


if __name__ == "__main__":
    main()
