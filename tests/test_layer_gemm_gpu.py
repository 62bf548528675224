"""The fused-epilogue GEMMs (``pagedrt.engine.layer_gemm``) on a GPU: every variant and configuration against its
float64 reference, fp16 and bf16, rows not a multiple of the tile, random shapes; and the layered decode step that runs them against
the one that runs cuBLAS and the unfused ops, and against the host path, in and out of CUDA graphs."""

import numpy as np
import pytest

from helpers import compile_all, needs_ml_dtypes, to_host
from rope_cases import Problem
from test_layer_gemm import model, problem

pytestmark = pytest.mark.gpu

SHAPES = {"norm_gemm": [(9, 192, 320), (37, 576, 960), (256, 576, 960)],
          "norm_gemm_silu": [(9, 192, 320), (100, 576, 1536), (256, 576, 1536)],
          "gemm_add": [(9, 384, 192), (130, 576, 576), (256, 1536, 576)]}
TOLERANCE = {"float16": 2e-3, "bfloat16": 1.6e-2}  # a rounding or two of the output's dtype (bf16: 8 bits)


def run_variant(name, dtype, m, k, n, seed=0):
    """The variant on the device and on the host; returns (device result, reference) as float64."""
    import cupy as cp
    from pagedrt.engine import layer_gemm as lg
    x, g, a, w = problem(dtype, m, k, 2 * n if name == "norm_gemm_silu" else n, seed)
    if name == "gemm_add":
        residual = (3 * np.random.default_rng(seed + 1).standard_normal((m, n))).astype(np.float32)
        dev = to_host(lg.gemm_add(cp.asarray(a), cp.asarray(w), cp.asarray(residual))) - residual
        ref = lg.gemm_add(a, w, residual.copy()) - residual
        return dev.astype(np.float64), ref.astype(np.float64)  # what was added
    fn = getattr(lg, name)
    out = np.empty((m, n), w.dtype)
    dev = fn(cp.asarray(x), cp.asarray(g), cp.asarray(w), cp.empty((m, n), w.dtype), 1e-5)
    return to_host(dev).astype(np.float64), fn(x, g, w, out, 1e-5).astype(np.float64)


def close(dev, ref, dtype):
    """Within TOLERANCE of the reference's largest magnitude, element by element."""
    scale = np.abs(ref).max()
    return float(np.abs(dev - ref).max() / scale) <= TOLERANCE[dtype]


@pytest.fixture(scope="module", autouse=True)
def compiled():
    from pagedrt.engine import layer_gemm as lg
    from pagedrt.engine import rope_write
    from pagedrt.kernels import configs, validate
    cfgs = [configs.Config(d, h, 16, 1, configs.FP8 if fp8 else None) for d, fp8 in ROPE_DTYPES for h in (64, 128)]
    compile_all(lg.instances(), rope_write.instances(cfgs), validate.instances())


@pytest.mark.parametrize("dtype", ["float16", pytest.param("bfloat16", marks=needs_ml_dtypes)])
@pytest.mark.parametrize("name", list(SHAPES))
def test_variants_match_their_references(name, dtype):
    for m, k, n in SHAPES[name]:
        dev, ref = run_variant(name, dtype, m, k, n)
        assert close(dev, ref, dtype), (name, dtype, m, k, n)


@pytest.mark.parametrize("dtype", ["float16", pytest.param("bfloat16", marks=needs_ml_dtypes)])
@pytest.mark.parametrize("name", list(SHAPES))
def test_random_shapes_match_their_references(name, dtype):
    """Rows 1..300, depth a multiple of 64 up to 1536, output columns a multiple of 8."""
    rng = np.random.default_rng(7)
    for i in range(5):
        m, k, n = int(rng.integers(1, 301)), 64 * int(rng.integers(1, 25)), 8 * int(rng.integers(1, 200))
        dev, ref = run_variant(name, dtype, m, k, n, seed=i)
        assert close(dev, ref, dtype), (name, dtype, m, k, n)


VARIANT = {"norm_gemm": (0, 0), "norm_gemm_silu": (0, 1), "gemm_add": (1, 2)}


