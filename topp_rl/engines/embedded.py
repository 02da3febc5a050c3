"""`EmbeddedEngine`: in-process batched generation for HF causal LMs, recording exact candidate sets.

Prompts are left-padded into one batch (attention mask + explicit position ids) and decoded with a KV cache:
by default (`decode="auto"`) through `topp_rl.engines.fused_decode` (a static cache, HF's forward rewritten for
dense Llama / Qwen2 / Qwen3 / Mistral models), else through the HF module's own forward and `DynamicCache`.
Every step applies SGLang's truncation rule (`topp_rl.ops.sampling_candidates`, convention "sglang") to
logits / temperature and draws the token from the renormalised kept set, so the recorded set, the recorded
log-prob and the draw all come from the same probabilities. Departures from SGLang: float32 sampling on
whatever device the model lives on, and the draw uses one seeded `torch.Generator` per `generate` call, so the
same seed gives the same rollout. `batching="static"` (the default) decodes each call's rows as one batch
(finished rows idle until the batch ends); `batching="continuous"` builds a `ContinuousEmbeddedEngine`: every
call's requests share one decode loop (`topp_rl.engines.continuous`) whose batch refills as requests finish, and
weight updates land between two decode steps (`InFlightUpdates`).
MoE models (`record_routes`, default on): every sample also gets the experts each MoE layer picked for every
token fed through the model (prompt and response but the last token), read from HF's router (`topp_rl.models.moe`).
"""

import contextlib
import copy
import inspect
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel

from topp_rl.data.params import SamplingParams
from topp_rl.data.sample import Sample, SampleStatus
from topp_rl.engines.base import InFlightUpdates, RolloutEngine, check_prompts
from topp_rl.engines.continuous import BATCHING, KV_AT_UPDATE, DecodeCounts, DecodeLoop, Request
from topp_rl.engines.fused_decode import FusedDecoder, unsupported_reason
from topp_rl.models.moe import RouteRecorder, moe_routing
from topp_rl.ops import Candidates
from topp_rl.ops.draw import inverse_cdf, sample_kept
from topp_rl.ops.sampling import nonfinite_row_error


