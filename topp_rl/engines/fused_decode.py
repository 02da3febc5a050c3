"""A hand-written eager forward for dense Llama-family decoders with a static KV cache (the embedded engine's
`decode="fused"` path).

`FusedDecoder(model).start(batch, capacity, mask)` returns a `StaticCacheForward`: called with the ids fed at one
step ([B, q]: the left-padded prompt, then one token per call) and their positions, it returns the last
position's logits [B, V] as float32, and equals HF's forward of the same module (`LlamaForCausalLM`,
`Qwen2ForCausalLM` with its qkv bias, `Qwen3ForCausalLM` with q_norm / k_norm and an explicit head_dim,
`MistralForCausalLM` without a sliding window) with `logits_to_keep=1` and a cache: HF's RMSNorm op for op
(float32 statistics), the default RoPE from the module's own `inv_freq` (cos / sin bit for bit as HF computes
them), the same projections read from the module's live parameters at every batch (an optimizer step on a shared
module is seen by the next `generate`; a large model's weights are never copied, a small one's q / k / v and
gate / up are concatenated per batch, see FUSE_PROJECTIONS_MAX_BYTES), and softmax(q k^T * head_dim^-0.5 + mask) v.

Where it departs: keys and values live in one cache [layers, B, kv_heads, capacity, head_dim] per batch, written
in place (HF's `DynamicCache` concatenates per layer per step); the prefill attends through SDPA with
`enable_gqa`; a one-token step through HF's *eager* formula (matmul, scale, add mask, float32 softmax, matmul) on
[B x kv_heads] rows with the group's queries as rows (no repeated cache), 2x faster than SDPA at these shapes on
CPU; padding is an additive mask (0 / dtype min), built once per batch. HF itself runs SDPA by default, so
logits differ from HF's by float32 rounding (<= 5e-6 on logits ~5 in tests/test_fused_decode.py), never in what
is computed. Anything else (MoE, rope scaling, sliding windows, other architectures) is refused by
`unsupported_reason`; PEFT layers and FSDP sharding by the engine.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# Architectures whose HF forward this module reproduces (type name of the `...ForCausalLM` module).
SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
# Below this many bytes of q/k/v and gate/up weights, a batch concatenates them (one matmul each instead of three
# and two): a small model's decode step is bound by per-op dispatch, not arithmetic (tiny Qwen2, hidden 128:
# measured faster), and the copy is small. A large model's step is bound by its matmuls, so it gains nothing and
# would hold a second copy of most of its weights.
FUSE_PROJECTIONS_MAX_BYTES = 32 * 2**20


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the fused forward cannot run `model` (None: it can). PEFT layers and FSDP sharding are the engine's
    checks (they can appear after construction)."""
    name = type(model).__name__
    if name not in SUPPORTED:
        return f"architecture {name} is not one of {', '.join(SUPPORTED)}"
    config = model.config
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = getattr(config, "rope_scaling", None)
    if rope_type != "default" or (scaling and scaling.get("rope_type", scaling.get("type")) != "default"):
        return f"{config.model_type} uses rope type {rope_type!r}; only the default rope is implemented"
    if getattr(model.model.rotary_emb, "attention_scaling", 1.0) != 1.0:
        return f"{config.model_type} scales its rope (attention_scaling != 1)"
    layer_types = getattr(config, "layer_types", None) or ()
    if any(t != "full_attention" for t in layer_types) or (
        name == "MistralForCausalLM" and config.sliding_window is not None
    ):
        return f"{config.model_type} has sliding-window attention layers"
    if getattr(config, "pretraining_tp", 1) != 1:
        return f"{config.model_type} has pretraining_tp={config.pretraining_tp}"
    return None


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's modules (their parameters are read at each call, never kept)."""

    attn_norm: nn.Module
    q: nn.Linear
    k: nn.Linear
    v: nn.Linear
    o: nn.Linear
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    mlp_norm: nn.Module
    gate: nn.Linear
    up: nn.Linear
    down: nn.Linear
    act: Callable[[torch.Tensor], torch.Tensor]


