"""The kernels' NumPy twins against naive attention, and every launcher check (host path, runs in CI)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedrt import Pool
from pagedrt.errors import BlockTableError, LaunchArgumentError, UnsupportedConfigError
from pagedrt.kernels import (DecodePlan, WritePlan, contiguous_decode, copy_blocks, instances,
                             merge_partials_reference, paged_decode, plan_splits, write_kv)
from pagedrt import source
from pagedrt.kernels import configs, decode
from pagedrt.kernels.configs import BASE, Config
from tests.kernel_cases import Case, naive_attention, np_dtype, rel_error


def lengths(bs):
    return [1, bs - 1, bs, bs + 1, 1000] if bs > 2 else [1, bs, bs + 1, 1000]


# --- decode twins -------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [8, 16, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_paged_twin_matches_naive_attention(block_size, group):
    case = Case(Config("float32", 64, block_size, group), lengths(block_size), seed=block_size + group)
    out = paged_decode(case.q, case.k, case.v, case.table, case.lens)
    ref = naive_attention(case.q, case.k, case.v, case.table, case.lens, 1 / math.sqrt(64))
    assert out.dtype == np.float32 and out.shape == case.q.shape
    assert rel_error(out, ref) < 1e-6
    assert np.isfinite(out).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_twin_returns_the_query_dtype(dtype):
    case = Case(Config(dtype, 128, 16, 4), [5, 40])
    out = paged_decode(case.q, case.k, case.v, case.table, case.lens, scale=0.3)
    ref = naive_attention(case.q, case.k, case.v, case.table, case.lens, 0.3)
    assert out.dtype == np_dtype(dtype)
    assert rel_error(out, ref) < (2e-3 if dtype == "float16" else 1e-2)


def test_contiguous_twin_equals_paged_twin():
    case = Case(Config("float32", 80, 16, 2), lengths(16))
    k, v = case.contiguous()
    paged = paged_decode(case.q, case.k, case.v, case.table, case.lens)
    assert np.array_equal(contiguous_decode(case.q, k, v, case.lens), paged)


@pytest.mark.parametrize("num_splits", [2, 7, 64])
def test_split_twin_equals_unsplit_with_empty_segments(num_splits):
    case = Case(Config("float32", 64, 16, 4), [1, 17, 1000, 300])
    whole = paged_decode(case.q, case.k, case.v, case.table, case.lens)
    split = paged_decode(case.q, case.k, case.v, case.table, case.lens, num_splits=num_splits)
    assert rel_error(split, whole) < 1e-6


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(1, 200), min_size=1, max_size=4), num_splits=st.integers(1, 20),
       block_size=st.sampled_from([8, 32]))
def test_split_twin_property(lens, num_splits, block_size):
    case = Case(Config("float32", 64, block_size, 2), lens, kv_heads=1)
    whole = paged_decode(case.q, case.k, case.v, case.table, case.lens)
    split = paged_decode(case.q, case.k, case.v, case.table, case.lens, num_splits=num_splits)
    assert rel_error(split, whole) < 1e-6


def test_merge_of_partials_is_softmax_of_the_whole():
    rng = np.random.default_rng(3)
    scores, values = rng.normal(size=(3, 50)), rng.normal(size=(3, 50, 8))
    cuts = [(0, 0), (0, 20), (20, 20), (20, 50)]  # two empty segments
    m, l, o = [], [], []
    for a, b in cuts:
        s, v = scores[:, a:b], values[:, a:b]
        top = s.max(axis=1) if b > a else np.full(3, -np.inf)
        p = np.exp(s - top[:, None]) if b > a else s
        m.append(top), l.append(p.sum(axis=1)), o.append(np.einsum("hn,hnd->hd", p, v))
    merged = merge_partials_reference(np.stack(m), np.stack(l), np.stack(o))
    p = np.exp(scores - scores.max(axis=1, keepdims=True))
    assert np.allclose(merged, np.einsum("hn,hnd->hd", p / p.sum(axis=1, keepdims=True), values), rtol=1e-12)


def test_twins_run_on_host_pool_views():
    """Planes as views of a host Pool in block-major placement (block stride = 4 planes)."""
    case = Case(Config("float16", 64, 32, 2), [33, 64, 5])
    with Pool(64 << 20, 2 << 20, backend="host") as pool:
        pool.grow(1)
        buf = pool.view(0, case.buffer.shape, case.buffer.dtype)
        buf[...] = case.buffer
        k, v = buf[:, 0, 1], buf[:, 1, 1]
        assert k.strides[0] == 4 * k[0].nbytes
        out = paged_decode(case.q, k, v, case.table, case.lens)
    assert np.array_equal(out, paged_decode(case.q, case.k, case.v, case.table, case.lens))


# --- split plan -------------------------------------------------------------------------

WORKLOADS = {"long-1": (1, 32768), "b8": (8, 8192), "b32": (32, 4096), "b64": (64, 2048), "b128": (128, 1024),
             "b256": (256, 512), "big": (64, 8192), "var": (64, 8192)}


@pytest.mark.parametrize("case", sorted(WORKLOADS))
def test_plan_fills_the_device_without_tiny_segments(case):
    batch, max_len = WORKLOADS[case]
    slots, tile, per_token = 132 * 3, 32, 2 * 128 * 2
    plan = plan_splits(batch, 8, max_len, tile, per_token, slots)
    assert plan.segment_tokens % tile == 0
    assert (plan.num_splits - 1) * plan.segment_tokens < max_len <= plan.num_splits * plan.segment_tokens
    assert batch * 8 * plan.num_splits <= max(slots, batch * 8)
    assert plan.num_splits == 1 or plan.segment_tokens * per_token >= decode.MIN_SEGMENT_BYTES
    if batch * 8 < slots // 2:
        assert plan.num_splits > 1


def test_plan_splits_a_full_batch_only_when_lengths_are_uneven():
    slots, tile, per_token = 264, 32, 2 * 128 * 2
    even = plan_splits(64, 8, 8192, tile, per_token, slots, mean_seq_len=8192)
    uneven = plan_splits(64, 8, 8192, tile, per_token, slots, mean_seq_len=4100)
    assert even.num_splits == 1
    assert uneven.num_splits == 8 and uneven.segment_tokens == 1024  # about a quarter of the mean
    assert not uneven.short  # uneven lengths keep the standard geometry (benchmarks/NOTES.md, v10)
    tiny_mean = plan_splits(64, 8, 8192, tile, per_token, slots, mean_seq_len=100)
    assert tiny_mean.segment_tokens * per_token >= decode.MIN_SEGMENT_BYTES


def test_plan_keeps_a_requested_split_count():
    plan = plan_splits(2, 8, 100, 32, 512, 396, num_splits=9)
    assert plan == decode.Plan(9, 32)  # segments 4..8 are empty


# --- write and copy twins -------------------------------------------------------------------

def test_write_twin_round_trips_through_the_slots_and_skips_padding():
    case = Case(Config("float16", 96, 16, 1), [1], spare_blocks=8)
    rng = np.random.default_rng(5)
    num_blocks, kv_heads = case.k.shape[:2]
    slots = rng.permutation(num_blocks * 16)[:40].astype(np.int64)
    slots[[3, 17]] = -1
    k = rng.standard_normal((40, kv_heads, 96)).astype(np.float16)
    v = rng.standard_normal((40, kv_heads, 96)).astype(np.float16)
    before = case.buffer.copy()
    write_kv(k, v, case.k, case.v, slots)
    for plane, src in ((case.k, k), (case.v, v)):
        for t, s in enumerate(slots):
            if s >= 0:
                assert np.array_equal(plane[s // 16, :, s % 16], src[t])
    written = np.zeros(case.buffer.shape, bool)
    for s in slots[slots >= 0]:
        written[s // 16, :, 1, :, s % 16] = True
    assert np.array_equal(case.buffer[~written], before[~written], equal_nan=True)


def test_write_then_decode_equals_naive_attention():
    cfg = Config("float32", 64, 8, 2)
    case = Case(cfg, [20, 3])
    rng = np.random.default_rng(9)
    n = 20
    k = rng.standard_normal((n, 2, 64)).astype(np.float32)
    v = rng.standard_normal((n, 2, 64)).astype(np.float32)
    table_row = case.table[0]
    slots = (table_row[np.arange(n) // 8].astype(np.int64) * 8 + np.arange(n) % 8)
    write_kv(k, v, case.k, case.v, slots)
    out = paged_decode(case.q, case.k, case.v, case.table, case.lens)
    ref = naive_attention(case.q, case.k, case.v, case.table, case.lens, 1 / 8)
    assert rel_error(out, ref) < 1e-6
    assert np.allclose(case.k[table_row[0], :, 3], k[3])


def test_copy_twin_copies_every_plane():
    buf = np.random.default_rng(2).standard_normal((10, 2, 3, 2, 8, 64)).astype(np.float32)
    planes = [buf[:, kv, layer] for kv in range(2) for layer in range(3)]
    before = buf.copy()
    copy_blocks(planes, [[1, 7], [2, 0], [1, 9]])
    for src, dst in ((1, 7), (2, 0), (1, 9)):
        assert np.array_equal(buf[dst], before[src])
    untouched = [b for b in range(10) if b not in (7, 0, 9)]
    assert np.array_equal(buf[untouched], before[untouched])
    copy_blocks(planes, np.zeros((0, 2), np.int64))
    assert np.array_equal(buf[untouched], before[untouched])


# --- launcher checks ------------------------------------------------------------------------

@pytest.fixture
def case():
    return Case(BASE, [1, 40, 17])


def decode_args(case, **over):
    args = dict(q=case.q, k_cache=case.k, v_cache=case.v, block_tables=case.table, seq_lens=case.lens)
    args.update(over)
    return args


@pytest.mark.parametrize("mutate, error, words", [
    (lambda c: dict(q=[[1.0]]), LaunchArgumentError, "NumPy or CuPy"),
    (lambda c: dict(q=c.q[0]), LaunchArgumentError, "3-D"),
    (lambda c: dict(q=c.q[:, ::2]), LaunchArgumentError, "C-contiguous"),
    (lambda c: dict(q=c.q.astype(np.float32)), LaunchArgumentError, "must match"),
    (lambda c: dict(q=c.q[:, :, :64].copy()), LaunchArgumentError, "head_dim"),
    (lambda c: dict(q=c.q[:, :7].copy()), LaunchArgumentError, "multiple"),
    (lambda c: dict(q=np.concatenate([c.q, c.q, c.q], axis=1)), UnsupportedConfigError, "group"),
    (lambda c: dict(k_cache=c.k[:, :, :, :64]), LaunchArgumentError, "C-contiguous inside a block"),
    (lambda c: dict(k_cache=c.k[..., None]), LaunchArgumentError, "4-D"),
    (lambda c: dict(k_cache=c.k[:, :0], v_cache=c.v[:, :0]), LaunchArgumentError, "empty dimension"),
    (lambda c: dict(k_cache=c.buffer[:, 0]), LaunchArgumentError, "4-D"),
    (lambda c: dict(v_cache=c.v[:-1]), LaunchArgumentError, "same shape and block stride"),
    (lambda c: dict(v_cache=c.buffer[:, 1, 0].astype(np.float32)), LaunchArgumentError, "must match"),
    (lambda c: dict(block_tables=c.table.astype(np.int64)), LaunchArgumentError, "int32"),
    (lambda c: dict(block_tables=c.table[:2]), LaunchArgumentError, "rows"),
    (lambda c: dict(block_tables=c.table[:, ::2]), LaunchArgumentError, "contiguous columns"),
    (lambda c: dict(block_tables=c.table[:, :0]), LaunchArgumentError, "contiguous columns"),
    (lambda c: dict(seq_lens=c.lens.astype(np.int64)), LaunchArgumentError, "int32"),
    (lambda c: dict(seq_lens=c.lens[:2]), LaunchArgumentError, "one length per query row"),
    (lambda c: dict(out=np.empty((3, 8, 128), np.float32)), LaunchArgumentError, "out must be"),
    (lambda c: dict(num_splits=0), LaunchArgumentError, "num_splits"),
    (lambda c: dict(max_seq_len=10**6), LaunchArgumentError, "max_seq_len"),
    (lambda c: dict(block_mask=np.ones(3, bool)), LaunchArgumentError, "block_mask"),
    (lambda c: dict(block_mask=np.ones(len(c.k), np.int32)), LaunchArgumentError, "block_mask"),
    (lambda c: dict(scale=float("nan")), LaunchArgumentError, "finite"),
])
def test_decode_argument_errors(case, mutate, error, words):
    out = np.full(case.q.shape, 7, case.q.dtype)
    args = decode_args(case, out=out)
    args.update(mutate(case))
    with pytest.raises(error, match=words):
        paged_decode(**args)
    assert (out == 7).all()


def two_layers(case):
    """The case's planes for layers 0 and 1; layer 0 holds -0.5 x layer 1 (NaN where layer 1 is NaN)."""
    case.buffer[:, :, 0] = (case.buffer[:, :, 1].astype(np.float32) * -0.5).astype(case.buffer.dtype)
    return [(case.buffer[:, 0, layer], case.buffer[:, 1, layer]) for layer in (0, 1)]


