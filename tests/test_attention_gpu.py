"""Decode attention on the device against the float64 reference (needs a GPU; skipped otherwise).

Every input is fresh random data; every output is poisoned with NaN before a launch;
every slot a kernel must not read holds NaN (see kernel_cases.Case). The matrix is
sweeps along each axis around the base configuration (configs.sweep()), each in
every geometry (forced with ``geometry=``), and all the kernels the module needs
are compiled up front in one NVRTC call per source file.
"""

import numpy as np
import pytest

from helpers import to_host
from kernel_cases import (Case, Reproducer, check_closed_cache_refuses_decode, rel_error,  # noqa: F401
                          stale_table)
from pagedrt import Pool, source
from pagedrt.attention import DecodePlan, contiguous_decode, paged_decode, reference, workspace_bytes
from pagedrt.attention import decode, planner
from pagedrt.errors import BlockTableError, LaunchArgumentError
from pagedrt.kernels import configs, validate
from pagedrt.kernels.configs import BASE, Config

pytestmark = pytest.mark.gpu

TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}
PAGED = configs.sweep()
CONTIGUOUS = list(dict.fromkeys([BASE] + [Config(d, 128, 16, 4) for d in configs.CUDA_TYPES]
                                + [Config("float16", 128, b, 4) for b in configs.BLOCK_SIZES]))


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Every kernel of this module, compiled up front: one NVRTC call per source file."""
    names = {}
    for part in (decode.instances(PAGED, paged=(True,)), decode.instances(CONTIGUOUS, paged=(False,)),
                 validate.instances()):
        for file, listed in part.items():
            names.setdefault(file, []).extend(listed)
    for file, listed in names.items():
        source.preload(file, listed)


@pytest.fixture(params=planner.GEOMETRIES)
def geometry(request):
    """Each case runs in every geometry, whatever the plan would choose."""
    return request.param


def lengths(bs):
    return [1, bs - 1, bs, bs + 1, 1000]


class OnDevice:
    """A Case's arrays on the device; the planes are views of the uploaded block-major buffer."""

    def __init__(self, case, layer=1):
        import cupy
        self.buffer = cupy.asarray(case.buffer)
        self.k, self.v = self.buffer[:, 0, layer], self.buffer[:, 1, layer]
        self.table, self.lens, self.q = cupy.asarray(case.table), cupy.asarray(case.lens), cupy.asarray(case.q)


def poisoned(shape, dtype):
    import cupy
    return cupy.asarray(np.full(shape, np.nan, np.float32).astype(dtype))


def expected(case):
    """The float64 reference's output, kept in float64."""
    return reference.paged_decode(case.q.astype(np.float64), case.k, case.v, case.table, case.lens)


def run(dev, case, **kw):
    out = poisoned(case.q.shape, case.q.dtype)
    assert paged_decode(dev.q, dev.k, dev.v, dev.table, dev.lens, out=out, **kw) is out
    return to_host(out)


def run_plan(plan, dev, case):
    """A plan's run over the case's layer on the device, into a poisoned out, brought to the host."""
    out = poisoned(case.q.shape, case.q.dtype)
    assert plan.run(dev.q, dev.k, dev.v, out=out) is out
    return to_host(out)


def arrival_counts(workspace, batch, q_heads, head_dim, num_splits):
    """The arrival counts inside a workspace laid out for these shapes (int32, one per query row)."""
    at = planner.workspace_layout(batch, q_heads, head_dim, num_splits)[2]
    return workspace[at:at + 4 * batch * q_heads].view(np.int32)


# --- results against the reference -----------------------------------------------------------------

@pytest.mark.parametrize("cfg", PAGED, ids=str)
def test_decode_matches_the_reference_split_or_not(cfg, geometry):
    case = Case(cfg, lengths(cfg.block_size), seed=PAGED.index(cfg))
    dev, ref, tol = OnDevice(case), expected(case), TOLERANCE[cfg.dtype]
    whole = run(dev, case, num_splits=1, geometry=geometry)
    assert rel_error(whole, ref) <= tol
    assert rel_error(run(dev, case, geometry=geometry), ref) <= tol  # the plan's split count
    for n in (3, 40):  # 40: most segments of the short sequences are empty
        split = run(dev, case, num_splits=n, geometry=geometry)
        assert rel_error(split, ref) <= tol and rel_error(split, whole) <= tol


