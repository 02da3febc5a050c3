"""Checks shared by the real-SGLang tests (one server: test_sglang.py; two behind a router: test_sglang_router.py):
the tiny test model, candidate sets and log-probs against HF transformers in float32, listening sockets."""

import copy
import ipaddress
import os
import re
import time
from pathlib import Path

import pytest
import torch
from helpers import by_version, hf_logits, perturbed  # noqa: F401 - the server tests import them from here

from topp_rl.engines.serving.weights import in_threads
from topp_rl.engines.sglang.server import sglang_python
from topp_rl.models import build_tiny_model
from topp_rl.ops import sampling_candidates, token_logprobs
from topp_rl.rollout import SampleStatus

VOCAB = 512
TOL = 1e-4  # float32 forward in two engines (SGLang torch_native vs HF eager), responses of a few tokens
PROMPTS = [[1, 5, 9, 14, 20], [1, 33, 7], [1, 60, 61, 62, 63, 64, 65, 66]]


def require_sglang(*, module: bool = False) -> Path:
    """The SGLang venv's python, or a skip naming the fix (never on CI: scripts/test.sh exports it)."""
    python = sglang_python()
    if python is None:
        pytest.skip("TOPP_RL_SGLANG_PYTHON is unset (scripts/test.sh exports what scripts/setup_sglang.sh "
                    "prints)", allow_module_level=module)
    return python


def tiny_model():
    # initializer_range 0.4 makes the random logits peaked enough that top-p sets are small and varied.
    return build_tiny_model("qwen2", vocab_size=VOCAB, hidden=64, layers=2, tie_embeddings=False,
                            max_positions=4096, initializer_range=0.4, seed=3)  # fmt: skip


def changed_model(model):
    """`model` with its output head scaled by 1.5 (every next-token distribution changes)."""
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.lm_head.weight.mul_(1.5)
    return changed


def boundary_explained(
    probs_row: torch.Tensor, got: set[int], want: set[int], top_p: float, *, tol: float = TOL,
    logp_row: torch.Tensor | None = None,
) -> bool:  # fmt: skip
    """True when every id kept by one side only (`got` against `want`) sits where float32 rounding can flip the
    top-p rule on `probs_row` (SGLang's and vLLM's alike: an id is kept while the mass before it is below top_p):
    its mass-before is within `tol` of top_p, or it is in a near-tie swapped across the cut (an id the other side
    alone kept whose log-prob, `logp_row` or log(probs_row), is within 2 `tol` of its own: each engine's log-probs
    are within `tol` of the reference, so the two can order such a pair either way)."""
    order = torch.sort(probs_row, descending=True, stable=True).indices
    before = torch.cumsum(probs_row[order], 0) - probs_row[order]
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    logp = probs_row.log() if logp_row is None else logp_row

    def explained(i: int, other_side: set[int]) -> bool:
        return abs(float(before[rank[i]]) - top_p) < tol or any(
            abs(float(logp[i] - logp[j])) <= 2 * tol for j in other_side)

    return all(explained(i, want - got) for i in got - want) and all(explained(i, got - want) for i in want - got)


def check_candidates(samples, model, params, *, logits_of=None, tol: float | torch.Tensor = TOL) -> list[int]:
    """Every recorded set equals `sampling_candidates` on HF float32 logits (up to top-p boundary rounding) and
    holds the sampled token; both log-probs match HF's within `tol` (or `tol[i]` at token i: a bar per token,
    `helpers.fp32_bars`). `logits_of(sample)`: the reference logits [R, V] (default: `hf_logits(model, sample)`).
    Returns the set sizes seen."""
    sizes = []
    for s in samples:
        assert s.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED) and s.response_length > 0
        logits = hf_logits(model, s) if logits_of is None else logits_of(s)
        ref = sampling_candidates(logits, temperature=params.temperature, top_p=params.top_p,
                                  top_k=params.top_k, min_p=params.min_p)  # fmt: skip
        scaled = torch.log_softmax(logits / params.temperature, dim=-1)
        probs = scaled.exp()
        for i, tok in enumerate(s.response_ids):
            got = set(s.candidates.ids[s.candidates.offsets[i] : s.candidates.offsets[i + 1]].tolist())
            want = set(ref.ids[ref.offsets[i] : ref.offsets[i + 1]].tolist())
            assert tok in got, f"sampled token {tok} missing from its recorded set"
            if got != want:
                assert boundary_explained(probs[i], got, want, params.top_p), (
                    f"sample {s.index} token {i}: SGLang kept {sorted(got)[:20]}..., "
                    f"sampling_candidates kept {sorted(want)[:20]}..."
                )
            kept = torch.tensor(sorted(got))
            renorm = scaled[i, tok] - torch.logsumexp(scaled[i, kept], 0)
            where, bar = f"sample {s.index} token {i} of {s.response_length}", float(tol[i] if torch.is_tensor(tol) else tol)
            assert abs(float(renorm) - s.rollout_log_probs[i]) <= bar, (where, float(renorm), s.rollout_log_probs[i], bar)
            assert abs(float(scaled[i, tok]) - s.rollout_raw_log_probs[i]) <= bar, (
                where, float(scaled[i, tok]), s.rollout_raw_log_probs[i])
            sizes.append(len(got))
    return sizes


