"""`topp_rl.parallel`: CP index maps and response rows against naive per-sequence loops; layout validation."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from topp_rl.parallel import (
    ParallelLayout,
    cp_local_lengths,
    cp_local_positions,
    cp_padded_lengths,
    cp_shard,
    cu_seqlens,
    response_rows,
)


def naive_positions(lengths: list[int], cp_size: int, cp_rank: int, mode: str) -> list[int]:
    """The issue's wording, literally, one sequence at a time."""
    if cp_size == 1:
        return list(range(sum(lengths)))
    if mode == "allgather":
        stream = list(range(sum(lengths)))
        while len(stream) % cp_size:
            stream.append(-1)
        n = len(stream) // cp_size
        return stream[cp_rank * n : (cp_rank + 1) * n]
    out, start = [], 0
    for length in lengths:
        seq = list(range(start, start + length))
        while len(seq) % (2 * cp_size):
            seq.append(-1)
        c = len(seq) // (2 * cp_size)
        out += seq[cp_rank * c : (cp_rank + 1) * c]
        out += seq[(2 * cp_size - 1 - cp_rank) * c : (2 * cp_size - cp_rank) * c]
        start += length
    return out


def naive_response_rows(positions: list[int], lengths: list[int], responses: list[int]):
    predicted = {}  # packed position of a logit row -> candidate row of the token it predicts
    start, cand = 0, 0
    for length, resp in zip(lengths, responses, strict=True):
        for j in range(resp):
            predicted[start + length - resp - 1 + j] = cand
            cand += 1
        start += length
    rows = [i for i, g in enumerate(positions) if g in predicted]
    return rows, [predicted[positions[i]] for i in rows]


lengths_st = st.lists(st.integers(0, 23), min_size=0, max_size=7)
cp_st = st.sampled_from([(1, "zigzag"), (1, "allgather"), (2, "zigzag"), (2, "allgather"), (3, "zigzag"),
                         (4, "allgather"), (4, "zigzag")])


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, cp=cp_st)
def test_positions_match_naive_and_cover_every_position_once(lengths, cp):
    cp_size, mode = cp
    t = torch.tensor(lengths, dtype=torch.int64)
    seen = []
    for rank in range(cp_size):
        pos = cp_local_positions(t, cp_size=cp_size, cp_rank=rank, mode=mode)
        assert pos.dtype == torch.int64
        assert pos.tolist() == naive_positions(lengths, cp_size, rank, mode)
        local = cp_local_lengths(t, cp_size=cp_size, cp_rank=rank, mode=mode)
        tail = pos.numel() - int(local.sum())
        assert tail >= 0 and (pos[pos.numel() - tail :] == -1).all()
        if mode == "zigzag":
            assert tail == 0
            # Sequence s owns a contiguous local piece of local[s] rows.
            owner = torch.repeat_interleave(torch.arange(len(lengths)), local)
            starts = torch.cumsum(t, 0) - t
            real = pos >= 0
            assert (pos[real] >= starts[owner[real]]).all() and (pos[real] < (starts + t)[owner[real]]).all()
        seen += [g for g in pos.tolist() if g >= 0]
    assert sorted(seen) == list(range(sum(lengths)))


def test_cp_size_one_is_the_unpadded_stream_in_both_modes():
    t = torch.tensor([3, 5, 1])
    for mode in ("zigzag", "allgather"):
        assert cp_local_positions(t, cp_size=1, cp_rank=0, mode=mode).tolist() == list(range(9))
        assert cp_padded_lengths(t, cp_size=1, mode=mode).tolist() == [3, 5, 1]


def test_zigzag_worked_example_and_lengths():
    t = torch.tensor([5, 3])
    assert cp_local_positions(t, cp_size=2, cp_rank=0, mode="zigzag").tolist() == [0, 1, -1, -1, 5, -1]
    assert cp_local_positions(t, cp_size=2, cp_rank=1, mode="zigzag").tolist() == [2, 3, 4, -1, 6, 7]
    assert cp_padded_lengths(t, cp_size=2, mode="zigzag").tolist() == [8, 4]
    assert cp_local_lengths(t, cp_size=2, cp_rank=1, mode="zigzag").tolist() == [4, 2]
    assert cp_local_lengths(t, cp_size=3, cp_rank=1, mode="allgather").tolist() == [2, 1]  # slice [3, 6)
    assert cu_seqlens(t).tolist() == [0, 5, 8] and cu_seqlens(t).dtype == torch.int32


