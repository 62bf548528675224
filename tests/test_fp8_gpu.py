"""FP8 (float8 e4m3) K/V on the device (needs a GPU of compute capability 8.9 or later; skipped otherwise).

Decode over FP8 planes against the float64 reference on the dequantised values (every FP8 configuration,
both geometries, unsplit and split, outputs NaN-poisoned, slots no sequence owns holding NaN bits);
write_kv's device quantisation bit for bit against the NumPy reference; prefill over FP8 planes (causal and
not, prompts, chunks after cached tokens and one-token rows, groups up to 40) against the same reference; and
the accuracy of FP8 attention against fp16 attention over the same values, printed (run with -s to see it).
"""

import numpy as np
import pytest

from helpers import compile_all, to_host
from kernel_cases import rel_error
from pagedrt import fp8, kernels
from pagedrt.attention import DecodePlan, PrefillPlan, decode, planner, prefill, prefill_sm90, reference
from pagedrt.kernels import configs, validate, write

pytestmark = pytest.mark.gpu

TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2}
CONFIGS = configs.fp8_sweep()
PREFILL = [c for c in CONFIGS if (c.block_size, c.group) == (16, 4)] + [
    configs.Config("float16", 128, 8, 1, configs.FP8), configs.Config("bfloat16", 64, 128, 40, configs.FP8)]


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


@pytest.fixture(scope="module", autouse=True)
def compiled():
    import cupy
    if cupy.cuda.Device().compute_capability < "89":
        pytest.skip("FP8 conversion instructions need compute capability 8.9 or later")
    compile_all(decode.instances(CONFIGS, paged=(True,)), write.instances(CONFIGS), decode.instances(
        [configs.Config(d, h, 16, 4) for d in configs.FP8_DTYPES for h in configs.FP8_HEAD_DIMS], paged=(True,)),
        write.instances([configs.Config(d, h, 16, 1) for d in configs.FP8_DTYPES for h in configs.FP8_HEAD_DIMS]),
        prefill.instances(PREFILL, capability=cupy.cuda.Device().compute_capability),
        decode.instances(PREFILL, paged=(True,), indexed=(True,)),
        validate.instances())


