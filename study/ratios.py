"""The ratio study: sample one batch per setting, score it with the trainer's path, mask on and off.

For each engine and setting (`grid.Setting`): the engine samples `n` responses to each prompt; the trainer's
`PolicyModule.score` scores every response token on the same weights with `use_mask=True` (over the kept set) and
`use_mask=False` (full vocabulary), and the kept mass (full-vocabulary probability of the kept set, trainer
logits / T) is computed apart from the same hidden states. By construction, per token,
`unmasked - masked = log kept mass`: the tests assert that identity on the figures this module returns.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from study.grid import Setting
from study.stats import TokenFigures
from topp_rl.data.sample import Sample, SampleStatus
from topp_rl.ops import Candidates
from topp_rl.parallel import cp_local_positions, response_rows
from topp_rl.rollout import pack_samples
from topp_rl.trainer.backbone import HFBackbone
from topp_rl.trainer.hook import ToppLogProb
from topp_rl.trainer.module import PolicyModule


class OneForward:
    """A backbone whose forward runs once per micro-batch: the masked and unmasked `score` calls and the kept
    mass read the same hidden states (same weights, no grad), so the trainer's scoring path runs unchanged at a
    third of the forward cost."""

    def __init__(self, backbone: HFBackbone) -> None:
        self.backbone = backbone
        self._batch, self._out = None, None

    def forward_hidden(self, batch):
        if self._batch is not batch:
            self._batch, self._out = batch, self.backbone.forward_hidden(batch)
        return self._out


def scorer(backbone: HFBackbone, temperature: float) -> PolicyModule:
    """The trainer's module on `backbone`, its hook at the rollout's temperature (no loss or optimizer use)."""
    return PolicyModule(policy=backbone, loss=_NoLoss(), optimizer=torch.optim.SGD,
                        hook=ToppLogProb(use_mask=True, temperature=temperature))


class _NoLoss:
    """`score` needs no loss; PolicyModule only asks whether one needs a reference model or a teacher."""

    needs_ref_logprobs = False
    needs_teacher_logprobs = False


@torch.no_grad()
def kept_log_mass(hidden: torch.Tensor, weight: torch.Tensor, batch, *, temperature: float,
                  chunk_rows: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """(log kept mass [R] float64, kept-set size [R] int64) of the batch's response tokens in sample order.

    Dense computation: z = hidden[row] @ weight.T / temperature; log(sum_{v in kept} softmax(z)[v]); rows without
    a recorded set (nothing was cut) have mass 1 and size V.
    """
    positions = cp_local_positions(batch.seq_lengths, cp_size=1, cp_rank=0, mode="zigzag")
    rows, token_index = response_rows(positions, batch.seq_lengths, batch.response_lengths)
    num = batch.response_tokens.numel()
    cands = batch.candidates.select(token_index) if batch.candidates is not None else Candidates.empty(rows.numel())
    out = torch.zeros(num, dtype=torch.float64)
    for a in range(0, rows.numel(), chunk_rows):
        b = min(a + chunk_rows, rows.numel())
        z = (hidden[rows[a:b]] @ weight.T).double() / temperature
        total = torch.logsumexp(z, dim=-1)
        block = cands[a:b]
        row_of = block.row_of_ids()
        values = z[row_of, block.ids.long()]
        top = torch.full((b - a,), -torch.inf, dtype=torch.float64).scatter_reduce(0, row_of, values, "amax")
        sums = torch.zeros(b - a, dtype=torch.float64).index_add_(0, row_of, torch.exp(values - top[row_of]))
        kept = torch.where(block.row_lengths() > 0, top + torch.log(sums), total)
        out[token_index[a:b]] = kept - total
    sizes = torch.zeros(num, dtype=torch.long)
    sizes[token_index] = torch.where(cands.row_lengths() > 0, cands.row_lengths(), weight.shape[0])
    return out, sizes


@torch.no_grad()
def score_samples(backbone: HFBackbone, samples: list[Sample], *, temperature: float,
                  max_tokens: int) -> TokenFigures:
    """The per-token figures of `samples` (aborted ones are counted, not scored)."""
    live = [s for s in samples if s.status != SampleStatus.ABORTED]
    if not live:
        raise ValueError(f"all {len(samples)} samples were aborted by the engine; nothing to score (see their "
                         "metadata, e.g. candidate_overflow: raise rollout.max_candidates)")
    shared = OneForward(backbone)
    module = scorer(backbone, temperature)
    parts = []
    for mb in pack_samples(live, [0.0] * len(live), max_tokens=max_tokens):
        masked = module.score(shared, mb, use_mask=True)
        unmasked = module.score(shared, mb, use_mask=False)
        hidden, weight = shared.forward_hidden(mb)
        log_mass, sizes = kept_log_mass(hidden, weight, mb, temperature=temperature)
        keep = mb.loss_mask > 0
        parts.append(TokenFigures(
            rollout=mb.rollout_log_probs[keep].double(), masked=masked[keep].double(),
            unmasked=unmasked[keep].double(), log_kept_mass=log_mass[keep], kept_size=sizes[keep],
        ))
    figures = TokenFigures.concat(parts)
    return TokenFigures(**{**figures.__dict__, "aborted": len(samples) - len(live)})


@dataclass(frozen=True, kw_only=True)
class EngineRun:
    """What one engine produced over the grid: the figures per setting and the wall time."""

    engine: str
    prompts: int
    figures: dict[Setting, TokenFigures]
    wall_s: float


def run_engine(name: str, engine, backbone: HFBackbone, prompts: list[list[int]], settings: list[Setting], *,
               samples: int, max_new_tokens: int, max_tokens: int, seed: int, stop_token_ids=(),
               log: Callable[[str], None] = print,
               on_setting: Callable[[EngineRun], None] | None = None) -> EngineRun:
    """Sample and score every setting with one engine; a line per setting as it finishes, and `on_setting`
    with the settings done so far (a long run stopped early keeps them)."""
    start = time.perf_counter()
    figures = {}
    for i, setting in enumerate(settings):
        t0 = time.perf_counter()
        params = setting.params(max_new_tokens=max_new_tokens, n=samples, stop_token_ids=stop_token_ids)
        batch = engine.generate(prompts, params, seed=seed + i)
        t1 = time.perf_counter()
        fig = score_samples(backbone, batch, temperature=setting.temperature, max_tokens=max_tokens)
        figures[setting] = fig
        masked_err = float((fig.masked - fig.rollout).abs().max())
        log(f"[study] {name} {i + 1}/{len(settings)} {setting.name}: {fig.rollout.numel()} tokens, "
            f"max |masked - rollout| {masked_err:.1e}, unmasked ratio mean "
            f"{float(torch.exp(fig.unmasked - fig.rollout).mean()):.4f}, kept mass "
            f"{float(torch.exp(fig.log_kept_mass).mean()):.4f}, aborted {fig.aborted} "
            f"(sample {t1 - t0:.0f} s, score {time.perf_counter() - t1:.0f} s)")
        if on_setting is not None:
            on_setting(EngineRun(engine=name, prompts=len(prompts), figures=dict(figures),
                                 wall_s=time.perf_counter() - start))
    return EngineRun(engine=name, prompts=len(prompts), figures=figures, wall_s=time.perf_counter() - start)
