"""`Placement`: which node and GPU each trainer rank and each SGLang server gets, computed once at start from the
trainer's `ParallelPlan` and the engine settings by a pure function (no CUDA call, no model), so that it is tested
on any machine and a layout that cannot work is refused before anything starts.

Rules:
- Trainer ranks: Lightning's order, rank r on node r // devices and GPU r % devices of that node. Their data-parallel
  group follows megatron-core's rank order (TP innermost, then CP, DP, PP), which FSDP (tp = cp = pp = 1) shares.
- Servers: every data-parallel replica's first rank (its source: the one rank that runs the engine) launches
  `num_servers` servers and alone pushes the weights to them.
- colocated: a replica's servers sit on the GPUs of its own ranks (in rank order, `tp_size` GPUs each), so weights
  can go over CUDA IPC; each server takes `mem_fraction` of its GPUs and leaves `TRAINER_SHARE` to the trainer,
  whose weights, gradients and optimizer state stay resident while the server generates.
- disaggregated: the servers get the GPUs `gpus` names on every node (none of them a trainer rank's), `tp_size`
  GPUs each, on the node of the rank that launches them and pushes to them (a replica's source: a process starts
  its servers beside itself); weights go over NCCL as before.
- A server's GPUs lie on one node (SGLang's TP runs inside one node); at most one server per GPU.
A server process is started with `CUDA_VISIBLE_DEVICES` = its GPUs and SGLang's `base_gpu_id=0`, `tp_size` = their
count (SGLang maps CUDA IPC handles by device UUID, so the two sides of a colocated push may number GPUs differently).
"""

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from topp_rl.parallel.plan import ParallelPlan

PLACEMENTS = ("colocated", "disaggregated")
# The rollout.engine keys the plan reads (the engine itself does not take them).
ENGINE_KEYS = ("placement", "gpus", "tp_size", "mem_fraction")
# A server's SGLang mem_fraction_static when rollout.engine.mem_fraction is null: about SGLang's own default with a
# GPU to itself; 0.4 where it shares one with a trainer rank (TRL's and verl's colocated defaults are 0.3 and 0.5).
DEFAULT_FRACTION = {"disaggregated": 0.85, "colocated": 0.4}
# The share of a shared GPU kept for the trainer rank in colocated mode: the memory saver releases the server's
# memory while the trainer trains, but the trainer's state stays on the GPU while the server generates.
TRAINER_SHARE = 0.5
_GPU_SPEC = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


def _fail(key: str, value, constraint: str, fix: str) -> None:
    raise ValueError(f"config {key}={value!r}: must be {constraint}; {fix}")