@settings(max_examples=60, deadline=None)
@given(data=st.data(), cp=cp_st)
def test_response_rows_match_naive(data, cp):
    cp_size, mode = cp
    lengths = data.draw(st.lists(st.integers(1, 20), min_size=1, max_size=6))
    responses = [data.draw(st.integers(0, length - 1)) for length in lengths]
    t, r = torch.tensor(lengths), torch.tensor(responses)
    all_cands = []
    for rank in range(cp_size):
        pos = cp_local_positions(t, cp_size=cp_size, cp_rank=rank, mode=mode)
        rows, cand_rows = response_rows(pos, t, r)
        want_rows, want_cands = naive_response_rows(pos.tolist(), lengths, responses)
        assert rows.tolist() == want_rows and cand_rows.tolist() == want_cands
        assert rows.dtype == cand_rows.dtype == torch.int64
        all_cands += cand_rows.tolist()
    assert sorted(all_cands) == list(range(sum(responses)))


def test_response_rows_predict_the_next_token():
    # Packed tokens are their own positions, so a row predicting packed position g + 1 must map there.
    t, r = torch.tensor([6, 4, 7]), torch.tensor([3, 1, 4])
    response_positions = torch.cat([torch.arange(o + n - k, o + n) for o, n, k in zip([0, 6, 10], t, r, strict=True)])
    for cp_size, mode in ((1, "zigzag"), (2, "zigzag"), (2, "allgather")):
        for rank in range(cp_size):
            pos = cp_local_positions(t, cp_size=cp_size, cp_rank=rank, mode=mode)
            rows, cand_rows = response_rows(pos, t, r)
            assert (pos[rows] + 1 == response_positions[cand_rows]).all()


def test_cp_shard_gathers_rows_pads_and_passes_gradients():
    t = torch.tensor([5, 3])
    x = torch.arange(16.0).view(8, 2).requires_grad_()
    pos = cp_local_positions(t, cp_size=2, cp_rank=0, mode="zigzag")  # [0, 1, -1, -1, 5, -1]
    out = cp_shard(x, pos, fill=-7.0)
    assert out.tolist() == [[0, 1], [2, 3], [-7, -7], [-7, -7], [10, 11], [-7, -7]]
    out.sum().backward()
    assert x.grad[:, 0].tolist() == [1, 1, 0, 0, 0, 1, 0, 0]
    assert cp_shard(torch.arange(8), pos, fill=0).tolist() == [0, 1, 0, 0, 5, 0]


def test_single_layout_holds_the_whole_vocabulary_and_stream():
    assert ParallelLayout(vocab_size=12).vocab_range() == (0, 12)
    single = ParallelLayout.single(7)
    assert (single.tp_size, single.cp_size, single.cp_mode, single.vocab_range()) == (1, 1, "zigzag", (0, 7))
    # one pipeline stage, which is therefore the last (the one that scores)
    assert (single.pp_size, single.pp_rank, single.pp_group, single.is_last_stage) == (1, 0, None, True)
    assert single.local_positions(torch.tensor([2, 3])).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(vocab_size=0), r"vocab_size=0 must be an int >= 1"),
        (dict(vocab_size=10, tp_size=0), r"tp_size=0 must be an int >= 1"),
        (dict(vocab_size=10, cp_size=2, cp_rank=0), r"cp_size=2 needs cp_group"),
        (dict(vocab_size=10, tp_size=2, tp_rank=1), r"tp_size=2 needs tp_group"),
        (dict(vocab_size=10, tp_rank=1), r"tp_rank=1 must be an int in \[0, tp_size=1\)"),
        (dict(vocab_size=10, cp_rank=-1), r"cp_rank=-1"),
        (dict(vocab_size=10, cp_mode="ring"), r"cp_mode='ring' must be one of"),
        (dict(vocab_size=10, tp_size=1.5), r"tp_size=1.5"),
        (dict(vocab_size=10, pp_size=0), r"pp_size=0 must be an int >= 1"),
        (dict(vocab_size=10, pp_size=2, pp_rank=1), r"pp_size=2 needs pp_group"),
        (dict(vocab_size=10, pp_rank=1), r"pp_rank=1 must be an int in \[0, pp_size=1\)"),
    ],
)
def test_layout_validation_names_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelLayout(**kwargs)


