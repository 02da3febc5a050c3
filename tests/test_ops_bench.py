"""benchmarks/bench_logprob.py: the quick mode runs and reports every case, and the compared paths agree."""

import importlib.util
import json
from pathlib import Path

import torch

from topp_rl.ops import candidate_head_logprobs, keep_mask, token_logprobs

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_logprob.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_logprob", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run_reports_every_case(tmp_path):
    bench = _bench()
    out = tmp_path / "bench.json"
    bench.main(["--quick", "--json", str(out)])
    data = json.loads(out.read_text())
    assert [c["name"] for c in data["cases"]] == list(bench.CASES)
    for case in data["cases"]:
        assert case["ms"] > 0 and case["peak_mb"] >= 0 and case["ratio"] > 0
        assert case["ratio_to"] in bench.CASES
    assert {t["name"] for t in data["targets"]} >= {"keep_mask: speed-up over the Python loop"}
    assert all(isinstance(t["met"], bool) for t in data["targets"])


def test_compared_paths_compute_the_same_thing():
    bench = _bench()
    shape = bench.SHAPES["quick"]
    inp = bench.logits_inputs(shape)
    sizes = inp["cands"].row_lengths().float()
    assert sizes.median() <= 3 and 4 <= sizes.mean() <= 14  # median ~2, mean ~8
    dense = bench.dense_logprobs(inp["logits"], inp)
    ours = token_logprobs(
        inp["logits"], inp["tokens"], cands=inp["cands"], rows=inp["rows"], temperature=bench.TEMPERATURE
    )
    head = candidate_head_logprobs(
        inp["hidden"],
        inp["weight"],
        inp["tokens"],
        cands=inp["cands"],
        rows=inp["rows"],
        temperature=bench.TEMPERATURE,
    )
    torch.testing.assert_close(ours, dense, rtol=0, atol=1e-4)
    torch.testing.assert_close(head, dense, rtol=0, atol=1e-4)
    m = bench.mask_inputs(shape)
    assert torch.equal(bench.run_mask_loop(m), bench.run_mask_ours(m))
    assert torch.equal(
        bench.run_mask_ours(m),
        keep_mask(
            m["cands"],
            m["rows"],
            num_rows=m["rows"].numel(),
            vocab_start=0,
            vocab_end=m["vocab"],
            tokens=m["tokens"],
        ),
    )