@pytest.mark.parametrize("cfg", CONTIGUOUS, ids=str)
def test_contiguous_baseline_agrees_with_paged(cfg, geometry):
    import cupy
    case = Case(cfg, lengths(cfg.block_size), seed=7)
    dev, ref, tol = OnDevice(case), expected(case), TOLERANCE[cfg.dtype]
    k, v = (cupy.asarray(x) for x in case.contiguous())
    paged = run(dev, case, geometry=geometry)
    for n in (1, 5):
        out = poisoned(case.q.shape, case.q.dtype)
        assert contiguous_decode(dev.q, k, v, dev.lens, out=out, num_splits=n, geometry=geometry) is out
        assert rel_error(to_host(out), ref) <= tol and rel_error(to_host(out), paged) <= tol


def test_long_context_split_by_the_plan_and_whole():
    case = Case(BASE, [32768, 3], seed=11)
    dev, ref, tol = OnDevice(case), expected(case), TOLERANCE[BASE.dtype]
    plan = DecodePlan(dev.q, dev.k, dev.table, dev.lens)
    assert plan.split.num_splits > 1  # two sequences leave most of the device idle unsplit
    whole, planned = run(dev, case, num_splits=1), run(dev, case)
    assert rel_error(whole, ref) <= tol and rel_error(planned, ref) <= tol and rel_error(planned, whole) <= tol


@pytest.mark.parametrize("hints", [{}, dict(num_splits=6), dict(geometry="short"), dict(mean_seq_len=600.0)])
def test_device_plan_cuts_whole_tiles_and_honours_requests(hints):
    import cupy
    case = Case(BASE, [5000, 17, 300], seed=23)
    dev = OnDevice(case)
    plan = DecodePlan(dev.q, dev.k, dev.table, dev.lens, **hints)
    split, capacity = plan.split, case.table.shape[1] * BASE.block_size
    assert split.segment_tokens % planner.geometry(BASE, "standard").tile == 0
    assert split.num_splits == hints.get("num_splits", split.num_splits) >= 1
    assert split.geometry == hints.get("geometry", split.geometry) and split.geometry in planner.GEOMETRIES
    assert [t for a, b in split.segments(capacity) for t in range(a, b)] == list(range(capacity))
    standard = decode._kernel(BASE, True, "standard", cupy.cuda.Device().id)
    assert split == planner.plan_splits(3, 2, capacity, standard.geometry.tile, 2 * 128 * 2,
                                        standard.resident_blocks, **hints)
    assert rel_error(run_plan(plan, dev, case), expected(case)) <= TOLERANCE[BASE.dtype]


def test_planes_in_a_cuda_pool():
    case = Case(BASE, [700, 33, 1], seed=3)
    dev = OnDevice(case)
    with Pool(256 << 20, 32 << 20, backend="cuda") as pool:
        pool.grow(1)
        buf = pool.view(0, case.buffer.shape, case.buffer.dtype)
        buf[...] = dev.buffer
        dev.k, dev.v = buf[:, 0, 1], buf[:, 1, 1]
        out = run(dev, case, num_splits=2)
    assert rel_error(out, expected(case)) <= TOLERANCE[BASE.dtype]


# --- plans and workspaces ------------------------------------------------------------------------------

@pytest.mark.parametrize("num_splits", [1, 4])
def test_plan_runs_every_layer_and_keeps_to_its_stream(num_splits):
    """One DecodePlan, run per layer, equals the reference per layer; a split plan refuses another stream."""
    import cupy
    case = Case(BASE, [5000, 17, 300], seed=13)
    case.buffer[:, :, 0] = (case.buffer[:, :, 1].astype(np.float32) * -0.5).astype(case.buffer.dtype)
    buffer = cupy.asarray(case.buffer)
    q, table, lens = cupy.asarray(case.q), cupy.asarray(case.table), cupy.asarray(case.lens)
    plan = DecodePlan(q, buffer[:, 0, 0], table, lens, num_splits=num_splits)
    for layer in (0, 1):
        out = poisoned(case.q.shape, case.q.dtype)
        assert plan.run(q, buffer[:, 0, layer], buffer[:, 1, layer], out=out) is out
        ref = reference.paged_decode(case.q.astype(np.float64), case.buffer[:, 0, layer], case.buffer[:, 1, layer],
                                     case.table, case.lens)
        assert rel_error(to_host(out), ref) <= TOLERANCE[BASE.dtype]
    with cupy.cuda.Stream():
        out = poisoned(case.q.shape, case.q.dtype)
        if num_splits > 1:
            with pytest.raises(LaunchArgumentError, match="stream"):
                plan.run(q, buffer[:, 0, 1], buffer[:, 1, 1], out=out)
            assert cupy.isnan(out).all()
        else:  # an unsplit plan has no workspace: any stream
            plan.run(q, buffer[:, 0, 1], buffer[:, 1, 1], out=out)
            cupy.cuda.get_current_stream().synchronize()
            assert rel_error(to_host(out), ref) <= TOLERANCE[BASE.dtype]


