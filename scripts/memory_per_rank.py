"""Weights + gradients + AdamW bytes per rank of real model sizes at the layouts a user would pick for 8, 16 and 64
GPUs (docs/evidence/scale.md, "Memory per rank by layout"; with --recipes, "Memory per GPU of the one-node
recipes"). Arithmetic from each model's config (the numbers of its HF config.json, written out below: nothing is
downloaded); every layout is checked by the project's own
`ParallelPlan` (and its layer split), so the table lists only layouts `train.py` accepts.

    .venv/bin/python scripts/memory_per_rank.py            # markdown table on stdout
    .venv/bin/python scripts/memory_per_rank.py --recipes  # the one-node 8-GPU recipes: memory per GPU role

Bytes per parameter are this project's GPU precision (`trainer=gpu`, bf16-mixed): float32 weights, float32
gradients and AdamW's two float32 moments, 4 + 4 + 8 = 16 B (docs/scale.md). Where they live:
- Megatron (tp, pp, cp, ep, dp): a stage holds num_layers / pp layers, the first stage the input embedding and the
  last the final norm and output layer; attention, dense MLPs, embeddings and the output layer split over tp;
  experts over ep x tp (expert TP = tp); norms and routers are replicated. The largest stage is reported.
  `parallel.distributed_optimizer=true` shards AdamW's 8 B over the ranks that hold the same slice: dp x cp for
  dense weights, world / (pp x ep x tp) for experts.
- FSDP (W ranks): all 16 B / W; the transients (a gathered layer, the output layer, the full gradient between
  micro-batches) are not counted, as for activations, the candidate head's buffers and the rollout engine.

`--recipes`: per GPU of the one-node recipes (`RECIPES`: their overrides, composed as `topp-rl plan` composes
them; the placement plan says which GPUs hold a trainer rank, a server or both), the trainer state above plus each
SGLang server's static pool. SGLang 0.5.23 sizes that pool as mem_fraction_static x the memory free on the GPU
when the server starts (`_profile_available_bytes`): its weights (split over its TP like Megatron's) and the rest
KV cache. The servers start in the datamodule's setup, after the strategy's `setup_environment` (where Megatron
builds its float32 weights on the GPU) and before the strategy's `setup` (where FSDP moves its shards there).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

from topp_rl.parallel.placement import Placement, span
from topp_rl.parallel.plan import ParallelPlan

GB = 1e9
WEIGHT_B, GRAD_B, ADAM_B = 4, 4, 8  # float32 weights, float32 gradients, AdamW's two float32 moments
WEIGHT_AND_GRAD_B = WEIGHT_B + GRAD_B


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # dense MLP width (0: every layer is MoE)
    vocab: int
    experts: int = 0
    moe_ffn: int = 0

    def attention(self) -> int:
        q_and_o = 2 * self.hidden * self.heads * self.head_dim
        return q_and_o + 2 * self.hidden * self.kv_heads * self.head_dim

    def replicated_per_layer(self) -> int:
        """Two RMSNorms, Qwen3's q/k norms and the router: small, held whole by every rank."""
        return 2 * self.hidden + 2 * self.head_dim + self.experts * self.hidden

    def expert_params(self) -> int:
        return self.experts * 3 * self.hidden * self.moe_ffn

    def total(self) -> int:
        layer = self.attention() + 3 * self.hidden * self.ffn + self.expert_params() + self.replicated_per_layer()
        return self.layers * layer + 2 * self.vocab * self.hidden + self.hidden  # untied embeddings + final norm


# From each model's config.json (Qwen3 family: untied embeddings, head_dim 128, vocab 151936; MoE layers only).
QWEN3 = [
    ModelShape("Qwen3-8B", layers=36, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=12288, vocab=151936),
    ModelShape("Qwen3-32B", layers=64, hidden=5120, heads=64, kv_heads=8, head_dim=128, ffn=25600, vocab=151936),
    ModelShape("Qwen3-30B-A3B", layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, ffn=0, vocab=151936,
               experts=128, moe_ffn=768),
    ModelShape("Qwen3-235B-A22B", layers=94, hidden=4096, heads=64, kv_heads=4, head_dim=128, ffn=0, vocab=151936,
               experts=128, moe_ffn=1536),
]


