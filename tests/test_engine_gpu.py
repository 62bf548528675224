"""The engine on a GPU against its NumPy path: every op against its reference, the forward pass of the tiny model
and of the real one (when its file is here), also in decode steps of more rows than the one-launch step takes,
CUDA graphs against eager steps, and generation end to end."""

import os

import numpy as np
import pytest

from helpers import to_host

pytestmark = pytest.mark.gpu


def test_ops_match_references():  # rotary embeddings + K/V write: test_rope_write_gpu.py
    import cupy as cp
    from pagedrt.engine import ops
    rng = np.random.default_rng(0)
    n, hidden, ffn = 37, 576, 1536
    f16 = lambda *shape: rng.standard_normal(shape).astype(np.float16)  # noqa: E731
    both = lambda a: (a.copy(), cp.asarray(a))  # noqa: E731

    ids = rng.integers(0, 100, n)
    table = f16(100, hidden)
    host, dev = np.empty((n, hidden), np.float32), cp.empty((n, hidden), cp.float32)
    ops.embed(ids, table, host)
    ops.embed(cp.asarray(ids), cp.asarray(table), dev)
    assert np.array_equal(to_host(dev), host)

    residual, weight = rng.standard_normal((n, hidden)).astype(np.float32), f16(hidden).astype(np.float32)
    delta = f16(n, hidden)
    qo = np.array([0, 5, 6, 37], np.int32)
    for rows, out_rows in ((None, n), (qo, 3)):
        (rh, rd), (dh, dd) = both(residual), both(delta)
        oh, od = np.empty((out_rows, hidden), np.float16), cp.empty((out_rows, hidden), cp.float16)
        ops.add_rms_norm(rh, dh, weight, oh, 1e-5, rows)
        ops.add_rms_norm(rd, dd, cp.asarray(weight), od, 1e-5, None if rows is None else cp.asarray(rows))
        np.testing.assert_allclose(to_host(od).astype(np.float32), oh.astype(np.float32), rtol=2e-3, atol=2e-3)
        np.testing.assert_allclose(to_host(rd), rh, rtol=1e-6, atol=1e-6)

    gu = f16(n, 2 * ffn)
    oh, od = np.empty((n, ffn), np.float16), cp.empty((n, ffn), cp.float16)
    ops.silu_mul(gu, oh)
    ops.silu_mul(cp.asarray(gu), od)
    np.testing.assert_allclose(to_host(od).astype(np.float32), oh.astype(np.float32), rtol=2e-3, atol=2e-3)

    a, b = f16(n, hidden), f16(ffn, hidden)  # b: a weight [out, in]
    for dtype in (np.float16, np.float32):
        oh, od = np.empty((n, ffn), dtype), cp.empty((n, ffn), dtype)
        ops.gemm(a, b, oh)
        ops.gemm(cp.asarray(a), cp.asarray(b), od)
        np.testing.assert_allclose(to_host(od).astype(np.float32), oh.astype(np.float32), rtol=1e-2, atol=5e-2)


def drive(gguf, backend, graphs, fed=None, steps=6, kv_dtype=None):
    """A fixed schedule on ``backend``: two prompts (one chunked over two steps, the other finding its first two
    blocks cached), a fork (copy-on-write), then decode steps. Each step's tokens are the greedy ones, or those
    of ``fed`` (teacher forcing). ``kv_dtype``: the cache's (FP8: scales of 1). Returns (logits per step, tokens
    fed per step)."""
    from pagedrt import PagedKVCache
    from pagedrt.engine.model import LlamaModel
    c = gguf.config
    rng = np.random.default_rng(1)
    a = rng.integers(0, c.vocab_size, 70)
    b = np.concatenate([a[:40], rng.integers(0, c.vocab_size, 9)])
    logits, inputs = [], []

    def forward(step, ids):
        inputs.append(ids)
        logits.append(to_host(model.forward(step, cache.xp.asarray(ids))).copy())
        if fed is None:
            return logits[-1].argmax(axis=1)
        return fed[len(inputs)] if len(inputs) < len(fed) else None

    with PagedKVCache(c.num_layers, c.kv_heads, c.head_dim, 16, "float16", max_tokens=4096, max_seqs=8,
                      backend=backend, kv_dtype=kv_dtype) as cache:
        model = LlamaModel(gguf, cache, graphs=graphs)
        with model.stream:
            step = cache.step(arrivals=[a], arrival_tokens=40)
            forward(step, a[:40])
            step = cache.step([int(step.arrived[0])], 30, a[40:], arrivals=[b])
            assert list(step.cached) == [32]
            tokens = forward(step, np.concatenate([a[40:], b[32:]]))
            step = cache.step(None, 1, tokens, forks=[0])
            greedy = forward(step, tokens)
            # the child's first token is its parent's last one
            tokens = greedy if fed is not None else np.concatenate([greedy, tokens[:1]])
            for _ in range(steps):
                step = cache.step(None, 1, tokens)
                tokens = forward(step, tokens)
    return logits, inputs