def test_split_workspace_is_never_read_stale_and_its_counts_reset():
    """Segments past a sequence's end are not merged; the kernel leaves every arrival count at zero, so a
    plan runs again and again (layers) on the counts its creation zeroed once."""
    import cupy
    case = Case(BASE, [1, 5000, 17, 300], seed=5)
    dev = OnDevice(case)
    batch, q_heads, head_dim = case.q.shape
    for n in (16, 64):
        workspace = cupy.full(workspace_bytes(batch, q_heads, head_dim, n), 0xFF, np.uint8)
        counts = arrival_counts(workspace, batch, q_heads, head_dim, n)
        partials = workspace[:planner.workspace_layout(batch, q_heads, head_dim, n)[2]]
        for lens in ([1, 5000, 17, 300], [1, 2100, 17, 250]):  # then fewer segments live, same workspace
            case.lens[:] = lens
            dev.lens = cupy.asarray(case.lens)
            plan = DecodePlan(dev.q, dev.k, dev.table, dev.lens, num_splits=n, workspace=workspace)
            for _ in range(3):
                assert not counts.any()
                partials.fill(0xFF)  # NaN in every partial o, m and l
                assert rel_error(run_plan(plan, dev, case), expected(case)) <= TOLERANCE[BASE.dtype]
        assert not counts.any()


@pytest.mark.parametrize("geometry", planner.GEOMETRIES)
def test_caller_workspace_gives_the_reference_and_serves_plan_after_plan(geometry):
    """One caller-owned workspace, larger than needed and dirty, serves plan after plan of different split
    counts and lengths (steps), each run over two layers, then a contiguous baseline; a plan made earlier
    on it refuses to run once a later one has laid it out."""
    import cupy
    case = Case(BASE, [5000, 17, 300], seed=29)
    dev = OnDevice(case)
    batch, q_heads, head_dim = case.q.shape
    workspace = cupy.full(workspace_bytes(batch, q_heads, head_dim, 9) + 4096, 0xFF, np.uint8)
    other = Case(BASE, [40, 3000, 900], seed=31)
    dev_other = OnDevice(other)
    plans = []
    for d, c, n in ((dev, case, 4), (dev_other, other, 9), (dev, case, 4)):
        plan = DecodePlan(d.q, d.k, d.table, d.lens, num_splits=n, geometry=geometry, workspace=workspace)
        for _ in range(2):
            assert rel_error(run_plan(plan, d, c), expected(c)) <= TOLERANCE[BASE.dtype]
        plans.append(plan)
    out = poisoned(case.q.shape, case.q.dtype)
    with pytest.raises(LaunchArgumentError, match="a later plan was made on this plan's workspace"):
        plans[1].run(dev_other.q, dev_other.k, dev_other.v, out=out)
    assert np.isnan(to_host(out).astype(np.float32)).all()  # refused before anything ran
    k, v = (cupy.asarray(x) for x in case.contiguous())
    out = contiguous_decode(dev.q, k, v, dev.lens, num_splits=5, geometry=geometry, workspace=workspace)
    assert rel_error(to_host(out), expected(case)) <= TOLERANCE[BASE.dtype]
    with pytest.raises(LaunchArgumentError, match="a later plan"):
        plans[2].run(dev.q, dev.k, dev.v)


