"""Continuous batching for the embedded engine: one decode loop, on its own thread, serves every `generate` call.

A call's requests (one per prompt copy) wait in a queue; between two decode steps the loop admits as many as its
slot cache (`topp_rl.engines.fused_decode.SlotCacheForward`) has free rows, so the decode batch stays full while
work waits. A new request's prompt but its last token is prefilled into its row; every step then feeds each row
its pending token (the prompt's last, then each sampled one) and samples the next with the static path's sampler
(SGLang's truncation rule, the kept set recorded, the log-prob renormalised over it). A finished request hands its
row to the last running one (running rows stay first: a step runs on a prefix of the cache, never a gather).

Reproducibility: request k = i * n + j (prompt i, copy j) of a call seeded `seed` draws its step-t token at
uniform t of its own stream, `torch.rand(max_new_tokens, dtype=float64)` from a CPU generator seeded
`request_seed(seed, k)`; its tokens do not depend on the requests beside it, up to the float rounding of
batched matmuls and attention over another batch shape.

Weight updates (`paused`): the loop stops between two steps (or idles), the caller copies the tensors, and the
tokens sampled after it record the new version. With `recompute` every running request then re-prefills its
tokens under the new weights, so its next tokens are sampled from the new weights' exact distribution; without,
it keeps the keys / values the old weights computed (cheaper; a distribution neither version's dense forward
gives). A prefill forward takes at most PREFILL_TOKENS padded tokens (rows longest first, one row at least).

Capacity: the cache holds prompt + max_new_tokens - 1 positions per row (the last sampled token is never fed);
a request that needs more grows it to max(its need, twice the capacity), capped at the model's context. An idle
loop frees it; the next request allocates one of its own need.
"""

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from topp_rl.data.params import SamplingParams
from topp_rl.data.sample import Sample, SampleStatus
from topp_rl.engines.fused_decode import FusedDecoder, SlotCacheForward
from topp_rl.ops import Candidates
from topp_rl.ops.sampling import nonfinite_row_error

BATCHING = ("static", "continuous")
KV_AT_UPDATE = ("recompute", "keep")
_MASK64 = (1 << 64) - 1
# Padded tokens (rows x the longest) one prefill forward takes at most.
PREFILL_TOKENS = 16384