def parse_gpus(spec: str | int | Sequence[int]) -> tuple[int, ...]:
    """The GPU ids of a node a `rollout.engine.gpus` value names: "4-7", "4,5,6,7", "0-1,6", 4 or [4, 5], sorted;
    each id at most once."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        spec = str(spec)
    elif isinstance(spec, Sequence) and not isinstance(spec, str):
        if not all(isinstance(g, int) and not isinstance(g, bool) for g in spec):
            spec = repr(list(spec))  # falls through to the syntax error below
        else:
            spec = ",".join(map(str, spec))
    text = str(spec).replace(" ", "")
    if not _GPU_SPEC.match(text):
        _fail("rollout.engine.gpus", spec, "GPU ids of a node as ranges and lists (e.g. 4-7, 4,5,6,7 or 0-1,6)",
              "write them like rollout.engine.gpus=4-7")
    ids: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        first, last = int(low), int(high or low)
        if last < first:
            _fail("rollout.engine.gpus", spec, f"ranges that go up ({part} goes down)", f"write {last}-{first}")
        ids.extend(range(first, last + 1))
    if len(set(ids)) != len(ids):
        _fail("rollout.engine.gpus", spec, "each GPU id at most once", "drop the repeated ids")
    return tuple(sorted(ids))


def span(ids: Iterable[int]) -> str:
    """Sorted ids as ranges: [0, 1, 2, 5] -> "0-2,5"."""
    out: list[str] = []
    for i in sorted(ids):
        if out and out[-1].split("-")[-1] == str(i - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ",".join(out)


@dataclass(frozen=True)
class TrainerRank:
    rank: int
    node: int
    gpu: int
    dp_group: int


@dataclass(frozen=True)
class Server:
    """One SGLang server: its node, its GPUs there, SGLang's mem_fraction_static, the data-parallel replica it
    serves and the trainer rank that pushes the weights to it."""

    index: int
    node: int
    gpus: tuple[int, ...]
    mem_fraction: float
    dp_group: int
    pushed_by: int

    @property
    def tp_size(self) -> int:
        return len(self.gpus)

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(map(str, self.gpus))

    @property
    def base_gpu_id(self) -> int:
        return 0  # the first of CUDA_VISIBLE_DEVICES


@dataclass(frozen=True)
class Placement:
    mode: str
    nodes: int
    devices: int  # trainer ranks per node
    plan: ParallelPlan
    trainer: tuple[TrainerRank, ...]
    servers: tuple[Server, ...]

    def gpu_use(self) -> dict[tuple[int, int], float]:
        """The share of each used (node, GPU) claimed: the servers' fractions, plus the trainer's (`TRAINER_SHARE`
        beside a server, the whole GPU alone)."""
        use: dict[tuple[int, int], float] = {}
        for s in self.servers:
            for g in s.gpus:
                use[s.node, g] = use.get((s.node, g), 0.0) + s.mem_fraction
        for t in self.trainer:
            use[t.node, t.gpu] = use.get((t.node, t.gpu), 0.0) + (TRAINER_SHARE if (t.node, t.gpu) in use else 1.0)
        return use

    def servers_of(self, dp_group: int) -> tuple[Server, ...]:
        return tuple(s for s in self.servers if s.dp_group == dp_group)


def dp_group_of(plan: ParallelPlan, rank: int) -> int:
    """The data-parallel replica of global `rank` (megatron-core's order: TP innermost, then CP, DP, PP)."""
    return rank // (plan.tp * plan.cp) % plan.dp


def replica_ranks(plan: ParallelPlan, dp_group: int) -> list[int]:
    """The global ranks of one data-parallel replica (its TP x CP x PP ranks), in rank order; the first is its
    source."""
    return [r for r in range(plan.world) if dp_group_of(plan, r) == dp_group]


def plan_placement(plan: ParallelPlan, *, nodes: int, devices: int, placement: str | None = None,
                   gpus: str | int | Sequence[int] | None = None, tp_size: int = 1, mem_fraction: float | None = None,
                   num_servers: int = 1) -> Placement:
    """Place `plan.world` trainer ranks (`devices` per node on `nodes` nodes) and `num_servers` servers per
    data-parallel replica (module docstring); refuse, naming the numbers, what cannot work. `placement` None:
    disaggregated where `gpus` is set, else colocated."""
    mode = placement if placement is not None else ("disaggregated" if gpus is not None else "colocated")
    fraction = check_engine_settings(mode, gpus=gpus, tp_size=tp_size, mem_fraction=mem_fraction,
                                     num_servers=num_servers)
    if nodes * devices != plan.world:
        _fail("trainer.devices * trainer.num_nodes", nodes * devices, f"the plan's world size ({plan.world})",
              "build the ParallelPlan from the same trainer.devices and trainer.num_nodes")
    trainer = tuple(TrainerRank(rank=r, node=r // devices, gpu=r % devices, dp_group=dp_group_of(plan, r))
                    for r in range(plan.world))
    if mode == "colocated":
        slots = _colocated_slots(plan, trainer, tp_size=tp_size, num_servers=num_servers)
    else:
        slots = _disaggregated_slots(plan, nodes=nodes, devices=devices, gpus=parse_gpus(gpus), tp_size=tp_size,
                                     num_servers=num_servers)
    servers = tuple(Server(index=i, node=node, gpus=ids, mem_fraction=fraction, dp_group=i // num_servers,
                           pushed_by=replica_ranks(plan, i // num_servers)[0])
                    for i, (node, ids) in enumerate(slots))
    return Placement(mode=mode, nodes=nodes, devices=devices, plan=plan, trainer=trainer, servers=servers)


def check_engine_settings(mode: str, *, gpus, tp_size: int, mem_fraction: float | None, num_servers: int) -> float:
    """The engine keys on their own (names, types, ranges, the fraction's rule); the fraction each server gets."""
    if mode not in PLACEMENTS:
        _fail("rollout.engine.placement", mode, f"one of {', '.join(PLACEMENTS)} or null",
              "use rollout.engine.placement=colocated, or disaggregated with rollout.engine.gpus=<ids>")
    for key, value in (("tp_size", tp_size), ("num_servers", num_servers)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            _fail(f"rollout.engine.{key}", value, "an integer >= 1", f"set rollout.engine.{key}=1 or more")
    if mode == "colocated" and gpus is not None:
        _fail("rollout.engine.gpus", gpus, "null with rollout.engine.placement=colocated (the servers share the "
              "trainer ranks' GPUs)", "drop rollout.engine.gpus, or set rollout.engine.placement=disaggregated")
    if mode == "disaggregated" and gpus is None:
        _fail("rollout.engine.gpus", None, "the GPUs of each node given to the servers with "
              "rollout.engine.placement=disaggregated", "set e.g. rollout.engine.gpus=4-7 (and trainer.devices=4)")
    if mem_fraction is None:
        return DEFAULT_FRACTION[mode]
    if isinstance(mem_fraction, bool) or not isinstance(mem_fraction, int | float) or not 0 < mem_fraction <= 1:
        _fail("rollout.engine.mem_fraction", mem_fraction, "a number in (0, 1] (SGLang's mem_fraction_static: the "
              "share of each of its GPUs a server takes)", f"e.g. rollout.engine.mem_fraction="
              f"{DEFAULT_FRACTION[mode]}, or null for that default")
    if mode == "colocated" and mem_fraction > 1 - TRAINER_SHARE:
        _fail("rollout.engine.mem_fraction", mem_fraction, f"at most {1 - TRAINER_SHARE:g} with "
              f"rollout.engine.placement=colocated (each shared GPU keeps {TRAINER_SHARE:g} for the trainer rank's "
              "weights, gradients and optimizer state, resident while the server generates)",
              f"use rollout.engine.mem_fraction={DEFAULT_FRACTION['colocated']}, or give the servers their own GPUs "
              "(rollout.engine.gpus=...)")
    return float(mem_fraction)


def _colocated_slots(plan: ParallelPlan, trainer: Sequence[TrainerRank], *, tp_size: int,
                     num_servers: int) -> list[tuple[int, tuple[int, ...]]]:
    """Each replica's servers on its own ranks' GPUs, `tp_size` each in rank order."""
    wanted = num_servers * tp_size
    if wanted > plan.model_parallel:
        _fail("rollout.engine.num_servers * rollout.engine.tp_size", wanted, f"at most the GPUs of one data-parallel "
              f"replica (tp x cp x pp = {plan.model_parallel}) with rollout.engine.placement=colocated: every replica "
              f"launches its own servers on its own GPUs ({plan.dp} replicas x {num_servers} servers x tp_size "
              f"{tp_size} = {plan.dp * wanted} GPUs for {plan.world})",
              "lower rollout.engine.tp_size or num_servers, or give the servers their own GPUs (rollout.engine.gpus)")
    slots = []
    for d in range(plan.dp):
        ranks = replica_ranks(plan, d)
        for j in range(num_servers):
            mine = [trainer[r] for r in ranks[j * tp_size:(j + 1) * tp_size]]
            if len({t.node for t in mine}) > 1:
                where = ", ".join(f"rank {t.rank} on node {t.node}" for t in mine)
                _fail("rollout.engine.tp_size", tp_size, f"a size whose GPUs lie on one node (server {len(slots)} "
                      f"would span {where}: SGLang's TP runs inside one node)",
                      "lower rollout.engine.tp_size, or put a replica's first ranks on one node (more trainer.devices)")
            slots.append((mine[0].node, tuple(t.gpu for t in mine)))
    return slots


def _disaggregated_slots(plan: ParallelPlan, *, nodes: int, devices: int, gpus: tuple[int, ...], tp_size: int,
                         num_servers: int) -> list[tuple[int, tuple[int, ...]]]:
    """`tp_size` of the named GPUs per server, on its source's node."""
    shared = [g for g in gpus if g < devices]
    if shared:
        _fail("rollout.engine.gpus", span(gpus), f"GPUs no trainer rank uses with rollout.engine.placement="
              f"disaggregated (trainer.devices={devices} puts trainer ranks on GPUs {span(range(devices))} of every "
              f"node; {span(shared)} would hold both)",
              f"name GPUs from {devices} up (e.g. rollout.engine.gpus={devices}-{2 * devices - 1}), or lower "
              "trainer.devices, or use rollout.engine.placement=colocated")
    if tp_size > len(gpus):
        _fail("rollout.engine.tp_size", tp_size, f"at most the server GPUs of one node ({len(gpus)}: "
              f"rollout.engine.gpus={span(gpus)}), since SGLang's TP runs inside one node",
              f"use rollout.engine.tp_size={len(gpus)} or less, or name more GPUs per node")
    per_node = len(gpus) // tp_size
    wanted = plan.dp * num_servers
    if wanted > per_node * nodes:
        _fail("rollout.engine.num_servers", num_servers, f"such that the servers fit their GPUs: {plan.dp} data-parallel "
              f"replicas x {num_servers} servers x tp_size {tp_size} need {wanted * tp_size} GPUs, and "
              f"rollout.engine.gpus={span(gpus)} on {nodes} node(s) holds {per_node * nodes} server(s) of {tp_size}",
              "name more GPUs, lower rollout.engine.tp_size, or train with fewer data-parallel replicas (a larger "
              "tp / cp / pp)")
    free = {node: [gpus[k * tp_size:(k + 1) * tp_size] for k in range(per_node)] for node in range(nodes)}
    slots = []
    for d in range(plan.dp):
        source = replica_ranks(plan, d)[0]
        home = source // devices  # the source launches its servers: on its own node
        for j in range(num_servers):
            if not free[home]:
                _fail("rollout.engine.num_servers", num_servers, f"such that every replica's servers fit on the node "
                      f"of the rank that launches them: replica {d} (source rank {source}, node {home}) needs "
                      f"{num_servers} server(s) of tp_size {tp_size}, and node {home} has no server GPUs left for its "
                      f"server {j} (rollout.engine.gpus={span(gpus)} holds {per_node} per node, shared by the "
                      f"{sum(1 for e in range(plan.dp) if replica_ranks(plan, e)[0] // devices == home)} replica(s) "
                      f"whose source is on node {home})",
                      "name more GPUs per node, lower rollout.engine.num_servers or tp_size, or spread the replicas' "
                      "first ranks over the nodes")
            slots.append((home, free[home].pop(0)))
    return slots


# How the weights reach the servers, by `rollout.engine.weight_sync` (resolved), for the plan's last line.
WEIGHT_PATHS = {
    "tensor": "handles to the pushing rank's own GPU memory (CUDA IPC); the servers release their memory while the "
              "trainer trains and take it back around the push",
    "distributed": "an NCCL broadcast from the pushing rank, in buckets",
    "disk": "a safetensors checkpoint each server loads",
}


def render(placement: Placement, *, weight_sync: str | None = None) -> str:
    """The plan as printed at start and by `topp-rl plan`: a headline, then per node its trainer ranks and its
    servers (GPUs, the launch settings, who pushes the weights), then how the weights travel (`weight_sync`)."""
    p, plan, first = placement, placement.plan, placement.servers[0]  # every replica has a server
    lines = [f"[topp_rl] placement: {p.mode}, {p.nodes} node(s) x {p.devices} trainer rank(s) (dp={plan.dp} "
             f"tp={plan.tp} cp={plan.cp} pp={plan.pp}), {len(p.servers)} server(s) of tp_size {first.tp_size} at "
             f"mem_fraction {first.mem_fraction:g}"]
    for node in range(p.nodes):
        ranks = [t for t in p.trainer if t.node == node]
        lines.append(f"  node {node}: trainer ranks {span(t.rank for t in ranks)} on GPUs {span(t.gpu for t in ranks)}")
        for s in (s for s in p.servers if s.node == node):
            lines.append(f"    server {s.index}: GPUs {span(s.gpus)} (CUDA_VISIBLE_DEVICES={s.cuda_visible_devices} "
                         f"base_gpu_id={s.base_gpu_id} tp_size={s.tp_size} mem_fraction_static={s.mem_fraction:g}), "
                         f"weights from rank {s.pushed_by} (replica {s.dp_group})")
    if weight_sync is not None:
        lines.append(f"  weights: rollout.engine.weight_sync={weight_sync}: {WEIGHT_PATHS[weight_sync]}")
    return "\n".join(lines)