def test_too_small_or_misaligned_workspace_is_refused_before_anything_runs():
    import cupy
    case = Case(BASE, [5000, 17, 300], seed=37)
    dev = OnDevice(case)
    batch, q_heads, head_dim = case.q.shape
    need = workspace_bytes(batch, q_heads, head_dim, 4)
    workspace = cupy.full(need + 16, 0xAB, np.uint8)
    sentinel = np.full(case.q.shape, 7, case.q.dtype)
    out = cupy.asarray(sentinel)
    bad_lens = cupy.asarray(np.array([0, 17, 300], np.int32))  # validation would launch a check and raise
    for small, words in ((workspace[:need - 16], rf"need {need}"), (workspace[1:need + 1], "16-byte")):
        with pytest.raises(LaunchArgumentError, match=words):
            paged_decode(dev.q, dev.k, dev.v, dev.table, bad_lens, out=out, num_splits=4, workspace=small)
        k, v = (cupy.asarray(x) for x in case.contiguous())
        with pytest.raises(LaunchArgumentError, match=words):
            contiguous_decode(dev.q, k, v, bad_lens, out=out, num_splits=4, workspace=small)
    cupy.cuda.get_current_stream().synchronize()
    assert (to_host(workspace) == 0xAB).all() and np.array_equal(to_host(out), sentinel)
    assert paged_decode(dev.q, dev.k, dev.v, dev.table, dev.lens, out=out, num_splits=4,
                        workspace=workspace[:need]) is out  # exactly enough
    assert rel_error(to_host(out), expected(case)) <= TOLERANCE[BASE.dtype]


def test_plan_holds_its_own_workspace_while_others_come_and_go():
    """Workspaces of other plans are allocated and freed after this plan's; the plan keeps its own."""
    case = Case(BASE, [5000, 17, 300], seed=17)
    dev = OnDevice(case)
    plan = DecodePlan(dev.q, dev.k, dev.table, dev.lens, num_splits=4)
    for n in range(5, 14):
        run(dev, case, num_splits=n)
    assert rel_error(run_plan(plan, dev, case), expected(case)) <= TOLERANCE[BASE.dtype]


def test_plan_with_a_caller_workspace_replays_in_a_cuda_graph():
    """A split plan made before capture, its runs captured, the graph launched twice: the reference each time."""
    import cupy
    case = Case(BASE, [5000, 17, 300], seed=41)
    dev = OnDevice(case)
    batch, q_heads, head_dim = case.q.shape
    workspace = cupy.empty(workspace_bytes(batch, q_heads, head_dim, 4), np.uint8)
    out = poisoned(case.q.shape, case.q.dtype)
    cupy.cuda.Device().synchronize()  # the uploads, on the default stream, are done before the capture stream runs
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        plan = DecodePlan(dev.q, dev.k, dev.table, dev.lens, num_splits=4, validate=False, workspace=workspace)
        stream.synchronize()
        stream.begin_capture()
        plan.run(dev.q, dev.k, dev.v, out=out)
        plan.run(dev.q, dev.k, dev.v, out=out)  # a second layer over the same counts
        graph = stream.end_capture()
        for _ in range(2):
            out.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            assert rel_error(to_host(out), expected(case)) <= TOLERANCE[BASE.dtype]


# --- validation and argument checks on the device ------------------------------------------

def test_bad_block_id_or_mask_raises_and_leaves_out_untouched():
    import cupy
    case = Case(BASE, [3, 40, 17], seed=2)
    dev = OnDevice(case)
    sentinel = np.full(case.q.shape, 7, case.q.dtype)
    out = cupy.asarray(sentinel)
    for bad in (-1, len(case.k)):
        table = case.table.copy()
        table[2, 1], table[1, 2], table[0, 2] = bad, bad, bad  # (0, 2) is unused: ignored
        with pytest.raises(BlockTableError, match=rf"block_tables\[1, 2\] = {bad}") as info:
            paged_decode(dev.q, dev.k, dev.v, cupy.asarray(table), dev.lens, out=out)
        assert (info.value.row, info.value.column, info.value.block_id) == (1, 2, bad)
    mask = np.ones(len(case.k), np.uint8)
    mask[case.table[2, 0]] = 0
    with pytest.raises(BlockTableError, match=r"block_tables\[2, 0\].*block_mask"):
        paged_decode(dev.q, dev.k, dev.v, dev.table, dev.lens, out=out, block_mask=cupy.asarray(mask))
    for row, bad_len in ((1, 0), (2, case.table.shape[1] * 16 + 1)):
        lens = case.lens.copy()
        lens[row] = bad_len
        with pytest.raises(BlockTableError, match=rf"seq_lens\[{row}\] = {bad_len}"):
            paged_decode(dev.q, dev.k, dev.v, dev.table, cupy.asarray(lens), out=out)
        with pytest.raises(BlockTableError, match=rf"seq_lens\[{row}\]"):
            contiguous_decode(dev.q, *(cupy.asarray(x) for x in case.contiguous()), cupy.asarray(lens), out=out)
    assert np.array_equal(to_host(out), sentinel)
    mask[:] = 1
    ok = paged_decode(dev.q, dev.k, dev.v, dev.table, dev.lens, block_mask=cupy.asarray(mask), validate=False)
    assert rel_error(to_host(ok), expected(case)) <= TOLERANCE[BASE.dtype]