class FusedDecoder:
    """The fused forward of one supported HF module (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"fused decode cannot run this model: {reason}")
        self.model = model
        config = model.config
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps

    def start(self, batch: int, capacity: int, mask: torch.Tensor | None) -> "StaticCacheForward":
        """A forward with a fresh cache for `batch` rows of up to `capacity` positions (prompt width + new);
        `mask` [B, capacity] is the whole run's padding mask (1 = a real token; None: no row is padded)."""
        return StaticCacheForward(self, batch, capacity, mask)

    def projection_bytes(self) -> int:
        """Bytes of every layer's q / k / v / gate / up weights (what `_Fused` would copy)."""
        return sum(
            m.weight.numel() * m.weight.element_size()
            for layer in self.layers() for m in (layer.q, layer.k, layer.v, layer.gate, layer.up)
        )

    def layers(self) -> list[_Layer]:
        out = []
        for layer in self.model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            out.append(_Layer(
                layer.input_layernorm, attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                getattr(attn, "q_norm", None), getattr(attn, "k_norm", None), layer.post_attention_layernorm,
                mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn,
            ))
        return out


class StaticCacheForward:
    """Calls in order: the prefill (the whole left-padded prompt), then one token per call."""

    def __init__(self, decoder: FusedDecoder, batch: int, capacity: int, mask: torch.Tensor | None) -> None:
        model = decoder.model
        weight = model.model.embed_tokens.weight
        self.decoder, self.model = decoder, model
        self.layers = decoder.layers()  # taken per batch: modules, whose parameters are read at each call
        # Small models: q / k / v and gate / up concatenated for this batch (the module cannot change during one
        # `generate`: it runs under no_grad, between optimizer steps).
        self.fused = (
            [_Fused.of(layer) for layer in self.layers]
            if decoder.projection_bytes() <= FUSE_PROJECTIONS_MAX_BYTES else None
        )
        self.dtype, self.device = weight.dtype, weight.device
        shape = (len(self.layers), batch, decoder.kv_heads, capacity, decoder.head_dim)
        self.keys = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.values = torch.empty(shape, dtype=self.dtype, device=self.device)
        flat = (len(self.layers), batch * decoder.kv_heads, capacity, decoder.head_dim)
        self.keys_flat, self.values_flat = self.keys.view(flat), self.values.view(flat)
        self.cos, self.sin = _rope_tables(model.model.rotary_emb.inv_freq, capacity, self.dtype, self.device)
        self.mask = mask
        # one-token steps see every filled slot but padding: one additive row for the run, sliced per step
        self.step_bias = None if mask is None else _attention_bias(
            mask, batch, capacity - 1, capacity, self.dtype, self.device
        )
        self.filled = 0

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Last-position logits [B, V] (float32) of `ids` [B, q] at `positions` [B, q], after the cache."""
        batch, q_len = ids.shape
        start, end = self.filled, self.filled + q_len
        if end > self.keys.shape[3]:
            raise ValueError(f"{end} positions exceed the cache's capacity ({self.keys.shape[3]})")
        if q_len == 1:
            bias = None if self.step_bias is None else self.step_bias[..., :end]
        else:
            bias = _attention_bias(self.mask, batch, start, end, self.dtype, self.device)
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [B, 1, q, d]
        h = F.embedding(ids, self.model.model.embed_tokens.weight)
        for i, layer in enumerate(self.layers):
            fused = None if self.fused is None else self.fused[i]
            h = h + self._attention(layer, fused, _rms_norm(h, layer.attn_norm, self.decoder.eps), i, cos, sin, bias)
            h = h + _mlp(layer, fused, _rms_norm(h, layer.mlp_norm, self.decoder.eps))
        self.filled = end
        return _last_logits(self.model, h, self.decoder.eps)

    def _attention(self, layer: _Layer, fused: "_Fused | None", x, i: int, cos, sin, bias) -> torch.Tensor:
        """o_proj(softmax(q k^T / sqrt(d) + bias) v) over the cache, this call's k / v written into it first."""
        batch, q_len, _ = x.shape
        dec, start, end = self.decoder, self.filled, self.filled + q_len
        q, k, v = _rotated_qkv(dec, layer, fused, x, cos, sin)
        keys, values = self.keys[i], self.values[i]  # [B, kv_heads, capacity, d]
        keys.narrow(2, start, q_len).copy_(k)
        values.narrow(2, start, q_len).copy_(v.transpose(1, 2))
        if q_len > 1:  # the prefill: SDPA's fused kernel never materialises the [q, q] scores per head
            out = F.scaled_dot_product_attention(
                q, keys[:, :, :end], values[:, :, :end], attn_mask=bias, scale=dec.head_dim**-0.5, enable_gqa=True
            )
            return _linear(out.transpose(1, 2).reshape(batch, q_len, -1), layer.o)
        out = _one_token_attention(dec, q, self.keys_flat[i][:, :end], self.values_flat[i][:, :end], bias)
        return _linear(out, layer.o)


