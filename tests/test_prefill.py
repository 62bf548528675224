"""Prefill attention on the host: the float64 reference against a naive loop, the NumPy path of the launcher,
the work items, the kernel's instances, every argument check (runs in CI)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_cases import PrefillCase, naive_prefill, rel_error
from pagedrt import PagedKVCache, source
from pagedrt.attention import PrefillPlan, paged_decode, paged_prefill, planner, prefill, prefill_sm90, reference
from pagedrt.errors import BlockTableError, LaunchArgumentError, UnsupportedConfigError
from pagedrt.kernels import configs, write_kv
from pagedrt.supported import HEAD_DIMS, PREFILL_HEAD_DIMS
from pagedrt.kernels.configs import Config
from pagedrt.supported import FP8_HEAD_DIMS

BASE = Config("float16", 128, 16, 4)
TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2}


def rows(bs):
    """(prefix, new) per sequence: every prefix around a block, empty and one-token rows, a long one."""
    return [(0, 9), (1, 1), (bs - 1, 5), (5, 0), (bs, 17), (bs + 1, 3), (0, 1), (3 * bs + 7, 40)]


def case_of(cfg, spec, **kwargs):
    return PrefillCase(cfg, [p for p, _ in spec], [n for _, n in spec], **kwargs)


def naive(case, causal=True, scale=None):
    scale = 1 / math.sqrt(case.cfg.head_dim) if scale is None else scale
    return naive_prefill(case.q, case.k, case.v, case.table, case.lens, case.qo_indptr, scale, causal)


# --- the reference ------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [8, 16, 128])
@pytest.mark.parametrize("group", [1, 3, 8, 40])
@pytest.mark.parametrize("causal", [True, False])
def test_reference_matches_a_naive_loop(block_size, group, causal):
    case = case_of(Config("float32", 64, block_size, group), rows(block_size), seed=block_size + group)
    out = reference.prefill(case.q, case.k, case.v, case.table, case.lens, case.qo_indptr, 0.2, causal)
    assert out.dtype == np.float32 and out.shape == case.q.shape
    assert rel_error(out, naive(case, causal, 0.2)) < 1e-6


def test_reference_of_one_token_rows_is_decode():
    """A causal row of one query over all its keys is a decode row."""
    case = case_of(Config("float32", 64, 16, 4), [(0, 1), (40, 1), (15, 1)])
    out = reference.prefill(case.q, case.k, case.v, case.table, case.lens, case.qo_indptr)
    assert rel_error(out, paged_decode(case.q, case.k, case.v, case.table, case.lens)) < 1e-6


def test_reference_of_a_chunk_is_the_end_of_the_whole_prompt():
    """A chunk after P cached tokens gives the rows a whole-prompt prefill gives its last tokens."""
    case = case_of(Config("float32", 64, 16, 2), [(0, 50)])
    whole = reference.prefill(case.q, case.k, case.v, case.table, case.lens, case.qo_indptr)
    chunk = reference.prefill(case.q[30:], case.k, case.v, case.table, case.lens, np.array([0, 20], np.int32))
    assert rel_error(chunk, whole[30:]) < 1e-12


# --- the launcher's NumPy path ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_paged_prefill_on_the_host_is_the_reference(dtype, head_dim, causal):
    case = case_of(Config(dtype, head_dim, 16, 4), rows(16), seed=head_dim)
    out = np.full(case.q.shape, 7, case.q.dtype)
    assert paged_prefill(case.q, case.k, case.v, case.table, case.lens, case.qo_indptr, out=out, causal=causal,
                         query_lens=case.query_lens) is out
    assert np.array_equal(out, reference.prefill(case.q, case.k, case.v, case.table, case.lens, case.qo_indptr,
                                                 causal=causal))
    assert rel_error(out, naive(case, causal)) < TOLERANCE[dtype]


def test_plan_runs_each_layer():
    case = case_of(BASE, rows(16))
    case.buffer[:, :, 0] = (case.buffer[:, :, 1].astype(np.float32) * -0.5).astype(case.buffer.dtype)
    plan = PrefillPlan(case.q, case.buffer[:, 0, 0], case.table, case.lens, case.qo_indptr, scale=0.1)
    outs = []
    for layer in (0, 1):
        k, v = case.buffer[:, 0, layer], case.buffer[:, 1, layer]
        outs.append(plan.run(case.q, k, v))
        assert np.array_equal(outs[-1], paged_prefill(case.q, k, v, case.table, case.lens, case.qo_indptr,
                                                      scale=0.1))
    assert np.isfinite(outs[0].astype(np.float32)).all() and not np.array_equal(outs[0], outs[1])


@settings(max_examples=30, deadline=None)
@given(spec=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 40)), min_size=1, max_size=5),
       block_size=st.sampled_from([8, 32]), group=st.sampled_from([1, 2, 5, 8, 24, 64]), causal=st.booleans(),
       seed=st.integers(0, 100))
def test_ragged_batches_property(spec, block_size, group, causal, seed):
    spec = [(p + (p + n == 0), n) for p, n in spec]  # every sequence holds a key
    case = case_of(Config("float16", 64, block_size, group), spec, kv_heads=1, seed=seed)
    out = paged_prefill(case.q, case.k, case.v, case.table, case.lens, case.qo_indptr, causal=causal)
    assert out.shape == case.q.shape
    if out.size:
        assert rel_error(out, naive(case, causal)) < TOLERANCE["float16"]


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_a_cache_holds_only_the_head_dims_prefill_attends(head_dim):
    """Decode attends every head dim of HEAD_DIMS; a cache, which prompts fill, those prefill attends too: the
    others are refused when the cache is made, not at its first prompt."""
    if head_dim not in PREFILL_HEAD_DIMS:
        with pytest.raises(UnsupportedConfigError, match=f"head_dim={head_dim} is not supported: use one of 64, 128"):
            PagedKVCache(2, 2, head_dim, 16, "float16", max_tokens=256, backend="host")
        return
    with PagedKVCache(2, 2, head_dim, 16, "float16", max_tokens=256, backend="host") as cache:
        step = cache.step(arrivals=[np.arange(20)])
        q = np.random.default_rng(0).standard_normal((20, 4, head_dim)).astype(np.float16)
        plan = PrefillPlan(q, cache.k(0), step.block_tables, step.seq_lens, step.qo_indptr, query_lens=step.query_lens)
        assert plan.run(q, cache.k(0), cache.v(0)).shape == q.shape


def test_a_cache_step_then_write_kv_then_a_plan_per_layer():
    """The call sequence of a prefill step on the host backend, per step (a step's arrays hold until the next):
    a prompt; a chunk of another beside a decode token; the chunk's rest beside another decode token."""
    rng = np.random.default_rng(5)
    with PagedKVCache(2, 2, 64, 16, "float16", max_tokens=4096, backend="host") as cache:
        schedule = [lambda: cache.step(arrivals=[np.arange(1000, 1030)]),
                    lambda: cache.step(arrivals=[np.arange(70)], arrival_tokens=[40]),
                    lambda: cache.step(None, [1, 30])]
        for make, query_lens, kv_lens in zip(schedule, ([30], [1, 40], [1, 30]), ([30], [31, 40], [32, 70])):
            step = make()
            assert step.query_lens.tolist() == query_lens and step.seq_lens.tolist() == kv_lens
            q = rng.standard_normal((step.num_tokens, 8, 64)).astype(np.float16)
            plan = PrefillPlan(q, cache.k(0), step.block_tables, step.seq_lens, step.qo_indptr,
                               query_lens=step.query_lens)
            for layer in range(2):
                k_new, v_new = rng.standard_normal((2, step.num_tokens, 2, 64)).astype(np.float16)
                write_kv(k_new, v_new, cache.k(layer), cache.v(layer), step.slot_mapping)
                out = plan.run(q, cache.k(layer), cache.v(layer))
                ref = naive_prefill(q, cache.k(layer), cache.v(layer), step.block_tables, step.seq_lens,
                                    step.qo_indptr, 1 / 8)
                assert rel_error(out, ref) < TOLERANCE["float16"]


# --- a mixed step: which rows the decode kernel takes ----------------------------------------------------

PLACEMENTS = {  # (prefix, new) per sequence: a mixed step's decode rows (one new token) placed among prompts
    "decodes first": [(40, 1), (17, 1), (0, 30), (5, 9)],
    "decodes last": [(0, 30), (5, 9), (40, 1), (17, 1)],
    "interleaved": [(40, 1), (0, 30), (17, 1), (3, 0), (5, 9), (2, 1)],
    "all decodes": [(40, 1), (17, 1), (0, 1)],
    "no decodes": [(0, 30), (5, 9), (3, 0)],
}


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("group", [1, 4, 8, 9, 40])
def test_the_decode_kernel_takes_the_one_token_rows_at_every_group(placement, group):
    spec = PLACEMENTS[placement]
    case = case_of(Config("float16", 64, 16, group), spec, kv_heads=1, seed=group)
    plan = PrefillPlan(case.q, case.k, case.table, case.lens, case.qo_indptr, query_lens=case.query_lens)
    ones = [b for b, (_, n) in enumerate(spec) if n == 1]
    assert plan.decode_rows.dtype == np.int64
    assert plan.decode_rows.tolist() == ones
    assert planner.decode_rows(case.query_lens).tolist() == plan.decode_rows.tolist()
    out = plan.run(case.q, case.k, case.v)
    assert np.array_equal(out, reference.prefill(case.q, case.k, case.v, case.table, case.lens, case.qo_indptr))


def test_decode_rows_fill_at_most_one_grid_dimension():
    rows = planner.decode_rows(np.ones(planner.MAX_DECODE_ROWS + 5, np.int64))
    assert rows.tolist() == list(range(planner.MAX_DECODE_ROWS))
    assert planner.decode_rows(np.array([], np.int64)).size == 0


@settings(max_examples=100, deadline=None)
@given(counts=st.lists(st.integers(0, 3), max_size=10), group=st.integers(1, 12))
def test_the_prefill_items_leave_out_exactly_the_decode_rows(counts, group):
    """Every packed row of a row the decode kernel does not take is in one item; those it takes are in none."""
    decoded = planner.decode_rows(np.array(counts, np.int64))
    items = planner.prefill_items(np.array(counts, np.int64), group, 16, skip=decoded)
    assert set(items[:, 0].tolist()) == {b for b, n in enumerate(counts) if n and b not in decoded.tolist()}
    full = planner.prefill_items(np.array(counts, np.int64), group, 16)
    kept = full[~np.isin(full[:, 0], decoded)]
    assert np.array_equal(items, kept)  # the same items, starts and order as without the decode rows


@given(sms=st.integers(1, 1000))
def test_a_mixed_prompt_takes_its_share_of_the_sms(sms):
    blocks = planner.mixed_prompt_blocks(sms)
    assert 1 <= blocks <= sms and blocks == math.ceil(planner.MIXED_PROMPT_SHARE * sms)
    with pytest.raises(LaunchArgumentError):
        planner.mixed_prompt_blocks(0)


def test_workspace_errors(case):
    with pytest.raises(LaunchArgumentError, match="workspace must be a contiguous 1-D uint8"):
        PrefillPlan(case.q, case.k, case.table, case.lens, case.qo_indptr, workspace=np.zeros(8, np.float32))
    with pytest.raises(LaunchArgumentError, match="NumPy or CuPy"):
        PrefillPlan(case.q, case.k, case.table, case.lens, case.qo_indptr, workspace=[0] * 8)


# --- work items, instances, geometry -------------------------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(counts=st.lists(st.integers(0, 300), max_size=8), group=st.integers(1, 64),
       tile=st.sampled_from([16, 64]))
