"""The attention package on the host: the float64 references against naive loops, the planner, every
launcher check (the NumPy path; runs in CI)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_cases import (Case, Reproducer, check_closed_cache_refuses_decode, naive_attention, np_dtype,  # noqa: F401
                          rel_error, stale_table)
from pagedrt import Pool
from pagedrt.attention import (ContiguousDecodePlan, DecodePlan, SplitPlan, contiguous_decode, paged_decode,
                               plan_splits, reference, workspace_bytes)
from pagedrt.attention import decode, planner
from pagedrt.errors import BlockTableError, LaunchArgumentError, UnsupportedConfigError
from pagedrt.kernels import configs
from pagedrt.kernels.configs import BASE, Config


def lengths(bs):
    return [1, bs - 1, bs, bs + 1, 1000] if bs > 2 else [1, bs, bs + 1, 1000]


# --- references -------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [8, 16, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_paged_reference_matches_naive_attention(block_size, group):
    case = Case(Config("float32", 64, block_size, group), lengths(block_size), seed=block_size + group)
    out = paged_decode(case.q, case.k, case.v, case.table, case.lens)
    ref = naive_attention(case.q, case.k, case.v, case.table, case.lens, 1 / math.sqrt(64))
    assert out.dtype == np.float32 and out.shape == case.q.shape
    assert rel_error(out, ref) < 1e-6
    assert np.isfinite(out).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_reference_returns_the_query_dtype(dtype):
    case = Case(Config(dtype, 128, 16, 4), [5, 40])
    out = paged_decode(case.q, case.k, case.v, case.table, case.lens, scale=0.3)
    ref = naive_attention(case.q, case.k, case.v, case.table, case.lens, 0.3)
    assert out.dtype == np_dtype(dtype)
    assert rel_error(out, ref) < (2e-3 if dtype == "float16" else 1e-2)


@pytest.mark.parametrize("num_splits", [None, 3])
def test_contiguous_baseline_reference_equals_paged_reference(num_splits):
    case = Case(Config("float32", 80, 16, 2), lengths(16))
    k, v = case.contiguous()
    paged = paged_decode(case.q, case.k, case.v, case.table, case.lens, num_splits=num_splits)
    assert np.array_equal(contiguous_decode(case.q, k, v, case.lens, num_splits=num_splits), paged)


def test_contiguous_plan_runs_per_layer_and_refuses_unlike_arrays():
    case = Case(Config("float32", 64, 16, 4), lengths(16))
    k, v = case.contiguous()
    plan = ContiguousDecodePlan(case.q, k, case.lens, num_splits=2)
    assert plan.split.num_splits == 2
    for layer_k, layer_v in ((k, v), (v, k)):  # two "layers" over the same lengths
        assert np.array_equal(plan.run(case.q, layer_k, layer_v),
                              contiguous_decode(case.q, layer_k, layer_v, case.lens, num_splits=2))
    with pytest.raises(LaunchArgumentError, match="must match the plan's k"):
        plan.run(case.q, k[:, :1].copy(), v)
    with pytest.raises(LaunchArgumentError, match="must be 5-D"):
        ContiguousDecodePlan(case.q, case.k, case.lens)


@pytest.mark.parametrize("num_splits", [2, 7, 64])
def test_split_reference_equals_unsplit_with_empty_segments(num_splits):
    case = Case(Config("float32", 64, 16, 4), [1, 17, 1000, 300])
    whole = paged_decode(case.q, case.k, case.v, case.table, case.lens)
    split = paged_decode(case.q, case.k, case.v, case.table, case.lens, num_splits=num_splits)
    assert rel_error(split, whole) < 1e-6


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(1, 200), min_size=1, max_size=4), num_splits=st.integers(1, 20),
       block_size=st.sampled_from([8, 32]))
def test_split_reference_property(lens, num_splits, block_size):
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
    merged = reference.merge_partials(np.stack(m), np.stack(l), np.stack(o))
    p = np.exp(scores - scores.max(axis=1, keepdims=True))
    assert np.allclose(merged, np.einsum("hn,hnd->hd", p / p.sum(axis=1, keepdims=True), values), rtol=1e-12)


def naive_causal(q, k, v, scale, offset):
    """Row by row, head by head: query row i (position offset + i) over keys 0..offset+i; None: all keys."""
    rows, q_heads, d = q.shape
    group = q_heads // k.shape[0]
    out = np.empty((rows, q_heads, d))
    for i in range(rows):
        seen = k.shape[1] if offset is None else offset + i + 1
        for h in range(q_heads):
            s = np.array([k[h // group, t] @ q[i, h] for t in range(seen)]) * scale
            p = np.exp(s - s.max())
            out[i, h] = sum(p[t] * v[h // group, t] for t in range(seen)) / p.sum()
    return out


@pytest.mark.parametrize("rows, keys, offset", [(1, 9, None), (1, 9, 8), (5, 12, 7), (6, 6, 0), (4, 30, 3)])
@pytest.mark.parametrize("segments", [None, [(0, 4), (4, 4), (4, 11), (11, 30)]])
def test_attend_causal_with_an_offset_matches_a_naive_loop(rows, keys, offset, segments):
    rng = np.random.default_rng(rows * 100 + keys)
    q = rng.standard_normal((rows, 6, 16))
    k, v = rng.standard_normal((2, 2, keys, 16))
    cut = None if segments is None else [(min(a, keys), min(b, keys)) for a, b in segments[:-1]] + \
        [(min(segments[-1][0], keys), keys)]
    out = reference.attend(q, k, v, 0.25, causal_offset=offset, segments=cut)
    assert out.shape == q.shape and out.dtype == np.float64
    assert np.allclose(out, naive_causal(q, k, v, 0.25, offset), rtol=1e-12, atol=1e-12)


def test_attend_causal_mask_aligns_bottom_right():
    """The last query row of a causal block sees every key: decode is causal attention of one row."""
    rng = np.random.default_rng(1)
    q, (k, v) = rng.standard_normal((3, 4, 8)), rng.standard_normal((2, 2, 10, 8))
    causal = reference.attend(q, k, v, 0.3, causal_offset=10 - 3)
    assert np.allclose(causal[-1], reference.attend(q[-1:], k, v, 0.3)[0], rtol=1e-12)
    assert not np.allclose(causal[0], reference.attend(q[:1], k, v, 0.3)[0])


def test_references_run_on_host_pool_views():
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


# --- the split plan ---------------------------------------------------------------------

WORKLOADS = {"long-1": (1, 32768), "b8": (8, 8192), "b32": (32, 4096), "b64": (64, 2048), "b128": (128, 1024),
             "b256": (256, 512), "big": (64, 8192)}
RESIDENT, TILE, PER_TOKEN = 132 * 3, 32, 2 * 128 * 2


def covers_once(plan, length):
    """The plan's segments of a sequence of ``length`` tokens cover each token exactly once, in order."""
    segments = plan.segments(length)
    tokens = [t for a, b in segments for t in range(a, b)]
    return len(segments) == plan.num_splits and tokens == list(range(length))