@pytest.mark.parametrize("dtype", ["float16", pytest.param("bfloat16", marks=needs_ml_dtypes)])
@pytest.mark.parametrize("name", list(SHAPES))
def test_every_config_matches_the_reference(name, dtype, monkeypatch):
    """Each configuration forced in turn, at 37 rows (no tile's multiple) and columns past a whole tile."""
    from pagedrt.engine import layer_gemm as lg
    for config in lg.configs(VARIANT[name]):
        monkeypatch.setattr(lg, "choose", lambda *_, c=config: c)
        lg._plan.cache_clear()
        m, k, n = (37, 384, 200) if name == "norm_gemm_silu" else (37, 640, 328)
        dev, ref = run_variant(name, dtype, m, k, n, seed=1)
        assert close(dev, ref, dtype), (name, config)
    lg._plan.cache_clear()


def decode(gguf, backend, batch, fed, graphs=False, fused=True, steps=4):
    """Prefill ``batch`` prompts, then ``steps`` decode steps fed ``fed[i]`` (or the greedy tokens when None);
    returns each decode step's logits, the tokens fed, and the kinds of the model's last decode step."""
    from pagedrt import PagedKVCache
    from pagedrt.engine.model import LlamaModel
    c = gguf.config
    rng = np.random.default_rng(batch)
    with PagedKVCache(c.num_layers, c.kv_heads, c.head_dim, 16, "float16", max_tokens=16384, max_seqs=batch,
                      backend=backend) as cache:
        m = LlamaModel(gguf, cache, graphs=graphs, fused=fused)
        xp = cache.xp
        with m.stream:
            prompts = [rng.integers(0, c.vocab_size, n) for n in rng.integers(1, 90, batch)]
            tokens = to_host(m.forward(cache.step([], arrivals=prompts), xp.asarray(np.concatenate(prompts)))).argmax(1)
            out, inputs = [], []
            for i in range(steps):
                tokens = tokens if fed is None else fed[i]
                inputs.append(tokens)
                step = cache.step(None, 1, tokens)
                out.append(to_host(m.forward(step, xp.asarray(tokens))).copy())
                tokens = out[-1].argmax(1)
            buffers = m.buffers(step.num_tokens, len(step.seqs))
            kinds = [kind for kind, _ in m.launches(step, xp.asarray(tokens), buffers, *m.plans(step, buffers, True))]
    return out, inputs, kinds


@pytest.mark.parametrize("batch", [12, 40])
def test_decode_steps_match_cublas_and_the_host(batch):
    gguf = model()
    host, fed, _ = decode(gguf, "host", batch, None)
    cublas, _, kinds = decode(gguf, "cuda", batch, fed, fused=False)
    assert "gemm_down" in kinds and "silu_mul" in kinds
    runs = {}
    for graphs in (False, True):
        runs[graphs], _, kinds = decode(gguf, "cuda", batch, fed, graphs=graphs)
        assert kinds.count("gemm_down_add") == 3 and "silu_mul" not in kinds and "rope_write" not in kinds
        assert kinds.count("norm_gemm_qkv_rope_write") == 3
        for fused, unfused, h in zip(runs[graphs], cublas, host):
            assert np.abs(fused - h).max() / h.std() < 0.02
            assert np.abs(fused - unfused).max() / h.std() < 0.02
            assert np.mean(fused.argmax(1) == h.argmax(1)) >= 0.9
    for eager, graph in zip(runs[False], runs[True]):  # the same kernels, in a graph or not
        np.testing.assert_allclose(graph, eager, rtol=0, atol=1e-3)


ROPE_DTYPES = [("float16", False), ("bfloat16", False), ("float16", True), ("bfloat16", True)]


def rope_step(dtype, fp8_planes, head_dim, rows=23, k=192, seed=0):
    """A decode step of ``rows`` rows (one token each, some padding slots) over poisoned planes, and the residual,
    norm weight and QKV weight whose norm_gemm is its qkv."""
    rng = np.random.default_rng(seed)
    p = Problem(dtype, fp8_planes, head_dim, query_lens=(1,) * rows, cached=tuple(rng.integers(0, 90, rows)),
                q_heads=6, kv_heads=2, pad=5, seed=seed)
    x, g, _, w = problem(dtype, rows, k, p.qkv.shape[1], seed)
    return p, x, g, w


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype, fp8_planes", [(d, f8) if d == "float16" else pytest.param(d, f8, marks=needs_ml_dtypes)
                                               for d, f8 in ROPE_DTYPES])