class EmbeddedEngine(RolloutEngine):
    shared_by_ranks = False  # in-process: every rank has its own
    max_candidates = None  # records kept sets of any size

    def __new__(cls, *args, batching: str = "static", **kwargs) -> "EmbeddedEngine":
        """`batching="continuous"` builds the subclass that batches concurrent calls and takes in-flight updates
        (so that `isinstance(engine, InFlightUpdates)` holds for it alone)."""
        if cls is EmbeddedEngine and batching == "continuous":
            cls = ContinuousEmbeddedEngine
        return super().__new__(cls)

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        record_candidates: bool = True,
        record_raw_log_probs: bool = False,
        record_routes: bool = True,
        max_batch_size: int = 64,
        share_weights: bool = False,
        progress: bool = True,
        decode: str = "auto",
        batching: str = "static",
        kv_at_update: str = "recompute",
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size ({max_batch_size}) must be >= 1")
        if decode not in ("auto", "hf", "fused"):
            raise ValueError(f"decode ({decode!r}) must be 'auto', 'hf' or 'fused'")
        _check_batching(batching, kv_at_update)
        self.batching, self.kv_at_update = batching, kv_at_update
        # Own copy (the default): training updates reach the engine only through update_weights, as they reach
        # a separate server. Shared: the engine samples with the caller's module itself (no second copy of the
        # weights in memory; an optimizer step is visible at once), leaving its grad flags alone and switching
        # it to eval mode only while it generates.
        self.share_weights = share_weights
        self.model = model if share_weights else copy.deepcopy(model).eval().requires_grad_(False)
        config = self.model.config
        eos = config.eos_token_id if eos_token_id is None else eos_token_id
        self.eos_token_ids = tuple(sorted({eos} if isinstance(eos, int) else set(eos or ())))
        self.pad_token_id = pad_token_id if pad_token_id is not None else (config.pad_token_id or 0)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.max_context = getattr(config, "max_position_embeddings", None)
        self.record_candidates = record_candidates
        self.record_raw_log_probs = record_raw_log_probs
        self.routing = moe_routing(self.model) if record_routes else None  # None: dense, or not asked
        self.max_batch_size = max_batch_size
        self.progress = progress
        self._gathered: Callable[[], contextlib.AbstractContextManager] | None = None  # `sample_sharded`
        self._holding = False  # inside `holding_weights`: the weights are gathered already
        self._cache_kwarg = (
            "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        )
        # The decode forward: "fused" (`topp_rl.engines.fused_decode`, a static cache) or "hf" (the module's own
        # forward with a DynamicCache). Resolved again at every generate (a module can be sharded or wrapped
        # later); `decode_path` / `decode_reason` say which one ran last and why not fused.
        self.decode = decode
        self.decode_path, self.decode_reason = self._resolve_decode()
        # Rows that sampled a token, and decode steps run: rows / steps is the mean decode batch size (a finished
        # row idling in a static batch is not counted).
        self.decode_counts = DecodeCounts()

    @classmethod
    def for_policy(cls, *, model: PreTrainedModel, tokenizer, workdir: Path, **kwargs) -> "EmbeddedEngine":
        """The config factory (`rollout.engine`): an engine on the policy's HF module (shared or copied, as
        `share_weights` says), with the tokenizer's stop / pad ids (`workdir` is unused: it writes no files)."""
        return cls(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **kwargs)

    @property
    def shares_trainer_weights(self) -> bool:
        """Samples with the trainer's module itself (`share_weights=True`), not a copy."""
        return self.share_weights

    @property
    def records_routes(self) -> bool:
        return self.routing is not None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, seed: int | None = None
    ) -> list[Sample]:
        self._check_context(prompts, params)
        generator = torch.Generator(device=self.device)
        # No seed: fresh entropy, without touching torch's global RNG (torch.seed() would reseed it).
        generator.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
        expanded = [(g, p) for g, p in enumerate(prompts) for _ in range(params.n)]
        self.decode_path, self.decode_reason = self._resolve_decode()
        samples: list[Sample] = []
        gather = self._gathered is not None and not self._holding
        with self._gathered() if gather else contextlib.nullcontext(), _sampling_mode(self.model):
            for start in range(0, len(expanded), self.max_batch_size):
                chunk = expanded[start : start + self.max_batch_size]
                samples += self._generate_batch([p for _, p in chunk], params, generator)
        return samples

    def _check_context(self, prompts: list[list[int]], params: SamplingParams) -> None:
        check_prompts(prompts, self.vocab_size)
        longest = max(map(len, prompts), default=0) + params.max_new_tokens
        limit = self.max_context
        if limit is not None and longest > limit:
            raise ValueError(
                f"longest prompt + max_new_tokens = {longest} exceeds the model's max_position_embeddings "
                f"({limit}); shorten the prompts or lower max_new_tokens"
            )

    def _generate_batch(
        self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator
    ) -> list[Sample]:
        batch, device = len(prompts), self.device
        width = max(map(len, prompts))
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long, device=device)
        # The whole run's attention mask, allocated once: step t passes a view of its first width + t columns
        # (no per-step concatenation). Without left padding no mask is passed at all (HF then skips building one).
        mask = torch.ones((batch, width + params.max_new_tokens), dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p) :] = torch.tensor(p, device=device)
            mask[i, : width - len(p)] = 0
        padded = any(len(p) < width for p in prompts)
        positions = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)
        steps = _StepRecords(batch, device)
        # The loop runs in inference mode (no version counters, no view tracking): the tiny model's decode loop
        # takes 15-20% less time (measured). The samples are built outside it, so that their tensors are ordinary
        # ones that training can save for its backward.
        with (RouteRecorder(self.model, self.routing) if self.routing else contextlib.nullcontext() as recorder,
              torch.inference_mode()):
            lengths, done = self._decode(input_ids, mask, positions, padded, params, generator, steps, recorder)
        self.decode_counts.add(steps=len(steps.tokens), rows=int(lengths.sum()))
        return steps.to_samples(prompts, lengths.tolist(), done.tolist(), raw=self.record_raw_log_probs)

    def _decode(self, step_ids, mask, positions, padded, params, generator, steps, recorder):
        """The decode loop: fills `steps`; returns (response lengths [B], done [B])."""
        batch, width = step_ids.shape
        device = step_ids.device
        stop_ids = torch.tensor(self.eos_token_ids + params.stop_token_ids, dtype=torch.long, device=device)
        record = self.record_candidates and params.truncates
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        hits: list[torch.Tensor] = []  # per step [B]: the token drawn there is a stop id
        if self.decode_path == "fused":
            forward = FusedDecoder(self.model).start(batch, width + params.max_new_tokens, mask if padded else None)
        else:
            forward = self._hf_forward(mask if padded else None)
        for _ in tqdm(
            range(params.max_new_tokens), desc="rollout decode", disable=not self.progress, leave=False
        ):
            logits = forward(step_ids, positions)[:, : self.vocab_size]
            if recorder is not None:
                steps.routes.append(recorder.take().unflatten(0, (batch, -1)))  # [B, tokens this forward, L, k]
            u = torch.rand(batch, generator=generator, device=device, dtype=torch.float64)
            tokens, log_probs, raw, cands, finite = self._sample(logits, params, u, record=record)
            steps.add(tokens, log_probs, raw, cands)
            hits.append(torch.isin(tokens, stop_ids))
            done |= hits[-1]
            # One host sync per step (~1 us on CPU, measured): all rows done, and (untruncated sampling) all rows
            # finite. A NaN / +inf row has no distribution; the truncating path raised on it in sampling_candidates.
            if finite is None:
                all_done, all_finite = bool(done.all()), True
            else:
                all_done, all_finite = torch.stack([done.all(), finite.all()]).tolist()
            if not all_finite:
                row = int((~finite).nonzero()[0])
                raise nonfinite_row_error(row, batch, params.temperature)
            if all_done:
                break
            step_ids = tokens[:, None]
            positions = positions[:, -1:] + 1
        return _response_lengths(hits, done, params.max_new_tokens), done

    def _hf_forward(self, mask: torch.Tensor | None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The HF module's forward with a DynamicCache, step by step: (ids [B, q], positions) -> last logits
        [B, V] float32. The mask (None: no padding) is the whole run's; each call passes a view of the columns
        seen so far (no per-step concatenation)."""
        cache = DynamicCache()

        def forward(step_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            seen = cache.get_seq_length() + step_ids.shape[1]
            out = self.model(
                input_ids=step_ids,
                attention_mask=mask[:, :seen] if mask is not None else None,
                position_ids=positions,
                logits_to_keep=1,
                use_cache=True,
                **{self._cache_kwarg: cache},
            )
            return out.logits[:, -1].float()

        return forward

    def _sample(
        self, logits: torch.Tensor, params: SamplingParams, u: torch.Tensor, *, record: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Candidates | None, torch.Tensor | None]:
        """Draw one token per row from the kept set at the uniforms `u` [B] (float64); return (tokens,
        renormalised log-probs, raw, candidates, finite [B]: whether each row's logits define a distribution,
        checked by the caller with its step sync; None where sampling already raised on such a row)."""
        scaled = logits if params.temperature == 1.0 else logits / params.temperature  # x / 1.0 is x exactly
        if params.truncates:
            cands, tokens, chosen = sample_kept(
                logits, scaled, u, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                min_p=params.min_p,
            )
            finite = None  # every row is finite: sampling_candidates raised on a bad one
        else:
            cands = None
            log_probs = scaled.log_softmax(-1)
            cum = log_probs.exp().double().cumsum(-1)
            finite = torch.isfinite(cum[:, -1])  # NaN iff some entry is NaN / +inf, or every entry is -inf
            tokens = inverse_cdf(cum, u)
            chosen = log_probs.gather(1, tokens[:, None]).squeeze(1)
        raw = None
        if self.record_raw_log_probs:
            raw = scaled.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
        return tokens, chosen, raw, cands if record else None, finite

    @contextlib.contextmanager
    def holding_weights(self) -> Iterator[None]:
        """The sharded module's weights gathered once for the block (every rank together), not per `generate`."""
        if self._gathered is None or self._holding:
            yield
            return
        with self._gathered():
            self._holding = True
            try:
                yield
            finally:
                self._holding = False

    def sample_sharded(self, gathered: Callable[[], contextlib.AbstractContextManager]) -> None:
        """The shared module was sharded by the trainer (FSDP2): every `generate` runs inside `gathered()`, which
        holds its full weights for the block (a collective: all ranks generate together), and `update_weights`
        has nothing to copy (the module is the trainer's own)."""
        if not self.share_weights:
            raise ValueError("sample_sharded is for an engine sharing the trainer's module (share_weights=True)")
        self._gathered = gathered
        self.decode_path, self.decode_reason = self._resolve_decode()

    def _resolve_decode(self) -> tuple[str, str | None]:
        """("fused" | "hf", why not fused): auto takes fused wherever it runs; `decode="fused"` on a model it
        cannot run raises, naming the reason and the fix."""
        if self.decode == "hf":
            return "hf", "decode='hf' asked"
        reason = unsupported_reason(self.model)
        if reason is None and self.routing:
            reason = "MoE routes are recorded through HF's router modules"
        if reason is None and _has_peft_layers(self.model):
            reason = "the module has PEFT (LoRA) adapter layers"
        if reason is None and self._gathered is not None:
            reason = "the module is sharded by FSDP (sample_sharded)"
        if reason is not None and self.decode == "fused":
            raise ValueError(
                f"decode='fused' cannot run {type(self.model).__name__} "
                f"({self.model.config.model_type}): {reason}; use decode='auto' (falls back to HF) or decode='hf'"
            )
        return ("hf", reason) if reason is not None else ("fused", None)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the engine's model, in memory (tied weights update together). A tensor that
        is the engine's own parameter (a shared engine synced from the module it samples with) is skipped; a
        sharded shared module (`sample_sharded`) takes nothing, and the tensors are not even drawn (no gather)."""
        if self._gathered is not None:
            return
        if self.share_weights and _has_peft_layers(self.model):
            # The trainer's own LoRA-adapted module: what it exports is its merged view under the plain HF
            # names, which this module does not hold (it holds base_layer + lora_A / lora_B); nothing to copy.
            return
        self._copy_weights(named_tensors)

    def _copy_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        state = self.model.state_dict()  # views of the live parameters (taken now: the model may have moved)
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = state.get(name)
                if target is None:
                    raise ValueError(f"update_weights: {name!r} is not a parameter of the engine's model")
                if target.shape != tensor.shape:
                    raise ValueError(
                        f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the engine expects "
                        f"{tuple(target.shape)}; sync from the same architecture"
                    )
                if _same_tensor(target, tensor):
                    continue
                target.copy_(tensor.detach().to(device=target.device, dtype=target.dtype))

    def close(self) -> None:
        """Nothing to release: the model is garbage-collected with the engine."""


# inspect.signature (the config's key check, `topp_rl.config.target_parameters`) reads `__new__` first, which only
# picks the class and passes everything on: the engine's keys are `__init__`'s.
EmbeddedEngine.__signature__ = inspect.signature(EmbeddedEngine.__init__).replace(
    parameters=list(inspect.signature(EmbeddedEngine.__init__).parameters.values())[1:]
)


class ContinuousEmbeddedEngine(EmbeddedEngine, InFlightUpdates):
    """`EmbeddedEngine(..., batching="continuous")`: `generate` may be called from several threads at once; every
    call's requests (n per prompt) enter one decode loop on an engine-owned thread (`DecodeLoop`, started at the
    first call, joined by `close`), a request starting as soon as one of the `max_batch_size` rows frees. Request
    k = i * n + j of a call (prompt i, copy j) draws from its own uniforms, seeded by `request_seed(seed, k)`, so
    a call samples the same tokens alone or beside others (up to float rounding of batched matmuls).
    Weight updates land between two decode steps (`update_weights_in_flight`); every token records the version
    that sampled it. At an update the running requests re-prefill their tokens under the new weights
    (`kv_at_update="recompute"`) or go on with the keys / values the old weights computed (`"keep"`).
    Runs on the fused decode path only, with the engine's own copy of the weights; shows no progress bar."""

    def __init__(self, model: PreTrainedModel, **kwargs) -> None:
        super().__init__(model, **kwargs)
        if self.share_weights:
            raise ValueError(
                "batching='continuous' needs the engine's own copy of the weights (share_weights=false): updates "
                "land between its decode steps, while a shared module changes whenever the trainer steps"
            )
        if self.decode_path != "fused":
            raise ValueError(
                f"batching='continuous' runs on the fused decode path, which cannot run {type(self.model).__name__} "
                f"({self.model.config.model_type}): {self.decode_reason}; use batching='static'"
            )
        self.loop = DecodeLoop(
            FusedDecoder(self.model), sample=self._sample, rows=self.max_batch_size, vocab_size=self.vocab_size,
            stop_ids=self.eos_token_ids, record_candidates=self.record_candidates,
            record_raw=self.record_raw_log_probs, recompute=self.kv_at_update == "recompute",
            counts=self.decode_counts,
        )
        self._updating = threading.Lock()  # one weight update at a time

    @property
    def version(self) -> int:
        """The version of the weights sampling now."""
        return self.loop.version

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, *, seed: int | None = None
    ) -> list[Sample]:
        self._check_context(prompts, params)
        if seed is None:  # fresh entropy, without touching torch's global RNG
            seed = int.from_bytes(os.urandom(8), "little") >> 1
        requests = [
            Request.start(prompt, params, seed=seed, index=i * params.n + j)
            for i, prompt in enumerate(prompts) for j in range(params.n)
        ]
        return self.loop.run(requests)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """`update_weights_in_flight` at the next version."""
        with self._updating:
            self._update(named_tensors, self.loop.version + 1)

    def update_weights_in_flight(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Copy the tensors into the engine's model between two decode steps (at once while the loop is idle),
        the loop waiting meanwhile; the tokens sampled after it record `version`. Blocks until they are in."""
        with self._updating:
            self._update(named_tensors, version)

    def _update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        # The tensors are copied on the caller's thread (an iterator that gathers shards runs where it was made)
        # while the loop waits between two steps.
        with self.loop.paused():
            try:
                self._copy_weights(named_tensors)
            finally:  # a refused tensor stops the copy midway: the ones before it are in
                self.loop.weights_changed()
            self.loop.version = version

    def start_version(self, version: int) -> None:
        with self._updating, self.loop.paused():
            self.loop.version = version

    def close(self) -> None:
        """Stop the decode loop (a call still waiting gets an error) and join its thread; idempotent."""
        self.loop.close()


def _check_batching(batching: str, kv_at_update: str) -> None:
    if batching not in BATCHING:
        raise ValueError(f"batching ({batching!r}) must be one of {', '.join(map(repr, BATCHING))}")
    if kv_at_update not in KV_AT_UPDATE:
        raise ValueError(f"kv_at_update ({kv_at_update!r}) must be one of {', '.join(map(repr, KV_AT_UPDATE))}")
    if kv_at_update != "recompute" and batching != "continuous":
        raise ValueError(
            f"kv_at_update={kv_at_update!r} applies to weight updates that land mid-generation, which need "
            "batching='continuous'; set batching='continuous' or leave kv_at_update at 'recompute'"
        )


def _response_lengths(hits: list[torch.Tensor], done: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """[B] tokens up to and including each row's first stop id (`max_new_tokens` for rows that never stopped)."""
    first = torch.stack(hits, 1).int().argmax(1)  # argmax returns the first of equal maxima
    return torch.where(done, first + 1, max_new_tokens)


def _has_peft_layers(model: torch.nn.Module) -> bool:
    """Whether PEFT injected adapter layers into `model` (`topp_rl.trainer.lora`); never imports PEFT itself."""
    if "peft" not in sys.modules:
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer

    return any(isinstance(m, BaseTunerLayer) for m in model.modules())


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.device == b.device and a.dtype == b.dtype and a.data_ptr() == b.data_ptr()
            and a.stride() == b.stride())


