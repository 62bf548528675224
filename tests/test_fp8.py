"""FP8 (float8 e4m3) K/V on the host backend: the format, write_kv's quantisation, decode over dequantised
values, the cache, snapshots and translate, and the named errors of bad input."""

import json

import numpy as np
import pytest

from helpers import needs_ml_dtypes
from pagedrt import PagedKVCache, fp8, kernels
from pagedrt.attention import (DecodePlan, PrefillPlan, contiguous_decode, decode, paged_decode, paged_prefill, planner,
                               reference)
from pagedrt.errors import LaunchArgumentError, UnsupportedConfigError
from pagedrt.kernels import configs, write
from pagedrt.snapshot import load_snapshot

SCALES = np.array([0.02, 0.05], np.float32)


def test_values_are_e4m3fn():
    assert fp8.VALUES[0x7E] == 448 and fp8.VALUES[0xFE] == -448 and fp8.VALUES[0x38] == 1.0
    assert fp8.VALUES[0x01] == 2.0 ** -9 and fp8.VALUES[0x08] == 2.0 ** -6
    assert np.isnan(fp8.VALUES[[0x7F, 0xFF]]).all() and np.isfinite(np.delete(fp8.VALUES, [0x7F, 0xFF])).all()
    ml_dtypes = pytest.importorskip("ml_dtypes")
    theirs = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    assert np.array_equal(theirs, fp8.VALUES, equal_nan=True)


def test_quantise_rounds_to_nearest_even_saturates_and_keeps_nan():
    x = np.array([1.0625, 1.1875, -0.0, 0.0, 448, 464, 500, np.inf, -np.inf, np.nan, -np.nan, 2.0 ** -10,
                  3 * 2.0 ** -11, -1e-30], np.float32)
    bits = fp8.quantise(x[None, None], np.ones(1, np.float32))[0, 0]
    #      1.0625: tie -> 1.0 (even); 1.1875: tie -> 1.25; 464: tie between 448 and (no 480) -> 448
    assert list(bits) == [0x38, 0x3A, 0x80, 0x00, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7F, 0x7F, 0x00, 0x01, 0x80]