@pytest.mark.parametrize("num_splits", [None, 3])
def test_plan_runs_each_layer_as_paged_decode_does(case, num_splits):
    planes = two_layers(case)
    plan = DecodePlan(case.q, planes[0][0], case.table, case.lens, num_splits=num_splits)
    outs = []
    for k, v in planes:
        out = np.full(case.q.shape, 7, case.q.dtype)
        assert plan.run(case.q, k, v, out=out) is out
        assert np.array_equal(out, paged_decode(case.q, k, v, case.table, case.lens, num_splits=num_splits))
        outs.append(out)
    assert np.isfinite(outs[0].astype(np.float32)).all() and not np.array_equal(outs[0], outs[1])


@pytest.mark.parametrize("mutate, words", [
    (lambda c: dict(v_cache=c.v.tolist()), "NumPy or CuPy"),
    (lambda c: dict(q=c.q.astype(np.float32)), "q must be"),
    (lambda c: dict(q=c.q[:2].copy()), "q must be"),
    (lambda c: dict(q=np.asfortranarray(c.q)), "q must be"),
    (lambda c: dict(k_cache=c.k.copy()), "must match the plan's K plane"),  # same shape, another block stride
    (lambda c: dict(v_cache=c.v[:-1]), "same shape and block stride"),
    (lambda c: dict(v_cache=c.v.astype(np.float32)), "must match"),
    (lambda c: dict(out=np.empty((3, 8, 64), c.q.dtype)), "out must be"),
])
def test_plan_run_refuses_arrays_unlike_the_plans(case, mutate, words):
    plan = DecodePlan(case.q, case.k, case.table, case.lens)
    out = np.full(case.q.shape, 7, case.q.dtype)
    args = dict(q=case.q, k_cache=case.k, v_cache=case.v, out=out)
    args.update(mutate(case))
    with pytest.raises(LaunchArgumentError, match=words):
        plan.run(**args)
    assert (out == 7).all()


