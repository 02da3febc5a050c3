"""The callbacks on a real Lightning Trainer: synthetic on-policy records and rollout samples go through a real
LightningModule's training_step, and the logged values (CSVLogger's metrics.csv, W&B offline summary) are
checked against numpy computations of the same figures; WeightSync against a real EmbeddedEngine."""

import csv
import json
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from topp_rl.callbacks import LogProbMismatch, RolloutStats, SupportStats, WeightSync
from topp_rl.data import RolloutBatch
from topp_rl.data.sample import Sample, SampleStatus
from topp_rl.trainer.metrics import reduce_sums
from topp_rl.trainer.records import OnPolicyRecord
from topp_rl.trainer.step_metrics import StepMetrics

STEPS = 3


def make_record(step: int, rank: int = 0) -> OnPolicyRecord:
    g = torch.Generator().manual_seed(100 * rank + step)
    n = 40 + 7 * rank + step
    rollout = -torch.rand(n, generator=g) * 3
    support = torch.randint(0, 7, (n,), generator=g)
    support[:3] = torch.tensor([1, 1, 0])
    return OnPolicyRecord(
        logprobs=rollout + torch.randn(n, generator=g) * 0.05,
        logprobs_unmasked=rollout - torch.rand(n, generator=g) * 1.5,  # some beyond ln 2: extreme tokens
        rollout_logprobs=rollout,
        loss_mask=(torch.rand(n, generator=g) > 0.25).float(),
        entropy=torch.rand(n, generator=g) * 2,
        support_size=support,
        staleness=torch.randint(0, 3, (n,), generator=g),  # rollouts ahead: some tokens of the trained weights
    )


def make_samples(step: int, rank: int = 0) -> list[Sample]:
    g = np.random.default_rng(10 * rank + step)
    samples = []
    for i in range(8):
        n = int(g.integers(1, 6))
        status = [SampleStatus.COMPLETED, SampleStatus.TRUNCATED, SampleStatus.ABORTED][i % 3 if i < 5 else 0]
        group = i // 2
        reward = None if status == SampleStatus.ABORTED else float(g.choice([0.0, 0.5, 1.0]))
        if group == 3:
            reward = 0.5  # a zero-variance group
        meta = {"correct": True} if i == 6 else {}
        if reward is not None:  # each reward function's value, as a task with a reward set leaves them
            meta["rewards"] = {"exact": float(reward == 1.0), "fmt/tags": float(g.choice([0.0, 0.25]))}
        samples.append(
            Sample(
                prompt_ids=[1, 2],
                response_ids=[3] * n,
                loss_mask=[1] * n,
                rollout_log_probs=[-0.5] * n,
                reward=reward,
                group_index=group,
                index=i,
                status=status,
                metadata=meta,
            )
        )
    return samples


class SyntheticPolicy(L.LightningModule):
    """Manual optimisation like PolicyModule: one optimizer step per rollout step, outputs per the contract;
    like PolicyModule it logs its own step metrics, reduced once across ranks (`log_metrics=False`: none)."""

    def __init__(self, *, log_metrics: bool = True) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.policy = torch.nn.Linear(3, 2)
        self.log_metrics = log_metrics

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = self.policy(torch.ones(1, 3)).square().sum()
        self.manual_backward(loss)
        opt.step()
        rank = self.global_rank
        metrics = {
            "train/loss": (float(loss.detach()) * (rank + 1), rank + 1.0),
            "train/grad_norm": (3.0, 1.0),
            "train/probe": (1.0 + 3 * rank, 1.0 + rank),
        }
        if self.log_metrics:
            StepMetrics.of(self.trainer).add(self.trainer, reduce_sums(self.trainer, metrics))
        return {
            "rollout": RolloutBatch(
                micro_batches=[],  # the callbacks read samples and stats only
                samples=make_samples(batch_idx, rank),
                step=batch_idx,
                stats={"perf/generate_s": (2.0 + rank, 1.0)},
            ),
            "onpolicy": make_record(batch_idx, rank),
            "metrics": metrics,
        }

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(list(range(STEPS)), batch_size=None)


def fit(tmp_path, callbacks, *, logger, module=None, datamodule=None, **trainer_kwargs):
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=logger,
        callbacks=[*callbacks, StepMetrics()],  # the owner of the step's figures (PolicyModule brings its own)
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        log_every_n_steps=1,
        **trainer_kwargs,
    )
    trainer.fit(module or SyntheticPolicy(), datamodule=datamodule)
    return trainer