class SlotCacheForward:
    """A static KV cache of `rows` independent sequences (continuous batching, `topp_rl.engines.continuous`).

    Row r holds the keys / values of its first `fill[r]` tokens at cache positions 0..fill[r]-1, which are their
    rope positions too (no padding). `prefill` writes whole sequences into chosen rows; `step` feeds one token to
    each of the first A rows, each at its own position, attending through an additive mask of its own length,
    and returns their logits; `move` copies a row (the caller keeps its running rows first); `grow` reallocates
    a longer cache. The same ops as `StaticCacheForward` per layer (norms, rope, projections, the one-token
    eager attention); the prefill of right-padded sequences attends through SDPA's causal mask (a padded tail
    only writes keys past the row's fill, which its steps overwrite before they attend to them).
    After an in-place weight update, `refresh_weights` re-reads the concatenated projections.
    """

    def __init__(self, decoder: FusedDecoder, rows: int, capacity: int) -> None:
        self.decoder, self.model = decoder, decoder.model
        self.layers = decoder.layers()
        weight = self.model.model.embed_tokens.weight
        self.dtype, self.device = weight.dtype, weight.device
        self.rows = rows
        self.fill = [0] * rows
        self.keys = self.values = None
        self.refresh_weights()
        self._allocate(capacity)

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    def refresh_weights(self) -> None:
        """Concatenate the projections again (small models): they are copies of the module's weights."""
        small = self.decoder.projection_bytes() <= FUSE_PROJECTIONS_MAX_BYTES
        self.fused = [_Fused.of(layer) for layer in self.layers] if small else None

    def grow(self, capacity: int) -> None:
        """A cache of `capacity` positions per row, holding every row's filled positions."""
        if capacity > self.capacity:
            self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        dec = self.decoder
        shape = (len(self.layers), self.rows, dec.kv_heads, capacity, dec.head_dim)
        # zeros, not empty: a step attends (at weight 0, under the mask) to positions past a shorter row's fill,
        # and 0 x a NaN left in uninitialised memory would be NaN
        keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        values = torch.zeros(shape, dtype=self.dtype, device=self.device)
        kept = max(self.fill)
        if self.keys is not None and kept:
            keys[..., :kept, :].copy_(self.keys[..., :kept, :])
            values[..., :kept, :].copy_(self.values[..., :kept, :])
        self.keys, self.values = keys, values
        flat = (len(self.layers), self.rows * dec.kv_heads, capacity, dec.head_dim)
        self.keys_flat, self.values_flat = keys.view(flat), values.view(flat)
        self.cos, self.sin = _rope_tables(self.model.model.rotary_emb.inv_freq, capacity, self.dtype, self.device)

    def move(self, src: int, dst: int) -> None:
        """Row `src`'s filled keys / values into row `dst`."""
        n = self.fill[src]
        self.keys[:, dst, :, :n].copy_(self.keys[:, src, :, :n])
        self.values[:, dst, :, :n].copy_(self.values[:, src, :, :n])
        self.fill[dst] = n

    def prefill(self, rows: list[int], seqs: list[list[int]]) -> None:
        """Write the keys / values of `seqs[j]` (non-empty) into row `rows[j]` at positions 0..len - 1."""
        dec, width = self.decoder, max(map(len, seqs))
        if width > self.capacity:
            raise ValueError(f"{width} positions exceed the cache's capacity ({self.capacity})")
        ids = torch.full((len(seqs), width), 0, dtype=torch.long, device=self.device)
        for j, seq in enumerate(seqs):
            ids[j, : len(seq)] = torch.tensor(seq, device=self.device)
        index = torch.tensor(rows, device=self.device)
        cos, sin = self.cos[:width][None, None], self.sin[:width][None, None]  # [1, 1, W, d]
        h = F.embedding(ids, self.model.model.embed_tokens.weight)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            fused = None if self.fused is None else self.fused[i]
            q, k, v = _rotated_qkv(dec, layer, fused, _rms_norm(h, layer.attn_norm, dec.eps), cos, sin)
            v = v.transpose(1, 2)
            self.keys[i][:, :, :width].index_copy_(0, index, k)
            self.values[i][:, :, :width].index_copy_(0, index, v)
            if i == last:  # the keys / values are all a prefill leaves behind
                break
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=dec.head_dim**-0.5, enable_gqa=True)
            h = h + _linear(out.transpose(1, 2).reshape(len(seqs), width, -1), layer.o)
            h = h + _mlp(layer, fused, _rms_norm(h, layer.mlp_norm, dec.eps))
        for row, seq in zip(rows, seqs, strict=True):
            self.fill[row] = len(seq)

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Feed ids[r] [A] to row r at position fill[r] (r < A); the logits [A, V] (float32) after it."""
        dec, active = self.decoder, ids.shape[0]
        at = torch.tensor(self.fill[:active], device=self.device)  # [A]
        end = max(self.fill[:active]) + 1
        if end > self.capacity:
            raise ValueError(f"{end} positions exceed the cache's capacity ({self.capacity})")
        keys = torch.arange(end, device=self.device)
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        bias = torch.where(keys <= at[:, None], zero, torch.finfo(self.dtype).min)[:, None, None]  # [A, 1, 1, end]
        positions = at[:, None]
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [A, 1, 1, d]
        # row b x kv_heads + h of the flat cache, written at the row's own position
        flat_rows = torch.arange(active * dec.kv_heads, device=self.device)
        flat_at = at.repeat_interleave(dec.kv_heads)
        h = F.embedding(ids[:, None], self.model.model.embed_tokens.weight)
        for i, layer in enumerate(self.layers):
            fused = None if self.fused is None else self.fused[i]
            q, k, v = _rotated_qkv(dec, layer, fused, _rms_norm(h, layer.attn_norm, dec.eps), cos, sin)
            keys_i, values_i = self.keys_flat[i], self.values_flat[i]
            keys_i.index_put_((flat_rows, flat_at), k.reshape(-1, dec.head_dim))
            values_i.index_put_((flat_rows, flat_at), v.reshape(-1, dec.head_dim))
            rows = active * dec.kv_heads
            out = _one_token_attention(dec, q, keys_i[:rows, :end], values_i[:rows, :end], bias)
            h = h + _linear(out, layer.o)
            h = h + _mlp(layer, fused, _rms_norm(h, layer.mlp_norm, dec.eps))
        for r in range(active):
            self.fill[r] += 1
        return _last_logits(self.model, h, dec.eps)


def _rotated_qkv(dec: FusedDecoder, layer: _Layer, fused: "_Fused | None", x, cos, sin):
    """q [B, heads, q, d] and k [B, kv_heads, q, d] normed (Qwen3) and rotated, v [B, q, kv_heads, d]."""
    batch, q_len, _ = x.shape
    if fused is None:
        q, k, v = _linear(x, layer.q), _linear(x, layer.k), _linear(x, layer.v)
    else:
        q, k, v = F.linear(x, fused.qkv, fused.qkv_bias).split(fused.qkv_split, -1)
    q = q.view(batch, q_len, dec.heads, dec.head_dim)
    k = k.view(batch, q_len, dec.kv_heads, dec.head_dim)
    v = v.view(batch, q_len, dec.kv_heads, dec.head_dim)
    if layer.q_norm is not None:
        q, k = _rms_norm(q, layer.q_norm, dec.eps), _rms_norm(k, layer.k_norm, dec.eps)
    return _rope(q.transpose(1, 2), cos, sin), _rope(k.transpose(1, 2), cos, sin), v


def _one_token_attention(dec: FusedDecoder, q, keys, values, bias) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + bias) v for one query per row [B, 1, heads x d], before o_proj.

    HF's eager attention (matmul, scale, add the mask, softmax, matmul), GQA on the kv heads with each group's
    queries as rows ([B x kv_heads, group, d]: no repeated cache); `keys` / `values` [B x kv_heads, end, d].
    2x faster than SDPA here at batch 32 (measured, hidden 128, 1 thread)."""
    batch = q.shape[0]
    rows, group, end = batch * dec.kv_heads, dec.heads // dec.kv_heads, keys.shape[1]
    scores = torch.bmm(q.reshape(rows, group, dec.head_dim), keys.transpose(1, 2)).mul_(dec.head_dim**-0.5)
    if bias is not None:
        scores.view(batch, dec.kv_heads, group, end).add_(bias)
    weights = scores.softmax(-1, dtype=torch.float32)  # HF: a float32 softmax, cast back
    weights = weights if scores.dtype == torch.float32 else weights.to(scores.dtype)
    return torch.bmm(weights, values).view(batch, 1, -1)  # [B x kv_heads, group, d] -> [B, 1, heads x d]