@dataclass(frozen=True)
class Layout:
    gpus: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    fsdp: bool = False
    dist_opt: bool = False

    def plan(self) -> ParallelPlan:
        return ParallelPlan(world=self.gpus, tp=self.tp, cp=self.cp, ep=self.ep, pp=self.pp, fsdp=self.fsdp)

    def label(self) -> str:
        if self.fsdp:
            return f"FSDP {self.gpus}"
        plan = self.plan()
        sizes = [f"{k.upper()}{v}" for k, v in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp), ("ep", self.ep),
                                                ("dp", plan.dp)) if v > 1]
        return " x ".join(sizes) + (" + dist. opt." if self.dist_opt else "")


def params_per_rank(m: ModelShape, lay: Layout) -> tuple[float, float, float]:
    """The parameters one rank of a Megatron layout holds (its largest stage): split dense, replicated, experts."""
    lay.plan().check_layers(m.layers)
    per_stage = m.layers // lay.pp
    dense = per_stage * (m.attention() + 3 * m.hidden * m.ffn) / lay.tp
    ends = 2 if lay.pp == 1 else 1  # the embedding (first stage) and the output layer (last stage)
    dense += ends * m.vocab * m.hidden / lay.tp
    replicated = per_stage * m.replicated_per_layer() + m.hidden
    experts = per_stage * m.expert_params() / (lay.ep * lay.tp)
    return dense, replicated, experts


def bytes_per_rank(m: ModelShape, lay: Layout) -> float:
    if lay.fsdp:
        lay.plan()
        return m.total() * (WEIGHT_AND_GRAD_B + ADAM_B) / lay.gpus
    plan = lay.plan()
    dense, replicated, experts = params_per_rank(m, lay)
    dense_adam_share = 1 / (plan.dp * lay.cp) if lay.dist_opt else 1.0
    expert_adam_share = lay.pp * lay.ep * lay.tp / lay.gpus if lay.dist_opt else 1.0
    return ((dense + replicated + experts) * WEIGHT_AND_GRAD_B
            + ((dense + replicated) * dense_adam_share + experts * expert_adam_share) * ADAM_B)


CHOICES = {
    "Qwen3-8B": [Layout(8, fsdp=True), Layout(8, tp=2, dist_opt=True), Layout(16, fsdp=True),
                 Layout(16, tp=2, pp=2, dist_opt=True), Layout(64, tp=2, pp=2, dist_opt=True)],
    "Qwen3-32B": [Layout(8, fsdp=True), Layout(8, tp=8), Layout(8, tp=4, pp=2), Layout(16, tp=8, pp=2),
                  Layout(64, tp=8, pp=2, dist_opt=True), Layout(64, tp=8, pp=2, cp=2, dist_opt=True)],
    "Qwen3-30B-A3B": [Layout(8, fsdp=True), Layout(8, ep=8, dist_opt=True), Layout(16, tp=2, ep=8, dist_opt=True),
                      Layout(64, tp=2, pp=2, ep=16, dist_opt=True)],
    # 94 layers = 2 x 47: an even split allows pp 2 (or 47) only
    "Qwen3-235B-A22B": [Layout(8, tp=4, pp=2), Layout(16, tp=4, pp=2, ep=2, dist_opt=True),
                        Layout(64, tp=4, pp=2, ep=8, dist_opt=True), Layout(64, tp=2, pp=2, ep=16, dist_opt=True)],
}

# ---- the one-node recipes (--recipes) -------------------------------------------------------------------------
GPU_GB = 80.0  # the recipes' GPUs (H100 / A100 80 GB)
DTYPE_B = {"bfloat16": 2, "float16": 2, "float32": 4}  # the servers' weights and KV cache (SGLang's --dtype)
MODELS = {m.name: m for m in QWEN3}
RECIPE_BASE = ("model=hf_path", "model.path=Qwen/Qwen3-8B", "trainer=gpu", "rollout=sglang",
               "rollout.engine.server_kwargs.dtype=bfloat16")
