"""The kernels on the device against their float64 twins (needs a GPU; skipped otherwise).

Every input is fresh random data; every output is poisoned with NaN before a launch;
every slot a kernel must not read holds NaN (see kernel_cases.Case). The matrix is
sweeps along each axis around the base configuration (configs.sweep()), and all the
kernels the module needs are compiled up front in one NVRTC call per source file.
"""

import numpy as np
import pytest

from pagedrt import Pool
from pagedrt.errors import BlockTableError, LaunchArgumentError
from pagedrt.kernels import (DecodePlan, WritePlan, contiguous_decode, copy_blocks, copy_blocks_reference,
                             paged_decode, paged_decode_reference, write_kv, write_kv_reference)
from pagedrt import source
from pagedrt.kernels import configs, copy, decode, validate, write
from pagedrt.kernels.configs import BASE, Config
from helpers import to_host
from tests.kernel_cases import Case, np_dtype, rel_error

pytestmark = pytest.mark.gpu

TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}
PAGED = configs.sweep()
CONTIGUOUS = list(dict.fromkeys([BASE] + [Config(d, 128, 16, 4) for d in configs.CUDA_TYPES]
                                + [Config("float16", 128, b, 4) for b in configs.BLOCK_SIZES]))
WRITES = list(dict.fromkeys([Config(d, 128, 16, 1) for d in configs.CUDA_TYPES]
                            + [Config("float16", 80, 16, 1), Config("float16", 128, 8, 1),
                               Config("float16", 128, 128, 1)]))


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Every kernel of this module, compiled up front: one NVRTC call per source file."""
    names = {}
    for part in (decode.instances(PAGED, paged=(True,)), decode.instances(CONTIGUOUS, paged=(False,)),
                 write.instances(WRITES), copy.instances(), validate.instances()):
        for file, listed in part.items():
            names.setdefault(file, []).extend(listed)
    for file, listed in names.items():
        source.preload(file, listed)


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


def reference(case):
    """The float64 twin's output, kept in float64."""
    return paged_decode_reference(case.q.astype(np.float64), case.k, case.v, case.table, case.lens)


def run(dev, case, **kw):
    out = poisoned(case.q.shape, case.q.dtype)
    assert paged_decode(dev.q, dev.k, dev.v, dev.table, dev.lens, out=out, **kw) is out
    return to_host(out)


# --- decode ----------------------------------------------------------------------------

@pytest.fixture(params=[True, False], ids=["short", "long"])
def geometry(request, monkeypatch):
    """Run the short-segment geometry, or the standard one, whatever the plan (decode.plan_splits)."""
    monkeypatch.setattr(decode, "SHORT_TILES", 10 ** 9 if request.param else 0)
    monkeypatch.setattr(decode, "SHORT_WAVES", 0)
    return request.param


@pytest.mark.parametrize("cfg", PAGED, ids=str)
def test_decode_matches_twin_split_or_not(cfg, geometry):
    case = Case(cfg, lengths(cfg.block_size), seed=PAGED.index(cfg))
    dev, ref, tol = OnDevice(case), reference(case), TOLERANCE[cfg.dtype]
    whole = run(dev, case, num_splits=1)
    assert rel_error(whole, ref) <= tol
    assert rel_error(run(dev, case), ref) <= tol  # the plan's choice
    for n in (3, 40):  # 40: most segments of the short sequences are empty
        split = run(dev, case, num_splits=n)
        assert rel_error(split, ref) <= tol and rel_error(split, whole) <= tol


@pytest.mark.parametrize("cfg", CONTIGUOUS, ids=str)
def test_contiguous_twin_agrees_with_paged(cfg, geometry):
    import cupy
    case = Case(cfg, lengths(cfg.block_size), seed=7)
    dev, ref, tol = OnDevice(case), reference(case), TOLERANCE[cfg.dtype]
    k, v = (cupy.asarray(x) for x in case.contiguous())
    paged = run(dev, case)
    for n in (1, 5):
        out = poisoned(case.q.shape, case.q.dtype)
        contiguous_decode(dev.q, k, v, dev.lens, out=out, num_splits=n)
        assert rel_error(to_host(out), ref) <= tol and rel_error(to_host(out), paged) <= tol