def make_case(cfg, lens, seed=0, kv=2):
    """Random FP8 planes (slots no sequence owns hold NaN bits), a shuffled table, scales, q."""
    rng = np.random.default_rng(seed)
    bs, d = cfg.block_size, cfg.head_dim
    need = sum(-(-n // bs) for n in lens)
    kc = np.full((need + 3, kv, bs, d), fp8.NAN_BITS, np.uint8)
    vc = kc.copy()
    k_scale = rng.uniform(0.005, 0.05, kv).astype(np.float32)
    v_scale = rng.uniform(0.005, 0.05, kv).astype(np.float32)
    ids = rng.permutation(need + 3).astype(np.int32)
    table = np.zeros((len(lens), max(-(-n // bs) for n in lens) + 1), np.int32)
    used = 0
    for row, n in enumerate(lens):
        nb = -(-n // bs)
        table[row, :nb] = ids[used:used + nb]
        used += nb
        pos = np.arange(n)
        blocks, slots = table[row, pos // bs], pos % bs
        kc[blocks, :, slots] = fp8.quantise(rng.standard_normal((n, kv, d)), k_scale)
        vc[blocks, :, slots] = fp8.quantise(rng.standard_normal((n, kv, d)), v_scale)
    q = rng.standard_normal((len(lens), kv * cfg.group, d)).astype(np.float32).astype(_dtype(cfg.dtype))
    return q, kc, vc, table, np.array(lens, np.int32), k_scale, v_scale


def run_device(q, kc, vc, table, lens, k_scale, v_scale, **kw):
    import cupy
    dev = [cupy.asarray(a) for a in (q, kc, vc, table, lens, k_scale, v_scale)]
    out = cupy.asarray(np.full(q.shape, np.nan, np.float32).astype(q.dtype))
    plan = DecodePlan(dev[0], dev[1], dev[3], dev[4], **kw)
    assert plan.run(dev[0], dev[1], dev[2], out, k_scale=dev[5], v_scale=dev[6]) is out
    return to_host(out), plan


@pytest.mark.parametrize("geometry", planner.GEOMETRIES)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.dtype}-d{c.head_dim}-b{c.block_size}-g{c.group}")
def test_decode_equals_the_reference_on_dequantised_values(cfg, num_splits, geometry):
    bs = cfg.block_size
    q, kc, vc, table, lens, ks, vs = make_case(cfg, [1, bs - 1, bs, bs + 1, 1000], seed=cfg.group + bs)
    out, plan = run_device(q, kc, vc, table, lens, ks, vs, num_splits=num_splits, geometry=geometry)
    want = reference.paged_decode(q.astype(np.float64), kc, vc, table, lens, k_scale=ks, v_scale=vs)
    assert np.isfinite(out.astype(np.float32)).all()
    for row in range(len(lens)):
        assert rel_error(out[row], want[row]) < TOLERANCE[cfg.dtype], (row, plan.split)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("cfg", PREFILL, ids=lambda c: f"{c.dtype}-d{c.head_dim}-b{c.block_size}-g{c.group}")
def test_prefill_equals_the_reference_on_dequantised_values(cfg, causal):
    """Rows of 1, 7, 17 and 130 new tokens after 0, 40, bs and 300 cached ones, a row with no queries, over FP8
    planes; the one-token row on decode_fp8's indexed variant, the others on prefill_fp8 (compute capability
    9.0: the sm_90a kernel's FP8 twin, test_prefill_sm90_gpu.py); NaN-poisoned out."""
    import cupy
    bs = cfg.block_size
    prefixes, new = [300, 40, bs, 0, 5], [1, 7, 17, 130, 0]
    q1, kc, vc, table, lens, ks, vs = make_case(cfg, [p + n for p, n in zip(prefixes, new)], seed=cfg.group + bs)
    qo = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    rng = np.random.default_rng(cfg.head_dim)
    q = rng.standard_normal((int(qo[-1]),) + q1.shape[1:]).astype(np.float32).astype(q1.dtype)
    dev = [cupy.asarray(a) for a in (q, kc, vc, table, lens, qo, ks, vs)]
    plan = PrefillPlan(dev[0], dev[1], dev[3], dev[4], dev[5], query_lens=np.array(new), causal=causal)
    hopper = cupy.cuda.Device().compute_capability == prefill_sm90.SM90
    assert plan.decode_rows.tolist() == [0] and plan.kernel == (prefill_sm90 if hopper else prefill).kernel_name(cfg)
    out = cupy.asarray(np.full(q.shape, np.nan, np.float32).astype(q.dtype))
    assert plan.run(dev[0], dev[1], dev[2], out, k_scale=dev[6], v_scale=dev[7]) is out
    got = to_host(out)
    want = reference.prefill(q.astype(np.float64), kc, vc, table, lens, qo, causal=causal, k_scale=ks, v_scale=vs)
    assert np.isfinite(got.astype(np.float32)).all()
    for row in range(len(new)):
        if new[row]:
            assert rel_error(got[qo[row]:qo[row + 1]], want[qo[row]:qo[row + 1]]) < TOLERANCE[cfg.dtype], row


def test_scales_may_be_views_one_float_off_a_16_byte_boundary():
    """A cache's scales are views of one [layers, 2, KV heads] array: with one KV head, v_scale(layer) starts 4
    bytes past a 16-byte boundary. The kernels read scales one float at a time, so write and decode take it."""
    import cupy
    cfg = configs.Config("float16", 128, 16, 4, configs.FP8)
    q, kc, vc, table, lens, ks, vs = make_case(cfg, [1, 17, 300], seed=11, kv=1)
    scales = cupy.asarray(np.stack([ks, vs])[None])  # [1 layer, K then V, 1 KV head]
    k_view, v_view = scales[0, 0], scales[0, 1]
    assert v_view.data.ptr % 16 == 4
    dev = [cupy.asarray(a) for a in (q, kc, vc, table, lens)]
    out = cupy.asarray(np.full(q.shape, np.nan, np.float16))
    DecodePlan(dev[0], dev[1], dev[3], dev[4]).run(dev[0], dev[1], dev[2], out, k_scale=k_view, v_scale=v_view)
    want = reference.paged_decode(q.astype(np.float64), kc, vc, table, lens, k_scale=ks, v_scale=vs)
    for row in range(len(lens)):
        assert rel_error(to_host(out)[row], want[row]) < TOLERANCE["float16"], row
    rng = np.random.default_rng(3)
    k, v = (rng.standard_normal((5, 1, 128)).astype(np.float16) for _ in range(2))
    slots = np.array([0, 3, 17, -1, 40], np.int64)
    want_k, want_v = np.zeros(kc.shape, np.uint8), np.zeros(kc.shape, np.uint8)
    kernels.write_kv_reference(k, v, want_k, want_v, slots, k_scale=ks, v_scale=vs)
    got_k, got_v = cupy.zeros(kc.shape, np.uint8), cupy.zeros(kc.shape, np.uint8)
    kernels.write_kv(cupy.asarray(k), cupy.asarray(v), got_k, got_v, cupy.asarray(slots), k_scale=k_view,
                     v_scale=v_view)
    assert np.array_equal(to_host(got_k), want_k) and np.array_equal(to_host(got_v), want_v)


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c.group == 4 and c.block_size in (16, 128)],
                         ids=lambda c: f"{c.dtype}-d{c.head_dim}-b{c.block_size}")
def test_write_kv_quantises_bit_for_bit_as_the_reference(cfg):
    import cupy
    rng = np.random.default_rng(5)
    n, kv, d, bs = 300, 2, cfg.head_dim, cfg.block_size
    k = (rng.standard_normal((n, kv, d)) * rng.choice([1e-4, 1, 20, 1e4], (n, kv, 1))).astype(np.float32)
    k.reshape(-1)[:12] = [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 448, -464, 1.0625, 1.1875, 1e-30, -3e-3]
    k = k.astype(_dtype(cfg.dtype))
    v = (rng.standard_normal((n, kv, d)) * 3).astype(np.float32).astype(_dtype(cfg.dtype))
    scales = (rng.uniform(0.001, 0.2, kv).astype(np.float32), np.array([1.0, 0.37], np.float32))
    slots = rng.permutation(-(-n // bs) * bs + bs)[:n].astype(np.int64)
    slots[::7] = -1
    shape = (-(-n // bs) + 1, kv, bs, d)
    want_k, want_v = np.zeros(shape, np.uint8), np.zeros(shape, np.uint8)
    kernels.write_kv_reference(k, v, want_k, want_v, slots, k_scale=scales[0], v_scale=scales[1])
    kc, vc = cupy.zeros(shape, np.uint8), cupy.zeros(shape, np.uint8)
    kernels.write_kv(cupy.asarray(k), cupy.asarray(v), kc, vc, cupy.asarray(slots), k_scale=cupy.asarray(scales[0]),
                     v_scale=cupy.asarray(scales[1]))
    assert np.array_equal(to_host(kc), want_k) and np.array_equal(to_host(vc), want_v)


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c.group == 4 and c.block_size == 16],
                         ids=lambda c: f"{c.dtype}-d{c.head_dim}")
def test_accuracy_against_fp16_attention(cfg):
    """The trade: FP8 decode (scales = per-head absmax / 448) against attention over the same values in the
    input dtype, both on the device; relative errors printed, bounded loosely to catch a broken kernel."""
    import cupy
    rng = np.random.default_rng(7)
    bs, kv, d, n, batch = 16, 2, cfg.head_dim, 2000, 4
    dt = _dtype(cfg.dtype)
    width = -(-n // bs)
    table = np.arange(batch * width, dtype=np.int32).reshape(batch, width)
    k = rng.standard_normal((batch * width, kv, bs, d)).astype(np.float32)
    v = rng.standard_normal((batch * width, kv, bs, d)).astype(np.float32)
    k_scale = (np.abs(k).max(axis=(0, 2, 3)) / fp8.MAX).astype(np.float32)
    v_scale = (np.abs(v).max(axis=(0, 2, 3)) / fp8.MAX).astype(np.float32)
    q = rng.standard_normal((batch, kv * cfg.group, d)).astype(np.float32).astype(dt)
    lens = np.full(batch, n, np.int32)
    k16, v16 = cupy.asarray(k.astype(dt)), cupy.asarray(v.astype(dt))
    k8, v8 = cupy.zeros(k.shape, np.uint8), cupy.zeros(k.shape, np.uint8)
    slots = cupy.arange(k.shape[0] * bs, dtype=np.int64)
    flat = lambda a: a.transpose(0, 2, 1, 3).reshape(-1, kv, d)  # noqa: E731
    kernels.write_kv(flat(k16).copy(), flat(v16).copy(), k8, v8, slots, k_scale=cupy.asarray(k_scale),
                     v_scale=cupy.asarray(v_scale))
    qd, td, ld = cupy.asarray(q), cupy.asarray(table), cupy.asarray(lens)
    out16 = to_host(DecodePlan(qd, k16, td, ld).run(qd, k16, v16)).astype(np.float64)
    out8 = to_host(DecodePlan(qd, k8, td, ld).run(qd, k8, v8, k_scale=cupy.asarray(k_scale),
                                                  v_scale=cupy.asarray(v_scale))).astype(np.float64)
    exact = reference.paged_decode(q.astype(np.float64), k.astype(dt), v.astype(dt), table, lens)
    on_dequantised = reference.paged_decode(q.astype(np.float64), to_host(k8), to_host(v8), table, lens,
                                            k_scale=k_scale, v_scale=v_scale)
    vs_fp16, vs_exact, vs_dequantised = rel_error(out8, out16), rel_error(out8, exact), rel_error(out8, on_dequantised)
    print(f"\n{cfg.dtype} d{d}: FP8 decode vs {cfg.dtype} decode {vs_fp16:.2e}, vs float64 on the {cfg.dtype} values "
          f"{vs_exact:.2e}, vs float64 on the dequantised values {vs_dequantised:.2e}; {cfg.dtype} decode vs "
          f"float64 {rel_error(out16, exact):.2e}")
    assert vs_dequantised < TOLERANCE[cfg.dtype] and vs_fp16 < 0.1
