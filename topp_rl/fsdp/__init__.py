"""FSDP2 over the HF backbone: `FSDPBackbone` (the sharded body) and `FSDPStrategy` (its Lightning strategy)."""

from topp_rl.fsdp.backbone import FSDPBackbone
from topp_rl.fsdp.strategy import FSDPStrategy

__all__ = ["FSDPBackbone", "FSDPStrategy"]