def test_unsupported_configs_name_the_value():
    for kw, words in ((dict(head_dim=48), "head_dim=48"), (dict(block_size=24), "block_size=24"),
                      (dict(group=9), "group"), (dict(dtype=np.float64), "float64")):
        args = dict(dtype=np.float16, head_dim=128, block_size=16, group=4)
        args.update(kw)
        with pytest.raises(UnsupportedConfigError, match=words):
            configs.config(**args)
    buf = np.zeros((4, 2, 24, 128), np.float16)
    with pytest.raises(UnsupportedConfigError, match="block_size=24.*8, 16, 32, 64, 128"):
        paged_decode(np.zeros((1, 8, 128), np.float16), buf, buf, np.zeros((1, 1), np.int32),
                     np.ones(1, np.int32))


def test_plane_block_stride_must_be_16_byte_multiple():
    raw = np.zeros(5 * (2 * 16 * 64 + 4), np.float16)
    plane = np.lib.stride_tricks.as_strided(raw, (5, 2, 16, 64), ((2 * 16 * 64 + 4) * 2, 16 * 64 * 2, 128, 2))
    with pytest.raises(LaunchArgumentError, match="multiple of 16"):
        paged_decode(np.zeros((1, 2, 64), np.float16), plane, plane, np.zeros((1, 1), np.int32),
                     np.ones(1, np.int32))