@pytest.mark.parametrize("case", sorted(WORKLOADS))
def test_plan_fills_the_device_without_tiny_segments(case):
    batch, max_len = WORKLOADS[case]
    plan = plan_splits(batch, 8, max_len, TILE, PER_TOKEN, RESIDENT)
    assert plan.segment_tokens % TILE == 0
    assert (plan.num_splits - 1) * plan.segment_tokens < max_len <= plan.num_splits * plan.segment_tokens
    assert 1 <= plan.num_splits and batch * 8 * plan.num_splits <= max(RESIDENT, batch * 8)
    assert plan.num_splits == 1 or plan.segment_tokens * PER_TOKEN >= planner.MIN_SEGMENT_BYTES
    if batch * 8 < RESIDENT // 2:
        assert plan.num_splits > 1
    assert all(covers_once(plan, n) for n in (1, max_len // 3, max_len - 1, max_len))


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(0, 300), kv_heads=st.integers(1, 8), max_len=st.integers(1, 40000),
       tile=st.sampled_from([8, 16, 32, 64]), resident=st.integers(1, 1200),
       mean=st.one_of(st.none(), st.floats(1, 40000)), requested=st.one_of(st.none(), st.integers(1, 300)),
       forced=st.sampled_from([None, "standard", "short"]), data=st.data())
def test_plan_property(batch, kv_heads, max_len, tile, resident, mean, requested, forced, data):
    """Whatever the workload: whole tiles, every token of every length covered once, a requested count and
    geometry kept, and the short geometry only for many short segments."""
    plan = plan_splits(batch, kv_heads, max_len, tile, PER_TOKEN, resident, num_splits=requested,
                       mean_seq_len=mean, geometry=forced)
    assert plan.segment_tokens % tile == 0 and plan.segment_tokens >= 1
    assert plan.num_splits == requested if requested else 1 <= plan.num_splits <= max(1, -(-max_len // tile))
    if not requested:
        assert plan.num_splits == 1 or (plan.num_splits - 1) * plan.segment_tokens < max_len
    assert covers_once(plan, data.draw(st.integers(1, max_len)))
    if forced:
        assert plan.geometry == forced
    elif plan.geometry == "short":
        assert plan.segment_tokens <= planner.SHORT_TILES * tile
        assert batch * kv_heads * plan.num_splits > planner.SHORT_WAVES * resident


def test_plan_splits_a_full_batch_only_when_lengths_are_uneven():
    resident = 264
    even = plan_splits(64, 8, 8192, TILE, PER_TOKEN, resident, mean_seq_len=8192)
    uneven = plan_splits(64, 8, 8192, TILE, PER_TOKEN, resident, mean_seq_len=4100)
    assert even.num_splits == 1
    assert uneven.num_splits > 1 and abs(uneven.segment_tokens - 4100 / 4) <= TILE  # about a quarter of the mean
    assert uneven.geometry == "standard"  # segments cut for unevenness are not the many-short-segments case
    tiny_mean = plan_splits(64, 8, 8192, TILE, PER_TOKEN, resident, mean_seq_len=100)
    assert tiny_mean.segment_tokens * PER_TOKEN >= planner.MIN_SEGMENT_BYTES
    # a batch that leaves the device room (twice the resident blocks of above) is cut as finely when uneven,
    # not just once: one wave of whole sequences would still end with the longest alone
    roomy = plan_splits(64, 8, 8192, TILE, PER_TOKEN, 2 * resident, mean_seq_len=4100)
    assert (roomy.num_splits, roomy.segment_tokens) == (uneven.num_splits, uneven.segment_tokens)
    assert plan_splits(64, 8, 8192, TILE, PER_TOKEN, 2 * resident, mean_seq_len=8192).num_splits == 1


def test_split_plans_fill_an_sm_with_the_bytes_in_flight_it_needs():
    """Sequences are cut to give each SM blocks whose pipelines hold SPLIT_SM_BYTES: one fp16 block at head_dim 128
    (96 KiB of stages), so 128 blocks on 132 SMs stay whole and b8's 64 are cut in two, not four; two of FP8's
    narrow kernel (48 KiB), so FP8's b8 is cut in four; never more than SPLIT_BLOCKS_PER_SM, so a kernel four of
    whose blocks fit (FP8's) leaves b32's 256 blocks whole rather than cut in two to fill 528 slots."""
    fp16, fp8 = 96 << 10, 48 << 10
    assert planner.split_residency(264, 132, fp16) == 132 and planner.split_residency(100, 132, fp16) == 100
    assert planner.split_residency(528, 132, fp8) == 264 == planner.split_residency(528, 132, 1 << 10)
    assert plan_splits(64, 2, 4096, TILE, PER_TOKEN, planner.split_residency(264, 132, fp16)).num_splits == 1
    assert plan_splits(8, 8, 8192, TILE, PER_TOKEN, planner.split_residency(264, 132, fp16)).num_splits == 2
    resident = planner.split_residency(528, 132, fp8)
    assert plan_splits(8, 8, 8192, TILE, PER_TOKEN // 2, resident).num_splits == 4
    assert plan_splits(32, 8, 4096, TILE, PER_TOKEN // 2, resident).num_splits == 1
    assert plan_splits(32, 8, 4096, TILE, PER_TOKEN // 2, 528).num_splits == 2


def test_the_short_geometry_counts_waves_of_every_resident_block():
    """b64 over FP8 (512 thread blocks, four of the standard geometry's an SM, split plans counting two) is one
    wave of the standard geometry: it keeps it; b128 (1024) is two, and takes the short one."""
    resident = planner.split_residency(528, 132, 48 << 10)
    assert plan_splits(64, 8, 2048, 64, PER_TOKEN // 2, resident).geometry == "short"  # waves of two an SM
    assert plan_splits(64, 8, 2048, 64, PER_TOKEN // 2, resident, wave_blocks=528).geometry == "standard"
    assert plan_splits(128, 8, 1024, 64, PER_TOKEN // 2, resident, wave_blocks=528).geometry == "short"


def test_plan_keeps_a_requested_split_count_and_geometry():
    plan = plan_splits(2, 8, 100, 32, 512, 396, num_splits=9)
    assert (plan.num_splits, plan.segment_tokens) == (9, 32)
    assert plan.segments(100)[3:] == [(96, 100)] + [(128 + 32 * i, 128 + 32 * i) for i in range(5)]  # empty
    for forced in planner.GEOMETRIES:
        assert plan_splits(256, 8, 512, 32, 512, 396, geometry=forced).geometry == forced
        assert plan_splits(1, 8, 32768, 32, 512, 396, num_splits=4, geometry=forced).geometry == forced
    assert plan_splits(0, 8, 100, 32, 512, 396) == SplitPlan(1, 128, "standard")  # an empty batch


def test_wide_groups_and_their_split_on_the_sm90a_kernel():
    """Past WIDE_GROUP heads fp16/bf16 decode goes to the sm_90a prefill kernel (at the head dims it takes), cut
    for a thread block per SM into whole key tiles of that kernel."""
    assert not planner.wide_group(Config("float16", 128, 16, planner.WIDE_GROUP))
    assert planner.wide_group(Config("float16", 128, 16, planner.WIDE_GROUP + 1))
    assert planner.wide_group(Config("bfloat16", 64, 8, 64))
    assert not planner.wide_group(Config("bfloat16", 256, 8, 64))  # the sm_90a kernel does not split at 256
    assert not planner.wide_group(Config("float32", 128, 16, 64))
    assert not planner.wide_group(Config("float16", 80, 16, 64))
    assert not planner.wide_group(Config("float16", 128, 16, 64, configs.FP8))
    cfg = Config("float16", 128, 16, 32)
    tile = planner.prefill_sm90_geometry(cfg).tile_n
    one = planner.wide_split(cfg, 1, 8, 32768, 132)
    assert one.geometry == planner.WGMMA and one.num_splits == 16 and one.segment_tokens % tile == 0
    assert planner.wide_split(cfg, 64, 2, 4096, 132).num_splits == 1  # 128 units: one wave unsplit
    for batch in (2, 8, 40):  # never segments shorter than WIDE_SEGMENT_BYTES of K+V
        split = planner.wide_split(cfg, batch, 2, 8192, 132)
        assert split.segment_tokens * 2 * 128 * 2 >= planner.WIDE_SEGMENT_BYTES
    assert planner.wide_split(cfg, 3, 2, 1000, 132, num_splits=5) == SplitPlan(5, 2 * tile, planner.WGMMA)


def test_an_unsplit_decode_of_at_most_32_heads_keeps_the_decode_kernel():
    """wide_kernel: to WIDE_UNSPLIT_GROUP heads the decode kernel's split count decides (1: the decode kernel);
    past it, or at WIDE_GROUP heads and fewer, the count is never asked for."""
    def never():
        raise AssertionError("the decode kernel's split was asked for")

    for group in (planner.WIDE_GROUP + 1, 24, planner.WIDE_UNSPLIT_GROUP):
        cfg = Config("bfloat16", 64, 16, group)
        assert not planner.wide_kernel(cfg, lambda: 1)
        assert planner.wide_kernel(cfg, lambda: 2)
    assert planner.wide_kernel(Config("float16", 128, 16, planner.WIDE_UNSPLIT_GROUP + 1), never)
    assert planner.wide_kernel(Config("float16", 128, 16, 64), never)
    assert not planner.wide_kernel(Config("float16", 128, 16, planner.WIDE_GROUP), never)
    assert not planner.wide_kernel(Config("float32", 128, 16, 24), never)


def test_the_sm90a_launch_refuses_more_units_than_the_kernel_counts():
    """(item, KV head, segment) units are an int in the kernel: more is a named error before any device work."""
    from types import SimpleNamespace
    from pagedrt.attention import prefill_sm90
    planes = SimpleNamespace(num_kv_heads=8, block_stride=1, block_size=16)
    items = np.zeros((2**20, 4), np.int32)
    with pytest.raises(LaunchArgumentError, match="units, over the kernel's"):
        prefill_sm90.launch(Config("float16", 128, 16, 32), planes, np.zeros((1, 1), np.int32), np.ones(1, np.int32),
                            items, False, 0.1, 0, num_splits=4096, split_tiles=1)


@pytest.mark.parametrize("bad", ["long", "", 1, True])
def test_plan_and_geometry_refuse_an_unknown_geometry(bad):
    with pytest.raises(LaunchArgumentError, match="geometry"):
        plan_splits(2, 8, 100, 32, 512, 396, geometry=bad)
    with pytest.raises(LaunchArgumentError, match="geometry"):
        planner.geometry(BASE, bad)


@pytest.mark.parametrize("batch, q_heads, head_dim, splits", [(1, 8, 128, 2), (3, 7, 80, 5), (64, 32, 256, 40)])
def test_workspace_layout_is_aligned_and_holds_every_partial(batch, q_heads, head_dim, splits):
    o, ml, arrivals, total = planner.workspace_layout(batch, q_heads, head_dim, splits)
    rows = batch * q_heads
    assert o % 16 == 0 and ml % 16 == 0 and arrivals % 16 == 0
    assert o + rows * splits * head_dim * 4 <= ml and ml + rows * splits * 2 * 4 <= arrivals
    assert arrivals + rows * 4 <= total == workspace_bytes(batch, q_heads, head_dim, splits)
    assert workspace_bytes(batch, q_heads, head_dim, 1) == 0  # unsplit: no partials


# --- geometry ---------------------------------------------------------------------------------

def test_short_geometry_trades_registers_and_stages_for_resident_blocks():
    for cfg in configs.sweep():
        std, short = planner.geometry(cfg, "standard"), planner.geometry(cfg, "short")
        assert std.tile % short.tile == 0  # a plan's segments are whole tiles of either
        if std.mma and cfg.group > planner.MMA_SHORT_GROUP:  # four m16 tiles of heads: two warps cannot hold them
            assert short == std
            continue
        assert short.smem_bytes < std.smem_bytes and short.mma == std.mma
        if std.mma:
            assert short.threads < std.threads and short.stages <= std.stages
        else:
            assert short.lanes >= std.lanes and short.stages < std.stages and short.threads == std.threads


def test_tensor_cores_for_half_precision_head_dims_64_and_128():
    for cfg in configs.sweep():
        for geometry_name in planner.GEOMETRIES:
            geo = planner.geometry(cfg, geometry_name)
            assert geo.mma == (cfg.dtype != "float32" and cfg.head_dim in planner.MMA_HEAD_DIMS)
            if geo.mma:  # a lane group is a warp, a warp per 16 tokens of a tile
                assert geo.lanes == 32 and geo.tile == 16 * geo.threads // 32


@pytest.mark.parametrize("geometry_name", planner.GEOMETRIES)
def test_geometry_stages_one_tile_of_k_and_v(geometry_name):
    for cfg in configs.sweep():
        geo = planner.geometry(cfg, geometry_name)
        row = cfg.head_dim * cfg.itemsize
        if not geo.mma:
            assert geo.tile * row <= planner.TILE_BYTES < 2 * geo.tile * row and geo.threads == planner.THREADS
        assert geo.tile & (geo.tile - 1) == 0
        assert geo.smem_bytes == geo.stages * 2 * geo.tile * row + 4 * geo.ids_window <= 227 * 1024


@pytest.mark.parametrize("geometry_name", planner.GEOMETRIES)
def test_every_supported_config_meets_the_kernel_static_asserts(geometry_name):
    """Mirror of DecodeShape's and decode_body's static_asserts for every configuration (the compile check
    builds a sweep)."""
    for dtype in configs.CUDA_TYPES:
        for h in configs.HEAD_DIMS:
            for g in configs.GROUPS:
                cfg = Config(dtype, h, 16, g)
                geo = planner.geometry(cfg, geometry_name)
                heads, chunks = planner.kernel_group(cfg)
                assert heads * chunks == g
                row_vecs = h * cfg.itemsize // 16
                lane_groups = geo.threads // geo.lanes
                pipeline = geo.stages * 2 * geo.tile * h * cfg.itemsize
                assert geo.lanes & (geo.lanes - 1) == 0 and geo.lanes <= 32
                assert -(-row_vecs // geo.lanes) <= 4
                assert geo.tile % lane_groups == 0 and geo.stages >= 2
                if geo.mma:
                    assert chunks == 1 and geo.lanes == 32 and geo.tile == 16 * lane_groups
                    m_tiles = 1 if g <= 16 else 2 if g <= 32 else 4
                    assert lane_groups % m_tiles == 0
                    parts = lane_groups // m_tiles
                else:
                    assert heads <= planner.CORE_GROUP
                    parts = lane_groups
                assert parts * heads * (h + 2) * 4 <= pipeline <= geo.smem_bytes <= 227 * 1024
                assert geo.ids_window >= (geo.stages + 1) * (geo.tile // 8 + 1)
                assert geo.ids_window % geo.threads == 0


def test_instances_name_every_swept_kernel_with_its_geometry():
    names = decode.instances()["decode.cu"]
    with_indexed = decode.instances(indexed=(False, True))["decode.cu"]
    assert len(set(names)) == len(names) and set(names) < set(with_indexed)
    expected = set()
    for cfg in configs.sweep():
        for paged, indexed in ((True, False), (False, False), (True, True)):  # no indexed contiguous twin
            for geometry_name in planner.GEOMETRIES:
                geo = planner.geometry(cfg, geometry_name)
                name = decode.kernel_name(cfg, paged, geometry_name, indexed)
                expected.add(name)
                assert name in with_indexed and (indexed or name in names)
                args = name[name.index("<") + 1:-1].split(", ")
                heads = planner.kernel_group(cfg)[0]  # a wide group on CUDA cores: the chunk's heads
                assert args == [cfg.cuda_type, *map(str, (cfg.head_dim, cfg.block_size, heads)),
                                "true" if paged else "false", *map(str, (geo.threads, geo.lanes, geo.tile,
                                                                          geo.stages)),
                                "true" if geo.mma else "false", str(geo.ids_window),
                                "true" if indexed else "false"]
    fp8 = {decode.kernel_name(c, True, g, i) for c in configs.fp8_sweep() for g in planner.GEOMETRIES
           for i in (False, True)}
    assert set(with_indexed) == expected | fp8  # FP8: paged kernels only


# --- launcher checks ----------------------------------------------------------------------------

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
    (lambda c: dict(q=np.concatenate([c.q] * 17, axis=1)), UnsupportedConfigError, "group"),  # 68 heads a KV head
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
    (lambda c: dict(geometry="long"), LaunchArgumentError, "geometry='long'"),
    (lambda c: dict(workspace=np.zeros(1 << 20, np.float32)), LaunchArgumentError, "uint8"),
    (lambda c: dict(workspace=np.zeros((2, 1 << 20), np.uint8)), LaunchArgumentError, "1-D"),
    (lambda c: dict(workspace=[0] * 64), LaunchArgumentError, "NumPy or CuPy"),
    (lambda c: dict(num_splits=3, workspace=np.zeros(workspace_bytes(3, 8, 128, 3) - 16, np.uint8)),
     LaunchArgumentError, rf"need {workspace_bytes(3, 8, 128, 3)}"),
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
    workspace = np.zeros(workspace_bytes(3, 8, 128, num_splits or 1), np.uint8)
    plan = DecodePlan(case.q, planes[0][0], case.table, case.lens, num_splits=num_splits, workspace=workspace)
    outs = []
    for k, v in planes:
        out = np.full(case.q.shape, 7, case.q.dtype)
        assert plan.run(case.q, k, v, out=out) is out
        assert np.array_equal(out, paged_decode(case.q, k, v, case.table, case.lens, num_splits=num_splits))
        outs.append(out)
    assert np.isfinite(outs[0].astype(np.float32)).all() and not np.array_equal(outs[0], outs[1])


@pytest.mark.parametrize("num_splits, forced", [(None, None), (3, None), (5, "short")])
def test_host_plan_reports_the_references_cut(case, num_splits, forced):
    plan = DecodePlan(case.q, case.k, case.table, case.lens, num_splits=num_splits, geometry=forced)
    assert plan.split == reference.split(case.table.shape[1] * 16, 16, num_splits or 1, forced or "standard")
    assert plan.split.num_splits == (num_splits or 1) and plan.split.geometry == (forced or "standard")
    assert all(covers_once(plan.split, int(n)) for n in case.lens)
    with pytest.raises(AttributeError):
        plan.split = None


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
    with pytest.raises(LaunchArgumentError, match="geometry"):
        contiguous_decode(case.q, k, v, case.lens, geometry="wide")
    with pytest.raises(LaunchArgumentError, match="need"):
        contiguous_decode(case.q, k, v, case.lens, num_splits=2, workspace=np.zeros(16, np.uint8))
    with pytest.raises(BlockTableError, match=r"seq_lens\[1\] = 40"):
        contiguous_decode(case.q, k, v, np.array([3, 40], np.int32))


# --- blocks whose memory is not mapped, closed pools ---------------------------------------------
# Before these checks each decode below read unmapped memory: a segfault that killed the test process.

def test_decode_refuses_a_block_in_a_chunk_never_mapped():
    r = Reproducer("host")
    table = np.array([[int(r.table[0, 0]), r.last]], np.int32)
    with pytest.raises(BlockTableError, match=rf"block_tables\[0, 1\] = {r.last} is a block whose memory is not "
                                              "mapped") as info:
        paged_decode(r.q, r.k, r.v, table, np.array([20], np.int32))
    assert (info.value.row, info.value.column, info.value.block_id) == (0, 1, r.last)
    with pytest.raises(BlockTableError, match="not mapped"):
        DecodePlan(r.q, r.k, table, np.array([20], np.int32), validate=False)  # NumPy inputs: always checked
    paged_decode(r.q, r.k, r.v, table, np.array([16], np.int32))  # the unmapped column unused: fine
    assert r.decode_is_right()


def test_decode_refuses_a_table_copied_before_free_and_trim():
    q = np.ones((2, 4, 128), np.float16)
    cache, table, lens, _ = stale_table("host", lambda c, t, n: paged_decode(q, c.k(0), c.v(0), t, n))
    with pytest.raises(BlockTableError, match=r"block_tables\[0, 0\] = .*not mapped"):
        paged_decode(q, cache.k(0), cache.v(0), table, lens)
    paged_decode(q[1:], cache.k(0), cache.v(0), table[1:], lens[1:])  # a's row is still good


def test_decode_refuses_planes_of_a_closed_cache():
    check_closed_cache_refuses_decode("host")