def test_work_items_cover_every_packed_row_once(counts, group, tile):
    items = planner.prefill_items(np.array(counts, np.int64), group, tile)
    assert items.dtype == np.int32 and items.shape[1] == 4
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    covered = {b: [] for b in range(len(counts))}
    for b, first, n, p in items.tolist():
        assert (first, n) == (starts[b], counts[b]) and p % tile == 0 and 0 <= p < n * group
        covered[b].extend(range(p, min(p + tile, n * group)))
    assert all(sorted(covered[b]) == list(range(counts[b] * group)) for b in covered)
    # a sequence at a time, those with more queries first (the earlier among equals), its later tiles first
    seqs = items[:, 0]
    firsts = [b for i, b in enumerate(seqs.tolist()) if i == 0 or seqs[i - 1] != b]
    assert len(firsts) == len(set(firsts))  # each sequence's items adjacent
    assert firsts == sorted(firsts, key=lambda b: (-counts[b], b))
    for b in firsts:
        assert (np.diff(items[seqs == b, 3]) < 0).all()


def test_instances_name_every_prefill_capable_config_of_the_sweep():
    names = prefill.instances()["prefill.cu"]
    capable = [c for c in configs.sweep() + configs.fp8_sweep()
               if c.dtype != "float32" and c.head_dim in PREFILL_HEAD_DIMS]
    assert set(names) == {prefill.kernel_name(c) for c in capable}
    assert set(prefill.instances()["prefill_sm90.cu"]) == {prefill_sm90.kernel_name(c) for c in capable}
    for cfg in capable:
        geo = planner.prefill_geometry(cfg)
        assert prefill.kernel_name(cfg).startswith("pagedrt::prefill_fp8<" if cfg.fp8 else "pagedrt::prefill<")
        args = prefill.kernel_name(cfg).split("<")[1][:-1].split(", ")
        assert args == [cfg.cuda_type, *map(str, (cfg.head_dim, cfg.block_size, geo.threads, geo.tile_m,
                                                  geo.tile_n, geo.stages))]


