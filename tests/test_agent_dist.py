"""The agent loop (`task=lookup`, the embedded engine) through the distributed backbones, one gloo spawn per family:

- Megatron on 4 ranks: tp2 (x DP 2), cp2 (x DP 2), tp2_cp2, and tiny Qwen3-MoE at ep2 (x DP 4 for attention)
  with routing replay (each trajectory's routes come from its last model turn's call);
- FSDP on 2 ranks (DP 2), and the OpenAI-compatible endpoint (`task=agent`) through it, two updates ahead;
- tp2 and ep2 with routing replay, with rollouts two updates ahead (`rollout.max_staleness=2`: a trajectory's
  turns may span weight versions; replay keeps each turn's recorded routes).
Every run: the masked on-policy |train - rollout| log-prob over trained tokens <= 1e-5 mean and <= 1e-4 max at
rollout.top_p=0.9 at every step (runs ahead: over the tokens the trained weights sampled, and never more than two
updates stale), the unmasked figure far above, every rank logging the same keys, the agent loop's
figures finite, and trajectory numbers step-global across DP ranks. Turns of 4 tokens around the environment's
"=v", so CP's zigzag chunks cut through environment tokens (asserted on the packed batch). After the run, each
rank changes every per-token field of the environment's tokens (advantage, rollout and reference log-prob) and the
ids of environment tokens appended after the last turn: the loss (a KL term and TIS included) and this rank's
every gradient stay bit for bit the same, while a model token's advantage changes them.
"""

import copy
import dataclasses
import importlib.util
import os
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from helpers import metric_columns

NO_MEGATRON = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                 reason="megatron-core (the `megatron` extra) is not installed")

LOOKUP = [
    "task=lookup", "rollout.top_p=0.9", "rollout.max_new_tokens=4", "trainer.max_steps=2",
    "rollout.prompts_per_step=4", "rollout.n_samples=4", "checkpoint.every_n_steps=0",
    "trainer.enable_progress_bar=false", "logger=csv", "export.hf=false",
]
AGENT_KEYS = ("rollout/turns_mean", "rollout/env_tokens_frac", "rollout/samples_per_trajectory_mean",
              "rollout/trajectories_failed", "rollout/prefix_breaks")
# Rollouts two updates ahead of training (the source rank generates on background threads beside the collectives).
AHEAD = ("rollout.max_staleness=2", "rollout.engine.share_weights=false", "algo.loss.tis_cap=2.0", "trainer.max_steps=3")
ENDPOINT = ("task=agent", "task.agent=topp_rl.tasks.agents.lookup:lookup_agent")
MEGATRON_RUNS = {  # world size 4
    "tp2": ("parallel=tp2", "trainer.devices=4"),
    "tp2_ahead": ("parallel=tp2", "trainer.devices=4", *AHEAD),
    "cp2": ("parallel=cp2", "trainer.devices=4"),
    "tp2_cp2": ("parallel=tp2_cp2",),
    "moe_ep2_replay": ("parallel=ep2", "trainer.devices=4", "model.family=qwen3_moe", "rollout.routing_replay=true"),
    "moe_ep2_replay_ahead": ("parallel=ep2", "trainer.devices=4", "model.family=qwen3_moe",
                             "rollout.routing_replay=true", *AHEAD),
}
FSDP_RUNS = {"fsdp": ("parallel=fsdp", "trainer.devices=2"),  # world size 2
             "fsdp_endpoint_ahead": ("parallel=fsdp", "trainer.devices=2", *ENDPOINT, *AHEAD)}
PRELOAD = ("megatron.core", "megatron.core.models.gpt", "topp_rl.megatron.strategy", "topp_rl.train", "hydra")


def _run(output_dir: Path, *extra: str) -> dict:
    from helpers import compose_config
    from lightning.pytorch.callbacks import Callback

    from topp_rl.train import build_run

    class Keep(Callback):  # the last step's samples and the keys this rank logged
        samples, keys = None, set()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            Keep.samples = copy.deepcopy(outputs["rollout"].samples)
            Keep.keys = set(trainer.callback_metrics)

    cfg = compose_config(output_dir, *LOOKUP, *extra)
    run = build_run(cfg)
    run.trainer.callbacks.insert(0, Keep())
    try:
        run.trainer.fit(run.module, datamodule=run.datamodule)
        invariance = _env_tokens_change_nothing(run, Keep.samples)
    finally:
        run.datamodule.close_engine()
    return {"metrics": metric_columns(output_dir) if run.trainer.is_global_zero else {}, "keys": sorted(Keep.keys),
            "trajectories": sorted(s.metadata["trajectory"] for s in Keep.samples),
            "indices": sorted(s.index for s in Keep.samples), **invariance}


