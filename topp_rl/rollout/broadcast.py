"""Rollouts shared by the tensor- and context-parallel peers of one data-parallel rank.

TP / CP peers train on the same sequences, so they must hold byte-identical rollouts. Only the group's source
(its first rank: TP rank 0, CP rank 0) runs the engine and the reward; it sends the scored samples to its
peers as a few packed tensors plus a small header:
- header (one `broadcast_object_list`): per sample the prompt / response lengths, status, index, group index,
  reward, metadata, weight version(s), and which optional fields travel;
- tensors (one `broadcast` each): prompt ids and response ids (int64), loss mask (int8), rollout log-probs and
  raw log-probs (float64: what the engine recorded, bit for bit), candidate row lengths and ids (int32), MoE
  routes ([rows, moe_layers, top_k], uint8 when every sample's are, else int32: gloo and NCCL have no int16;
  each sample's own dtype is restored), each concatenated over the samples.
Aborted samples travel too, so every peer keeps the same sample list and step statistics. Departure from slime,
which has every rank pull its share from the rollout manager over Ray: here the peers of a DP rank need the
same data, and one collective over their group delivers it. NCCL groups carry the tensors on the current GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from topp_rl.data.sample import Sample
from topp_rl.ops import Candidates
from topp_rl.parallel.peers import RolloutPeers


def share_samples(samples: list[Sample] | None, peers: RolloutPeers) -> tuple[list[Sample], int]:
    """(the source's `samples` on every peer, tensor bytes sent); the source passes its list, the others None."""
    if peers.size == 1:
        assert samples is not None, "a rank without peers generates its own samples"
        return samples, 0
    device = _device(peers.group)
    header: list = [_header(samples) if peers.is_source else None]
    dist.broadcast_object_list(header, src=peers.source, group=peers.group)
    meta = header[0]
    tensors = _tensors(samples) if peers.is_source else _empty(meta)
    for name in sorted(tensors):
        t = tensors[name].to(device)
        dist.broadcast(t, src=peers.source, group=peers.group)
        tensors[name] = t.cpu()
    sent = sum(t.numel() * t.element_size() for t in tensors.values())
    return (samples if peers.is_source else _unpack(meta, tensors)), sent


def share_object(value: object, peers: RolloutPeers) -> object:
    """The source's `value` (small, picklable) on every peer: one `broadcast_object_list`."""
    if peers.size == 1:
        return value
    box = [value if peers.is_source else None]
    dist.broadcast_object_list(box, src=peers.source, group=peers.group)
    return box[0]


def samples_to_state(samples: list[Sample]) -> dict:
    """`samples` as plain lists and tensors (the broadcast's header and tensors), which a checkpoint holds and
    torch's safe loader (`weights_only=True`) reads back; `samples_from_state` inverts it exactly."""
    return {"header": _header(samples), "tensors": _tensors(samples)}


def samples_from_state(state: dict) -> list[Sample]:
    return _unpack(state["header"], state["tensors"])


def _device(group: dist.ProcessGroup) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _header(samples: list[Sample]) -> dict:
    return {
        "prompt_lengths": [len(s.prompt_ids) for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "status": [str(s.status) for s in samples],
        "index": [s.index for s in samples],
        "group_index": [s.group_index for s in samples],
        "reward": [s.reward for s in samples],
        "weight_version": [s.weight_version for s in samples],
        "weight_versions": [s.weight_versions for s in samples],  # per token, None where one version sampled all
        "metadata": [s.metadata for s in samples],
        "has_raw": [s.rollout_raw_log_probs is not None for s in samples],
        "has_candidates": [s.candidates is not None for s in samples],
        "num_candidate_ids": sum(int(s.candidates.ids.numel()) for s in samples if s.candidates is not None),
        # per sample: its routes' dtype name (None: no routes), and the (moe_layers, top_k) every route row has
        "route_dtype": [str(s.routes.dtype).removeprefix("torch.") if s.routes is not None else None
                        for s in samples],
        "route_shape": next((list(s.routes.shape[1:]) for s in samples if s.routes is not None), [0, 0]),
    }


def _tensors(samples: list[Sample]) -> dict[str, torch.Tensor]:
    with_raw = [s for s in samples if s.rollout_raw_log_probs is not None]
    with_cands = [s.candidates for s in samples if s.candidates is not None]
    wire = _route_wire([str(s.routes.dtype).removeprefix("torch.") if s.routes is not None else None
                        for s in samples])
    with_routes = [s.routes.to(wire) for s in samples if s.routes is not None]
    return {
        "routes": torch.cat(with_routes) if with_routes else torch.zeros(0, dtype=wire),
        "prompt_ids": torch.tensor([t for s in samples for t in s.prompt_ids], dtype=torch.int64),
        "response_ids": torch.tensor([t for s in samples for t in s.response_ids], dtype=torch.int64),
        "loss_mask": torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.int8),
        "log_probs": torch.tensor([x for s in samples for x in s.rollout_log_probs], dtype=torch.float64),
        "raw_log_probs": torch.tensor([x for s in with_raw for x in s.rollout_raw_log_probs], dtype=torch.float64),
        "candidate_lengths": torch.cat([c.row_lengths().to(torch.int32) for c in with_cands]) if with_cands
        else torch.zeros(0, dtype=torch.int32),
        "candidate_ids": torch.cat([c.ids.cpu() for c in with_cands]) if with_cands
        else torch.zeros(0, dtype=torch.int32),
    }


def _empty(meta: dict) -> dict[str, torch.Tensor]:
    responses = sum(meta["response_lengths"])
    raw = sum(n for n, has in zip(meta["response_lengths"], meta["has_raw"], strict=True) if has)
    rows = sum(n for n, has in zip(meta["response_lengths"], meta["has_candidates"], strict=True) if has)
    return {
        "routes": torch.empty((sum(_route_rows(meta)), *meta["route_shape"]), dtype=_route_wire(meta["route_dtype"])),
        "prompt_ids": torch.empty(sum(meta["prompt_lengths"]), dtype=torch.int64),
        "response_ids": torch.empty(responses, dtype=torch.int64),
        "loss_mask": torch.empty(responses, dtype=torch.int8),
        "log_probs": torch.empty(responses, dtype=torch.float64),
        "raw_log_probs": torch.empty(raw, dtype=torch.float64),
        "candidate_lengths": torch.empty(rows, dtype=torch.int32),
        "candidate_ids": torch.empty(meta["num_candidate_ids"], dtype=torch.int32),
    }


def _unpack(meta: dict, t: dict[str, torch.Tensor]) -> list[Sample]:
    prompts = t["prompt_ids"].split(meta["prompt_lengths"])
    per_response = {k: t[k].split(meta["response_lengths"]) for k in ("response_ids", "loss_mask", "log_probs")}
    raw = iter(t["raw_log_probs"].split([n for n, h in zip(meta["response_lengths"], meta["has_raw"],
                                                              strict=True) if h]))
    cand_rows = iter(t["candidate_lengths"].split([n for n, h in zip(meta["response_lengths"],
                                                                     meta["has_candidates"], strict=True) if h]))
    route_rows = _route_rows(meta)
    routes = iter(t["routes"].view(sum(route_rows), *meta["route_shape"]).split(route_rows) if route_rows else ())
    id_offset = 0
    samples = []
    for i, n in enumerate(meta["response_lengths"]):
        candidates = None
        if meta["has_candidates"][i]:
            lengths = next(cand_rows).to(torch.int64)
            offsets = torch.zeros(n + 1, dtype=torch.int64)
            torch.cumsum(lengths, 0, out=offsets[1:])
            k = int(offsets[-1])
            candidates = Candidates(ids=t["candidate_ids"][id_offset : id_offset + k].clone(),
                                    offsets=offsets.to(torch.int32))
            id_offset += k
        samples.append(Sample(
            prompt_ids=prompts[i].tolist(), response_ids=per_response["response_ids"][i].tolist(),
            loss_mask=per_response["loss_mask"][i].tolist(), rollout_log_probs=per_response["log_probs"][i].tolist(),
            rollout_raw_log_probs=next(raw).tolist() if meta["has_raw"][i] else None, candidates=candidates,
            reward=meta["reward"][i], group_index=meta["group_index"][i], index=meta["index"][i],
            status=meta["status"][i], metadata=meta["metadata"][i], weight_version=meta["weight_version"][i],
            weight_versions=meta.get("weight_versions", [None] * (i + 1))[i],  # absent before partial rollouts
            routes=_route_tensor(next(routes), meta["route_dtype"][i]) if _has_routes(meta, i) else None,
        ))
    return samples


def _has_routes(meta: dict, i: int) -> bool:
    return meta.get("route_dtype", [None] * (i + 1))[i] is not None  # absent in checkpoints from before routes


def _route_wire(dtypes: list[str | None]) -> torch.dtype:
    return torch.uint8 if all(d in (None, "uint8") for d in dtypes) else torch.int32


def _route_rows(meta: dict) -> list[int]:
    """Rows of each sample that carries routes: its tokens fed through the model (prompt + response - 1)."""
    return [p + r - 1 for i, (p, r) in enumerate(zip(meta["prompt_lengths"], meta["response_lengths"], strict=True))
            if _has_routes(meta, i)]


def _route_tensor(rows: torch.Tensor, dtype: str) -> torch.Tensor:
    return rows.to(getattr(torch, dtype)).clone()
