"""Glue of `python -m study ratios`: compose the config, build the model, engines and prompts, run the
grid on each engine, write the tables and the plot."""

import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import transformers
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig

from study.grid import Setting, grid
from study.output import plot, rows_of, write_tables
from study.ratios import EngineRun, run_engine
from study.stats import TokenFigures
from topp_rl.config import validate_config
from topp_rl.engines.sglang.server import sglang_python
from topp_rl.paths import config_dir
from topp_rl.trainer.backbone import HFBackbone

FIGURES = "figures.pt"


def compose_config(overrides: list[str], *, engine: str, out: Path) -> DictConfig:
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        # The engine's group last: the study picks it, not the overrides.
        cfg = compose("config", overrides=[f"paths.output_dir={out}", "logger=none", *overrides,
                                           f"rollout={engine}"])
    validate_config(cfg)
    return cfg


def sglang_version() -> str | None:
    python = sglang_python()
    if python is None:
        return None
    done = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
                          capture_output=True, text=True, timeout=60)
    return done.stdout.strip() or None


def run_ratios(args) -> list[Path]:
    settings = grid(args.truncations.split(","), [float(t) for t in args.temperatures.split(",")])
    if "sglang" in args.engines and sglang_python() is None:
        raise ValueError("--engines sglang needs the SGLang venv: export TOPP_RL_SGLANG_PYTHON=$(bash "
                         "scripts/setup_sglang.sh), or drop sglang from --engines")
    cfgs = {name: compose_config(args.overrides, engine=name, out=args.out) for name in args.engines}
    cfg = cfgs[args.engines[0]]
    if cfg.get("num_threads"):
        torch.set_num_threads(int(cfg.num_threads))
    torch.manual_seed(cfg.seed)
    policy, tokenizer = instantiate(cfg.model)
    policy.float().eval()
    backbone = HFBackbone(policy)
    task = instantiate(cfg.task)
    most = max(args.sglang_prompts if n == "sglang" else args.prompts for n in args.engines)
    prompts = [task.prompt(i, tokenizer).prompt_ids for i in range(most)]
    runs = []
    for name in args.engines:
        count = args.sglang_prompts if name == "sglang" else args.prompts
        runs.append(_run_one(name, cfgs[name], policy, tokenizer, backbone, prompts[:count], settings, args))
    facts = _facts(cfg, args, runs)
    args.out.mkdir(parents=True, exist_ok=True)
    save_runs(runs, facts, args.out / FIGURES)
    return [*write_tables(rows_of(runs), facts, args.out), plot(runs, args.plot or args.out / "ratios.png"),
            args.out / FIGURES]


def save_runs(runs: list[EngineRun], facts: dict, path: Path) -> None:
    """The per-token figures, so runs of different engines (or machines) can be merged into one table."""
    torch.save({"facts": facts, "runs": [
        {"engine": r.engine, "prompts": r.prompts, "wall_s": r.wall_s,
         "figures": [((s.truncation, s.temperature), f.__dict__) for s, f in r.figures.items()]} for r in runs]}, path)


def load_runs(path: Path) -> tuple[list[EngineRun], dict]:
    data = torch.load(path, weights_only=False)
    runs = [EngineRun(engine=r["engine"], prompts=r["prompts"], wall_s=r["wall_s"], figures={
        Setting(truncation=t, temperature=temp): TokenFigures(**f) for (t, temp), f in r["figures"]})
        for r in data["runs"]]
    return runs, data["facts"]


def merge_ratios(args) -> list[Path]:
    """One table and plot from the figures of several `ratios` runs (e.g. one per engine)."""
    runs, facts = [], {}
    for d in args.dirs:
        path = d if d.is_file() else d / FIGURES
        if not path.is_file():
            raise ValueError(f"{path} does not exist; pass output dirs of python -m study ratios (or a "
                             "partial-<engine>.pt file)")
        more, f = load_runs(path)
        runs += more
        for key, value in f.items():  # per-engine facts merge; shared ones must agree or are listed per run
            if isinstance(value, dict) and isinstance(facts.get(key), dict):
                facts[key] = {**facts[key], **value}
            elif key in facts and facts[key] != value:
                facts[key] = f"{facts[key]}; {value}"
            else:
                facts[key] = value
    return [*write_tables(rows_of(runs), facts, args.out), plot(runs, args.plot or args.out / "ratios.png")]


def _run_one(name, cfg, policy, tokenizer, backbone, prompts, settings, args) -> EngineRun:
    # SGLang: record any kept set (no candidate_overflow aborts); embedded: decode the whole batch at once.
    extra = ({"max_candidates": int(policy.config.vocab_size)} if name == "sglang"
             else {"max_batch_size": len(prompts) * args.samples})
    t0 = time.perf_counter()
    # The engine's files (a server's weights and logs) go to a temporary dir, never into the output dir.
    with tempfile.TemporaryDirectory(prefix=f"topp_rl_study_{name}_") as workdir, instantiate(cfg.rollout.engine)(
            model=policy, tokenizer=tokenizer, workdir=Path(workdir), **extra) as engine:
        print(f"[study] {name} engine ready in {time.perf_counter() - t0:.0f} s; {len(settings)} settings x "
              f"{len(prompts)} prompts x {args.samples} samples x <= {args.max_new_tokens} tokens", flush=True)
        return run_engine(name, engine, backbone, prompts, settings, samples=args.samples,
                          max_new_tokens=args.max_new_tokens, max_tokens=int(cfg.data.max_tokens_per_micro_batch),
                          seed=int(cfg.seed), stop_token_ids=tuple(cfg.rollout.stop_token_ids or ()),
                          log=lambda line: print(line, flush=True),
                          on_setting=lambda done: _save_partial(done, cfg, args))


def _save_partial(run: EngineRun, cfg, args) -> None:
    """`<out>/partial-<engine>.pt` after every setting; `merge` reads it like a finished run's figures.pt."""
    args.out.mkdir(parents=True, exist_ok=True)
    save_runs([run], {**_facts(cfg, args, [run]), "partial": True}, args.out / f"partial-{run.engine}.pt")


def _facts(cfg: DictConfig, args, runs: list[EngineRun]) -> dict:
    return {
        "command": "python -m study ratios " + " ".join(
            [f"--engines {','.join(args.engines)}", f"--prompts {args.prompts}",
             f"--sglang-prompts {args.sglang_prompts}", f"--samples {args.samples}",
             f"--max-new-tokens {args.max_new_tokens}", *args.overrides]),
        "model": cfg.model._target_, "task": cfg.task._target_, "seed": int(cfg.seed),
        "prompts": {r.engine: r.prompts for r in runs},
        "samples_per_prompt": args.samples, "max_new_tokens": args.max_new_tokens,
        "wall_s": {r.engine: round(r.wall_s, 1) for r in runs},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__,
                     **({"sglang": sglang_version()} if "sglang" in args.engines else {})},
        "dtype": "float32 (trainer, embedded engine, SGLang server --dtype float32)",
        "threads": torch.get_num_threads(),
    }
