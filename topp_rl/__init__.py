"""topp_rl: exact top-p / top-k / min-p log-probs for LLM RL post-training.

Python API: `topp_rl.fit(overrides=[...])` trains one run and returns a `FitResult` (run dir, summary, metrics);
`topp_rl.compose(overrides)` gives the config it would run (see `topp_rl.api`).
Submodules are imported lazily so that `topp_rl.ops` stays a light, Lightning-free import. Importing the package
registers the OmegaConf resolver that names a sweep's job dirs (`topp_rl.run.sweep`; omegaconf only).
"""

from topp_rl.run.sweep import register_resolvers

register_resolvers()

__all__ = ["FitResult", "ToppLogProb", "compose", "fit"]

_API = ("FitResult", "compose", "fit")


def __getattr__(name: str):
    if name == "ToppLogProb":
        from topp_rl.trainer.hook import ToppLogProb

        return ToppLogProb
    if name in _API:
        from topp_rl import api

        return getattr(api, name)
    raise AttributeError(f"module 'topp_rl' has no attribute {name!r}")
