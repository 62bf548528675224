"""The fused-epilogue GEMMs on the host (pagedrt.engine.layer_gemm): each reference against the unfused ops it
replaces (``ops.add_rms_norm``, ``ops.gemm``, ``ops.silu_mul``, the residual add) computed apart in float64 and
rounded where they round; the configuration choice's invariants; the named errors, with nothing written."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import needs_ml_dtypes
from pagedrt.engine import layer_gemm as lg
from pagedrt.engine import ops
from pagedrt.errors import LaunchArgumentError
from pagedrt.spec import numpy_dtype

DTYPES = ["float64", "float16", pytest.param("bfloat16", marks=needs_ml_dtypes)]
H200 = dict(smem_limit=227 << 10)


def problem(dtype, m, k, rows, seed=0):
    """(residual float32 [m, k], norm weight float32 [k], a [m, k], w [rows, k]) of ``dtype``."""
    rng = np.random.default_rng(seed)
    t = numpy_dtype(dtype) if dtype == "bfloat16" else np.dtype(dtype)
    x = (3 * rng.standard_normal((m, k))).astype(np.float32)
    g = (1 + 0.1 * rng.standard_normal(k)).astype(np.float32)
    a = rng.standard_normal((m, k)).astype(t)
    w = (rng.standard_normal((rows, k)) / np.sqrt(k)).astype(t)
    return x, g, a, w


def unfused_norm(x, g, dtype, eps):
    """ops.add_rms_norm's output (no delta) in ``dtype``, from float64 arithmetic."""
    out = np.empty(x.shape, np.float64)
    ops.add_rms_norm(x.copy(), None, g, out, eps)
    return out.astype(dtype)