@contextlib.contextmanager
def _sampling_mode(model: torch.nn.Module) -> Iterator[None]:
    """Every submodule in eval mode and every parameter without `requires_grad` for the block, then each back to
    its own flag. A shared policy may be in train mode, or have layers flagged `training` for gradient
    checkpointing: sampling must see no dropout. And torch picks other matmul kernels for weights that require
    grad, even under no_grad (last-bit differences, measured here on an AVX-512 Xeon): without the flag a shared
    engine samples bit for bit as a copied one."""
    training = [m for m in model.modules() if m.training]
    trainable = [p for p in model.parameters() if p.requires_grad]
    for m in training:
        m.training = False
    for p in trainable:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for m in training:
            m.training = True
        for p in trainable:
            p.requires_grad_(True)


class _StepRecords:
    """Per-step tensors [B] (step-major), turned into per-sample fields once at the end."""

    def __init__(self, batch: int, device: torch.device) -> None:
        self.batch, self.device = batch, device
        self.tokens: list[torch.Tensor] = []
        self.log_probs: list[torch.Tensor] = []
        self.raw: list[torch.Tensor] = []
        self.cands: list[Candidates] = []
        # MoE routes per forward: the prefill's [B, W, L, k], then one [B, 1, L, k] per decode step
        self.routes: list[torch.Tensor] = []

    def add(self, tokens, log_probs, raw, cands) -> None:
        self.tokens.append(tokens)
        self.log_probs.append(log_probs)
        if raw is not None:
            self.raw.append(raw)
        if cands is not None:
            self.cands.append(cands)

    def to_samples(
        self, prompts: list[list[int]], lengths: list[int], done: list[bool], *, raw: bool
    ) -> list[Sample]:
        tokens = torch.stack(self.tokens, 1).tolist()  # [B, S]
        log_probs = torch.stack(self.log_probs, 1).tolist()
        raw_lp = torch.stack(self.raw, 1).tolist() if raw else None
        per_sample = _split_candidates(self.cands, lengths) if self.cands else [None] * len(prompts)
        routes = torch.cat(self.routes, 1).cpu() if self.routes else None  # [B, W + steps, L, k]
        width = max(map(len, prompts))
        samples = []
        for b, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
            samples.append(
                Sample(
                    prompt_ids=list(prompt),
                    response_ids=tokens[b][:n],
                    loss_mask=[1] * n,
                    rollout_log_probs=log_probs[b][:n],
                    rollout_raw_log_probs=raw_lp[b][:n] if raw_lp is not None else None,
                    candidates=per_sample[b],
                    # the prompt (left-padded into the width) and the response tokens fed back: all but the last
                    routes=routes[b, width - len(prompt) : width + n - 1].clone() if routes is not None else None,
                    status=SampleStatus.COMPLETED if done[b] else SampleStatus.TRUNCATED,
                )
            )
        return samples