def read_csv(path: Path) -> list[dict[str, float]]:
    """One dict per step, merging rows of the same step."""
    steps: dict[int, dict[str, float]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            into = steps.setdefault(int(row["step"]), {})
            into.update({k: float(v) for k, v in row.items() if v != "" and k != "step"})
    return [steps[k] for k in sorted(steps)]


def expected_mismatch(records: list[OnPolicyRecord]) -> dict[str, float]:
    keep = np.concatenate([r.loss_mask.numpy() > 0 for r in records])
    col = {
        f: np.concatenate([getattr(r, f).double().numpy() for r in records])[keep]
        for f in records[0].__dataclass_fields__
        if f != "routing_agreement"
    }
    current = col["staleness"] == 0
    out = {"train/rollout_logprob_abs_diff_current": np.abs(col["logprobs"] - col["rollout_logprobs"])[current].mean()}
    for suffix, lp in (("", col["logprobs"]), ("_unmasked", col["logprobs_unmasked"])):
        d = lp - col["rollout_logprobs"]
        ratio = np.exp(d)
        out |= {
            f"train/rollout_logprob_abs_diff{suffix}": np.abs(d).mean(),
            f"train/rollout_logprob_abs_diff_max{suffix}": np.abs(d).max(),
            f"train/rollout_logprob_abs_diff_p99{suffix}": np.quantile(np.abs(d), 0.99),
            f"train/kl_k3_rollout{suffix}": (ratio - 1 - d).mean(),
            f"train/is_ratio_mean{suffix}": ratio.mean(),
            f"train/is_ratio_min{suffix}": ratio.min(),
            f"train/is_ratio_max{suffix}": ratio.max(),
            f"train/is_ratio_outside_frac{suffix}": ((ratio < 0.9) | (ratio > 1.1)).mean(),
            f"train/rollout_extreme_frac{suffix}": (np.abs(d) > np.log(2.0)).mean(),
        }
    return out


def expected_support(records: list[OnPolicyRecord]) -> dict[str, float]:
    sizes = np.concatenate([r.support_size[r.loss_mask > 0].numpy() for r in records])
    has = sizes[sizes > 0]
    return {
        "rollout/support_coverage": len(has) / len(sizes),
        "rollout/support_size_mean": has.mean(),
        "rollout/support_size_median": np.median(has),
        "rollout/support_size_p99": np.quantile(has, 0.99),
        "rollout/support_size_max": has.max(),
        "rollout/support_singleton_frac": (has == 1).mean(),
    }


def expected_rollout(sample_lists: list[list[Sample]], gen_seconds: list[float]) -> dict[str, float]:
    samples = [s for lst in sample_lists for s in lst]
    live = [s for s in samples if s.status != SampleStatus.ABORTED]
    rewards = np.array([s.reward for s in live])
    correct = np.array([s.metadata.get("correct", s.reward >= 1.0) for s in live])
    groups = {}
    for rank, lst in enumerate(sample_lists):  # groups are per rank
        for s in lst:
            if s.status != SampleStatus.ABORTED:
                groups.setdefault((rank, s.group_index), []).append(s.reward)
    return {
        "rollout/reward_mean": rewards.mean(),
        "rollout/reward_std": rewards.std(),
        "rollout/accuracy": correct.mean(),
        "rollout/response_length_mean": np.mean([s.response_length for s in live]),
        "rollout/truncation_rate": np.mean([s.status == SampleStatus.TRUNCATED for s in live]),
        "rollout/aborted_frac": 1 - len(live) / len(samples),
        "rollout/zero_variance_group_frac": np.mean([max(g) == min(g) for g in groups.values()]),
        "perf/generate_s": np.mean(gen_seconds),
        "rollout/reward/exact_mean": np.mean([s.metadata["rewards"]["exact"] for s in live]),
        "rollout/reward/fmt/tags_mean": np.mean([s.metadata["rewards"]["fmt/tags"] for s in live]),
    }


def assert_logged(rows: list[dict[str, float]], world_size: int) -> None:
    assert len(rows) == STEPS
    for step, row in enumerate(rows):
        ranks = range(world_size)
        expected = (
            expected_mismatch([make_record(step, r) for r in ranks])
            | expected_support([make_record(step, r) for r in ranks])
            | expected_rollout([make_samples(step, r) for r in ranks], [2.0 + r for r in ranks])
            | {"train/grad_norm": 3.0}
            # pooled (sum, count) mean: 1 on one rank, (1 + 4) / (1 + 2) on two (the mean of rank means is 1.5)
            | {"train/probe": 1.0 if world_size == 1 else 5 / 3}
        )
        for name, value in expected.items():
            assert row[name] == pytest.approx(value, rel=1e-6, abs=1e-9), (step, name)
        assert 0 < row["train/rollout_logprob_abs_diff"] < row["train/rollout_logprob_abs_diff_unmasked"]


class TaskDataModule(L.LightningDataModule):
    """Holds a real task, as RolloutDataModule does: RolloutStats logs the task's own figures."""

    def __init__(self, task) -> None:
        super().__init__()
        self.task = task

    def train_dataloader(self):
        return torch.utils.data.DataLoader(list(range(STEPS)), batch_size=None)


def test_metric_callbacks_log_exact_values(tmp_path):
    from topp_rl.models import build_char_tokenizer
    from topp_rl.tasks.datasets import DatasetTask

    gsm8k = Path(__file__).resolve().parents[1] / "data" / "gsm8k_sample.jsonl"
    task = DatasetTask(path=gsm8k, prompt_key="question", reward_fn="topp_rl.tasks.rewards:math_answer",
                       max_prompt_tokens=100, cache_dir=str(tmp_path / "cache"))
    tok = build_char_tokenizer()
    task.prompt(0, tok)  # the datamodule's first ticket: prompts are measured with the tokenizer
    questions = [json.loads(line)["question"] for line in gsm8k.read_text().splitlines()]
    filtered = sum(len(tok.encode(q, add_special_tokens=False)) + 1 > 100 for q in questions)  # + BOS
    support = SupportStats(out_dir=str(tmp_path / "run"))
    fit(tmp_path, [LogProbMismatch(), support, RolloutStats()], logger=CSVLogger(tmp_path, name="csv"),
        module=SyntheticPolicy(), datamodule=TaskDataModule(task))
    rows = read_csv(tmp_path / "csv" / "version_0" / "metrics.csv")
    assert_logged(rows, world_size=1)
    assert filtered > 0 and [row["rollout/filtered_prompts"] for row in rows] == [filtered] * STEPS
    # The loss metric is the module's (sum, count) mean: loss * 1 / 1 for one rank.
    assert all(row["train/loss"] > 0 for row in rows)
    saved = json.loads((tmp_path / "run" / "support_size_counts.json").read_text())
    sizes = np.concatenate(
        [make_record(s).support_size[make_record(s).loss_mask > 0].numpy() for s in range(STEPS)]
    )
    values, counts = np.unique(sizes[sizes > 0], return_counts=True)
    assert saved == {"steps": STEPS, "counts": {str(v): int(c) for v, c in zip(values, counts, strict=True)}}
    assert support.state_dict()["steps"] == STEPS


class _FailAt(L.Callback):
    """Raises at the end of step `batch_idx`, noting whether `path` existed at the end of each step before."""

    def __init__(self, batch_idx: int, path: Path) -> None:
        self.batch_idx, self.path, self.existed = batch_idx, path, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.batch_idx:
            raise RuntimeError("stop here")
        self.existed.append(self.path.exists())


def test_support_counts_are_saved_with_checkpoints_and_when_training_fails(tmp_path):
    """The counts file is written with every checkpoint, at the end and when the run fails; not every step."""
    path = tmp_path / "run" / "support_size_counts.json"
    support, fail = SupportStats(out_dir=str(tmp_path / "run")), _FailAt(1, path)
    with pytest.raises(RuntimeError, match="stop here"):
        fit(tmp_path, [support, fail], logger=False)
    assert fail.existed == [False]  # a step alone writes nothing
    assert json.loads(path.read_text())["steps"] == 2  # the two steps counted before the failure

    support = SupportStats(out_dir=str(tmp_path / "run"))
    trainer = fit(tmp_path, [support], logger=False)
    path.unlink()
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    assert json.loads(path.read_text())["steps"] == STEPS


def test_log_prob_mismatch_logs_only_mismatch_figures(tmp_path):
    fit(tmp_path, [LogProbMismatch(histograms=False)], logger=CSVLogger(tmp_path, name="csv"),
        module=SyntheticPolicy(log_metrics=False))
    rows = read_csv(tmp_path / "csv" / "version_0" / "metrics.csv")
    assert set().union(*rows) - {"epoch"} == set(expected_mismatch([make_record(0)]))


class RecordingWandbLogger(WandbLogger):
    """A real (offline) W&B logger that also keeps what it was asked to log, read through public objects
    (`wandb.Histogram.histogram` / `.bins`) instead of W&B's private transaction log."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.logged: list[dict] = []

    def log_metrics(self, metrics, step=None) -> None:
        self.logged.append(dict(metrics))
        super().log_metrics(metrics, step)


def test_mismatch_histograms_reach_wandb_offline(tmp_path):
    import wandb

    logger = RecordingWandbLogger(offline=True, save_dir=str(tmp_path), project="topp_rl_test")
    fit(tmp_path, [LogProbMismatch(), SupportStats()], logger=logger)
    logger.experiment.finish()
    last = {k: v for metrics in logger.logged for k, v in metrics.items()}
    hist = last["train/rollout_logprob_abs_diff_unmasked_hist"]
    assert isinstance(hist, wandb.Histogram)
    d = make_record(STEPS - 1)
    keep = d.loss_mask > 0
    expected = (d.logprobs_unmasked[keep].double() - d.rollout_logprobs[keep].double()).abs()
    assert sum(hist.histogram) == int(keep.sum())
    assert hist.bins[0] == pytest.approx(float(expected.min()), rel=1e-6)
    assert hist.bins[-1] == pytest.approx(float(expected.max()), rel=1e-6)
    assert isinstance(last["rollout/support_size_hist"], wandb.Histogram)
    assert last["train/rollout_logprob_abs_diff"] == pytest.approx(
        expected_mismatch([d])["train/rollout_logprob_abs_diff"]
    )
    assert list(tmp_path.rglob("offline-run-*")), "the run was written offline"


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_metric_callbacks_are_exact_across_two_ranks(tmp_path):
    """ddp_fork over gloo, each rank with different token counts: every figure equals numpy on the union."""
    fit(
        tmp_path,
        [LogProbMismatch(histograms=False), SupportStats(save_counts=False), RolloutStats()],
        logger=CSVLogger(tmp_path, name="csv"),
        # fork, not spawn: ~1 s instead of 20-30 s of re-imports per rank here. The ranks only touch tensors of
        # ~50 elements (below torch's OpenMP grain size), so no OpenMP pool is needed in the forked children.
        strategy="ddp_fork",
        devices=2,
        use_distributed_sampler=False,  # every rank runs all STEPS rollout steps, with its own data
    )
    rows = read_csv(tmp_path / "csv" / "version_0" / "metrics.csv")
    assert_logged(rows, world_size=2)


def _gather_columns_on_rank(rank: int) -> tuple[torch.Tensor, list[str]]:
    """gather_columns with Lightning's own DDP strategy on the trainer, recording every warning it raises."""
    import warnings
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy

    from topp_rl.callbacks._common import gather_columns

    trainer = SimpleNamespace(world_size=2, strategy=DDPStrategy(parallel_devices=[torch.device("cpu")] * 2))
    values = torch.arange(2 * (rank + 1), dtype=torch.float32).reshape(2, rank + 1) + 10 * rank
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gathered = gather_columns(trainer, values)
    return gathered, [str(w.message) for w in caught]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_gathering_figures_across_ranks_raises_no_deprecation_warning():
    """Lightning's strategy.all_gather goes through torch.distributed.nn.functional.all_gather, which torch
    deprecates: every FSDP step printed its warning (issue 35). The exact gather needs no autograd."""
    from dist_utils import run_distributed

    for gathered, warned in run_distributed(_gather_columns_on_rank, 2, preload=("lightning.pytorch",)):
        assert gathered.tolist() == [[0.0, 10.0, 11.0], [1.0, 12.0, 13.0]]
        assert warned == []


class EngineDataModule(L.LightningDataModule):
    def __init__(self, engine) -> None:
        super().__init__()
        self.engine = engine

    def train_dataloader(self):
        return torch.utils.data.DataLoader(list(range(STEPS)), batch_size=None)


class TinyPolicy(L.LightningModule):
    def __init__(self, policy) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.policy = policy.train()

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        ids = torch.tensor([[1, 2, 3, 4]])
        loss = self.policy(input_ids=ids, labels=ids).loss
        self.manual_backward(loss)
        opt.step()
        return {}

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def hf_named_tensors(self):  # the WeightSource protocol WeightSync exports through
        for name, param in self.policy.named_parameters():
            yield name, param.detach()


def test_weight_sync_makes_the_engine_equal_to_the_policy(tmp_path):
    from topp_rl.engines.embedded import EmbeddedEngine
    from topp_rl.models import build_tiny_model

    policy = build_tiny_model()
    engine = EmbeddedEngine(policy, progress=False)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    sync = WeightSync()
    fit(tmp_path, [sync], logger=False, module=TinyPolicy(policy), datamodule=EngineDataModule(engine))
    assert sync.pushes == STEPS + 1  # once at start, once per step
    engine_state = engine.model.state_dict()
    for name, param in policy.state_dict().items():
        assert torch.equal(engine_state[name], param), name
    assert any(not torch.equal(before[k], engine_state[k]) for k in before)


def test_weight_sync_needs_an_engine(tmp_path):
    with pytest.raises(ValueError, match="trainer.datamodule.engine"):
        fit(tmp_path, [WeightSync()], logger=False)


def test_counts_file_name_matches_the_report():
    from topp_rl.callbacks.support import COUNTS_FILE
    from topp_rl.report import COUNTS_FILE as REPORT_COUNTS_FILE

    assert COUNTS_FILE == REPORT_COUNTS_FILE