@pytest.mark.parametrize("row, length", [(1, 0), (2, 63 * 16 + 1), (0, -3)])
def test_bad_length_raises_block_table_error(case, row, length):
    lens = case.lens.copy()
    lens[row] = length
    out = np.full(case.q.shape, 7, case.q.dtype)
    with pytest.raises(BlockTableError, match=rf"seq_lens\[{row}\] = {length}") as info:
        paged_decode(**decode_args(case, seq_lens=lens, out=out))
    assert info.value.row == row and (out == 7).all()


@pytest.mark.parametrize("bad_id", [-1, 10**6])
def test_bad_block_id_names_the_first_entry(case, bad_id):
    table = case.table.copy()
    table[1, 2] = bad_id         # used: row 1 has 40 tokens = 3 blocks
    table[2, 1] = bad_id         # used, but later in row-major order
    table[0, 2] = bad_id         # unused column (row 0 has 1 token): ignored
    with pytest.raises(BlockTableError, match=rf"block_tables\[1, 2\] = {bad_id}") as info:
        paged_decode(**decode_args(case, block_tables=table))
    assert (info.value.row, info.value.column, info.value.block_id) == (1, 2, bad_id)


def test_block_mask_refuses_unusable_blocks(case):
    mask = np.ones(len(case.k), np.uint8)
    paged_decode(**decode_args(case, block_mask=mask))
    mask[case.table[2, 1]] = 0
    with pytest.raises(BlockTableError, match=r"block_tables\[2, 1\].*block_mask"):
        paged_decode(**decode_args(case, block_mask=mask))
    mask[:] = 1
    mask[np.setdiff1d(np.arange(len(case.k)), case.table)] = 0  # blocks no sequence uses
    paged_decode(**decode_args(case, block_mask=mask.astype(bool)))