RECIPES = {  # docs/scale.md's one-node commands: RECIPE_BASE + these overrides
    "A": ("parallel=fsdp", "trainer.devices=8"),
    "B": ("parallel=fsdp", "trainer.devices=4", "rollout.engine.gpus=4-7"),
    "C": ("parallel=megatron", "parallel.tp_size=2", "parallel.distributed_optimizer=true", "trainer.devices=8",
          "rollout.engine.tp_size=2"),
}


@dataclass(frozen=True)
class Recipe:
    name: str
    model: ModelShape
    layout: Layout
    placement: Placement
    server_dtype_b: int

    def label(self) -> str:
        return f"{self.name}: {self.model.name}, {self.layout.label()}, {self.placement.mode}"


def load_recipe(name: str, overrides: Sequence[str]) -> Recipe:
    """The recipe's config, composed and checked as `topp-rl plan` does, and the placement it gets."""
    from topp_rl.api import compose
    from topp_rl.config import placement_of, validate_config

    cfg = compose([*RECIPE_BASE, *overrides])
    validate_config(cfg)
    placement = placement_of(cfg)
    if placement is None:
        raise ValueError(f"recipe {name} ({' '.join(overrides)}) places no SGLang server on GPUs: it needs "
                         "trainer=gpu and rollout=sglang with launched servers")
    plan = placement.plan
    layout = Layout(plan.world, tp=plan.tp, pp=plan.pp, cp=plan.cp, ep=plan.ep, fsdp=plan.fsdp,
                    dist_opt=bool(cfg.parallel.get("distributed_optimizer", False)))
    model_name = PurePosixPath(str(cfg.model.path)).name
    if model_name not in MODELS:
        raise ValueError(f"model.path={cfg.model.path!r}: must name one of the shapes written out here "
                         f"({', '.join(MODELS)}); add its config.json's numbers to QWEN3")
    return Recipe(name, MODELS[model_name], layout, placement, DTYPE_B[cfg.rollout.engine.server_kwargs.dtype])


def server_weight_bytes(m: ModelShape, *, tp: int, dtype_b: int) -> float:
    """One GPU's share of a TP server's weights: SGLang splits the same matrices as Megatron (attention heads, MLP,
    vocab) and keeps the norms whole."""
    return sum(params_per_rank(m, Layout(tp, tp=tp))) * dtype_b