def matmul(a, w):
    return a.astype(np.float64) @ w.astype(np.float64).T


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k, n", [(1, 64, 8), (9, 192, 320), (37, 576, 960)])
def test_norm_gemm_is_the_norm_then_the_gemm(dtype, m, k, n):
    x, g, _, w = problem(dtype, m, k, n)
    out = np.empty((m, n), w.dtype)
    lg.norm_gemm(x, g, w, out, 1e-5)
    expected = matmul(unfused_norm(x, g, w.dtype, 1e-5), w).astype(w.dtype)
    assert np.array_equal(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k, f", [(1, 64, 8), (9, 192, 320), (37, 576, 1536)])
def test_norm_gemm_silu_is_the_norm_the_gemm_and_silu_mul(dtype, m, k, f):
    x, g, _, w = problem(dtype, m, k, 2 * f)
    out = np.empty((m, f), w.dtype)
    lg.norm_gemm_silu(x, g, w, out, 1e-5)
    gate_up = matmul(unfused_norm(x, g, w.dtype, 1e-5), w).astype(w.dtype)  # rounded, as cuBLAS's output
    expected = np.empty((m, f), w.dtype)
    ops.silu_mul(gate_up, expected)
    np.testing.assert_array_equal(out, expected)
    signs = np.sign(gate_up.astype(np.float64))
    assert np.all(np.sign(out.astype(np.float64)) == signs[:, :f] * signs[:, f:])  # silu(g) has g's sign


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k, n", [(1, 64, 8), (9, 384, 192), (37, 1536, 576)])
def test_gemm_add_adds_the_rounded_product_to_the_residual(dtype, m, k, n):
    x, _, a, w = problem(dtype, m, k, n)
    residual = x[:, :n].copy()
    lg.gemm_add(a, w, residual)
    delta = matmul(a, w).astype(w.dtype)  # what the o or down GEMM stored, then add_rms_norm added
    expected = x[:, :n].copy()
    ops.add_rms_norm(expected, delta, np.ones(n, np.float32), np.empty((m, n)), 1e-5)
    assert residual.dtype == np.float32 and np.array_equal(residual, expected)


def test_rounding_to_the_weights_dtype_is_where_the_unfused_path_rounds():
    """In float16 the norm's output is rounded before the GEMM: the unrounded product differs, and the
    reference does not give it."""
    x, g, _, w = problem("float16", 16, 192, 64, seed=3)
    out = np.empty((16, 64), np.float16)
    lg.norm_gemm(x, g, w, out, 1e-5)
    exact = matmul(unfused_norm(x, g, np.float64, 1e-5), w).astype(np.float16)
    assert not np.array_equal(out, exact)


@settings(max_examples=200, deadline=None)
@given(m=st.integers(1, 512), k=st.integers(1, 40).map(lambda x: 64 * x), variant=st.sampled_from(lg.VARIANTS),
       smem_limit=st.sampled_from([48 << 10, 99 << 10, 163 << 10, 227 << 10]))
def test_the_chosen_config_is_the_first_in_the_table_that_covers_and_fits(m, k, variant, smem_limit):
    prologue, epilogue = variant
    config = lg.choose(prologue, epilogue, m, k, smem_limit)
    entries = [c for rows, depth, c in lg.TABLE[variant]
               if m <= rows and k <= depth and lg.smem_bytes(prologue, c, k) <= smem_limit]
    assert config == (entries[0] if entries else lg.FALLBACK)
    assert config in lg.configs(variant)


@pytest.mark.parametrize("variant", lg.VARIANTS)
def test_every_config_is_a_valid_instance(variant):
    """8 warps split WARPS_K ways over k and the rest over the tile in whole 16 x 16 fragments; SiLU's tiles hold
    as many gate rows as up rows a warp (as cuda_src/layer_gemm.cu asserts, checked here before a compile)."""
    for bm, bn, stages, warps_k in lg.configs(variant):
        warps = 8 // warps_k
        warps_m = min(bm // 16, warps)
        assert warps_k in (1, 2, 4) and stages >= 2 and bm % 16 == 0
        assert (bm // warps_m) % 16 == 0 and (bn // (warps // warps_m)) % 16 == 0


def test_smollm2_launches_fit_the_h200_at_every_batch():
    """SmolLM2-135M's four GEMMs from 9 to 256 rows: each launch's shared memory fits an H200's block."""
    shapes = {"qkv": (576, lg.NORM, lg.STORE), "o": (576, lg.PLAIN, lg.ADD), "gate_up": (576, lg.NORM, lg.SILU_UP),
              "down": (1536, lg.PLAIN, lg.ADD)}
    for m in range(lg.MIN_ROWS, lg.MAX_ROWS + 1):
        for k, prologue, epilogue in shapes.values():
            config = lg.choose(prologue, epilogue, m, k, H200["smem_limit"])
            assert config != lg.FALLBACK and lg.smem_bytes(prologue, config, k) <= H200["smem_limit"]


def test_unsupported_names_the_reason():
    from types import SimpleNamespace as NS
    c = NS(hidden=576, ffn=1536, q_heads=9, kv_heads=3, head_dim=64)
    spec = NS(dtype=np.dtype(np.float16))
    assert lg.unsupported(c, spec, 90, 227 << 10) is None
    assert "capability" in lg.unsupported(c, spec, 75, 227 << 10)
    assert "float32" in lg.unsupported(c, NS(dtype=np.dtype(np.float32)), 90, 227 << 10)
    assert "multiple of 64" in lg.unsupported(NS(hidden=576, ffn=1000, q_heads=9, kv_heads=3, head_dim=64), spec, 90,
                                              227 << 10)
    assert "shared memory" in lg.unsupported(NS(hidden=8192, ffn=28672, q_heads=64, kv_heads=8, head_dim=128), spec,
                                             90, 99 << 10)


def test_bad_arguments_are_named_errors_and_write_nothing():
    x, g, a, w = problem("float16", 9, 192, 320)
    out = np.zeros((9, 320), np.float16)
    cases = [lambda: lg.norm_gemm(x.astype(np.float16), g, w, out, 1e-5),  # the residual is float32
             lambda: lg.norm_gemm(x, g, w[:, :128], out, 1e-5),  # k differs
             lambda: lg.norm_gemm(x, g[:64], w, out, 1e-5),
             lambda: lg.norm_gemm(x, g, w, out.astype(np.float32), 1e-5),
             lambda: lg.norm_gemm(x[:, :96], g[:96], w[:, :96], out, 1e-5),  # k not a multiple of 64
             lambda: lg.norm_gemm_silu(x, g, w, out, 1e-5),  # w holds 2 x 160 rows, not 2 x 320
             lambda: lg.gemm_add(a, w, out),  # the residual is float32
             lambda: lg.gemm_add(a[:, ::2], w[:, :96], x[:, :320].copy())]
    for call in cases:
        with pytest.raises(LaunchArgumentError):
            call()
    assert not out.any()


def model(seed=0):
    """A 3-layer GGUFModel of random weights: hidden 192 (3 query heads, 1 KV head of 64), ffn 320."""
    from pagedrt.engine.config import ModelConfig
    from pagedrt.engine.loader import GGUFModel, Weights
    c = ModelConfig(name="layer gemm test", num_layers=3, hidden=192, ffn=320, q_heads=3, kv_heads=1, head_dim=64,
                    vocab_size=517, context_length=4096, rope_theta=10000.0, rope_scale=1.0, rms_eps=1e-5)
    rng = np.random.default_rng(seed)
    mat = lambda o, i: (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)  # noqa: E731
    norm = lambda: (1 + 0.1 * rng.standard_normal(c.hidden)).astype(np.float32)  # noqa: E731
    layers = [{"attn_norm": norm(), "ffn_norm": norm(), "qkv": mat(5 * 64, c.hidden), "o": mat(c.hidden, c.hidden),
               "gate_up": mat(2 * c.ffn, c.hidden), "down": mat(c.hidden, c.ffn)} for _ in range(c.num_layers)]
    return GGUFModel("layer gemm test", c, None, Weights(mat(517, c.hidden), mat(517, c.hidden), norm(), layers))


def test_the_host_models_decode_step_on_the_fused_layers_equals_the_unfused_one():
    """The fused layers' wiring (which buffer each launch reads and writes) on the host model, whose float64
    activations make every rounding exact: the same logits as the unfused layers, from five launches a layer."""
    from pagedrt import PagedKVCache
    from pagedrt.engine.model import LlamaModel
    gguf = model()
    c = gguf.config
    rng = np.random.default_rng(2)
    with PagedKVCache(c.num_layers, c.kv_heads, c.head_dim, 16, "float16", max_tokens=4096, max_seqs=12,
                      backend="host") as cache:
        m = LlamaModel(gguf, cache)
        assert not m.fused_gemms  # the host runs the unfused layers unless told otherwise
        prompts = [rng.integers(0, c.vocab_size, n) for n in rng.integers(1, 40, 12)]
        m.forward(cache.step([], arrivals=prompts), np.concatenate(prompts))
        ids = rng.integers(0, c.vocab_size, 12)
        step = cache.step(None, 1, ids)
        logits, kinds = [], []
        for fused in (False, True):  # the second pass writes the same K/V into the same slots
            m.fused_gemms = fused
            b = m.buffers(12, 12)
            launches = list(m.launches(step, ids, b, *m.plans(step, b, True)))
            for _, launch in launches:
                launch()
            logits.append(b["logits"].copy())
            kinds.append([kind for kind, _ in launches])
    assert len(kinds[0]) == 3 + 9 * c.num_layers and len(kinds[1]) == 3 + 5 * c.num_layers
    assert kinds[1][1:6] == ["norm_gemm_qkv_rope_write", "attention", "gemm_o_add", "norm_gemm_gate_up_silu",
                             "gemm_down_add"]
    np.testing.assert_allclose(logits[1], logits[0], rtol=1e-6, atol=1e-6 * np.abs(logits[0]).max())


def test_instances_name_every_variant_and_config_per_dtype():
    names = lg.instances()[lg.FILE]
    assert len(set(names)) == len(names) == len(lg.DTYPES) * sum(len(lg.configs(v)) for v in lg.VARIANTS)
    assert "pagedrt::layer_gemm<__nv_bfloat16, 0, 1, 16, 32, 2, 4>" in names