def _env_tokens_change_nothing(run, samples) -> dict:
    """Pack the last step's samples (+ 2 environment tokens after each last turn) as the datamodule does and compare
    the loss and this rank's gradients with every environment token's fields (and the tail's ids) changed."""
    from topp_rl.data.sample import SampleStatus
    from topp_rl.losses import GRPOLoss
    from topp_rl.rollout.packing import pack_samples
    from topp_rl.trainer.timer import PhaseTimer

    dm, module = run.datamodule, run.module
    live = [s for s in copy.deepcopy(samples) if s.status != SampleStatus.ABORTED]
    tail = dm.tokenizer.encode("=9", add_special_tokens=False)
    for s in live:
        routes, s.routes = s.routes, None
        s.append_response_tokens(tail, trainable=False)
        if routes is not None:  # the tail's routes: any valid experts (only the tail attends to them)
            s.routes = torch.cat([routes, routes[-1:].expand(len(tail), *routes.shape[1:])])
    dp = dm.collectives
    totals = dp.sum(torch.tensor([float(sum(sum(s.loss_mask) for s in live)), float(len(live))]))
    micro = pack_samples(live, torch.linspace(-1.0, 1.5, len(live)), max_tokens=dm.max_tokens,
                         num_loss_tokens_global=float(totals[0]), num_sequences_global=int(totals[1]), most=dp.max)
    module.loss_fn = GRPOLoss(kl_coef=0.1, tis_cap=2.0)
    old = [module.onpolicy_pass(mb)[0] for mb in micro]
    refs = [o - 0.05 * torch.arange(o.numel()).remainder(3) for o in old]  # a reference a little off: KL > 0

    def changed(mb, ref, old_mb):
        env = mb.loss_mask == 0
        out = dataclasses.replace(mb, tokens=mb.tokens.clone(), response_tokens=mb.response_tokens.clone(),
                                  rollout_log_probs=mb.rollout_log_probs.clone(), advantages=mb.advantages.clone())
        out.rollout_log_probs[env], out.advantages[env] = -3.7, 9.0
        ends_r, ends_t = torch.cumsum(mb.response_lengths, 0), mb.cu_seqlens[1:].long()
        for back in (1, 2):
            out.response_tokens[ends_r - back] = 40 + back
            out.tokens[ends_t - back] = 40 + back
        ref, old_mb = ref.clone(), old_mb.clone()
        ref[env], old_mb[env] = 2.0, -1.0
        return out, ref, old_mb

    def grads(batches, references, olds):
        module.zero_grad(set_to_none=True)
        sums, _ = module.accumulate_gradients(batches, references, old=olds, timer=PhaseTimer())
        local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                 for p in module.parameters() if p.grad is not None]
        return [g.clone() for g in local], sums["train/loss"]

    base, base_loss = grads(micro, refs, old)
    other = list(zip(*(changed(*args) for args in zip(micro, refs, old, strict=True)), strict=True))
    same, same_loss = grads(*other)
    first = other[0][0]
    first.advantages[int((first.loss_mask == 1).nonzero()[0])] += 1.0  # a model token: the comparison can see it
    _, moved_loss = grads(*other)
    module.zero_grad(set_to_none=True)
    cp = getattr(module.layout, "cp_size", 1) > 1
    return {"grads_equal": len(base) > 0 and all(torch.equal(a, b) for a, b in zip(base, same, strict=True)),
            "grad_nonzero": any(float(g.abs().max()) > 0 for g in base),
            "loss": (base_loss, same_loss, moved_loss), "cuts": _zigzag_env_cuts(micro) if cp else None}