def request_seed(seed: int, index: int) -> int:
    """The seed of request `index` of a call seeded `seed`: output index + 1 of SplitMix64 started at `seed`
    (mod 2^64), shifted right by one bit (a non-negative 63-bit int)."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass
class DecodeCounts:
    """Rows that sampled a token and decode steps run; rows / steps is the mean decode batch size."""

    steps: int = 0
    rows: int = 0

    def add(self, *, steps: int, rows: int) -> None:
        self.steps += steps
        self.rows += rows

    @property
    def mean_batch_size(self) -> float:
        return self.rows / self.steps if self.steps else 0.0


class _Call:
    """One `generate` call: its samples in request order, resolved when the last one finishes."""

    def __init__(self, size: int) -> None:
        self.future: Future[list[Sample]] = Future()
        self.samples: list[Sample | None] = [None] * size
        self.remaining = size

    def finish(self, position: int, sample: Sample) -> None:
        self.samples[position] = sample
        self.remaining -= 1
        if self.remaining == 0:
            self.future.set_result(self.samples)

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


@dataclass(eq=False)
class Request:
    """One response to generate: its prompt, parameters and uniforms, and what it sampled so far."""

    prompt: list[int]
    params: SamplingParams
    uniforms: list[float]
    index: int  # i * n + j within its call
    call: _Call | None = None
    stops: frozenset[int] = frozenset()  # the engine's stop ids and the call's
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    raw: list[float] = field(default_factory=list)
    kept: list[torch.Tensor] = field(default_factory=list)  # per token, its kept ids (int32, CPU)
    versions: list[int] = field(default_factory=list)

    @classmethod
    def start(cls, prompt: list[int], params: SamplingParams, *, seed: int, index: int) -> "Request":
        generator = torch.Generator().manual_seed(request_seed(seed, index))
        uniforms = torch.rand(params.max_new_tokens, generator=generator, dtype=torch.float64).tolist()
        return cls(prompt=list(prompt), params=params, uniforms=uniforms, index=index)

    @property
    def need(self) -> int:
        """Cache positions it fills at most: every token but the last sampled one."""
        return len(self.prompt) + self.params.max_new_tokens - 1

    def fed(self) -> list[int]:
        """The tokens its cache row holds between two steps: all but the pending one."""
        return (self.prompt + self.tokens)[:-1]

    def pending(self) -> int:
        """The token the next step feeds."""
        return self.tokens[-1] if self.tokens else self.prompt[-1]

    def status(self) -> SampleStatus | None:
        """COMPLETED at a stop id, TRUNCATED at max_new_tokens, None while it runs."""
        if self.tokens[-1] in self.stops:
            return SampleStatus.COMPLETED
        return SampleStatus.TRUNCATED if len(self.tokens) == self.params.max_new_tokens else None

    def to_sample(self, status: SampleStatus, *, raw: bool) -> Sample:
        n = len(self.tokens)
        candidates = None
        if self.kept:
            sizes = torch.tensor([0] + [k.numel() for k in self.kept])
            candidates = Candidates.built(ids=torch.cat(self.kept), offsets=sizes.cumsum(0).to(torch.int32))
        sample = Sample(
            prompt_ids=self.prompt, response_ids=list(self.tokens), loss_mask=[1] * n,
            rollout_log_probs=list(self.log_probs), rollout_raw_log_probs=list(self.raw) if raw else None,
            candidates=candidates, status=status,
        )
        sample.set_token_versions(self.versions)
        return sample


# (logits [B, V], params, uniforms [B] float64, record=) -> (tokens, log-probs, raw | None, kept sets | None,
# finite [B] | None): `EmbeddedEngine._sample`
Sampled = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Candidates | None, torch.Tensor | None]
Sampler = Callable[..., Sampled]


class DecodeLoop:
    """The decode loop of a `ContinuousEmbeddedEngine` (see the module docstring). `run` is thread-safe."""

    def __init__(
        self, decoder: FusedDecoder, *, sample: Sampler, rows: int, vocab_size: int, stop_ids: tuple[int, ...],
        record_candidates: bool, record_raw: bool, recompute: bool, counts: DecodeCounts,
    ) -> None:
        self.decoder, self.sample, self.rows = decoder, sample, rows
        self.vocab_size, self.stop_ids = vocab_size, stop_ids
        self.record_candidates, self.record_raw, self.recompute = record_candidates, record_raw, recompute
        self.counts = counts
        self.version = 0  # of the weights sampling now; changed only while the loop is paused
        # Called on the loop's thread at every step boundary with the steps run so far (tests hold the loop at a
        # chosen step with it).
        self.boundary_hook: Callable[[int], None] | None = None
        self.cond = threading.Condition()
        # guarded by `cond`:
        self.waiting: collections.deque[Request] = collections.deque()
        self.pause_requests = 0
        self.parked = False  # between two steps, waiting (idle or paused)
        self.running = False  # a loop thread is alive
        self.closed = False
        # the loop thread's own:
        self.active: list[Request] = []  # row r of the cache is active[r]
        self.cache: SlotCacheForward | None = None
        self.stale = False  # the weights changed since the cache's rows were computed
        self.thread: threading.Thread | None = None

    def run(self, requests: list[Request]) -> list[Sample]:
        """Queue a call's requests; block until all have finished; their samples in order."""
        call = _Call(len(requests))
        for request in requests:
            request.call = call
            request.stops = frozenset(self.stop_ids + request.params.stop_token_ids)
        if not requests:
            return []
        with self.cond:
            if self.closed:
                raise RuntimeError("the engine is closed; build a new one to generate")
            self.waiting.extend(requests)
            if not self.running:
                self.running = True
                self.thread = threading.Thread(target=self._run, name="embedded-decode-loop", daemon=True)
                self.thread.start()
            self.cond.notify_all()
        return call.future.result()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A block during which the loop runs no step: it waits between two steps (or idles, or is not running)."""
        with self.cond:
            self.pause_requests += 1
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.parked or not self.running)
        try:
            yield
        finally:
            with self.cond:
                self.pause_requests -= 1
                self.cond.notify_all()

    def weights_changed(self) -> None:
        """Inside `paused`: the model's weights were written (the cache's rows and copies are stale)."""
        self.stale = True

    def close(self) -> None:
        """Stop the loop at its next boundary, failing the calls in flight, and join its thread."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
            thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    # ---- the loop's thread ----

    def _run(self) -> None:
        error: BaseException | None = None
        try:
            with torch.inference_mode():
                while (admitted := self._boundary()) is not None:
                    self._admit(admitted)
                    self._step()
        except BaseException as e:  # handed to every waiting caller
            error = e
        with self.cond:
            if error is None:
                error = RuntimeError("the engine was closed while this generate call ran")
            for request in [*self.active, *self.waiting]:
                request.call.fail(error)
            self.active, self.cache, self.stale = [], None, False
            self.waiting.clear()
            self.running = False
            self.cond.notify_all()

    def _boundary(self) -> list[Request] | None:
        """Between two steps: wait while paused or idle; the requests to admit (None: closed)."""
        if self.boundary_hook is not None:
            self.boundary_hook(self.counts.steps)
        with self.cond:
            while not self.closed and (self.pause_requests or not (self.active or self.waiting)):
                if not (self.active or self.waiting):
                    self.cache = None  # idle: the memory goes back until the next request (as a static batch's)
                self.parked = True
                self.cond.notify_all()
                self.cond.wait()
            self.parked = False
            if self.closed:
                return None
            free = self.rows - len(self.active)
            return [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]

    def _admit(self, admitted: list[Request]) -> None:
        """Give each admitted request a row and prefill it (with every running row, after a weight update with
        `recompute`)."""
        need = max((r.need for r in admitted), default=0)
        if self.cache is None:
            if not admitted:
                return
            self.cache = SlotCacheForward(self.decoder, self.rows, need)
        elif need > self.cache.capacity:
            limit = getattr(self.decoder.model.config, "max_position_embeddings", None) or need
            self.cache.grow(max(need, min(2 * self.cache.capacity, limit)))
        recompute = False
        if self.stale:
            self.cache.refresh_weights()
            self.stale, recompute = False, self.recompute
        refill = list(range(len(self.active))) if recompute else []
        for request in admitted:
            refill.append(len(self.active))
            self.active.append(request)
        for row in refill:
            self.cache.fill[row] = 0
        seqs = {row: self.active[row].fed() for row in refill}
        for rows in _prefill_chunks({row: len(seq) for row, seq in seqs.items() if seq}):
            self.cache.prefill(rows, [seqs[row] for row in rows])

    def _step(self) -> None:
        """Feed every running row its pending token, sample the next, finish the requests that ended."""
        active = self.active
        ids = torch.tensor([r.pending() for r in active], device=self.cache.device)
        logits = self.cache.step(ids)[:, : self.vocab_size]
        for params, rows in _by_params(active).items():
            self._sample_rows(logits if len(rows) == len(active) else logits[rows], params, [active[r] for r in rows])
        self.counts.add(steps=1, rows=len(active))
        finished = {}
        for row, request in enumerate(active):
            if (status := request.status()) is not None:
                finished[row] = status
        if finished:
            self._finish(finished)

    def _sample_rows(self, logits: torch.Tensor, params: SamplingParams, requests: list[Request]) -> None:
        u = torch.tensor([r.uniforms[len(r.tokens)] for r in requests], dtype=torch.float64, device=logits.device)
        record = self.record_candidates and params.truncates
        tokens, log_probs, raw, cands, finite = self.sample(logits, params, u, record=record)
        if finite is not None and not bool(finite.all()):
            raise nonfinite_row_error(int((~finite).nonzero()[0]), len(requests), params.temperature)
        raw_list = raw.tolist() if raw is not None else None
        if cands is not None:
            kept_ids, offsets = cands.ids.cpu(), cands.offsets.tolist()
        drawn = zip(requests, tokens.tolist(), log_probs.tolist(), strict=True)
        for j, (request, token, log_prob) in enumerate(drawn):
            request.tokens.append(token)
            request.log_probs.append(log_prob)
            request.versions.append(self.version)
            if raw_list is not None:
                request.raw.append(raw_list[j])
            if cands is not None:
                request.kept.append(kept_ids[offsets[j] : offsets[j + 1]])

    def _finish(self, finished: dict[int, SampleStatus]) -> None:
        """Hand each finished request's sample to its call; move the last running rows into the freed ones."""
        with torch.inference_mode(False):  # ordinary tensors in the samples (training may save them)
            for row, status in finished.items():
                request = self.active[row]
                request.call.finish(request.index, request.to_sample(status, raw=self.record_raw))
        end = len(self.active) - len(finished)  # rows below it stay running
        holes = [row for row in sorted(finished) if row < end]
        movers = [row for row in range(end, len(self.active)) if row not in finished]
        for hole, row in zip(holes, movers, strict=True):
            self.cache.move(row, hole)
            self.active[hole] = self.active[row]
        del self.active[end:]
        for row in range(end, self.rows):
            self.cache.fill[row] = 0


def _prefill_chunks(lengths: dict[int, int]) -> list[list[int]]:
    """The rows to prefill (row -> tokens), longest first, in chunks of at most PREFILL_TOKENS padded tokens (one
    row per chunk at least): a re-prefill of every running row after an update is bounded in memory."""
    chunks: list[list[int]] = []
    for row in sorted(lengths, key=lengths.get, reverse=True):
        if chunks and (len(chunks[-1]) + 1) * lengths[chunks[-1][0]] <= PREFILL_TOKENS:
            chunks[-1].append(row)
        else:
            chunks.append([row])
    return chunks


def _by_params(requests: list[Request]) -> dict[SamplingParams, list[int]]:
    """The rows of each sampling setting (calls with different parameters share the batch)."""
    rows: dict[SamplingParams, list[int]] = {}
    for row, request in enumerate(requests):
        rows.setdefault(request.params, []).append(row)
    return rows