def test_contiguous_checks():
    case = Case(BASE, [3, 20])
    k, v = case.contiguous()
    with pytest.raises(LaunchArgumentError, match="C-contiguous"):
        contiguous_decode(case.q, k[:, :, ::2], v, case.lens)
    with pytest.raises(LaunchArgumentError, match="same shape"):
        contiguous_decode(case.q, k, v[:, :1].copy(), case.lens)
    with pytest.raises(BlockTableError, match=r"seq_lens\[1\] = 40"):
        contiguous_decode(case.q, k, v, np.array([3, 40], np.int32))


def test_write_checks():
    case = Case(BASE, [1], spare_blocks=2)
    n = len(case.k) * 16
    k = np.ones((3, 2, 128), np.float16)
    before = case.buffer.copy()
    with pytest.raises(BlockTableError, match=rf"slot_mapping\[1\] = {n}"):
        write_kv(k, k, case.k, case.v, np.array([0, n, n + 5], np.int64))
    with pytest.raises(LaunchArgumentError, match="int64"):
        write_kv(k, k, case.k, case.v, np.zeros(3, np.int32))
    with pytest.raises(LaunchArgumentError, match="one slot per token"):
        write_kv(k, k, case.k, case.v, np.zeros(2, np.int64))
    with pytest.raises(LaunchArgumentError, match="to match the cache"):
        write_kv(k[:, :1].copy(), k[:, :1].copy(), case.k, case.v, np.zeros(3, np.int64))
    with pytest.raises(LaunchArgumentError, match="same shape"):
        write_kv(k, k[:2], case.k, case.v, np.zeros(3, np.int64))
    assert np.array_equal(case.buffer, before, equal_nan=True)


