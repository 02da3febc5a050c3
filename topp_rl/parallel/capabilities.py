"""What a parallel strategy is, stated by the strategy class and asked where a class or string check stood: the
run dir (which checkpoint format it resumes), the config checks and LoRA. Lightning's own strategies (and any
other class) answer with the defaults of `StrategyCapabilities`."""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from topp_rl.parallel.context import CP_MODES

# The way out of a resume refused for its layout: a checkpoint's weights load at any layout through an HF export (no
# step, optimizer or rollout state: a new run). There is no weights-only resume key.
WEIGHTS_ONLY_WAY_OUT = ("to go on from its weights alone at this layout, export them (python -m topp_rl.export "
                        "<ckpt> OUT) and start a new run on them (model=hf_path model.path=OUT, no ckpt_path)")


@dataclass(frozen=True)
class Layout:
    """The parallel layout a run's config names: what a checkpoint was written at, or what a resume asks for."""

    strategy: str | None  # the strategy's `_target_`; None: no strategy (one process, the HF backbone)
    tp: int = 1
    cp: int = 1
    ep: int = 1
    pp: int = 1
    vpp: int = 1
    distributed_optimizer: bool = False
    devices: Any = 1  # trainer.devices: a count, or "auto" / a device list
    num_nodes: int = 1

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> "Layout":
        """From a resolved config (a dict: a checkpoint's record, or this run's); absent keys are their defaults
        (a config written before pipeline parallelism has no pp_size)."""
        parallel, trainer = config.get("parallel") or {}, config.get("trainer") or {}
        strategy = parallel.get("strategy")
        return cls(strategy=strategy.get("_target_") if isinstance(strategy, Mapping) else None,
                   tp=parallel.get("tp_size", 1), cp=parallel.get("cp_size", 1), ep=parallel.get("ep_size", 1),
                   pp=parallel.get("pp_size", 1), vpp=parallel.get("vpp_size", 1),
                   distributed_optimizer=bool(parallel.get("distributed_optimizer", False)),
                   devices=trainer.get("devices", 1), num_nodes=trainer.get("num_nodes", 1))

    @property
    def world(self) -> int | None:
        """devices x nodes where devices is a count (None for "auto" or a device list)."""
        return self.devices * self.num_nodes if isinstance(self.devices, int) else None

    def sizes(self) -> str:
        """`tp 2, cp 1, ep 1, pp 1, vpp 1, 2 devices` (the strategy's sizes; none without a strategy)."""
        devices = f"{self.devices} device{'s' if self.devices != 1 else ''}" + (
            f" x {self.num_nodes} nodes" if self.num_nodes != 1 else "")
        if self.strategy is None:
            return f"no parallel strategy, {devices}"
        optimizer = ", distributed optimizer" if self.distributed_optimizer else ""
        return (f"{self.strategy.rsplit('.', 1)[-1]}: tp {self.tp}, cp {self.cp}, ep {self.ep}, pp {self.pp}, "
                f"vpp {self.vpp}{optimizer}, {devices}")


class StrategyCapabilities:
    """Class-level answers; a topp_rl strategy subclasses this and overrides what differs."""

    writes_sharded_checkpoints: ClassVar[bool] = False  # a directory of torch.distributed.checkpoint shards
    adapts_lora: ClassVar[bool] = False  # shards a LoRA-adapted HF backbone (a Megatron strategy does not)
    shards_hf_backbone: ClassVar[bool] = False  # FSDP: every rank holds a shard of the HF model's weights
    cp_modes: ClassVar[tuple[str, ...]] = CP_MODES  # the context-parallel splits its backbone runs

    @classmethod
    def resume_refusal(cls, saved: Layout, wanted: Layout) -> str | None:
        """Why a checkpoint this strategy wrote at `saved` cannot resume at `wanted` (same strategy), or None:
        by default any sizes (one process; FSDP's shards are re-sharded by DCP at any world size)."""
        return None


def capabilities_of(strategy_class: type | None) -> type[StrategyCapabilities]:
    """The capabilities of a strategy class (None: no strategy, a single process)."""
    if isinstance(strategy_class, type) and issubclass(strategy_class, StrategyCapabilities):
        return strategy_class
    return StrategyCapabilities