def pgid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return None


def group_members(group: int) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and pgid(int(p)) == group]


def listening(pids: set[int]) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """(bound address, pid) of every listening TCP socket of `pids` (from /proc/net/tcp{,6})."""
    owner = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                owner[link[8:-1]] = pid
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in owner:  # state 0A: LISTEN
                raw = bytes.fromhex(fields[1].split(":")[0])
                # each 32-bit word is in host (little-endian) order
                addr = ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)))
                mapped = getattr(addr, "ipv4_mapped", None)
                found.append((mapped or addr, owner[fields[9]]))
    return found


_NEW_SEQS = re.compile(rb"Prefill batch.*?#new-seq: (\d+)")


def log_size(path: Path) -> int:
    """Where a server log ends now: `wait_for_prefills` counts what the server logs after it."""
    return path.stat().st_size


def prefills_logged(path: Path, *, offset: int) -> int:
    """The requests whose prefill the server has logged past byte `offset` of its log (SGLang logs "Prefill batch,
    #new-seq: N, ..." as it starts decoding N requests)."""
    with path.open("rb") as f:
        f.seek(offset)
        return sum(int(n) for n in _NEW_SEQS.findall(f.read()))


def wait_for_prefills(path: Path, *, offset: int, seqs: int, timeout_s: float = 300.0) -> int:
    """Wait until the server has logged prefill batches for `seqs` requests past byte `offset` of its log: the event
    a test acts on, instead of a fixed sleep. The bound is generous: reaching it means the server hung. Returns the
    requests seen."""
    deadline, seen = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline:
        seen = prefills_logged(path, offset=offset)
        if seen >= seqs:
            return seen
        time.sleep(0.05)
    raise AssertionError(f"{path}: prefills for {seen} of {seqs} requests after {timeout_s:.0f} s (a hung server?)")


# ---- partial rollouts: an update with requests in flight ------------------------------------------------------
def generate_across_update(engine, prompts, params, new_model, *, version: int, timeout_s: float = 300.0):
    """`engine.generate(prompts, params)` in a thread, with `new_model` pushed as `version`
    (`update_weights_in_flight`) while every request is held by its server after its prefill (so each response has
    at least its first token from the old weights). The hold is the servers' own pause: paused in place before the
    requests are sent (SGLang's tokenizer manager queues what arrives while paused), then resumed and paused again
    at once (`decode_briefly`) until every server has logged the prefill of every request; the update's own pause
    finds them paused. Returns the samples."""
    servers = engine.servers
    logs = [srv.log_path for srv in servers]
    offsets = [log_size(log) for log in logs]
    wanted, out = len(prompts) * params.n, {}
    for srv in servers:
        engine.weights.control(srv.url, "/pause_generation", {"mode": "in_place"})
    with in_threads([lambda: out.update(samples=engine.generate(prompts, params))]):
        deadline = time.monotonic() + timeout_s  # reaching it means a hung server
        while (seen := sum(prefills_logged(log, offset=o) for log, o in zip(logs, offsets, strict=True))) < wanted:
            assert time.monotonic() < deadline and not out, f"prefills for {seen} of {wanted} requests"
            decode_briefly(engine, [srv.url for srv in servers])
            time.sleep(0.2)  # the scheduler logs a prefill as it runs it: a read before that costs one more round
        engine.update_weights_in_flight(new_model.named_parameters(), version=version)
    return out["samples"]


def decode_briefly(engine, urls: list[str]) -> None:
    """Resume the paused servers and pause them (in place) again 0.02 s later, without waiting for the resumes'
    answers: the queued requests reach the scheduler, which prefills them and decodes a few tokens. The 0.02 s lets
    the resumes go first; a stall of this process in between lets the requests decode longer (a round in which one
    finished runs again: `helpers.in_flight_rounds`)."""
    resume = [lambda url=url: engine.weights.control(url, "/continue_generation", {}) for url in urls]
    with in_threads(resume):
        time.sleep(0.02)
        for url in urls:
            engine.weights.control(url, "/pause_generation", {"mode": "in_place"})


def deviation(sample, logits: torch.Tensor, *, temperature: float) -> torch.Tensor:
    """|recorded - dense fp32| [R]: each token's recorded log-prob against `topp_rl.ops.token_logprobs` on `logits`
    over its recorded kept set."""
    dense = token_logprobs(logits, torch.tensor(sample.response_ids), cands=sample.candidates,
                           temperature=temperature)  # fmt: skip
    return (torch.tensor(sample.rollout_log_probs) - dense).abs()
