"""`MegatronStrategy` under a real Lightning Trainer on 4 CPU processes.

`PolicyModule` (GRPO loss with a KL term to the frozen reference, which the strategy converts too; SGD; grad
clipping; two micro-batches per step) trained through Megatron at (TP, CP, DP) = (2, 1, 2), (1, 2, 2) and
(2, 2, 1) ends with the same weights (exported under HF names) and the same gradient norms as the same module
trained on the HF model in one process over the union of the DP shards. This checks the policy conversion, the
DP sampler split, the gradient sum over DP x CP with accumulation, TP-aware clipping and the export together.
SGD, because Adam's first step is sign(g): 1e-7 noise on near-zero gradients becomes lr-sized weight differences.
A checkpoint round trip (HF-named full weights + per-TP-rank optimizer state) is checked at the end.
"""

import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch
from dist_utils import run_distributed

NO_MEGATRON = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                 reason="megatron-core (the `megatron` extra) is not installed")

STEPS = 2
LAYOUTS = [(2, 1), (1, 2), (2, 2)]
PRELOAD = ("megatron.core", "megatron.core.models.gpt", "topp_rl.megatron.strategy", "topp_rl.trainer.module", "lightning")


def micro_batch(seed: int, *, vocab: int, num_loss_tokens_global: float, num_sequences_global: int):
    """A packed micro-batch with rollout fields, candidate rows (some empty) and one sample without data."""
    from topp_rl.ops import Candidates

    g = torch.Generator().manual_seed(seed)
    seq_lengths = torch.tensor([7, 10])
    response_lengths = torch.tensor([3, 6])
    tokens = torch.randint(3, vocab, (int(seq_lengths.sum()),), generator=g)
    ends = torch.cumsum(seq_lengths, 0)
    response_tokens = torch.cat([tokens[e - r: e] for e, r in zip(ends.tolist(), response_lengths.tolist(), strict=True)])
    r_total = int(response_lengths.sum())
    rows = [[] if i % 4 == 3 else torch.randperm(vocab, generator=g)[: 1 + i % 3].tolist() for i in range(r_total)]
    return SimpleNamespace(
        tokens=tokens, seq_lengths=seq_lengths, response_lengths=response_lengths,
        position_ids=torch.cat([torch.arange(n) for n in seq_lengths.tolist()]),
        response_tokens=response_tokens, candidates=Candidates.from_lists(rows),
        loss_mask=(torch.arange(r_total) % 5 != 4).float(),
        advantages=torch.randn(r_total, generator=g),
        rollout_log_probs=-torch.rand(r_total, generator=g),
        sample_index=torch.tensor([seed % 7, seed % 7 + 1]),
        num_loss_tokens_global=num_loss_tokens_global, num_sequences_global=num_sequences_global,
        routes=None, staleness=None,  # no recorded MoE routes, on-policy tokens (PackedBatch's defaults)
    )


def steps_data(dp_size: int, vocab: int) -> list[list[list]]:
    """[step][dp_rank] -> micro-batches; denominators count every DP shard of the step."""
    out = []
    for step in range(STEPS):
        seeds = [[100 * step + 10 * d + m for m in range(2)] for d in range(dp_size)]
        probe = [micro_batch(s, vocab=vocab, num_loss_tokens_global=1.0, num_sequences_global=1) for ss in seeds for s in ss]
        tokens = float(sum(float(mb.loss_mask.sum()) for mb in probe))
        out.append([[micro_batch(s, vocab=vocab, num_loss_tokens_global=tokens, num_sequences_global=2 * len(probe))
                     for s in ss] for ss in seeds])
    return out


class _Record:
    """Callback keeping each step's grad norm."""

    def __new__(cls):
        from lightning.pytorch.callbacks import Callback

        class Record(Callback):
            def __init__(self):
                self.norms = []

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                s, c = outputs["metrics"]["train/grad_norm"]
                self.norms.append(s / c)

        return Record()