def test_long_context_split_by_the_plan_and_whole():
    case = Case(BASE, [32768, 3], seed=11)
    dev, ref, tol = OnDevice(case), reference(case), TOLERANCE[BASE.dtype]
    whole, planned = run(dev, case, num_splits=1), run(dev, case)
    assert rel_error(whole, ref) <= tol and rel_error(planned, ref) <= tol and rel_error(planned, whole) <= tol


def test_split_workspace_is_never_read_stale_and_its_counts_reset():
    """Segments past a sequence's end are not merged; the arrival counts are zero after every launch."""
    import cupy
    case = Case(BASE, [1, 5000, 17, 300], seed=5)
    dev = OnDevice(case)
    for n in (16, 64):
        run(dev, case, num_splits=n)  # creates the workspace for this shape
        o, ml, arrivals = decode._workspace(cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr,
                                            case.q.shape[0] * case.q.shape[1], n, case.q.shape[2])
        for lens in ([1, 5000, 17, 300], [1, 2100, 17, 250]):  # then fewer segments live, same workspace
            assert not arrivals.any()
            o.fill(np.nan)
            ml.fill(np.nan)
            case.lens[:] = lens
            dev.lens = cupy.asarray(case.lens)
            assert rel_error(run(dev, case, num_splits=n), reference(case)) <= TOLERANCE[BASE.dtype]
        case.lens[:] = [1, 5000, 17, 300]
        dev.lens = cupy.asarray(case.lens)
    assert not arrivals.any()