def test_layout_rejects_vocab_not_divisible_by_tp_and_says_why_padding_is_no_fix():
    with pytest.raises(ValueError, match=r"vocab_size=10 is not divisible by tp_size=3.*unpadded.*divides 10"):
        ParallelLayout(vocab_size=10, tp_size=3, tp_rank=0)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: cp_local_positions(torch.tensor([3, -1]), cp_size=1, cp_rank=0, mode="zigzag"), "must be >= 0"),
        (lambda: cp_local_positions(torch.tensor([3.0]), cp_size=1, cp_rank=0, mode="zigzag"), "integer tensor"),
        (lambda: cp_local_positions(torch.tensor([3]), cp_size=2, cp_rank=2, mode="zigzag"), r"cp_rank=2"),
        (lambda: cp_local_positions(torch.tensor([3]), cp_size=0, cp_rank=0, mode="zigzag"), r"cp_size=0"),
        (lambda: cp_local_positions(torch.tensor([3]), cp_size=2, cp_rank=0, mode="ring"), r"mode='ring'"),
        (lambda: response_rows(torch.arange(5), torch.tensor([5]), torch.tensor([5])),
         r"response_lengths\[0\]=5 with seq_lengths\[0\]=5"),
        (lambda: response_rows(torch.arange(5), torch.tensor([5]), torch.tensor([-1])), r"response_lengths\[0\]=-1"),
        (lambda: response_rows(torch.arange(5), torch.tensor([5]), torch.tensor([1, 1])), "shaped like seq_lengths"),
        (lambda: response_rows(torch.arange(6), torch.tensor([5]), torch.tensor([1])), "positions reach 5"),
        (lambda: response_rows(torch.arange(5).int(), torch.tensor([5]), torch.tensor([1])), "positions must be int64"),
        (lambda: cp_shard(torch.zeros(3, 2), torch.arange(4)), "positions reach 3"),
    ],
)
def test_bad_inputs_raise_value_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.gpu
def test_cuda_tensors_give_the_cpu_results():
    lengths, responses = torch.tensor([13, 2, 40, 7]), torch.tensor([5, 1, 30, 0])
    x = torch.randn(int(lengths.sum()), 3)
    for cp_size, mode in ((1, "zigzag"), (2, "zigzag"), (3, "allgather")):
        for rank in range(cp_size):
            pos = cp_local_positions(lengths, cp_size=cp_size, cp_rank=rank, mode=mode)
            pos_cuda = cp_local_positions(lengths.cuda(), cp_size=cp_size, cp_rank=rank, mode=mode)
            assert pos_cuda.is_cuda and torch.equal(pos_cuda.cpu(), pos)
            rows, cand_rows = response_rows(pos_cuda, lengths.cuda(), responses.cuda())
            want_rows, want_cands = response_rows(pos, lengths, responses)
            assert torch.equal(rows.cpu(), want_rows) and torch.equal(cand_rows.cpu(), want_cands)
            assert torch.equal(cp_shard(x.cuda(), pos).cpu(), cp_shard(x, pos))


# ----- ParallelPlan: the one owner of the size arithmetic (issue 36) -----
@pytest.mark.parametrize(
    ("sizes", "dp"),
    [(dict(world=1), 1), (dict(world=8, tp=2), 4), (dict(world=8, tp=2, cp=2), 2), (dict(world=4, cp=2, ep=2), 2),
     (dict(world=4, tp=2, ep=2), 2), (dict(world=4, fsdp=True), 4)],
)
def test_plan_derives_dp_from_the_world_and_the_model_parallel_sizes(sizes, dp):
    from topp_rl.parallel.plan import ParallelPlan

    plan = ParallelPlan(**sizes)
    assert plan.dp == dp and plan.dp * plan.model_parallel == plan.world


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (dict(world=3, tp=2), r"config parallel.tp_size \* parallel.cp_size \* parallel.pp_size=2: must be a divisor "
                              r"of the world size \(3 = trainer.devices \* trainer.num_nodes\)"),
        (dict(world=2, tp=2, ep=2), r"config parallel.ep_size=2: must be a divisor of data-parallel x context-parallel "
                                    r"size \(1 x 1"),
        (dict(world=2, tp=2, pp=2), r"config parallel.tp_size \* parallel.cp_size \* parallel.pp_size=4: must be a "
                                    r"divisor of the world size \(2"),
        (dict(world=2, tp=2, fsdp=True), r"config parallel.tp_size=2: must be 1 with parallel=fsdp"),
        (dict(world=2, cp=0), r"config parallel.cp_size=0: must be an integer >= 1; use parallel.cp_size=1"),
        (dict(world=2, tp=True), r"config parallel.tp_size=True: must be an integer >= 1"),
        (dict(world=0), r"config trainer.devices \* trainer.num_nodes=0: must be an integer >= 1"),
        (dict(world=2, cp=2, cp_mode="ring"), r"config parallel.cp_mode='ring': must be one of zigzag, allgather"),
    ],
)
def test_plan_refuses_sizes_that_do_not_fit_naming_the_key_and_the_fix(sizes, message):
    from topp_rl.parallel.plan import ParallelPlan

    with pytest.raises(ValueError, match=message):
        ParallelPlan(**sizes)