def test_quantise_matches_ml_dtypes_in_range_and_divides_in_float32():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((4000, 2, 16)) * rng.choice([1e-3, 1, 10, 30], (4000, 1, 1))).astype(np.float16)
    bits = fp8.quantise(x, SCALES)
    y = x.astype(np.float32) / SCALES[:, None]
    inside = np.abs(y) <= 448
    assert np.array_equal(bits[inside], y[inside].astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    assert set(np.unique(bits[~inside] & 0x7F)) <= {0x7E}
    back = fp8.dequantise(bits.transpose(1, 0, 2), SCALES).transpose(1, 0, 2)  # exact: value * scale
    assert np.array_equal(back[inside], (fp8.VALUES[bits] * SCALES[:, None])[inside])
    error = np.abs(back - x.astype(np.float64))[inside]
    assert np.all(error <= np.abs(x.astype(np.float64))[inside] / 16 + (2.0 ** -10 * SCALES[:, None] + 0 * x)[inside])


def planes(num_blocks=12, kv=2, bs=16, d=128):
    return (np.full((num_blocks, kv, bs, d), fp8.NAN_BITS, np.uint8),
            np.full((num_blocks, kv, bs, d), fp8.NAN_BITS, np.uint8))


def test_write_kv_quantises_into_fp8_planes_and_skips_padding():
    rng = np.random.default_rng(2)
    kc, vc = planes()
    k, v = (rng.standard_normal((5, 2, 128)).astype(np.float16) for _ in range(2))
    slots = np.array([3, -1, 17, 40, 191], np.int64)
    kernels.write_kv(k, v, kc, vc, slots, k_scale=SCALES, v_scale=SCALES * 2)
    for token, slot in enumerate(slots):
        if slot < 0:
            continue
        assert np.array_equal(kc[slot // 16, :, slot % 16], fp8.quantise(k[token], SCALES))
        assert np.array_equal(vc[slot // 16, :, slot % 16], fp8.quantise(v[token], SCALES * 2))
    assert (kc == fp8.NAN_BITS).sum() == kc.size - 4 * 2 * 128


def case(dtype=np.float16, d=128, group=4, lens=(1, 15, 16, 17, 300)):
    rng = np.random.default_rng(3)
    bs, kv = 16, 2
    kc, vc = planes(60, kv, bs, d)
    width = max(-(-n // bs) for n in lens)
    ids = rng.permutation(60)
    table = np.zeros((len(lens), width), np.int32)
    used = 0
    for row, n in enumerate(lens):
        nb = -(-n // bs)
        table[row, :nb] = ids[used:used + nb]
        used += nb
        for t in range(n):
            b, s = table[row, t // bs], t % bs
            kc[b, :, s] = fp8.quantise(rng.standard_normal((kv, d)), SCALES)
            vc[b, :, s] = fp8.quantise(rng.standard_normal((kv, d)), SCALES[::-1].copy())
    q = rng.standard_normal((len(lens), kv * group, d)).astype(dtype)
    return q, kc, vc, table, np.array(lens, np.int32)


def test_decode_attends_over_the_dequantised_values():
    q, kc, vc, table, lens = case()
    v_scale = SCALES[::-1].copy()
    out = paged_decode(q, kc, vc, table, lens, k_scale=SCALES, v_scale=v_scale)
    assert out.dtype == np.float16
    for row, n in enumerate(lens):
        blocks = table[row, :-(-n // 16)]
        k = fp8.dequantise(kc[blocks], SCALES).transpose(1, 0, 2, 3).reshape(2, -1, 128)[:, :n]
        v = fp8.dequantise(vc[blocks], v_scale).transpose(1, 0, 2, 3).reshape(2, -1, 128)[:, :n]
        want = reference.attend(q[row:row + 1].astype(np.float64), k, v, 1 / np.sqrt(128))[0]
        np.testing.assert_allclose(out[row], want, rtol=2e-3, atol=2e-3)
    plan = DecodePlan(q, kc, table, lens, num_splits=3)
    split = plan.run(q, kc, vc, k_scale=SCALES, v_scale=v_scale)
    np.testing.assert_allclose(split.astype(np.float64), out.astype(np.float64), rtol=2e-3, atol=2e-3)


def test_decode_refuses_missing_or_bad_scales_and_fp8_where_unsupported():
    q, kc, vc, table, lens = case()
    plan = DecodePlan(q, kc, table, lens)
    bad = [{}, {"k_scale": SCALES}, {"k_scale": SCALES.astype(np.float64), "v_scale": SCALES},
           {"k_scale": SCALES[:1], "v_scale": SCALES}, {"k_scale": SCALES, "v_scale": np.ones((1, 2), np.float32)},
           {"k_scale": list(SCALES), "v_scale": SCALES}]
    for scales in bad:
        with pytest.raises(LaunchArgumentError, match="scale"):
            plan.run(q, kc, vc, **scales)
    fp16 = kc.astype(np.float16)
    with pytest.raises(LaunchArgumentError, match="FP8"):
        paged_decode(q, fp16, fp16, table, lens, k_scale=SCALES, v_scale=SCALES)
    with pytest.raises(UnsupportedConfigError, match="float16, bfloat16"):
        paged_decode(q.astype(np.float32), kc, vc, table, lens, k_scale=SCALES, v_scale=SCALES)
    with pytest.raises(UnsupportedConfigError, match="head_dim"):
        big = np.zeros((4, 2, 16, 256), np.uint8)
        paged_decode(np.zeros((1, 8, 256), np.float16), big, big, table[:1, :1], lens[:1], k_scale=SCALES,
                     v_scale=SCALES)
    with pytest.raises(UnsupportedConfigError, match="head_dim"):  # prefill too: FP8 at head_dim 64 and 128
        big = np.zeros((4, 2, 16, 256), np.uint8)
        PrefillPlan(np.zeros((1, 8, 256), np.float16), big, table[:1, :1], lens[:1], np.array([0, 1], np.int32))
    with pytest.raises(UnsupportedConfigError, match="contiguous"):
        contiguous = np.zeros((5, 3, 2, 16, 128), np.uint8)
        contiguous_decode(q, contiguous, contiguous, lens.clip(1, 48))
    with pytest.raises(LaunchArgumentError, match="FP8"):
        kernels.write_kv(q[:, :2].copy(), q[:, :2].copy(), kc, vc, np.arange(5, dtype=np.int64), k_scale=SCALES)


def test_prefill_attends_over_the_dequantised_values_and_checks_its_scales():
    """A prefill over FP8 planes (on NumPy: the reference over the dequantised values, with float64 K/V) equals
    prefill over the dequantised planes themselves; every row is the prefill kernel's; scales are checked as
    decode checks them."""
    q, kc, vc, table, lens = case(lens=(1, 40, 17, 300))
    new = np.array([1, 7, 17, 30])
    qo = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    rng = np.random.default_rng(4)
    queries = rng.standard_normal((int(qo[-1]), q.shape[1], 128)).astype(np.float16)
    v_scale = SCALES[::-1].copy()
    plan = PrefillPlan(queries, kc, table, lens, qo, query_lens=new)
    assert plan.decode_rows.tolist() == [0]  # the one-token row: decode_fp8's indexed variant on a device
    out = plan.run(queries, kc, vc, k_scale=SCALES, v_scale=v_scale)
    want = reference.prefill(queries, fp8.dequantise(kc, SCALES), fp8.dequantise(vc, v_scale), table, lens, qo)
    assert out.dtype == np.float16 and np.array_equal(out, want)
    full = paged_prefill(queries, kc, vc, table, lens, qo, causal=False, k_scale=SCALES, v_scale=v_scale)
    assert np.array_equal(full, reference.prefill(queries, fp8.dequantise(kc, SCALES), fp8.dequantise(vc, v_scale),
                                                  table, lens, qo, causal=False))
    for scales in ({}, {"k_scale": SCALES}, {"k_scale": SCALES[:1], "v_scale": SCALES}):
        with pytest.raises(LaunchArgumentError, match="scale"):
            plan.run(queries, kc, vc, **scales)
    fp16 = kc.astype(np.float16)
    with pytest.raises(LaunchArgumentError, match="FP8"):
        paged_prefill(queries, fp16, fp16, table, lens, qo, k_scale=SCALES, v_scale=SCALES)
    with pytest.raises(UnsupportedConfigError, match="float16, bfloat16"):
        PrefillPlan(queries.astype(np.float32), kc, table, lens, qo)


def test_fp8_kernels_are_named_and_planned_with_the_bytes_of_fp16_in_flight():
    """To 8 heads (transposed, half the registers) an FP8 kernel takes fp16's tile and stages at half the bytes,
    so twice the thread blocks share an SM; to 16 heads its tile holds twice the tokens (two chunks a warp), past
    them it takes twice the stages: either way the shared memory of the fp16 kernel."""
    cfg = configs.config("bfloat16", 64, 32, 8, kv_dtype=configs.FP8)
    assert cfg.fp8 and cfg.kv_itemsize == 1
    assert decode.kernel_name(cfg, True, "standard") == ("pagedrt::decode_fp8<__nv_bfloat16, 64, 32, 8, 128, 64, 3, "
                                                         "256, false>")
    assert decode.kernel_name(cfg, True, "standard", indexed=True).endswith(", 256, true>")  # mixed steps' rows
    assert write.kernel_name(cfg) == "pagedrt::write_kv_fp8<__nv_bfloat16, 64, 32>"
    ids = 4 * planner.IDS_WINDOW
    for group in (1, 4, 8):
        for name in planner.GEOMETRIES:
            fp16 = planner.geometry(configs.config("bfloat16", 128, 32, group), name)
            geo = planner.geometry(configs.config("bfloat16", 128, 32, group, kv_dtype=configs.FP8), name)
            assert geo.mma and (geo.tile, geo.stages, geo.threads) == (fp16.tile, fp16.stages, fp16.threads)
            assert geo.smem_bytes - ids == (fp16.smem_bytes - ids) // 2, (group, name)
    for group, tile, stages in ((9, 2, 1), (16, 2, 1), (24, 1, 2), (64, 1, 2)):
        for name in planner.GEOMETRIES:
            fp16 = planner.geometry(configs.config("bfloat16", 128, 32, group), name)
            geo = planner.geometry(configs.config("bfloat16", 128, 32, group, kv_dtype=configs.FP8), name)
            assert geo.mma and (geo.tile, geo.stages) == (tile * fp16.tile, stages * fp16.stages), (group, name)
            assert geo.smem_bytes == fp16.smem_bytes
    names = decode.instances()["decode.cu"]
    assert all(decode.kernel_name(c, True, g) in names for c in configs.fp8_sweep() for g in planner.GEOMETRIES)
    assert not any("decode_fp8" in n for n in decode.instances(configs.sweep())["decode.cu"])


@needs_ml_dtypes
def test_cache_stores_fp8_with_scales_and_snapshots_translate_know_it(tmp_path):
    scales = np.full((2, 2, 2), 0.05, np.float32)
    scales[1, 1] = [0.1, 0.2]
    cache = PagedKVCache(2, 2, 128, 16, "bfloat16", kv_dtype="float8_e4m3", kv_scales=scales, max_tokens=1024,
                         backend="host")
    try:
        assert cache.kv_dtype == "float8_e4m3" and cache.dtype.name == "bfloat16"
        assert cache.k(1).dtype == np.uint8 and cache.layout.itemsize == 1 and cache.layout.dtype == "float8_e4m3"
        assert np.array_equal(cache.v_scale(1), np.float32([0.1, 0.2])) and cache.k_scale(0).dtype == np.float32
        assert "float8_e4m3" in repr(cache)
        step = cache.step(arrivals=[np.arange(20)])
        t = cache.translate(int(step.arrived[0]), 17, layer=1, kv="v", head=1)
        assert t.nbytes == 128
        cache.write_snapshot(tmp_path / "s.json")
        assert json.loads((tmp_path / "s.json").read_text())["layout"]["dtype"] == "float8_e4m3"
        assert load_snapshot(tmp_path / "s.json")["layout"]["itemsize"] == 1
    finally:
        cache.close()
    fp16 = PagedKVCache(2, 2, 128, 16, "float16", max_tokens=1024, backend="host")
    try:
        assert fp16.kv_dtype == "float16" and fp16.k_scale(0) is None
    finally:
        fp16.close()


@pytest.mark.parametrize("kw, match", [
    ({"kv_dtype": "float8_e4m3", "kv_scales": np.ones((2, 2, 3))}, "shape"),
    ({"kv_dtype": "float8_e4m3", "kv_scales": np.zeros((2, 2, 2))}, "positive"),
    ({"kv_dtype": "float8_e4m3", "kv_scales": np.full((2, 2, 2), np.inf)}, "positive"),
    ({"kv_scales": np.ones((2, 2, 2))}, "only"),
    ({"kv_dtype": "bfloat16"}, "stored"),
    ({"kv_dtype": "float8_e5m2"}, "K/V dtype"),
    ({"kv_dtype": "float8_e4m3", "dtype": "float32"}, "float16, bfloat16"),
    ({"kv_dtype": "float8_e4m3", "head_dim": 96}, "head_dim"),
])
def test_cache_refuses_bad_fp8_arguments(kw, match):
    args = {"dtype": "float16", "head_dim": 128, **kw}
    with pytest.raises(UnsupportedConfigError, match=match):
        PagedKVCache(2, 2, args.pop("head_dim"), 16, args.pop("dtype"), max_tokens=1024, backend="host", **args)


def test_cli_reads_fp8_snapshots(tmp_path):
    from click.testing import CliRunner

    from pagedrt.cli import main
    cache = PagedKVCache(2, 2, 128, 16, "float16", kv_dtype="float8_e4m3", max_tokens=1024, backend="host")
    try:
        cache.step(arrivals=[np.arange(40)])
        cache.write_snapshot(tmp_path / "s.json")
    finally:
        cache.close()
    result = CliRunner().invoke(main, ["translate", "0", "37", str(tmp_path / "s.json")])
    assert result.exit_code == 0 and "128 contiguous bytes (128 x float8_e4m3)" in result.output
    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "s.json")])
    assert result.exit_code == 0