def test_write_plan_runs_each_layer_as_write_kv_does():
    case = Case(BASE, [40], spare_blocks=2)
    rng = np.random.default_rng(9)
    slots = np.array([5, -1, 17, 3 * 16 + 2], np.int64)
    new = [[rng.standard_normal((4, 2, 128)).astype(np.float16) for _ in range(2)] for _ in range(2)]
    plan = WritePlan(new[0][0], case.buffer[:, 0, 0], slots)
    expected = case.buffer.copy()
    for layer, (k, v) in enumerate(new):
        write_kv(k, v, expected[:, 0, layer], expected[:, 1, layer], slots)
        plan.run(k, v, case.buffer[:, 0, layer], case.buffer[:, 1, layer])
        assert np.array_equal(case.buffer, expected, equal_nan=True)
    assert np.array_equal(case.buffer[3, 1, 1, :, 2], new[1][1][3])


@pytest.mark.parametrize("mutate, words", [
    (lambda c, k: dict(v=k.tolist()), "NumPy or CuPy"),
    (lambda c, k: dict(v=k[:2]), "same shape"),
    (lambda c, k: dict(k=k.astype(np.float32)), "same shape"),
    (lambda c, k: dict(k_cache=c.k.copy()), "must match the plan's K plane"),
    (lambda c, k: dict(v_cache=c.v[:-1]), "same shape and block stride"),
])
def test_write_plan_run_refuses_arrays_unlike_the_plans(mutate, words):
    case = Case(BASE, [40], spare_blocks=2)
    k = np.ones((3, 2, 128), np.float16)
    plan = WritePlan(k, case.k, np.array([0, 1, 2], np.int64))
    before = case.buffer.copy()
    args = dict(k=k, v=k, k_cache=case.k, v_cache=case.v)
    args.update(mutate(case, k))
    with pytest.raises(LaunchArgumentError, match=words):
        plan.run(**args)
    assert np.array_equal(case.buffer, before, equal_nan=True)


def test_copy_checks():
    buf = np.zeros((6, 2, 2, 8, 64), np.float16)
    planes = [buf[:, 0], buf[:, 1]]
    for pairs, error, words in (([[0, 6]], BlockTableError, r"pairs\[0\] = \(0, 6\)"),
                                ([[0, 1], [2, 1]], LaunchArgumentError, "same destination"),
                                ([[0, 1], [1, 2]], LaunchArgumentError, "block 1 is both"),
                                ([[0.5, 1]], LaunchArgumentError, "integers"),
                                ([0, 1], LaunchArgumentError, r"\[n, 2\]")):
        with pytest.raises(error, match=words):
            copy_blocks(planes, pairs)
    with pytest.raises(LaunchArgumentError, match="share both"):
        copy_blocks([buf[:, 0], np.zeros((6, 2, 8, 64), np.float16)], [[0, 1]])
    with pytest.raises(LaunchArgumentError, match="empty"):
        copy_blocks([], [[0, 1]])


# --- sources and configurations -----------------------------------------------------------

def test_sweep_covers_every_value_of_every_axis():
    sweep = configs.sweep()
    assert sweep[0] == BASE and len(set(sweep)) == len(sweep)
    assert {c.dtype for c in sweep} == set(configs.CUDA_TYPES)
    assert {c.head_dim for c in sweep} == set(configs.HEAD_DIMS)
    assert {c.block_size for c in sweep} == set(configs.BLOCK_SIZES)
    assert {c.group for c in sweep} == set(configs.GROUPS)
    for d in configs.CUDA_TYPES:
        for h in configs.HEAD_DIMS:
            assert Config(d, h, 16, 8) in sweep  # the heaviest group, for every dtype x head_dim


def test_instances_name_every_swept_kernel():
    names = instances()
    for cfg in configs.sweep():
        for paged in (True, False):
            for short in (False, True):
                assert decode.kernel_name(cfg, paged, short) in names["decode.cu"]
    assert "pagedrt::decode<__half, 128, 16, 4, true, 128, 32, 64, 3, true>" in names["decode.cu"]  # tensor cores
    assert "pagedrt::decode<__half, 128, 16, 4, true, 64, 32, 32, 3, true>" in names["decode.cu"]  # short, 2 warps
    assert "pagedrt::decode<__half, 80, 16, 4, true, 128, 8, 32, 4, false>" in names["decode.cu"]
    assert "pagedrt::decode<__half, 80, 16, 4, true, 128, 16, 32, 3, false>" in names["decode.cu"]  # short segments