@pytest.mark.parametrize("num_splits", [1, 4])
def test_plan_runs_every_layer_and_keeps_to_its_stream(num_splits):
    """One DecodePlan, run per layer, equals the float64 twin per layer; a split plan refuses another stream."""
    import cupy
    case = Case(BASE, [5000, 17, 300], seed=13)
    case.buffer[:, :, 0] = (case.buffer[:, :, 1].astype(np.float32) * -0.5).astype(case.buffer.dtype)
    buffer = cupy.asarray(case.buffer)
    q, table, lens = cupy.asarray(case.q), cupy.asarray(case.table), cupy.asarray(case.lens)
    plan = DecodePlan(q, buffer[:, 0, 0], table, lens, num_splits=num_splits)
    for layer in (0, 1):
        out = poisoned(case.q.shape, case.q.dtype)
        assert plan.run(q, buffer[:, 0, layer], buffer[:, 1, layer], out=out) is out
        ref = paged_decode_reference(case.q.astype(np.float64), case.buffer[:, 0, layer], case.buffer[:, 1, layer],
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


def test_plan_keeps_its_split_workspace_when_the_cache_of_workspaces_moves_on():
    """Workspaces for other split counts push this plan's out of decode._workspace's cache; the plan holds it."""
    case = Case(BASE, [5000, 17, 300], seed=17)
    dev = OnDevice(case)
    plan = DecodePlan(dev.q, dev.k, dev.table, dev.lens, num_splits=4)
    for n in range(5, 5 + decode._workspace.cache_info().maxsize + 1):
        run(dev, case, num_splits=n)
    out = poisoned(case.q.shape, case.q.dtype)
    plan.run(dev.q, dev.k, dev.v, out=out)
    assert rel_error(to_host(out), reference(case)) <= TOLERANCE[BASE.dtype]


def test_planes_in_a_cuda_pool():
    case = Case(BASE, [700, 33, 1], seed=3)
    dev = OnDevice(case)
    with Pool(256 << 20, 32 << 20, backend="cuda") as pool:
        pool.grow(1)
        buf = pool.view(0, case.buffer.shape, case.buffer.dtype)
        buf[...] = dev.buffer
        dev.k, dev.v = buf[:, 0, 1], buf[:, 1, 1]
        out = run(dev, case, num_splits=2)
    assert rel_error(out, reference(case)) <= TOLERANCE[BASE.dtype]


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
    assert rel_error(to_host(ok), reference(case)) <= TOLERANCE[BASE.dtype]


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
        write_kv(case.q[:, :2], case.q[:, :2], dev.k, dev.v, cupy.zeros(1, np.int64))


# --- write and copy --------------------------------------------------------------------------

def same_bits(a, b):
    a, b = to_host(a), to_host(b)
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("cfg", WRITES, ids=str)
@pytest.mark.parametrize("shape", ["prompt", "decode"])
def test_write_kv_matches_twin_and_skips_padding(cfg, shape):
    import cupy
    rng = np.random.default_rng(4)
    bs = cfg.block_size
    case = Case(cfg, [1], kv_heads=2, spare_blocks=(4096 // bs) + 300)
    num_blocks = len(case.k)
    if shape == "prompt":  # one 4096-token prompt into scattered blocks
        blocks = rng.permutation(num_blocks)[:4096 // bs]
        slots = (blocks[:, None] * bs + np.arange(bs)).reshape(-1).astype(np.int64)
    else:  # one token for each of 256 sequences
        slots = rng.permutation(num_blocks * bs)[:256].astype(np.int64)
    slots[rng.permutation(len(slots))[:len(slots) // 10]] = -1  # padding
    dt = np_dtype(cfg.dtype)
    k = rng.standard_normal((len(slots), 2, cfg.head_dim)).astype(dt)
    v = rng.standard_normal((len(slots), 2, cfg.head_dim)).astype(dt)
    dev = OnDevice(case)
    write_kv(cupy.asarray(k), cupy.asarray(v), dev.k, dev.v, cupy.asarray(slots))
    write_kv_reference(k, v, case.k, case.v, slots)
    assert same_bits(dev.buffer, case.buffer)
    with pytest.raises(BlockTableError, match="slot_mapping"):
        bad = slots.copy()
        bad[-1] = num_blocks * bs
        write_kv(cupy.asarray(k), cupy.asarray(v), dev.k, dev.v, cupy.asarray(bad))
    assert same_bits(dev.buffer, case.buffer)


def test_write_plan_runs_every_layer_like_the_twin():
    import cupy
    rng = np.random.default_rng(6)
    case = Case(BASE, [1], kv_heads=2, spare_blocks=300)
    slots = rng.permutation(len(case.k) * BASE.block_size)[:256].astype(np.int64)
    slots[::10] = -1
    new = [[rng.standard_normal((256, 2, BASE.head_dim)).astype(np.float16) for _ in range(2)] for _ in range(2)]
    dev = OnDevice(case)
    plan = WritePlan(cupy.asarray(new[0][0]), dev.buffer[:, 0, 0], cupy.asarray(slots))
    for layer, (k, v) in enumerate(new):
        plan.run(cupy.asarray(k), cupy.asarray(v), dev.buffer[:, 0, layer], dev.buffer[:, 1, layer])
        write_kv_reference(k, v, case.buffer[:, 0, layer], case.buffer[:, 1, layer], slots)
        assert same_bits(dev.buffer, case.buffer)


def test_copy_blocks_every_plane_in_one_launch():
    import cupy
    host = np.random.default_rng(8).standard_normal((64, 2, 3, 2, 16, 128)).astype(np.float16)
    dev = cupy.asarray(host)
    planes = lambda b: [b[:, kv, layer] for kv in range(2) for layer in range(3)]  # noqa: E731
    pairs = np.array([[1, 40], [2, 0], [1, 63], [5, 6]])
    copy_blocks(planes(dev), cupy.asarray(pairs))
    copy_blocks_reference(planes(host), pairs)
    assert same_bits(dev, host)
    with pytest.raises(BlockTableError, match=r"pairs\[1\]"):
        copy_blocks(planes(dev), [[3, 4], [5, 64]])
    assert same_bits(dev, host)