def fit(policy, items, *, strategy, devices: int, tmp: str):
    import lightning as L
    from torch.utils.data import DataLoader

    from topp_rl.losses import GRPOLoss
    from topp_rl.trainer.backbone import HFBackbone
    from topp_rl.trainer.hook import ToppLogProb
    from topp_rl.trainer.module import PolicyModule

    module = PolicyModule(
        policy=HFBackbone(policy), loss=GRPOLoss(eps_clip=0.2, eps_clip_high=0.28, kl_coef=0.05), hook=ToppLogProb(temperature=0.9),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5), grad_clip=0.5,
    )
    record = _Record()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
                        use_distributed_sampler=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[record], default_root_dir=tmp)
    loader = DataLoader(items, batch_size=1, collate_fn=lambda xs: xs[0])
    trainer.fit(module, train_dataloaders=loader)
    return module, record.norms, trainer


def _worker(rank: int, tmp: str) -> dict:
    import torch.distributed as dist

    from topp_rl.megatron.strategy import MegatronStrategy
    from topp_rl.models import build_tiny_model

    world = dist.get_world_size()
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # group already up: Lightning only reads ranks
    results = {}
    for tp, cp in LAYOUTS:
        dp = world // (tp * cp)
        data = steps_data(dp, vocab=128)
        # This rank's DP shard of every step, in step order (Megatron orders ranks TP fastest, then CP, then DP).
        # Lightning's DistributedSampler would shuffle the items with PL_GLOBAL_SEED, which an earlier in-process
        # run may have set: steps would then mix up.
        dp_rank = rank // (tp * cp)
        items = [SimpleNamespace(micro_batches=step[dp_rank]) for step in data]
        model = build_tiny_model("qwen2", seed=5)
        strategy = MegatronStrategy(tp_size=tp, cp_size=cp, process_group_backend="gloo")
        module, norms, trainer = fit(model, items, strategy=strategy, devices=world, tmp=tmp)
        weights = {k: v.clone() for k, v in module.policy.hf_named_tensors()}
        ckpt = os.path.join(tmp, f"ckpt_{tp}_{cp}.ckpt")
        trainer.save_checkpoint(ckpt)
        # Reload into fresh converted weights: the HF-named checkpoint restores the same model.
        strategy_state = trainer.strategy
        with torch.no_grad():
            for p in module.policy.parameters():
                p.zero_()
        strategy_state.load_model_state_dict(torch.load(ckpt, weights_only=False))
        reloaded = dict(module.policy.hf_named_tensors())
        results[(tp, cp)] = {"weights": weights if rank == 0 else None, "norms": norms,
                             "reload_exact": all(torch.equal(reloaded[k], weights[k]) for k in weights)}
        dist.barrier()
    if rank == 0:  # reference: HF, one process, every DP shard of a step in one batch
        for key in ("LOCAL_RANK", "RANK", "NODE_RANK", "WORLD_SIZE"):
            os.environ.pop(key, None)
        for tp, cp in LAYOUTS:
            dp = world // (tp * cp)
            data = steps_data(dp, vocab=128)
            items = [SimpleNamespace(micro_batches=[mb for shard in step for mb in shard]) for step in data]
            ref, norms, _ = fit(build_tiny_model("qwen2", seed=5), items, strategy="auto", devices=1, tmp=tmp)
            results[(tp, cp)]["ref_weights"] = {k: v.clone() for k, v in ref.policy.hf_named_tensors()}
            results[(tp, cp)]["ref_norms"] = norms
    return results


@NO_MEGATRON
@pytest.mark.distributed
def test_strategy_trains_like_the_hf_model(tmp_path):
    results = run_distributed(_worker, 4, str(tmp_path), timeout=500, preload=PRELOAD)
    for layout in LAYOUTS:
        r0 = results[0][layout]
        for rank in range(4):
            assert results[rank][layout]["reload_exact"], (layout, rank)
            assert results[rank][layout]["norms"] == pytest.approx(r0["ref_norms"], rel=1e-5, abs=1e-6), layout
        assert all(n > 0.5 for n in r0["ref_norms"]), "clipping at 0.5 must be active for the test to bite"
        errs = {k: float((r0["weights"][k] - v).abs().max()) for k, v in r0["ref_weights"].items() if k in r0["weights"]}
        assert set(r0["ref_weights"]) - set(r0["weights"]) <= {"lm_head.weight"}
        assert max(errs.values()) <= 1e-5, (layout, sorted(errs.items(), key=lambda kv: -kv[1])[:3])