def test_short_segments_get_half_the_lane_budget_and_a_stage_less():
    cfg = Config("float16", 80, 16, 4)
    long, short = decode.geometry(cfg), decode.geometry(cfg, short=True)
    assert (long.lanes, long.stages) == (8, 4) and (short.lanes, short.stages) == (16, 3)
    assert short.tile == long.tile and not long.mma


def test_tensor_cores_for_half_precision_head_dims_64_and_128():
    for cfg in configs.sweep():
        geo = decode.geometry(cfg)
        assert geo.mma == (cfg.dtype != "float32" and cfg.head_dim in (64, 128))
        if geo.mma:  # a warp per 16 tokens: four warps, or two for short segments, at the same stages
            short = decode.geometry(cfg, short=True)
            assert (geo.lanes, geo.threads, geo.tile) == (32, 128, 64)
            assert (short.lanes, short.threads, short.tile, short.stages) == (32, 64, 32, geo.stages)


def test_short_tensor_core_geometry_fits_four_blocks_per_sm():
    """Four two-warp blocks hold as many stages' bytes as two standard ones (228 KiB per SM, 1 KiB each reserved)."""
    cfg = Config("float16", 128, 16, 4)
    geo, short = decode.geometry(cfg), decode.geometry(cfg, short=True)
    assert 4 * (short.smem_bytes + 1024) <= 228 * 1024 < 5 * (short.smem_bytes + 1024)
    assert 4 * short.stages * short.tile == 2 * geo.stages * geo.tile and 4 * short.threads == 2 * geo.threads


def test_plan_picks_the_short_geometry_for_many_short_segments_only():
    slots, tile, per_token = 264, 32, 2 * 128 * 2
    lens = np.random.default_rng(0).integers(1, 8193, 64)
    short = {name: plan_splits(batch, 8, max_len, tile, per_token, slots,
                               mean_seq_len=float(lens.mean()) if name == "var" else None).short
             for name, (batch, max_len) in WORKLOADS.items()}
    # b128, b256: 1024 and 2048 blocks of 32 and 16 tiles; var (8 segments of 1024 tokens per sequence) is
    # uneven, so keeps the standard geometry
    assert short == {"long-1": False, "b8": False, "b32": False, "b64": False, "b128": True, "b256": True,
                     "big": False, "var": False}


@pytest.mark.parametrize("short", [False, True])
def test_geometry_stages_one_tile_of_k_and_v(short):
    for cfg in configs.sweep():
        geo = decode.geometry(cfg, short)
        row = cfg.head_dim * cfg.itemsize
        if geo.mma:
            assert geo.tile == 16 * geo.threads // 32
        else:
            assert geo.tile * row <= decode.TILE_BYTES < 2 * geo.tile * row and geo.threads == decode.THREADS
        assert geo.tile & (geo.tile - 1) == 0
        assert geo.smem_bytes == geo.stages * 2 * geo.tile * row + 4 * decode.IDS_WINDOW <= 227 * 1024
    assert f"kIdsWindow = {decode.IDS_WINDOW};" in source.text("decode.cu")


def test_source_text_inlines_local_headers_once():
    code = source.text("decode.cu")
    assert '#include "' not in code and "#pragma once" not in code
    assert code.count("struct Vec16") == 1 and "#include <cuda_fp16.h>" in code


@pytest.mark.parametrize("short", [False, True])
def test_every_supported_config_meets_the_kernel_static_asserts(short):
    """Mirror of DecodeShape's static_asserts for all 600 configurations (the compile check builds a sweep)."""
    for dtype in configs.CUDA_TYPES:
        for h in configs.HEAD_DIMS:
            for g in configs.GROUPS:
                cfg = Config(dtype, h, 16, g)
                geo = decode.geometry(cfg, short)
                row_vecs = h * cfg.itemsize // 16
                lane_groups = geo.threads // geo.lanes
                assert geo.lanes & (geo.lanes - 1) == 0 and geo.lanes <= 32
                assert -(-row_vecs // geo.lanes) <= 4
                assert geo.tile % lane_groups == 0
                assert lane_groups * g * (h + 2) * 4 <= geo.smem_bytes <= 227 * 1024