def test_device_only_argument_checks():
    import cupy
    case = Case(BASE, [5], seed=1)
    dev = OnDevice(case)
    shifted = cupy.empty(case.q.size + 1, case.q.dtype)[1:].reshape(case.q.shape)
    with pytest.raises(LaunchArgumentError, match="16-byte"):
        paged_decode(shifted, dev.k, dev.v, dev.table, dev.lens)
    with pytest.raises(LaunchArgumentError, match="mix NumPy"):
        paged_decode(dev.q, dev.k, dev.v, case.table, dev.lens)
    with pytest.raises(LaunchArgumentError, match="mix NumPy"):
        paged_decode(dev.q, dev.k, dev.v, dev.table, dev.lens, workspace=np.zeros(1 << 20, np.uint8))
    with pytest.raises(LaunchArgumentError, match="uint8"):
        paged_decode(dev.q, dev.k, dev.v, dev.table, dev.lens, workspace=cupy.zeros(1 << 18, np.float32))


# --- blocks whose memory is not mapped, closed pools ---------------------------------------------
# Before these checks each refused decode below ended in CUDA_ERROR_ILLEGAL_ADDRESS (validate=True too: the
# ids were in range), which leaves the process's CUDA context unusable: each test launches a decode afterwards.

def test_decode_refuses_a_block_in_a_chunk_never_mapped_and_the_context_survives():
    import cupy
    r = Reproducer("cuda")
    table = cupy.asarray([[int(r.table[0, 0]), r.last]], dtype=np.int32)
    for geometry_name in planner.GEOMETRIES:
        with pytest.raises(BlockTableError, match=rf"block_tables\[0, 1\] = {r.last} is a block whose memory is "
                                                  "not mapped") as info:
            paged_decode(r.q, r.k, r.v, table, cupy.asarray([20], np.int32), num_splits=2, geometry=geometry_name)
        assert (info.value.row, info.value.column, info.value.block_id) == (0, 1, r.last)
    paged_decode(r.q, r.k, r.v, table, cupy.asarray([16], np.int32))  # the unmapped column unused: fine
    assert r.decode_is_right()
    cupy.cuda.Device().synchronize()


def test_decode_refuses_a_table_copied_before_free_and_trim():
    import cupy
    q = cupy.ones((2, 4, 128), np.float16)
    cache, table, lens, _ = stale_table("cuda", lambda c, t, n: paged_decode(q, c.k(0), c.v(0), t, n))
    with pytest.raises(BlockTableError, match=r"block_tables\[0, 0\] = .*not mapped"):
        paged_decode(q, cache.k(0), cache.v(0), table, lens)  # the chunk mask cached before the trim is stale
    out = paged_decode(q[1:], cache.k(0), cache.v(0), table[1:], lens[1:])  # a's row is still good
    cupy.cuda.Device().synchronize()
    assert out.shape == (1, 4, 128)


def test_decode_refuses_planes_of_a_closed_cache():
    check_closed_cache_refuses_decode("cuda")
    case = Case(BASE, [3, 40], seed=3)  # the context is fine: a decode elsewhere runs
    dev = OnDevice(case)
    assert rel_error(to_host(paged_decode(dev.q, dev.k, dev.v, dev.table, dev.lens)), expected(case)) \
        <= TOLERANCE[BASE.dtype]
