"""Weights + gradients + AdamW bytes per rank of real model sizes at the layouts a user would pick for 8, 16 and 64
GPUs: the table of docs/scale.md ("Which layout"). Arithmetic from each model's config (the numbers of its HF
config.json, written out below: nothing is downloaded); every layout is checked by the project's own
`ParallelPlan` (and its layer split), so the table lists only layouts `train.py` accepts.

    .venv/bin/python scripts/memory_per_rank.py            # markdown table on stdout

Bytes per parameter are this project's GPU precision (`trainer=gpu`, bf16-mixed): float32 weights, float32
gradients and AdamW's two float32 moments, 4 + 4 + 8 = 16 B (docs/scale.md). Where they live:
- Megatron (tp, pp, cp, ep, dp): a stage holds num_layers / pp layers, the first stage the input embedding and the
  last the final norm and output layer; attention, dense MLPs, embeddings and the output layer split over tp;
  experts over ep x tp (expert TP = tp); norms and routers are replicated. The largest stage is reported.
  `parallel.distributed_optimizer=true` shards AdamW's 8 B over the ranks that hold the same slice: dp x cp for
  dense weights, world / (pp x ep x tp) for experts.
- FSDP (W ranks): all 16 B / W; the transients (a gathered layer, the output layer, the full gradient between
  micro-batches) are not counted, as for activations, the candidate head's buffers and the rollout engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from topp_rl.parallel.plan import ParallelPlan

GB = 1e9
WEIGHT_AND_GRAD_B, ADAM_B = 8, 8  # float32 weights + gradients; AdamW's two float32 moments


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


def bytes_per_rank(m: ModelShape, lay: Layout) -> float:
    if lay.fsdp:
        lay.plan()
        return m.total() * (WEIGHT_AND_GRAD_B + ADAM_B) / lay.gpus
    plan = lay.plan()
    plan.check_layers(m.layers)
    per_stage = m.layers // lay.pp
    dense = per_stage * (m.attention() + 3 * m.hidden * m.ffn) / lay.tp
    ends = 2 if lay.pp == 1 else 1  # the embedding (first stage) and the output layer (last stage)
    dense += ends * m.vocab * m.hidden / lay.tp
    replicated = per_stage * m.replicated_per_layer() + m.hidden
    experts = per_stage * m.expert_params() / (lay.ep * lay.tp)
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


def main() -> None:
    print("| model (parameters) | GPUs | layout | GB per rank (weights + grads + AdamW, 16 B / param) | fits 80 GB |")
    print("|---|---|---|---|---|")
    for m in QWEN3:
        for lay in CHOICES[m.name]:
            gb = bytes_per_rank(m, lay) / GB
            print(f"| {m.name} ({m.total() / 1e9:.1f}B) | {lay.gpus} | {lay.label()} | {gb:,.1f} | "
                  f"{'yes' if gb < 60 else 'tight' if gb < 80 else 'no'} |")


if __name__ == "__main__":
    main()