def test_plan_splits_the_layers_evenly_over_pipeline_stages_or_names_the_fix():
    from topp_rl.parallel.layout import pipeline_stages
    from topp_rl.parallel.plan import ParallelPlan, stage_layers

    plan = ParallelPlan(world=8, tp=2, pp=2)
    assert (plan.dp, plan.model_parallel) == (2, 4)
    assert [stage_layers(8, plan.pp, r) for r in (0, 1)] == [range(0, 4), range(4, 8)]
    with pytest.raises(ValueError, match=r"config parallel.pp_size=2: must be a divisor of the model's layer count "
                                         r"\(num_hidden_layers=5: every pipeline stage holds the same number of "
                                         r"layers\); use parallel.pp_size in \[1, 5\]"):
        plan.check_layers(5)
    assert pipeline_stages(4, 2) == "stage 0: embedding + layers 0-1 | stage 1: layers 2-3 + head"
    assert pipeline_stages(3, 3) == "stage 0: embedding + layer 0 | stage 1: layer 1 | stage 2: layer 2 + head"


def test_virtual_stages_interleave_equal_chunks_as_megatron_numbers_them_or_name_the_fix():
    """vpp > 1: pp x vpp equal chunks, rank r holding chunks r, r + pp, ... (megatron-core's
    `get_transformer_layer_offset`, checked against it below); refused with pp = 1 or an uneven split."""
    from topp_rl.parallel.layout import pipeline_stages
    from topp_rl.parallel.plan import ParallelPlan, chunk_layers

    assert [chunk_layers(8, 2, 2, r) for r in (0, 1)] == [[range(0, 2), range(4, 6)], [range(2, 4), range(6, 8)]]
    assert chunk_layers(8, 2, 1, 1) == [range(4, 8)]  # vpp 1: the stage's layers
    assert pipeline_stages(8, 2, 2) == ("stage 0: embedding + layers 0-1, layers 4-5 | stage 1: layers 2-3, "
                                        "layers 6-7 + head")
    with pytest.raises(ValueError, match=r"^config parallel.vpp_size=2: must be 1 with parallel.pp_size=1 .*; set "
                                         r"parallel.pp_size >= 2, or parallel.vpp_size=1$"):
        ParallelPlan(world=2, vpp=2)
    with pytest.raises(ValueError, match=r"^config parallel.vpp_size=3: must be a divisor of the layers per pipeline "
                                         r"stage \(num_hidden_layers=8 / parallel.pp_size=2 = 4: .*\); use "
                                         r"parallel.vpp_size in \[1, 2, 4\]$"):
        ParallelPlan(world=2, pp=2, vpp=3).check_layers(8)
    with pytest.raises(ValueError, match=r"^config parallel.vpp_size=0: must be an integer >= 1"):
        ParallelPlan(world=2, pp=2, vpp=0)
    megatron = pytest.importorskip("megatron.core.transformer.transformer_layer")
    from topp_rl.megatron.spec import transformer_config
    from topp_rl.models import build_tiny_model

    hf = build_tiny_model("llama", vocab_size=96, hidden=16, layers=12, heads=2, kv_heads=1).config
    for pp, vpp in ((2, 2), (2, 3), (3, 2)):
        config = transformer_config(hf, tp_size=1, cp_size=1, pp_size=pp, vpp_size=vpp)
        for rank in range(pp):
            offsets = [megatron.get_transformer_layer_offset(config, vp_stage=v, pp_rank=rank) for v in range(vpp)]
            assert offsets == [r.start for r in chunk_layers(12, pp, vpp, rank)], (pp, vpp, rank)


def test_interleaved_schedule_micro_batch_groups_megatron_accepts():
    """megatron-core 0.16 runs groups of N micro-batches per virtual stage with pp <= N <= m and m mod N = 0 or
    >= pp; the smallest such N (pp when m is a multiple of pp), and m < pp refused naming the fix."""
    pytest.importorskip("megatron.core")
    from topp_rl.megatron.pipeline import microbatch_group_size

    assert [microbatch_group_size(m, 2) for m in (2, 3, 4, 5, 6, 7, 8)] == [2, 3, 2, 3, 2, 4, 2]
    assert [microbatch_group_size(m, 4) for m in (4, 5, 6, 7, 8, 9, 10)] == [4, 5, 6, 7, 4, 5, 5]
    for m, pp in ((5, 4), (9, 4), (10, 4), (7, 3)):
        n = microbatch_group_size(m, pp)
        assert pp <= n <= m and (m % n == 0 or m % n >= pp)
    with pytest.raises(ValueError, match=r"^1 micro-batches at parallel.pp_size=2 with virtual stages: .* or set "
                                         r"parallel.vpp_size=1$"):
        microbatch_group_size(1, 2)


def test_plan_checks_prompts_per_data_parallel_rank():
    from topp_rl.parallel.plan import ParallelPlan

    plan = ParallelPlan(world=8, tp=2, cp=2, cp_mode="zigzag")
    plan.check_prompts(4)
    with pytest.raises(ValueError, match=r"config rollout.prompts_per_step=3: must be divisible by the data-parallel "
                                         r"size \(2\); use a multiple of 2"):
        plan.check_prompts(3)