def compare(gguf, tolerance, kv_dtype=None):
    """GPU (graphs and eager) against the host path on the host's tokens: the largest |difference| of a step's
    logits over the std of the host's, and the share of rows whose greedy token agrees."""
    host, fed = drive(gguf, "host", False, kv_dtype=kv_dtype)
    results = {}
    for graphs in (False, True):
        gpu, _ = drive(gguf, "cuda", graphs, fed, kv_dtype=kv_dtype)
        worst = max(float(np.abs(g - h).max() / h.std()) for g, h in zip(gpu, host))
        agree = np.mean(np.concatenate([g.argmax(1) == h.argmax(1) for g, h in zip(gpu, host)]))
        results[graphs] = gpu
        print(f"{gguf.config.name}: graphs={graphs}: max |gpu - host| / std = {worst:.4f}, greedy agree {agree:.3f}")
        assert worst < tolerance and agree >= 0.9
    for e, g in zip(results[False], results[True]):  # the same kernels, in a graph or not
        np.testing.assert_allclose(g, e, rtol=0, atol=1e-3)


def test_the_models_stream_waits_for_what_came_before_the_model(tiny):
    """The model's stream does not block on the default stream, so it must wait for what was queued before the
    model existed (its weights, the cache's step buffers): a value written after a 200 ms sleep on the
    constructing stream is what a copy on the model's stream reads (the model built without the one-launch
    step, whose kernel's compilation could outlast the sleep). The sanitizer once read a step's offsets before the
    cache's zero-fill of them had run."""
    import cupy
    from pagedrt import PagedKVCache
    from pagedrt.engine import loader
    from pagedrt.engine.model import LlamaModel
    gguf = loader.load(tiny)
    c = gguf.config
    late = cupy.RawKernel(r"""extern "C" __global__ void late(long long* x) {
        for (int i = 0; i < 2000; ++i) __nanosleep(100000);
        x[0] = 7;
    }""", "late")
    marker = cupy.zeros(1, np.int64)
    with PagedKVCache(c.num_layers, c.kv_heads, c.head_dim, 16, "float16", max_tokens=256, max_seqs=2,
                      backend="cuda") as cache:
        late((1,), (1,), (marker,))
        model = LlamaModel(gguf, cache, graphs=False, fused=False)
        with model.stream:
            seen = marker.copy()
        model.stream.synchronize()
        assert int(seen.get()[0]) == 7


def test_tiny_model_gpu_matches_host(tiny):
    from pagedrt.engine import loader
    compare(loader.load(tiny), 0.02)


def test_tiny_model_over_an_fp8_cache_gpu_matches_host(tiny):
    """The schedule over FP8 caches: the device's FP8 prefill (prefill_fp8; on compute capability 9.0 the sm_90a
    kernel's FP8 twin) and decode_fp8 (in and out of graphs) against the host's references on dequantised
    values; looser than fp16's, as fp16 activations round a few K/V
    values to the other side of an e4m3 step (an eighth of the value: one such flip moves a logit by far more
    than fp16's rounding does), and the flips compound over the layers. A wrong scale or a misread byte moves the
    logits by about their spread (1 here), and the greedy tokens with them."""
    from pagedrt.engine import loader
    compare(loader.load(tiny), 0.15, kv_dtype="float8_e4m3")


def test_real_model_gpu_matches_host():
    from pagedrt.engine import fetch, loader
    path = os.environ.get("PAGEDRT_TEST_MODEL") or fetch.default_path()
    if not os.path.isfile(path):
        pytest.skip(f"the model file is not at {path}: pagedrt generate fetches it")
    compare(loader.load(path), 0.05)


