"""Helpers the test modules share (imported by name: `from helpers import compose_cfg`; pytest puts tests/ on
sys.path): the tiny training config every short run starts from, its metrics.csv, and the environment of a
`train.py` subprocess. Fixtures live in conftest.py."""

import contextlib
import copy
import csv
import os
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
# Two steps of 2 prompts x 2 samples x 4 new tokens; the last entry (top_p) is dropped by a sweep over top_p.
TINY = [
    "trainer.max_steps=2", "rollout.prompts_per_step=2", "rollout.n_samples=2", "rollout.max_new_tokens=4",
    "checkpoint.every_n_steps=0", "trainer.enable_progress_bar=false", "rollout.top_p=0.9",
]


def compose_config(output_dir: Path, *overrides: str):
    """conf/config.yaml with its run dir at `output_dir` and `overrides` (later ones win), no tiny defaults."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[f"paths.output_dir={output_dir}", *overrides])


def compose_cfg(output_dir: Path, *overrides: str):
    """The tiny config (TINY) with `overrides` on top."""
    return compose_config(output_dir, *TINY, *overrides)


def read_metrics(output_dir: Path) -> list[dict[str, str]]:
    """The rows of a run's only csv/*/metrics.csv."""
    (path,) = output_dir.glob("csv/*/metrics.csv")
    with path.open() as f:
        return list(csv.DictReader(f))


def column(rows: list[dict[str, str]], key: str) -> list[float]:
    """`key`'s logged values, in row order (rows without it skipped)."""
    return [float(r[key]) for r in rows if r.get(key)]


def metric_columns(output_dir: Path) -> dict[str, list[float]]:
    """Every logged key of a run's metrics.csv -> its values, in row order."""
    rows = read_metrics(output_dir)
    return {key: column(rows, key) for key in {k for r in rows for k, v in r.items() if v}}


def train_env(**extra: str) -> dict[str, str]:
    """This process's environment for a `train.py` subprocess: W&B offline, no hub downloads, plus `extra`."""
    return dict(os.environ, WANDB_MODE="offline", HF_HUB_OFFLINE="1", **extra)


def hf_logits(model, sample) -> torch.Tensor:
    """Logits [R, V] that produced each response token of `sample` (float32, HF eager): the reference the real
    server tests compare kept sets and log-probs against."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    p = len(sample.prompt_ids)
    return logits[p - 1 : p - 1 + sample.response_length]


U32 = 2.0**-24  # float32 unit roundoff


def fp32_bars(config, sample, logits: torch.Tensor) -> tuple[torch.Tensor, float]:
    """How far two float32 evaluations of one model (a server's CPU kernels, HF eager) may put a long response's
    recorded log-probs apart, from the arithmetic: (a bar per token [R], a bar on their mean).

    A float32 sum of n products lies within gamma_n = n*u / (1 - n*u) of the exact one, relative to its terms'
    magnitudes (Higham, Accuracy and Stability of Numerical Algorithms, eq. 3.4; u = 2^-24), and the bounds of
    sequential reductions add (to first order). Response token i is predicted at position p = prompt + i, through
    per layer: the input RMSNorm (d), q/k/v (d), the attention's softmax and value sums over p positions (2p), o_proj
    (d), the MLP's RMSNorm (d), gate/up (d) and down (intermediate); then the final norm (d), the head (d) and the
    log-softmax over the vocabulary: n = L * (2p + 5d + intermediate) + 2d + vocab. The terms' scale is the row's
    largest |logit| (RMSNorm keeps the hidden states of order one). Each engine is within gamma_n of exact, and a
    log-prob is a logit minus a log-sum-exp of logits: 4 gamma_n max|z| per token. Their mean over many tokens
    follows the probabilistic bound instead (independent roundings: sqrt(n) * u, Higham and Mary, SIAM J. Sci.
    Comput. 2019), times the rows' mean scale. Measured on vLLM's 3000-token responses: per token at most 0.04 of its
    bar, the mean 0.12 of its bar; a token sampled from the wrong version or over stale KV moves them by 0.1-1
    nats. Used by the vLLM and SGLang in-flight tests."""
    positions = torch.arange(sample.response_length, dtype=torch.float64) + len(sample.prompt_ids)
    d, layers = config.hidden_size, config.num_hidden_layers
    n = layers * (2 * positions + 5 * d + config.intermediate_size) + 2 * d + config.vocab_size
    gamma = n * U32 / (1 - n * U32)
    scale = logits.detach().double().abs().amax(dim=-1)
    return 4 * gamma * scale, float((n.sqrt() * U32 * scale).mean())


def perturbed(model, *, seed: int, scale: float = 0.1):
    """A copy of `model` with every weight moved by `scale` times its tensor's std (the attention too: its KV
    changes; a one-element tensor by `scale`): a weight update that misses any layer shows."""
    new = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * (float(p.std()) if p.numel() > 1 else 1.0))
    return new


def by_version(old_model, new_model, at: int):
    """The reference logits [R, V] of a sample whose tokens switch versions at `at`: rows before it from
    `old_model`, the others from `new_model` (HF float32)."""
    return lambda s: torch.cat([hf_logits(old_model, s)[:at], hf_logits(new_model, s)[at:]])


@contextlib.contextmanager
def launched_server_url(tmp: Path, *overrides: str):
    """The URL of one inference server launched the way a run with `overrides` launches it (the same factory and
    server settings, on the config's initial policy), stopped on exit: runs connect with `rollout.engine.urls=[url]`
    instead of launching their own. What an earlier run left on it does not matter: a run pushes its policy's
    weights at train start."""
    from hydra.utils import instantiate

    from topp_rl.train import engine_for

    cfg = compose_cfg(tmp, *overrides)
    model, tokenizer = instantiate(cfg.model)
    engine = engine_for(cfg, model.float(), tokenizer, tmp)(0)
    try:
        yield engine.urls[0]
    finally:
        engine.close()


def in_flight_rounds(run_round, restore, *, old: int, rounds: int = 3) -> list:
    """The samples of the first of `rounds` calls of `run_round()` whose weight update reached every request (each
    has a token of a version other than `old`). The requests are held by the server's pause, but the pause after a
    brief resume is a message from this process, and on a loaded machine every process stalls for seconds at a time
    (4-10 s measured with two busy processes on 2 cores) while the engine decodes: a request can finish first. Such
    a round is followed by `restore()` (the old weights back, nothing in flight) and runs again; only a round's own
    samples are ever checked."""
    for _ in range(rounds):
        samples = run_round()
        if all(set(s.token_versions()) != {old} for s in samples):
            return samples
        restore()
    raise AssertionError(f"in {rounds} rounds a request finished before the pause reached its server")


def version_switch(sample, old: int, new: int, *, length: int) -> int:
    """The first token of version `new` in a `length`-token sample that is `old` up to it and `new` from it (both
    non-empty; no abort)."""
    from topp_rl.data.sample import SampleStatus

    assert sample.status is SampleStatus.TRUNCATED and sample.response_length == length
    versions = sample.token_versions()
    assert new in versions, f"no token of version {new}: all {set(versions)} (the update missed the requests)"
    at = versions.index(new)
    assert 0 < at < sample.response_length and versions == [old] * at + [new] * (sample.response_length - at)
    assert sample.spans_versions and sample.weight_version == old
    return at