def test_norm_gemm_rope_write_is_norm_gemm_then_rope_write_bit_for_bit(dtype, fp8_planes, head_dim):
    """q and both planes, byte for byte, against the two launches it replaces (poisoned planes, padding slots);
    and against the float64 rotation computed apart (rope_cases) of the qkv the device's norm_gemm makes, which
    the tests above hold to its reference."""
    import cupy as cp
    from pagedrt.engine import layer_gemm as lg
    from pagedrt.engine.rope_write import RopeWritePlan
    p, x, g, w = rope_step(dtype, fp8_planes, head_dim)
    dx, dg, dw = cp.asarray(x), cp.asarray(g), cp.asarray(w)
    steps = [cp.asarray(getattr(p, name)) for name in ("slots", "qo_indptr", "seq_lens", "inv_freq")]
    qkv = cp.empty(p.qkv.shape, w.dtype)
    results = []
    for fused in (True, False):
        buffer, q = cp.asarray(p.buffer), cp.asarray(p.q)
        k, v = p.planes(buffer)
        plan = RopeWritePlan(qkv, q, k, *steps)
        if fused:
            lg.norm_gemm_rope_write(dx, dg, dw, plan, q, k, v, 1e-5, **p.scale_keywords(cp))
        else:
            plan.run(lg.norm_gemm(dx, dg, dw, qkv, 1e-5), q, k, v, **p.scale_keywords(cp))
        results.append((to_host(q), to_host(buffer)))
    (q_fused, b_fused), (q_apart, b_apart) = results
    assert q_fused.tobytes() == q_apart.tobytes() and b_fused.tobytes() == b_apart.tobytes()
    p.qkv = to_host(qkv)
    p.check(q_fused, b_fused)


def test_norm_gemm_rope_write_refuses_bad_arguments_by_name_and_writes_nothing():
    """A QKV weight of other rows (its epilogue would store past the heads), a float64 norm weight, q of another
    dtype, x of another dtype, and a plan of a prefill step."""
    import cupy as cp
    from pagedrt.engine import layer_gemm as lg
    from pagedrt.engine.rope_write import RopeWritePlan
    from pagedrt.errors import LaunchArgumentError
    p, x, g, w = rope_step("float16", False, 64, rows=9)
    buffer, q = cp.asarray(p.buffer), cp.asarray(p.q)
    k, v = p.planes(buffer)
    steps = [cp.asarray(getattr(p, name)) for name in ("slots", "qo_indptr", "seq_lens", "inv_freq")]
    plan = RopeWritePlan(cp.empty(p.qkv.shape, w.dtype), q, k, *steps)
    dx, dg, dw = cp.asarray(x), cp.asarray(g), cp.asarray(w)
    cases = [lambda: lg.norm_gemm_rope_write(dx, dg, cp.concatenate([dw, dw[:64]]), plan, q, k, v, 1e-5),
             lambda: lg.norm_gemm_rope_write(dx, dg, dw[:-64], plan, q, k, v, 1e-5),
             lambda: lg.norm_gemm_rope_write(dx, dg.astype(np.float64), dw, plan, q, k, v, 1e-5),
             lambda: lg.norm_gemm_rope_write(dx, dg, dw, plan, q.astype(np.float32), k, v, 1e-5),
             lambda: lg.norm_gemm_rope_write(dx.astype(np.float16), dg, dw, plan, q, k, v, 1e-5)]
    for call in cases:
        with pytest.raises(LaunchArgumentError):
            call()
    cp.cuda.get_current_stream().synchronize()
    assert to_host(buffer).tobytes() == p.buffer.tobytes() and np.isnan(to_host(q).astype(np.float32)).all()


def test_norm_gemm_rope_write_refuses_a_plan_of_a_prefill_step_and_writes_nothing():
    import cupy as cp
    from pagedrt.engine import layer_gemm as lg
    from pagedrt.engine.rope_write import RopeWritePlan
    from pagedrt.errors import LaunchArgumentError
    p = Problem("float16", False, 64, query_lens=(1, 5, 3), cached=(4, 0, 9), q_heads=6, kv_heads=2)
    x, g, _, w = problem("float16", 9, 192, p.qkv.shape[1])
    buffer, q = cp.asarray(p.buffer), cp.asarray(p.q)
    k, v = p.planes(buffer)
    plan = RopeWritePlan(cp.empty(p.qkv.shape, w.dtype), q, k, *(cp.asarray(getattr(p, name)) for name in
                                                                 ("slots", "qo_indptr", "seq_lens", "inv_freq")))
    with pytest.raises(LaunchArgumentError, match="decode step"):
        lg.norm_gemm_rope_write(cp.asarray(x), cp.asarray(g), cp.asarray(w), plan, q, k, v, 1e-5)
    cp.cuda.get_current_stream().synchronize()
    assert to_host(buffer).tobytes() == p.buffer.tobytes() and np.isnan(to_host(q).astype(np.float32)).all()