def drive_batch(gguf, backend, graphs, batch, fed=None, steps=4):
    """``batch`` prompts, then ``steps`` decode steps of ``batch`` rows (more than the one-launch step takes: the
    layered step, on the fused GEMMs), greedy or fed ``fed``. Returns (logits per decode step, tokens fed)."""
    from pagedrt import PagedKVCache
    from pagedrt.engine.model import LlamaModel
    c = gguf.config
    rng = np.random.default_rng(batch)
    with PagedKVCache(c.num_layers, c.kv_heads, c.head_dim, 16, "float16", max_tokens=8192, max_seqs=batch,
                      backend=backend) as cache:
        model = LlamaModel(gguf, cache, graphs=graphs)
        xp = cache.xp
        with model.stream:
            prompts = [rng.integers(0, c.vocab_size, n) for n in rng.integers(1, 30, batch)]
            step = cache.step([], arrivals=prompts)
            tokens = to_host(model.forward(step, xp.asarray(np.concatenate(prompts)))).argmax(1)
            logits, inputs = [], []
            for i in range(steps):
                tokens = tokens if fed is None else fed[i]
                inputs.append(tokens)
                logits.append(to_host(model.forward(cache.step(None, 1, tokens), xp.asarray(tokens))).copy())
                tokens = logits[-1].argmax(1)
    return logits, inputs


def compare_batch(gguf, batch, tolerance):
    """Decode steps of ``batch`` rows on the GPU (graphs and eager) against the host path on the host's tokens."""
    host, fed = drive_batch(gguf, "host", False, batch)
    results = {}
    for graphs in (False, True):
        gpu, _ = drive_batch(gguf, "cuda", graphs, batch, fed)
        worst = max(float(np.abs(g - h).max() / h.std()) for g, h in zip(gpu, host))
        agree = np.mean(np.concatenate([g.argmax(1) == h.argmax(1) for g, h in zip(gpu, host)]))
        print(f"{gguf.config.name} x {batch}: graphs={graphs}: max |gpu - host| / std = {worst:.4f}, "
              f"greedy agree {agree:.3f}")
        assert worst < tolerance and agree >= 0.9
        results[graphs] = gpu
    for e, g in zip(results[False], results[True]):
        np.testing.assert_allclose(g, e, rtol=0, atol=1e-3)


@pytest.mark.parametrize("batch", [24, 200])
def test_tiny_model_decode_batches_gpu_match_host(tiny, batch):
    from pagedrt.engine import loader
    compare_batch(loader.load(tiny), batch, 0.02)


def test_real_model_decode_batch_gpu_matches_host():
    from pagedrt.engine import fetch, loader
    path = os.environ.get("PAGEDRT_TEST_MODEL") or fetch.default_path()
    if not os.path.isfile(path):
        pytest.skip(f"the model file is not at {path}: pagedrt generate fetches it")
    compare_batch(loader.load(path), 24, 0.05)


def test_generate_on_gpu(tiny, tmp_path):
    from pagedrt.engine import Engine, SamplingParams
    from pagedrt.snapshot import load_snapshot
    common = "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs into the "
    prompts = [common + "woods.", common + "house.", "Paging the cache"]
    params = [SamplingParams(max_tokens=20), SamplingParams(max_tokens=20, n=3, temperature=0.8, seed=3),
              SamplingParams(max_tokens=12, temperature=0.7, top_p=0.9)]
    snap = tmp_path / "snap.json"
    with Engine(tiny, backend="cuda", max_seqs=16, kv_tokens=1 << 14) as gpu:
        results = gpu.generate(prompts, params, snapshot=snap)
        assert gpu.stats.cached_tokens > 0  # the second prompt found the first one's system prompt blocks
    assert [len(r.tokens) for r in results] == [1, 3, 1]
    for r, p in zip(results, params):
        assert all(1 <= len(t) <= p.max_tokens for t in r.tokens)
    assert (np.asarray(load_snapshot(snap)["blocks"]["ref_counts"]) > 1).any()  # shared blocks while all lived
    with Engine(tiny, backend="host", max_seqs=16, kv_tokens=1 << 14) as host:
        first = host.generate(prompts[:1], params[0])[0]
    agree = np.mean(first.tokens[0][:8] == results[0].tokens[0][:8])
    print(f"tiny greedy: host {first.tokens[0].tolist()} gpu {results[0].tokens[0].tolist()}")
    assert agree >= 0.5