def _zigzag_env_cuts(micro) -> int:
    """Zigzag chunk boundaries (cp 2: each sequence padded to a multiple of 4, cut in 4 equal chunks) that fall
    between two environment tokens."""
    cuts = 0
    for mb in micro:
        prompts = mb.seq_lengths - mb.response_lengths
        masks = mb.loss_mask.split(mb.response_lengths.tolist())
        for length, prompt, mask in zip(mb.seq_lengths.tolist(), prompts.tolist(), masks, strict=True):
            chunk = -(-length // 4)
            for b in (chunk, 2 * chunk, 3 * chunk):
                lo, hi = b - 1 - prompt, b - prompt  # response positions of the tokens either side of the cut
                cuts += 0 <= lo and hi < len(mask) and int(mask[lo]) == 0 and int(mask[hi]) == 0
    return cuts


def _worker(rank: int, world: int, tmp: str, runs: dict) -> dict:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # the group is up: Lightning only reads ranks
    return {name: _run(Path(tmp) / name, *extra) for name, extra in runs.items()}


def _check(results: list[dict], name: str, *, dp: int) -> dict:
    ranks = [r[name] for r in results]
    metrics = ranks[0]["metrics"]
    masked, worst = metrics["train/rollout_logprob_abs_diff"], metrics["train/rollout_logprob_abs_diff_max"]
    unmasked = metrics["train/rollout_logprob_abs_diff_unmasked"]
    if "ahead" in name:  # over the tokens the trained weights sampled (older ones differ on purpose)
        masked, worst = _check_ahead(metrics, name), [0.0]
    assert len(masked) == len(unmasked) == 3 if "ahead" in name else len(masked) == len(worst) == 2, name
    assert max(masked) <= 1e-5 and max(worst) <= 1e-4, (name, masked, worst)
    assert min(unmasked) > 1e-2, (name, unmasked)  # the bias the mask removes, far above
    assert max(metrics["rollout/env_tokens_frac"]) > 0 and set(metrics["rollout/trajectories_failed"]) == {0.0}
    for key in AGENT_KEYS:
        assert key in metrics, (name, key)
    assert all(r["keys"] == ranks[0]["keys"] for r in ranks), name  # every rank logs the same keys
    # DP ranks number their trajectories step-globally: the step's 16 numbers once each over the DP ranks
    numbers = sorted({n for r in ranks for n in r["trajectories"]})
    assert numbers == list(range(16)), name
    if "endpoint" in name:  # an agent that rewrites its history splits its trajectory into several samples
        per_rank = [set(r["trajectories"]) for r in ranks]
        assert sum(map(len, per_rank)) == 16 * len(ranks) // dp and len(set(map(frozenset, per_rank))) == dp, name
    else:
        assert sum(len(r["trajectories"]) for r in ranks) == 16 * len(ranks) // dp, name
        assert all(r["trajectories"] == r["indices"] for r in ranks), name
    for r in ranks:
        base, same, moved = r["loss"]
        assert r["grads_equal"] and r["grad_nonzero"] and base == same and moved != base, (name, r["loss"])
    if "moe" in name:  # on-policy steps: the trainer's router picks the rollout's experts; older weights differ
        agreement = metrics["train/routing_agreement"]
        assert agreement[0] == 1.0 and (0 < min(agreement) if "ahead" in name else set(agreement) == {1.0}), name
    return {"masked_mean": max(masked), "masked_max": max(worst), "unmasked": min(unmasked)}


def _check_ahead(metrics: dict, name: str) -> list[float]:
    """Two updates ahead: every step within the bound, the steps' tokens of the trained weights (step 0's at least)
    on-policy; returns that masked mismatch per step where there were such tokens."""
    assert len(metrics["rollout/staleness_max"]) == 3 and max(metrics["rollout/staleness_max"]) <= 2, name
    assert metrics["rollout/dropped_stale"] == [0.0] * 3, name
    current = metrics["train/rollout_logprob_abs_diff_current"]
    assert 1 <= len(current) <= 3, (name, current)
    return current + [0.0] * (3 - len(current))


@NO_MEGATRON
@pytest.mark.distributed
@pytest.mark.slow
def test_agent_loop_through_megatron_on_four_ranks(tmp_path):
    results = run_distributed(_worker, 4, 4, str(tmp_path), MEGATRON_RUNS, timeout=900, preload=PRELOAD)
    dp = {"tp2": 2, "tp2_ahead": 2, "cp2": 2, "tp2_cp2": 1, "moe_ep2_replay": 4, "moe_ep2_replay_ahead": 4}
    for name in MEGATRON_RUNS:
        print(name, _check(results, name, dp=dp[name]))
    for name in ("cp2", "tp2_cp2"):  # zigzag chunks cut through environment tokens
        assert sum(r[name]["cuts"] for r in results) > 0, name


@pytest.mark.distributed
@pytest.mark.slow
def test_agent_loop_through_fsdp_on_two_ranks(tmp_path):
    results = run_distributed(_worker, 2, 2, str(tmp_path), FSDP_RUNS, timeout=600, preload=("topp_rl.train", "hydra"))
    for name in FSDP_RUNS:
        print(name, _check(results, name, dp=2))
