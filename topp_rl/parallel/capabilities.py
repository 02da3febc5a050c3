"""What a parallel strategy is, stated by the strategy class and asked where a class or string check stood: the
run dir (which checkpoint format it resumes), the config checks and LoRA. Lightning's own strategies (and any
other class) answer with the defaults of `StrategyCapabilities`."""

from typing import ClassVar

from topp_rl.parallel.context import CP_MODES


class StrategyCapabilities:
    """Class-level answers; a topp_rl strategy subclasses this and overrides what differs."""

    writes_sharded_checkpoints: ClassVar[bool] = False  # a directory of torch.distributed.checkpoint shards
    adapts_lora: ClassVar[bool] = False  # shards a LoRA-adapted HF backbone (a Megatron strategy does not)
    shards_hf_backbone: ClassVar[bool] = False  # FSDP: every rank holds a shard of the HF model's weights
    cp_modes: ClassVar[tuple[str, ...]] = CP_MODES  # the context-parallel splits its backbone runs


def capabilities_of(strategy_class: type | None) -> type[StrategyCapabilities]:
    """The capabilities of a strategy class (None: no strategy, a single process)."""
    if isinstance(strategy_class, type) and issubclass(strategy_class, StrategyCapabilities):
        return strategy_class
    return StrategyCapabilities