def kv_bytes_per_token(m: ModelShape, *, tp: int, dtype_b: int) -> int:
    """One GPU's KV cache per token: K and V of every layer, the server's TP splitting the KV heads (SGLang keeps
    one per GPU where tp exceeds them)."""
    return 2 * m.layers * max(1, m.kv_heads // tp) * m.head_dim * dtype_b


def resident_at_server_start(m: ModelShape, lay: Layout) -> float:
    """The trainer rank's bytes on its GPU when a colocated server starts (module docstring): Megatron's float32
    weights, built in the strategy's setup_environment; nothing of FSDP's, whose shards move there later."""
    return 0.0 if lay.fsdp else sum(params_per_rank(m, lay)) * WEIGHT_B


@dataclass(frozen=True)
class GpuMemory:
    """What each GPU of one role holds (bytes; 0 where it holds no trainer rank or no server)."""

    gpus: str
    role: str
    trainer: float
    pool: float
    server_weights: float
    kv_tokens: int  # per server (a TP server's GPUs each hold their heads of every token)

    @property
    def kv_cache(self) -> float:
        return self.pool - self.server_weights

    @property
    def peak(self) -> float:
        # Colocated, the server releases its pool while the trainer trains, so the peak is while it generates:
        # trainer state + pool. Disaggregated, one of the two is 0.
        return self.trainer + self.pool


def gpu_memory(recipe: Recipe) -> list[GpuMemory]:
    """One row per role the placement gives GPUs (trainer rank, server, both), in GPU order."""
    p, m = recipe.placement, recipe.model
    server_on = {(s.node, g): s for s in p.servers for g in s.gpus}
    trainer_on = {(t.node, t.gpu) for t in p.trainer}
    roles: dict[tuple, list[int]] = {}
    for node, gpu in sorted(trainer_on | server_on.keys()):
        s = server_on.get((node, gpu))
        key = (node, (node, gpu) in trainer_on, s and (s.tp_size, s.mem_fraction))
        roles.setdefault(key, []).append(gpu)
    rows = []
    for (node, trains, serves), gpus in roles.items():
        trainer = bytes_per_rank(m, recipe.layout) if trains else 0.0
        pool = weights = 0.0
        tokens = 0
        if serves:
            tp, fraction = serves
            free = GPU_GB * GB - (resident_at_server_start(m, recipe.layout) if trains else 0.0)
            pool = fraction * free
            weights = server_weight_bytes(m, tp=tp, dtype_b=recipe.server_dtype_b)
            tokens = max(0, int((pool - weights) // kv_bytes_per_token(m, tp=tp, dtype_b=recipe.server_dtype_b)))
        where = span(gpus) if p.nodes == 1 else f"node {node}: {span(gpus)}"
        rows.append(GpuMemory(where, _role(trains, serves), trainer, pool, weights, tokens))
    return rows


def _role(trains: bool, serves: tuple[int, float] | None) -> str:
    if not serves:
        return "trainer rank"
    tp, fraction = serves
    server = f"{'server' if tp == 1 else f'TP{tp} server shard'} (mem_fraction {fraction:g})"
    return f"trainer rank + {server}" if trains else server


def _fits(row: GpuMemory) -> str:
    if row.pool and row.kv_cache <= 0:
        return "no: the server's weights fill its pool (raise rollout.engine.mem_fraction)"
    if row.peak > GPU_GB * GB:
        return "no"
    return f"yes ({GPU_GB - row.peak / GB:.1f} GB left)"


def print_recipes() -> None:
    def gb(x: float) -> str:
        return f"{x / GB:,.1f}" if x else "-"

    print("| recipe | GPUs | each GPU holds | trainer state (GB) | SGLang pool (GB) | of which weights (GB) | "
          "of which KV cache (GB) | KV cache (tokens per server) | peak (GB) | fits 80 GB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, overrides in RECIPES.items():
        recipe = load_recipe(name, overrides)
        for row in gpu_memory(recipe):
            tokens = f"{row.kv_tokens:,}" if row.pool else "-"
            print(f"| {recipe.label()} | {row.gpus} | {row.role} | {gb(row.trainer)} | {gb(row.pool)} | "
                  f"{gb(row.server_weights)} | {gb(row.kv_cache)} | {tokens} | {gb(row.peak)} | {_fits(row)} |")
    print(f"\nPer GPU of {GPU_GB:g} GB (1 GB = 1e9 B). Trainer state: weights + gradients + AdamW at 16 B / param, "
          "split as in the layout table. SGLang pool: mem_fraction_static x the memory free when the server starts "
          "(the whole GPU, less Megatron's float32 weights, which are built on the GPU before the servers start; "
          "FSDP's shards arrive after): the server's weights at its dtype (bf16), split over its TP, and the rest "
          "KV cache, 2 (K, V) x layers x KV heads per GPU x head_dim x 2 B per token. Peak: colocated, the server "
          "releases its pool while the trainer trains, so the peak is while it generates, trainer state + pool; "
          "disaggregated, each GPU holds one of them. Not counted: activations, FSDP's gathered layers, logits, "
          "SGLang's runtime buffers (CUDA graphs, sampling) and the CUDA / NCCL contexts: they use what is left.")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", action="store_true", help="print the memory per GPU of the one-node 8-GPU "
                        "recipes (trainer state, SGLang pool, KV cache, peak) instead of the layout table")
    if parser.parse_args(argv).recipes:
        print_recipes()
        return
    print("| model (parameters) | GPUs | layout | GB per rank (weights + grads + AdamW, 16 B / param) | fits 80 GB |")
    print("|---|---|---|---|---|")
    for m in QWEN3:
        for lay in CHOICES[m.name]:
            gb = bytes_per_rank(m, lay) / GB
            print(f"| {m.name} ({m.total() / 1e9:.1f}B) | {lay.gpus} | {lay.label()} | {gb:,.1f} | "
                  f"{'yes' if gb < 60 else 'tight' if gb < 80 else 'no'} |")


if __name__ == "__main__":
    main()