def _split_candidates(steps: list[Candidates], lengths: list[int]) -> list[Candidates]:
    """Step-major sets (step t holds one row per sample b) -> one `Candidates` per sample b holding its first
    lengths[b] rows, on the CPU.

    One gather reorders every kept id sample-major; each sample's rows are then a slice of it. The layout is
    built here from the steps' own offsets, so the per-sample sets skip the construction checks (a dozen ops and
    host syncs each, for 32 samples per batch)."""
    offsets = torch.stack([c.offsets for c in steps]).long()  # [S, B + 1]
    ids = torch.cat([c.ids for c in steps])
    sizes = offsets[:, 1:] - offsets[:, :-1]  # [S, B]
    step_base = torch.cumsum(offsets[:, -1], 0) - offsets[:, -1]  # where step t's ids start in `ids`
    starts = offsets[:, :-1] + step_base[:, None]
    lengths_t = torch.tensor(lengths, dtype=torch.long, device=offsets.device)
    taken = (torch.arange(len(steps), device=offsets.device)[:, None] < lengths_t).T  # [B, S]: sample-major
    row_starts, row_sizes = starts.T[taken], sizes.T[taken]
    new_offsets = torch.zeros(row_sizes.numel() + 1, dtype=torch.long, device=offsets.device)
    torch.cumsum(row_sizes, 0, out=new_offsets[1:])
    total = int(new_offsets[-1])
    # id j of the new layout, in row r: ids[row_starts[r] + (j - new_offsets[r])]
    shift = torch.repeat_interleave(row_starts - new_offsets[:-1], row_sizes, output_size=total)
    ordered = ids[shift + torch.arange(total, device=offsets.device)].cpu()
    new_offsets = new_offsets.to(device="cpu", dtype=torch.int32)
    bounds = new_offsets.tolist()
    out, first = [], 0
    for n in lengths:
        a, b = bounds[first], bounds[first + n]
        out.append(Candidates.built(ids=ordered[a:b], offsets=new_offsets[first : first + n + 1] - a))
        first += n
    return out
