"""topp_rl: exact top-p / top-k / min-p log-probs for LLM RL post-training.

Submodules are imported lazily so that `topp_rl.ops` stays a light, Lightning-free import. Importing the package
registers the OmegaConf resolver that names a sweep's job dirs (`topp_rl.sweep`; omegaconf only).
"""

from topp_rl.sweep import register_resolvers

register_resolvers()

__all__ = ["ToppLogProb"]


def __getattr__(name: str):
    if name == "ToppLogProb":
        from topp_rl.hook import ToppLogProb

        return ToppLogProb
    raise AttributeError(f"module 'topp_rl' has no attribute {name!r}")
