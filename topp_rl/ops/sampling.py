"""`sampling_candidates`: the set of token ids a top-p / top-k / min-p sampler keeps, per logits row.

Two conventions:

"sglang" (SGLang's torch sampler, the default): p = softmax(logits / temperature) in float32; rank tokens by p
descending, ties broken by lower id first; keep rank r iff (top_k == 0 or r < top_k) and
(cumsum(p)[r] - p[r]) <= top_p (the mass strictly before r, computed the way SGLang does) and p[r] >= min_p * p[0].
The argmax is always kept. Worked example, p = [0.5, 0.3, 0.15, 0.05] (ids 0..3), top_p = 0.7: the masses before
ranks 0..3 are 0, 0.5, 0.8, 0.95, so ids {0, 1} are kept (the token that crosses top_p is kept). With top_k = 1:
{0}. With min_p = 0.5 (threshold 0.25): {0, 1}.

"vllm" (vLLM's `apply_top_k_top_p` after its min-p processor): p = softmax(logits / temperature); drop tokens with
p < min_p * p_max; sort the logits ascending (stable, so among equal logits the higher id ranks first); top-k keeps
every logit >= the k-th largest (ties at the threshold are all kept); top-p renormalises over what is left, takes
the ascending cumulative sum c and drops positions with c <= 1 - top_p, never the last (largest) one. Worked
example, same p, top_p = 0.7: ascending c = [0.05, 0.2, 0.5, 1.0] <= 0.3 drops ids {3, 2}, keeps {0, 1}; with
top_p = 0.5, c <= 0.5 also drops id 1: {0}. (SGLang keeps {0, 1} at top_p = 0.5: mass before id 1 is 0.5.)
Departures from vLLM: top-p is applied only to rows with top_p < 1 and top-k only to rows with 0 < top_k < V
(vLLM applies the mask batch-wide, which at top_p = 1 also drops tokens whose probability underflows to 0).

Output: one CSR row per logits row, ids in rank order (most probable first, ties as above). A row whose
logits / temperature define no distribution (a NaN, +inf, or all -inf) raises ValueError naming the row.

Speed ("sglang"): the engine calls this every decode step, so it avoids a full-vocabulary sort: it takes the
top-k of p for a small k (64; up to V = 8192 at least the ranks top_p / p_max that the rule surely keeps), decides
every rank inside that window exactly, and grows k only for rows whose kept set may extend past the window (to at
least twice k, or to the number of ranks the remaining top-p mass needs at the window's smallest p); rows fall back
to a full stable sort once k would reach V/2 (at once for V <= 128, or when the sets surely span half of V).
Inside the window ties are ordered by id explicitly, and a row whose last kept rank ties with the window's
smallest value (an equal value may lie outside) is re-done with a larger window, so the result equals the
full-sort rule whatever the window. Above V = 2048 the rows are first offered a cheaper test than growing
(each growth is another top-k over the whole row): one histogram pass picks per row a threshold t, the entries
with p >= t are compacted and ranked (`topp_rl.ops._prefix`), and a row whose last such rank is dropped is decided
(no entry outside ties with one inside); the other rows grow the window as above. The first window goes first
where it likely decides most rows (a min-p of 0.005 or more, or a median p_max >= 0.3); a top-k up to 128 needs
no prefix. Scalar parameters (the engine's case) skip the per-row tensors and their checks (host syncs);
`sglang_kept` also returns the full sort's ranking, for the engine's dense draw (`topp_rl.ops.draw`). "vllm" is a
trainer-side fallback and uses one full sort.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Literal

import torch

from topp_rl.ops._checks import SAMPLING_RULES, ParamT, check_sampling_params, per_row
from topp_rl.ops._prefix import IntParam, Param, threshold_prefix
from topp_rl.ops.candidates import Candidates

_WINDOW = 64
_ESTIMATE_MAX_V = 8192
# Above: ranked prefixes from a threshold (`_prefix`); measured 1.5-2.4x faster than growing the window for top-p
# rows at V = 2049..49152 (1 CPU thread, batch 32), slower at V = 1024.
_PREFIX_MIN_V = 2048
# A batch whose median row has p_max >= 0.3 takes the first window first: measured on SmolLM2 decode logits,
# 1 CPU thread (random-token prompts): such batches (temperature 0.5-0.7) kept ~10-20 ids per row, at temperature 1
# (medians 0.1-0.28) rows kept ~1400 ids on average.
_PEAKED = 0.3
_MIN_P_WINDOW_FIRST = 0.005  # not 0.01: a min_p of 0.01 is 0.00999... in float32


def sampling_candidates(
    logits: torch.Tensor,
    *,
    temperature: ParamT = 1.0,
    top_p: ParamT = 1.0,
    top_k: ParamT = 0,
    min_p: ParamT = 0.0,
    convention: Literal["sglang", "vllm"] = "sglang",
) -> Candidates:
    """Kept token ids of each row of `logits` [N, V] (parameters: scalars or one value per row)."""
    if logits.dim() != 2:
        raise ValueError(f"logits has shape {tuple(logits.shape)}; pass a 2-D [N, V] tensor")
    scalars = _scalar_params(temperature, top_p, top_k, min_p) if convention == "sglang" else None
    if scalars is not None:  # the engine's case: no per-row tensors, no tensor checks (host syncs)
        return _sglang_scalar(logits, *scalars)[0]
    n, device = logits.shape[0], logits.device
    temperature_t = per_row(temperature, name="temperature", n=n, dtype=torch.float32, device=device)
    top_p_t = per_row(top_p, name="top_p", n=n, dtype=torch.float32, device=device)
    top_k_t = per_row(top_k, name="top_k", n=n, dtype=torch.int64, device=device)
    min_p_t = per_row(min_p, name="min_p", n=n, dtype=torch.float32, device=device)
    check_sampling_params(temperature=temperature_t, top_p=top_p_t, top_k=top_k_t, min_p=min_p_t)
    if n == 0:
        return Candidates.empty(0, device=device)
    if convention not in ("sglang", "vllm"):
        raise ValueError(f"convention={convention!r} is not one of 'sglang', 'vllm'")
    z = logits.float() / temperature_t[:, None]
    probs = torch.softmax(z, dim=-1)
    _check_distribution(probs, temperature_t)
    if convention == "sglang":
        return _sglang(probs, top_p=top_p_t, top_k=top_k_t, min_p=min_p_t)[0]
    return _vllm(z, probs, top_p=top_p_t, top_k=top_k_t, min_p=min_p_t)


@dataclass(frozen=True, eq=False)
class FullRanking:
    """Every row ranked by one full stable sort: `order` [N, V] int64 ids by (p descending, id ascending),
    `keep` [N, V] bool the kept ranks, `count` [N] int64 how many (on the CPU the kept ranks are the first
    `count`: see `topp_rl.ops.draw.draw_dense`)."""

    order: torch.Tensor
    keep: torch.Tensor
    count: torch.Tensor


def sglang_kept(
    logits: torch.Tensor, *, temperature: float, top_p: float, top_k: int, min_p: float
) -> tuple[Candidates, FullRanking | None]:
    """`sampling_candidates(logits, ...)` (convention "sglang", scalar parameters), and the full ranking behind
    it when one full sort decided every row (small vocabularies, or rows whose sets span half of V)."""
    if logits.dim() != 2:
        raise ValueError(f"logits has shape {tuple(logits.shape)}; pass a 2-D [N, V] tensor")
    scalars = _scalar_params(temperature, top_p, top_k, min_p)
    if scalars is None:  # not plain numbers, or out of range: the general path checks them and raises
        return sampling_candidates(logits, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p), None
    return _sglang_scalar(logits, *scalars)


def _scalar_params(*values: ParamT) -> tuple[float, float, int, float] | None:
    """(temperature, top_p, top_k, min_p) as Python numbers rounded to the per-row tensors' dtypes (float32,
    int64), so that every comparison equals the tensor path's; None unless each is a plain number within its
    rule (the tensor path then raises the rule's error)."""
    out = []
    for rule, value in zip(SAMPLING_RULES, values, strict=True):
        if type(value) is int and -(1 << 63) <= value < (1 << 63):
            value = value if rule.kind is int else float(value)
        elif type(value) is not float or rule.kind is int:
            return None
        if rule.kind is float:
            try:
                value = struct.unpack("f", struct.pack("f", value))[0]
            except OverflowError:
                return None
        if not rule.ok(value):
            return None
        out.append(value)
    return tuple(out)


def _sglang_scalar(
    logits: torch.Tensor, temperature: float, top_p: float, top_k: int, min_p: float
) -> tuple[Candidates, FullRanking | None]:
    if logits.shape[0] == 0:
        return Candidates.empty(0, device=logits.device), None
    z = logits.float()
    # float32 / a float32 value: as per row; x / 1.0 is x exactly, so that division is skipped
    probs = torch.softmax(z if temperature == 1.0 else z / temperature, dim=-1)
    _check_distribution(probs, temperature)
    return _sglang(probs, top_p=top_p, top_k=top_k, min_p=min_p)


def _check_distribution(probs: torch.Tensor, temperature: torch.Tensor | float) -> None:
    """A row whose logits / temperature hold a NaN or +inf (or are all -inf) has no distribution: its softmax
    sums to NaN. Such a row has no kept set, and a sampler drawing from it would pick an arbitrary token."""
    if math.isfinite(float(probs.sum())):  # one sync: the total is finite iff every row's sum (~1 each) is
        return
    bad = ~torch.isfinite(probs.sum(dim=-1))
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        t = temperature if isinstance(temperature, float) else float(temperature[row])
        raise nonfinite_row_error(row, probs.shape[0], t)


def nonfinite_row_error(row: int, rows: int, temperature: float) -> ValueError:
    """The error for a row of logits that defines no distribution (shared by every sampling path)."""
    return ValueError(
        f"logits row {row} (of {rows}) is not finite after dividing by temperature={temperature:g} (NaN, +inf, or "
        "every entry -inf): it defines no distribution to truncate; check the model weights for NaN and that the "
        "temperature does not overflow the logits"
    )


def _sglang_keep(p_sorted: torch.Tensor, *, top_p: Param, top_k: IntParam, min_p: Param) -> torch.Tensor:
    """The SGLang rule on probabilities sorted descending [n, k] (a prefix of the full ranking); parameters per
    row [n] or Python numbers (float32 values, as in `_scalar_params`: the same comparisons, fewer ops)."""
    before = torch.cumsum(p_sorted, dim=-1) - p_sorted
    if isinstance(top_k, int):
        keep = before <= top_p
        if 0 < top_k < keep.shape[1]:
            keep[:, top_k:] = False
        if min_p > 0:
            keep &= p_sorted >= min_p * p_sorted[:, :1]
    else:
        ranks = torch.arange(p_sorted.shape[1], device=p_sorted.device)
        keep = (top_k[:, None] == 0) | (ranks[None, :] < top_k[:, None])
        keep &= before <= top_p[:, None]
        keep &= p_sorted >= (min_p * p_sorted[:, 0])[:, None]
    keep[:, 0] = True  # the argmax is always kept (the rule keeps it anyway; this guards float edge cases)
    return keep


def _rank_window(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of each row ordered by (p descending, id ascending)."""
    if k >= probs.shape[1]:
        vals, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
        return vals, ids
    vals, ids = probs.topk(k, dim=-1)
    ids, perm = ids.sort(dim=-1)  # ids ascending, then a stable sort by value keeps lower ids first on ties
    vals, perm2 = vals.gather(1, perm).sort(dim=-1, descending=True, stable=True)
    return vals, ids.gather(1, perm2)


def _sglang(
    probs: torch.Tensor, *, top_p: Param, top_k: IntParam, min_p: Param
) -> tuple[Candidates, FullRanking | None]:
    n, vocab = probs.shape
    k = _first_window(probs, top_p=top_p, top_k=top_k, min_p=min_p)
    if k * 2 >= vocab:  # small vocabularies, or sets surely spanning half of it
        return _full_sort(probs, top_p=top_p, top_k=top_k, min_p=min_p)
    pending = torch.arange(n, device=probs.device)
    done: tuple[list[torch.Tensor], list[Candidates]] = ([], [])
    plan = _prefix_plan(top_k, min_p) if vocab > _PREFIX_MIN_V else "never"
    if plan == "first" and float(probs.amax(dim=1).median()) >= _PEAKED:  # most sets likely small: window first
        plan = "after_window"
    prefix_next = plan != "never"
    if plan == "after_window":  # sets likely fit the first window: try it first
        pending, k = _window_pass(probs, pending, k, top_p=top_p, top_k=top_k, min_p=min_p, done=done)
    while pending.numel():
        if prefix_next:  # once, for the rows still open
            prefix_next = False
            rows_probs = probs if pending.numel() == n else probs.index_select(0, pending)
            prefix = threshold_prefix(rows_probs, top_p=_rows(top_p, pending), top_k=_rows(top_k, pending),
                                      min_p=_rows(min_p, pending))
            if prefix is None and not done[0]:  # every row's prefix spans half of V
                return _full_sort(probs, top_p=top_p, top_k=top_k, min_p=min_p)
            if prefix is not None:
                pending = _prefix_pass(*prefix, pending, top_p=top_p, top_k=top_k, min_p=min_p, done=done)
            continue
        if k * 2 >= vocab:
            k = vocab
            if not done[0]:  # every row still open: no regrouping
                return _full_sort(probs, top_p=top_p, top_k=top_k, min_p=min_p)
        pending, k = _window_pass(probs, pending, k, top_p=top_p, top_k=top_k, min_p=min_p, done=done)
    return _in_row_order(*done, n), None


def _prefix_plan(top_k: IntParam, min_p: Param) -> Literal["never", "after_window", "first"]:
    """When to rank the open rows' threshold prefixes (measured at V = 1024..49152, SmolLM2-like rows, 1 CPU
    thread): never for a top-k up to twice the first window (its second window, top_k + 1, decides every row
    without ties: two top-k calls); after the first window for a min-p of 0.005 or more (sets of a few dozen ids)
    and for per-row parameters (no host sync to inspect them); else first (top-p sets of hundreds of ids)."""
    if isinstance(top_k, torch.Tensor) or isinstance(min_p, torch.Tensor):
        return "after_window"
    if 0 < top_k <= 2 * _WINDOW:
        return "never"
    return "after_window" if min_p >= _MIN_P_WINDOW_FIRST else "first"


def _window_pass(
    probs: torch.Tensor, pending: torch.Tensor, k: int, *, top_p: Param, top_k: IntParam, min_p: Param,
    done: tuple[list[torch.Tensor], list[Candidates]],
) -> tuple[torch.Tensor, int]:
    """Decide the `pending` rows the top-k window decides (appending them to `done`); return the other rows and
    the window to try for them next."""
    vocab = probs.shape[1]
    rows_probs = probs if pending.numel() == probs.shape[0] else probs.index_select(0, pending)
    vals, ids = _rank_window(rows_probs, k)
    keep = _sglang_keep(vals, top_p=_rows(top_p, pending), top_k=_rows(top_k, pending), min_p=_rows(min_p, pending))
    if k == vocab:
        resolved = torch.ones(pending.numel(), dtype=torch.bool, device=probs.device)
    else:
        # Ranks past the window are dropped iff the window's last rank is (top-k, min-p and the mass before a
        # rank are monotone in rank); the last kept rank must also not tie with values outside the window.
        last_kept = (keep * torch.arange(k, device=probs.device)).amax(dim=1)
        resolved = ~keep[:, -1] & (vals.gather(1, last_kept[:, None]).squeeze(1) > vals[:, -1])
    if bool(resolved.any()):
        done[0].append(pending[resolved])
        done[1].append(_to_csr(ids[resolved], keep[resolved]))
    if bool((~resolved).any()):
        unresolved = pending[~resolved]
        k = _next_window(vals[~resolved], k, top_p=_rows(top_p, unresolved), top_k=_rows(top_k, unresolved))
    return pending[~resolved], k


def _prefix_pass(
    vals: torch.Tensor, ids: torch.Tensor, count: torch.Tensor, pending: torch.Tensor, *, top_p: Param,
    top_k: IntParam, min_p: Param, done: tuple[list[torch.Tensor], list[Candidates]],
) -> torch.Tensor:
    """Decide the `pending` rows whose ranked prefix (`_prefix.threshold_prefix`, one row each) ends with a
    dropped rank: every later rank is dropped too (the rule is monotone in rank, and no entry outside the prefix
    ties with one inside). Append them to `done`; return the other rows."""
    params = dict(top_p=_rows(top_p, pending), top_k=_rows(top_k, pending), min_p=_rows(min_p, pending))
    keep = _sglang_keep(vals, **params)  # the cumsums of the full sort's first ranks, computed as the window's
    keep &= torch.arange(vals.shape[1], device=vals.device) < count[:, None]
    resolved = (count > 0) & ~keep.gather(1, (count - 1).clamp_min(0)[:, None]).squeeze(1)
    if bool(resolved.all()):
        done[0].append(pending)
        done[1].append(_to_csr(ids, keep))
    elif bool(resolved.any()):
        done[0].append(pending[resolved])
        done[1].append(_to_csr(ids[resolved], keep[resolved]))
    return pending[~resolved]


def _full_sort(
    probs: torch.Tensor, *, top_p: Param, top_k: IntParam, min_p: Param
) -> tuple[Candidates, FullRanking]:
    """Every row decided by one full stable sort."""
    vals, ids = _rank_window(probs, probs.shape[1])
    keep = _sglang_keep(vals, top_p=top_p, top_k=top_k, min_p=min_p)
    count = keep.sum(dim=1)
    return _to_csr(ids, keep, count), FullRanking(order=ids, keep=keep, count=count)


def _first_window(probs: torch.Tensor, *, top_p: Param, top_k: IntParam, min_p: Param) -> int:
    """The window to try first: 64, or more where the kept sets surely are longer. With no min-p every rank r
    with r x p_max <= top_p is kept (the mass before it is at most r x p_max, up to rounding), so near-uniform
    rows keep more than top_p / p_max ranks (a top-k caps that) and a smaller window would fail: skip it.
    Estimated for vocabularies up to _ESTIMATE_MAX_V (an [N, V] pass, cheap beside the window's top-k there).
    Only the cost depends on the window: every window gives the full-sort result."""
    vocab = probs.shape[1]
    if vocab <= 2 * _WINDOW or vocab > _ESTIMATE_MAX_V or isinstance(min_p, float) and min_p > 0:
        return min(vocab, _WINDOW)
    sure = (top_p / probs.amax(dim=1)).clamp_max(vocab).floor().long() + 1  # ranks surely kept (rank 0 too)
    if isinstance(top_k, int):
        sure = sure.clamp_max(top_k) if top_k > 0 else sure
    else:
        sure = torch.where(top_k > 0, torch.minimum(sure, top_k), sure)
        sure = torch.where(min_p > 0, 0, sure)
    return min(vocab, max(_WINDOW, int(sure.max()) + 1))


def _rows(param: Param | IntParam, index: torch.Tensor) -> Param | IntParam:
    """A per-row parameter's entries at `index` (a Python number holds for every row)."""
    return param if isinstance(param, int | float) else param[index]


def _next_window(vals: torch.Tensor, k: int, *, top_p: Param, top_k: IntParam) -> int:
    """A window for the unresolved rows: every further rank has p <= the window's last p, so reaching top_p
    takes at least (top_p - window mass) / last p more ranks (exact for flat tails); a top-k caps it at k + 1."""
    mass, last = vals.sum(dim=-1), vals[:, -1].clamp_min(torch.finfo(vals.dtype).tiny)
    need = k + 1 + ((top_p - mass).clamp_min(0) / last).ceil().clamp_max(1 << 30).long()
    if isinstance(top_k, int):
        need = need.clamp_max(top_k + 1) if top_k > 0 else need
    else:
        need = torch.where(top_k > 0, torch.minimum(need, top_k + 1), need)
    return max(int(need.max()), k * 2)


def _vllm(
    z: torch.Tensor, probs: torch.Tensor, *, top_p: torch.Tensor, top_k: torch.Tensor, min_p: torch.Tensor
) -> Candidates:
    n, vocab = z.shape
    z = z.masked_fill(probs < (min_p * probs.amax(dim=-1))[:, None], float("-inf"))
    z_sort, ids = torch.sort(z, dim=-1, stable=True)  # ascending, as vLLM sorts
    use_k = (top_k > 0) & (top_k < vocab)
    if bool(use_k.any()):
        kth = z_sort.gather(1, (vocab - top_k.clamp(1, vocab))[:, None])
        z_sort = z_sort.masked_fill(use_k[:, None] & (z_sort < kth), float("-inf"))
    cum = torch.softmax(z_sort, dim=-1).cumsum(dim=-1)
    drop = (top_p < 1)[:, None] & (cum <= (1 - top_p)[:, None])
    drop[:, -1] = False  # vLLM always keeps the largest logit
    keep = torch.isfinite(z_sort) & ~drop
    return _to_csr(ids.flip(-1), keep.flip(-1))


def _to_csr(ids: torch.Tensor, keep: torch.Tensor, count: torch.Tensor | None = None) -> Candidates:
    """Rows of `ids` [n, k] where `keep` (`count` [n] per row, when known), in column order."""
    offsets = torch.zeros(ids.shape[0] + 1, dtype=torch.int32, device=ids.device)
    torch.cumsum(keep.sum(dim=1) if count is None else count, 0, out=offsets[1:])
    return Candidates.built(ids=ids.masked_select(keep).to(torch.int32), offsets=offsets)


def _in_row_order(row_groups: list[torch.Tensor], sets: list[Candidates], n: int) -> Candidates:
    """Concatenate per-group results and put the rows back in 0..n-1 order."""
    if len(sets) == 1:  # one group holds every row, in order
        return sets[0]
    merged = Candidates.concat(sets)
    rows = torch.cat(row_groups)
    if bool((rows[1:] > rows[:-1]).all()):
        return merged
    inverse = torch.empty_like(rows)
    inverse[rows] = torch.arange(n, device=rows.device)
    return merged.select(inverse)