@pytest.mark.parametrize("dtype", planner.PREFILL_DTYPES)
@pytest.mark.parametrize("head_dim", PREFILL_HEAD_DIMS)
def test_prefill_geometry_meets_the_kernel_static_asserts(dtype, head_dim):
    """Mirror of PrefillShape's static_asserts; shared memory fits an H100/H200 thread block (227 KiB)."""
    geo = planner.prefill_geometry(Config(dtype, head_dim, 16, 4))
    row_vecs = head_dim * 2 // 16
    rows_per_round = geo.threads // row_vecs
    assert geo.tile_m == 16 * geo.threads // 32 and geo.tile_n % 16 == 0 and row_vecs % 8 == 0
    assert geo.threads % row_vecs == 0 and geo.tile_n % rows_per_round == 0 and geo.tile_m % rows_per_round == 0
    assert geo.stages >= 2 and geo.smem_bytes == (2 * geo.stages * geo.tile_n + geo.tile_m) * head_dim * 2
    assert geo.smem_bytes <= 227 * 1024
    if head_dim in FP8_HEAD_DIMS:  # FP8 K/V: stages of head_dim-byte rows, a whole number of copy rounds
        fp8 = planner.prefill_geometry(Config(dtype, head_dim, 16, 4, "float8_e4m3"))
        kv_vecs = head_dim // 16
        assert (kv_vecs % 8 == 0 or kv_vecs == 4) and geo.threads % kv_vecs == 0
        assert fp8.tile_n % (fp8.threads // kv_vecs) == 0
        assert fp8.smem_bytes == 2 * fp8.stages * fp8.tile_n * head_dim + fp8.tile_m * head_dim * 2


def test_sm90_instances_name_every_capable_config_and_a_device_gets_its_own():
    """Compute capability 9.0 compiles the sm_90a kernels only (FP8's twin too): the mma.sync one runs there for a
    scale of 0 or below alone."""
    capable = [c for c in configs.sweep() + configs.fp8_sweep()
               if c.dtype != "float32" and c.head_dim in PREFILL_HEAD_DIMS]
    both = prefill.instances()
    assert set(both[prefill_sm90.FILE]) == {prefill_sm90.kernel_name(c) for c in capable}
    for cfg in capable:
        geo = planner.prefill_sm90_geometry(cfg)
        name, args = prefill_sm90.kernel_name(cfg)[:-1].split("<")
        assert name == ("pagedrt::prefill_sm90_fp8" if cfg.fp8 else "pagedrt::prefill_sm90")
        assert args.split(", ") == [cfg.cuda_type, str(cfg.head_dim), str(geo.tile_n), str(geo.stages)] + (
            [str(geo.staging)] if cfg.fp8 else [])
        assert (geo.staging > 0) == cfg.fp8
    assert prefill.instances(capability="90") == {prefill_sm90.FILE: both[prefill_sm90.FILE]}
    assert prefill.instances(capability="80") == {prefill.FILE: both[prefill.FILE]}
    assert prefill.instances(capable, capability="90") == {prefill_sm90.FILE: both[prefill_sm90.FILE]}
    assert source.options(prefill_sm90.FILE) == source.OPTIONS + ("-arch=sm_90a",)
    assert source.options(prefill.FILE) == source.options("decode.cu") == source.OPTIONS


@pytest.mark.parametrize("dtype", planner.PREFILL_DTYPES)
@pytest.mark.parametrize("head_dim", PREFILL_HEAD_DIMS)
def test_prefill_sm90_geometry_meets_the_kernel_static_asserts(dtype, head_dim):
    """Mirror of PrefillSm90Shape's static_asserts and of the producer's copy split; shared memory (dynamic, and
    the static mbarriers) fits a thread block on compute capability 9.0 (227 KiB)."""
    geo = planner.prefill_sm90_geometry(Config(dtype, head_dim, 16, 4))
    rows_per_round = 128 // (head_dim // 8)  # rows the producer warpgroup's 16-byte copies cover at once
    rows_per_thread = geo.tile_n // rows_per_round
    assert (geo.threads, geo.tile_m) == (384, 128) and head_dim % 64 == 0
    assert geo.tile_n % 16 == 0 and 64 <= geo.tile_n <= 256 and geo.tile_n % rows_per_round == 0
    assert rows_per_thread % 8 == 0 and rows_per_thread <= 16 and geo.stages >= 2
    assert geo.smem_bytes == (geo.tile_m + 2 * geo.stages * geo.tile_n) * head_dim * 2 + 1024
    assert geo.smem_bytes + 8 * (1 + 4 * geo.stages) <= 227 * 1024
    if head_dim in FP8_HEAD_DIMS:  # the FP8 twin: f16 stages, then staging slots of e4m3 K and V
        fp8 = planner.prefill_sm90_geometry(Config(dtype, head_dim, 16, 4, "float8_e4m3"))
        assert (fp8.threads, fp8.tile_m, fp8.tile_n) == (geo.threads, geo.tile_m, geo.tile_n)
        assert 2 <= fp8.stages <= geo.stages and 2 <= fp8.staging <= 4
        assert fp8.tile_n % (128 // (head_dim // 16)) == 0  # whole copy rounds of 16-byte e4m3 chunks
        assert fp8.smem_bytes == ((fp8.tile_m + 2 * fp8.stages * fp8.tile_n) * head_dim * 2
                                  + fp8.staging * 2 * fp8.tile_n * head_dim + 1024)
        assert fp8.smem_bytes + 8 * (2 + 4 * fp8.stages + 2) + 16 <= 227 * 1024
        # no room for one more stage beside the staging slots, nor (under the cap) one more slot
        room = 227 * 1024 - fp8.smem_bytes
        assert fp8.stages == 4 or room + (fp8.staging - 2) * 2 * fp8.tile_n * head_dim < 4 * fp8.tile_n * head_dim
        assert fp8.staging == 4 or room < 2 * fp8.tile_n * head_dim


# --- argument checks -----------------------------------------------------------------------------------

@pytest.fixture
def case():
    return case_of(BASE, [(0, 5), (3, 2), (20, 7)])


def offsets(*values):
    return np.array(values, np.int32)


@pytest.mark.parametrize("mutate, error, words", [
    (lambda c: dict(q=[[1.0]]), LaunchArgumentError, "NumPy or CuPy"),
    (lambda c: dict(q=c.q[0]), LaunchArgumentError, "3-D"),
    (lambda c: dict(q=c.q[:, ::2]), LaunchArgumentError, "C-contiguous"),
    (lambda c: dict(q=c.q.astype(np.float32)), LaunchArgumentError, "must match"),
    (lambda c: dict(q=c.q[:, :, :64].copy()), LaunchArgumentError, "head_dim"),
    (lambda c: dict(q=c.q[:, :7].copy()), LaunchArgumentError, "multiple"),
    (lambda c: dict(q=np.concatenate([c.q] * 17, axis=1)), UnsupportedConfigError, "group.*64"),
    (lambda c: dict(k_cache=c.k[..., None]), LaunchArgumentError, "4-D"),
    (lambda c: dict(v_cache=c.v[:-1]), LaunchArgumentError, "same shape and block stride"),
    (lambda c: dict(block_tables=c.table.astype(np.int64)), LaunchArgumentError, "int32"),
    (lambda c: dict(block_tables=c.table[:, ::2]), LaunchArgumentError, "contiguous columns"),
    (lambda c: dict(kv_lens=c.lens[:2]), LaunchArgumentError, "one length per block-table row"),
    (lambda c: dict(kv_lens=c.lens.astype(np.int64)), LaunchArgumentError, "int32"),
    (lambda c: dict(qo_indptr=c.qo_indptr[:3]), LaunchArgumentError, "4 offsets"),
    (lambda c: dict(qo_indptr=c.qo_indptr.astype(np.int64)), LaunchArgumentError, "int32"),
    (lambda c: dict(qo_indptr=offsets(1, 5, 7, 14)), LaunchArgumentError, r"qo_indptr\[0\] = 1"),
    (lambda c: dict(qo_indptr=offsets(0, 8, 7, 14)), LaunchArgumentError, r"decreases at 2 \(8 -> 7\)"),
    (lambda c: dict(qo_indptr=offsets(0, 5, 7, 13)), LaunchArgumentError, r"qo_indptr\[3\] = 13 but q has 14"),
    (lambda c: dict(query_lens=np.array([5, 3, 6])), LaunchArgumentError, r"qo_indptr\[2\] = 7 but query_lens"),
    (lambda c: dict(query_lens=np.array([5, 2])), LaunchArgumentError, "3 counts"),
    (lambda c: dict(query_lens=np.array([5, -2, 11])), LaunchArgumentError, r"query_lens\[1\] is negative"),
    (lambda c: dict(query_lens=[5, 2, 7]), LaunchArgumentError, "NumPy integer array"),
    (lambda c: dict(query_lens=np.array([5, 2, 7.0])), LaunchArgumentError, "NumPy integer array"),
    (lambda c: dict(out=np.empty((14, 8, 128), np.float32)), LaunchArgumentError, "out must be"),
    (lambda c: dict(block_mask=np.ones(3, bool)), LaunchArgumentError, "block_mask"),
    (lambda c: dict(scale=float("inf")), LaunchArgumentError, "finite"),
])
def test_argument_errors(case, mutate, error, words):
    out = np.full(case.q.shape, 7, case.q.dtype)
    args = dict(q=case.q, k_cache=case.k, v_cache=case.v, block_tables=case.table, kv_lens=case.lens,
                qo_indptr=case.qo_indptr, out=out)
    args.update(mutate(case))
    with pytest.raises(error, match=words):
        paged_prefill(**args)
    assert (out == 7).all()


@pytest.mark.parametrize("row, length, words", [
    (1, 1, r"kv_lens\[1\] = 1 is less than the row's 2 query tokens"),
    (2, 0, r"kv_lens\[2\] = 0 is outside \[1, 32\]"),
    (0, 33, r"kv_lens\[0\] = 33 is outside \[1, 32\]"),
])
def test_bad_lengths_raise_block_table_errors(case, row, length, words):
    lens = case.lens.copy()
    lens[row] = length
    with pytest.raises(BlockTableError, match=words) as info:
        PrefillPlan(case.q, case.k, case.table, lens, case.qo_indptr, validate=False)  # NumPy: always checked
    assert (info.value.row, info.value.length) == (row, length)


def test_bad_block_id_and_mask_are_refused(case):
    table = case.table.copy()
    table[2, 1] = len(case.k)
    with pytest.raises(BlockTableError, match=r"block_tables\[2, 1\]"):
        paged_prefill(case.q, case.k, case.v, table, case.lens, case.qo_indptr)
    mask = np.ones(len(case.k), np.uint8)
    mask[case.table[1, 0]] = 0
    with pytest.raises(BlockTableError, match=r"block_tables\[1, 0\].*block_mask"):
        paged_prefill(case.q, case.k, case.v, case.table, case.lens, case.qo_indptr, block_mask=mask)


@pytest.mark.parametrize("dtype, head_dim, words", [("float32", 128, "dtype .*float16, bfloat16"),
                                                    ("float16", 80, "head_dim .*64, 128, 256"),
                                                    ("bfloat16", 96, "head_dim")])
def test_configurations_off_the_tensor_core_path_are_refused(dtype, head_dim, words):
    c = case_of(Config(dtype, head_dim, 16, 2), [(3, 2)])
    with pytest.raises(UnsupportedConfigError, match=words):
        paged_prefill(c.q, c.k, c.v, c.table, c.lens, c.qo_indptr)


def test_unsupported_block_size_names_the_value():
    buf = np.zeros((4, 2, 24, 128), np.float16)
    with pytest.raises(UnsupportedConfigError, match="block_size=24"):
        paged_prefill(np.zeros((1, 8, 128), np.float16), buf, buf, np.zeros((1, 1), np.int32), np.ones(1, np.int32),
                      offsets(0, 1))


@pytest.mark.parametrize("mutate, words", [
    (lambda c: dict(q=c.q[:3].copy()), "q must be"),
    (lambda c: dict(k_cache=c.k.copy()), "must match the plan's K plane"),
    (lambda c: dict(v_cache=c.v.astype(np.float32)), "must match"),
    (lambda c: dict(out=np.empty((14, 8, 64), c.q.dtype)), "out must be"),
])
def test_plan_run_refuses_arrays_unlike_the_plans(case, mutate, words):
    plan = PrefillPlan(case.q, case.k, case.table, case.lens, case.qo_indptr)
    args = dict(q=case.q, k_cache=case.k, v_cache=case.v)
    args.update(mutate(case))
    with pytest.raises(LaunchArgumentError, match=words):
        plan.run(**args)
