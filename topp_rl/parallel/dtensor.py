"""Whole tensors from sharded ones (FSDP2's DTensors), for exports and weight syncs that need HF's full weights."""

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor


def full_tensor(t: Tensor) -> Tensor:
    """The unsharded tensor (an all-gather for a DTensor; CPU-offloaded shards travel through the mesh device)."""
    if not isinstance(t, DTensor):
        return t
    mesh_device = torch.device(t.device_mesh.device_type)
    if t.device.type != mesh_device.type:
        t = t.to(mesh_device)
    return t.full_tensor()
