"""`ParallelPlan`: the one owner of the parallel arithmetic. World size, tensor / context / expert / pipeline
sizes and FSDP are validated once, here, with errors that name the key, the value, the rule and the fix; the
config checks at start and the strategies at setup build one and read `dp` from it instead of dividing sizes
themselves (the per-rank groups and coordinates are `ParallelLayout`'s, built from the strategy's groups).

Rules (megatron-core's): world = dp x pp x cp x tp; the experts spread over the data x context ranks of a
stage (ep divides dp x cp), with expert TP = tp. FSDP shards the HF model over data-parallel ranks only, so it
combines with none of tp / cp / ep / pp. Pipeline parallelism (pp) splits the decoder layers into pp equal stages
(`stage_layers`), so the model's layer count must divide by pp (`check_layers`, once the model is known). Virtual
stages (vpp > 1, megatron's interleaved schedule) split them into pp x vpp equal chunks instead, rank r holding
chunks r, r + pp, r + 2 pp, ... (`chunk_layers`); they need pp > 1.
"""

from dataclasses import dataclass

from topp_rl.parallel.context import CP_MODES

SIZES = ("tp", "cp", "ep", "pp")
CONFIG_KEY = {"tp": "parallel.tp_size", "cp": "parallel.cp_size", "ep": "parallel.ep_size", "pp": "parallel.pp_size",
              "vpp": "parallel.vpp_size",
              "world": "trainer.devices * trainer.num_nodes", "cp_mode": "parallel.cp_mode",
              "tp * cp * pp": "parallel.tp_size * parallel.cp_size * parallel.pp_size"}


def _fail(key: str, value, constraint: str, fix: str) -> None:
    raise ValueError(f"config {CONFIG_KEY.get(key, key)}={value!r}: must be {constraint}; {fix}")


def check_sizes(**sizes: int) -> None:
    """Each size (tp, cp, ep, pp, world) an integer >= 1 (a bool is not a size)."""
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            _fail(name, value, "an integer >= 1", f"use {CONFIG_KEY.get(name, name)}=1 to disable it"
                  if name != "world" else "set trainer.devices and trainer.num_nodes to 1 or more")


def check_layers(num_layers: int, pp: int, vpp: int = 1) -> None:
    """Every pipeline stage (every virtual stage's chunk at vpp > 1) holds the same number of decoder layers
    (megatron-core's even split)."""
    if num_layers % pp:
        divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
        _fail("pp", pp, f"a divisor of the model's layer count (num_hidden_layers={num_layers}: every pipeline "
              "stage holds the same number of layers)", f"use parallel.pp_size in {divisors}")
    if (num_layers // pp) % vpp:
        divisors = [d for d in range(1, num_layers // pp + 1) if (num_layers // pp) % d == 0]
        _fail("vpp", vpp, f"a divisor of the layers per pipeline stage (num_hidden_layers={num_layers} / "
              f"parallel.pp_size={pp} = {num_layers // pp}: the model splits into pp x vpp equal chunks)",
              f"use parallel.vpp_size in {divisors}")


def check_virtual_stages(pp: int, vpp: int) -> None:
    """Virtual stages interleave the chunks of several pipeline ranks: they need pp > 1."""
    check_sizes(vpp=vpp)
    if vpp > 1 and pp == 1:
        _fail("vpp", vpp, "1 with parallel.pp_size=1 (virtual stages interleave the layer chunks of several "
              "pipeline ranks)", "set parallel.pp_size >= 2, or parallel.vpp_size=1")


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> range:
    """The (global, 0-based) decoder layers of pipeline stage `pp_rank`."""
    check_layers(num_layers, pp)
    per = num_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def chunk_layers(num_layers: int, pp: int, vpp: int, pp_rank: int) -> list[range]:
    """The (global, 0-based) decoder layers of each of pipeline rank `pp_rank`'s vpp model chunks: the model splits
    into pp x vpp equal chunks and the rank holds chunks pp_rank, pp_rank + pp, ... (megatron-core's
    `get_transformer_layer_offset`: vp_stage * num_layers / vpp + pp_rank * num_layers / (pp * vpp)). vpp = 1: the
    stage's layers."""
    check_virtual_stages(pp, vpp)
    check_layers(num_layers, pp, vpp)
    per = num_layers // (pp * vpp)
    return [range((v * pp + pp_rank) * per, (v * pp + pp_rank + 1) * per) for v in range(vpp)]


@dataclass(frozen=True)
class ParallelPlan:
    """The run's parallel sizes, valid together (checked at construction); `dp` is derived."""

    world: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    pp: int = 1
    vpp: int = 1  # virtual (interleaved) pipeline stages: model chunks per pipeline rank
    fsdp: bool = False
    cp_mode: str = "zigzag"

    def __post_init__(self) -> None:
        check_sizes(world=self.world, tp=self.tp, cp=self.cp, ep=self.ep, pp=self.pp)
        check_virtual_stages(self.pp, self.vpp)
        if self.cp_mode not in CP_MODES:
            _fail("cp_mode", self.cp_mode, f"one of {', '.join(CP_MODES)}", "use parallel.cp_mode=zigzag")
        if self.fsdp:
            for name in SIZES:
                if getattr(self, name) != 1:
                    _fail(name, getattr(self, name), "1 with parallel=fsdp (FSDP shards the weights over "
                          "data-parallel ranks; tensor / context / expert parallelism is the Megatron backbone's)",
                          f"set {CONFIG_KEY[name]}=1, or pick a Megatron layout (parallel=tp2, cp2, ep2, ...)")
        if self.world % self.model_parallel:
            _fail("tp * cp * pp", self.model_parallel, f"a divisor of the world size ({self.world} = "
                  "trainer.devices * trainer.num_nodes)", "change trainer.devices or the parallel sizes")
        if (self.dp * self.cp) % self.ep:
            _fail("ep", self.ep, f"a divisor of data-parallel x context-parallel size ({self.dp} x {self.cp}: "
                  "megatron spreads the experts over those ranks, with expert TP = parallel.tp_size)",
                  "choose an ep_size dividing it, or raise trainer.devices")

    @property
    def model_parallel(self) -> int:
        """Ranks that hold one copy of the model between them (and train on one rollout share): tp x cp x pp."""
        return self.tp * self.cp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel size: the number of rollout shares a step's prompts are split into."""
        return self.world // self.model_parallel

    def check_layers(self, num_layers: int) -> None:
        """The decoder layers split evenly over the pipeline stages and their virtual stages (megatron-core's even
        split)."""
        check_layers(num_layers, self.pp, self.vpp)

    def check_prompts(self, prompts_per_step: int) -> None:
        """Every data-parallel rank gets whole prompt groups."""
        if prompts_per_step % self.dp:
            _fail("rollout.prompts_per_step", prompts_per_step, f"divisible by the data-parallel size ({self.dp})",
                  f"use a multiple of {self.dp}, so that every rank gets whole prompt groups")
