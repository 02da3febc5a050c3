"""Wire format for candidate sets: two little-endian int32 arrays (ids, offsets), base64-encoded.

Encoded form (what `encode_candidates` returns and our SGLang patch puts into `meta_info`)::

    {"candidate_ids_b64": <base64 of int32 LE ids, K values>,
     "candidate_offsets_b64": <base64 of int32 LE offsets, N + 1 values>}

Row i (response token i) holds `ids[offsets[i]:offsets[i + 1]]`, the token ids the sampler kept.
`decode_candidates` also accepts, under the same keys or under `candidate_ids` / `candidate_offsets`, raw
bytes (int32 LE) or plain int lists, and SGLang's native `output_token_sampling_mask` (one list of kept ids
per output token). This replaces SGLang's nested JSON lists, which cost a Python object per candidate id.
"""

import binascii
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pybase64
import torch

from topp_rl.ops import Candidates
from topp_rl.ops.candidates import rows_missing_token

IDS_KEY = "candidate_ids_b64"
OFFSETS_KEY = "candidate_offsets_b64"
SGLANG_MASK_KEY = "output_token_sampling_mask"
_ALT_KEYS = {IDS_KEY: "candidate_ids", OFFSETS_KEY: "candidate_offsets"}
_LE_INT32 = np.dtype("<i4")


def encode_candidates(cands: Candidates) -> dict[str, str]:
    return {IDS_KEY: _b64(cands.ids), OFFSETS_KEY: _b64(cands.offsets)}


def _b64(values: torch.Tensor) -> str:
    return pybase64.b64encode(values.numpy().astype(_LE_INT32, copy=False).tobytes()).decode("ascii")


def decode_candidates(
    meta: Mapping[str, Any],
    *,
    num_tokens: int,
    vocab_size: int | None = None,
    tokens: Sequence[int] | torch.Tensor | None = None,
) -> Candidates | None:
    """Candidates for `num_tokens` response tokens from an engine's `meta`, or None when it carries none.

    Checks the CSR structure, the vocab range (when `vocab_size` is given) and that every sampled token is in
    its row (when `tokens` is given); any violation raises ValueError saying which.
    """
    ids_raw = _first(meta, IDS_KEY)
    offsets_raw = _first(meta, OFFSETS_KEY)
    if ids_raw is None and offsets_raw is None:
        if meta.get(SGLANG_MASK_KEY) is None:
            return None
        ids, offsets = _from_nested(meta[SGLANG_MASK_KEY])
    elif ids_raw is None or offsets_raw is None:
        have, lack = (IDS_KEY, OFFSETS_KEY) if offsets_raw is None else (OFFSETS_KEY, IDS_KEY)
        raise ValueError(f"candidate payload has {have!r} but not {lack!r}; both arrays are needed to decode")
    else:
        ids, offsets = _to_int32(ids_raw, IDS_KEY), _to_int32(offsets_raw, OFFSETS_KEY)
    _check_structure(ids, offsets, num_tokens=num_tokens, vocab_size=vocab_size)
    cands = Candidates(ids=torch.from_numpy(ids), offsets=torch.from_numpy(offsets))
    if tokens is not None:
        _check_tokens(cands, torch.as_tensor(tokens, dtype=torch.long), num_tokens)
    return cands


def merge_encoded(parts: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """One payload for consecutive turns: ids concatenated, each part's offsets shifted by the ids before it."""
    all_ids, all_offsets, shift = [], [np.zeros(1, dtype=np.int32)], 0
    for i, part in enumerate(parts):
        ids, offsets = (
            _to_int32(_first(part, IDS_KEY), IDS_KEY),
            _to_int32(_first(part, OFFSETS_KEY), OFFSETS_KEY),
        )
        try:
            _check_structure(ids, offsets, num_tokens=len(offsets) - 1, vocab_size=None)
        except ValueError as err:
            raise ValueError(f"merge_encoded part {i}: {err}") from None
        all_ids.append(ids)
        all_offsets.append(offsets[1:] + shift)
        shift += len(ids)
    ids = np.concatenate(all_ids) if all_ids else np.zeros(0, dtype=np.int32)
    merged = Candidates(ids=torch.from_numpy(ids), offsets=torch.from_numpy(np.concatenate(all_offsets)))
    return encode_candidates(merged)


def _first(meta: Mapping[str, Any], key: str) -> Any:
    value = meta.get(key)
    return meta.get(_ALT_KEYS[key]) if value is None else value


def _to_int32(value: Any, key: str) -> np.ndarray:
    if value is None:
        raise ValueError(f"candidate payload lacks {key!r}; both ids and offsets are needed")
    if isinstance(value, str):
        try:
            value = pybase64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as err:
            raise ValueError(
                f"{key}: malformed base64 ({err}); expected standard base64 of int32 LE values"
            ) from None
    if isinstance(value, (bytes, bytearray, memoryview)):
        if len(value) % 4:
            raise ValueError(f"{key}: {len(value)} bytes is not a multiple of 4; expected int32 LE values")
        return np.frombuffer(bytes(value), dtype=_LE_INT32).astype(np.int32)
    if isinstance(value, torch.Tensor):
        value = value.cpu().numpy()
    arr = np.asarray(value)
    if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{key}: expected a flat sequence of ints, got shape {arr.shape} dtype {arr.dtype}")
    return arr.astype(np.int32)


def _from_nested(rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = [int(t) for r in rows for t in r]
    return np.asarray(flat, dtype=np.int32), offsets.astype(np.int32)


def _check_structure(
    ids: np.ndarray, offsets: np.ndarray, *, num_tokens: int, vocab_size: int | None
) -> None:
    if len(offsets) != num_tokens + 1:
        raise ValueError(
            f"candidate offsets have {len(offsets)} entries but {num_tokens} tokens need {num_tokens + 1} "
            "(one row per response token, plus the end)"
        )
    if offsets[0] != 0:
        raise ValueError(f"candidate offsets must start at 0, got {int(offsets[0])}")
    steps = np.diff(offsets)
    if (steps < 0).any():
        i = int(np.argmax(steps < 0))
        raise ValueError(
            f"candidate offsets decrease at row {i} ({int(offsets[i])} -> {int(offsets[i + 1])})"
        )
    if offsets[-1] != len(ids):
        raise ValueError(f"last candidate offset {int(offsets[-1])} != number of candidate ids {len(ids)}")
    if vocab_size is not None and len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
        raise ValueError(
            f"candidate id {bad} is outside the vocabulary [0, {vocab_size}); check the engine's model"
        )


def _check_tokens(cands: Candidates, tokens: torch.Tensor, num_tokens: int) -> None:
    if tokens.numel() != num_tokens:
        raise ValueError(f"{tokens.numel()} sampled tokens given for {num_tokens} candidate rows")
    missing = rows_missing_token(cands, tokens)
    if missing.numel():
        i = int(missing[0])
        raise ValueError(
            f"sampled token {int(tokens[i])} at response position {i} is missing from its candidate row "
            f"{cands.ids[cands.offsets[i] : cands.offsets[i + 1]].tolist()}; the sampler always keeps it"
        )