def _mlp(layer: _Layer, fused: "_Fused | None", x: torch.Tensor) -> torch.Tensor:
    if fused is None:
        gate, up = _linear(x, layer.gate), _linear(x, layer.up)
    else:
        gate, up = F.linear(x, fused.gate_up).split(fused.gate_up_split, -1)
    return _linear(layer.act(gate) * up, layer.down)


def _last_logits(model: nn.Module, h: torch.Tensor, eps: float) -> torch.Tensor:
    """The final norm and the LM head at the last position: logits [B, V] float32."""
    h = _rms_norm(h[:, -1:], model.model.norm, eps)
    logits = _linear(h, model.get_output_embeddings())[:, -1]
    return logits if logits.dtype == torch.float32 else logits.float()


@dataclass(frozen=True)
class _Fused:
    """One layer's q / k / v weights (and biases) and gate / up weights, concatenated along the outputs: row i of
    x @ W.T is the same dot products as the separate projections'."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    qkv_split: tuple[int, int, int]
    gate_up: torch.Tensor
    gate_up_split: tuple[int, int]

    @classmethod
    def of(cls, layer: _Layer) -> "_Fused":
        projections = (layer.q, layer.k, layer.v)
        biases = [m.bias for m in projections]
        assert len({b is None for b in biases}) == 1, "HF's q / k / v projections all have a bias or none"
        return cls(
            qkv=torch.cat([m.weight for m in projections]),
            qkv_bias=None if biases[0] is None else torch.cat(biases),
            qkv_split=tuple(m.weight.shape[0] for m in projections),
            gate_up=torch.cat([layer.gate.weight, layer.up.weight]),
            gate_up_split=(layer.gate.weight.shape[0], layer.up.weight.shape[0]),
        )


def _linear(x: torch.Tensor, module: nn.Linear) -> torch.Tensor:
    return F.linear(x, module.weight, module.bias)


def _rms_norm(x: torch.Tensor, norm: nn.Module, eps: float) -> torch.Tensor:
    """HF's RMSNorm, op for op: weight * (x * rsqrt(mean(x^2) + eps)), the statistics in float32 (the no-op
    casts of a float32 model skipped: 2x faster at hidden 128, the same bits)."""
    h = x if x.dtype == torch.float32 else x.float()
    h = h * h.square().mean(-1, keepdim=True).add_(eps).rsqrt_()
    return norm.weight * (h if x.dtype == torch.float32 else h.to(x.dtype))


def _rope_tables(inv_freq: torch.Tensor, capacity: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [capacity, d] for positions 0..capacity-1 as HF's default rotary embedding computes them
    (float32 position x inv_freq, duplicated halves); sin with its first half negated, so that
    rotate_half(x) * sin == x.roll(d / 2) * sin_signed exactly (a negation is exact)."""
    freqs = torch.arange(capacity, device=device, dtype=torch.float32)[:, None] * inv_freq.to(device).float()
    emb = torch.cat((freqs, freqs), dim=-1)
    half = freqs.shape[-1]
    sin = emb.sin()
    sin[:, :half].neg_()
    return emb.cos().to(dtype), sin.to(dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (HF's `apply_rotary_pos_emb` for one tensor)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def _attention_bias(mask: torch.Tensor | None, batch: int, start: int, end: int, dtype, device) -> torch.Tensor:
    """Additive mask [B, 1, q, end]: 0 where query i (at cache slot start + i) may see key j (j <= start + i and
    j a real token), dtype min elsewhere (a padding query sees a uniform average, never NaN)."""
    keys = torch.arange(end, device=device)
    allowed = keys[None, :] <= torch.arange(start, end, device=device)[:, None]  # [q, end]
    allowed = allowed[None].expand(batch, -1, -1)
    if mask is not None:
        allowed = allowed & mask[:, None, :end].bool()
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[:, None]
