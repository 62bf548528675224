"""The one-launch decode step (``pagedrt.engine.fused``) against the layered step it replaces: the same logits
and the same K/V bytes in the cache, for fp16 and bf16, head dims 64 and 128, groups of 1, 3, 8 and 12 query heads
(12 x 128 needs more than 48 KiB of shared memory), batches 1 to 8 and contexts across many blocks and attention
splits; in and out of CUDA graphs. Against the float64 host path it runs in ``test_engine_gpu.py`` (the tiny
model's decode steps take it)."""

import numpy as np
import pytest

from helpers import to_host

pytestmark = pytest.mark.gpu


def model(head_dim, q_heads, kv_heads, seed=0, ffn=320):
    """A GGUFModel of random weights: 3 layers, hidden = q_heads * head_dim, an odd vocabulary."""
    from pagedrt.engine.config import ModelConfig
    from pagedrt.engine.loader import GGUFModel, Weights
    hidden, vocab = q_heads * head_dim, 517
    c = ModelConfig(name="fused test", num_layers=3, hidden=hidden, ffn=ffn, q_heads=q_heads, kv_heads=kv_heads,
                    head_dim=head_dim, vocab_size=vocab, context_length=4096, rope_theta=10000.0, rope_scale=1.0,
                    rms_eps=1e-5)
    rng = np.random.default_rng(seed)
    mat = lambda o, i: (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)  # noqa: E731
    norm = lambda: (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)  # noqa: E731
    layers = [{"attn_norm": norm(), "ffn_norm": norm(), "qkv": mat((q_heads + 2 * kv_heads) * head_dim, hidden),
               "o": mat(hidden, hidden), "gate_up": mat(2 * ffn, hidden), "down": mat(hidden, ffn)}
              for _ in range(c.num_layers)]
    return GGUFModel("fused test", c, None, Weights(mat(vocab, hidden), mat(vocab, hidden), norm(), layers))


def run(gguf, dtype, batch, fused, graphs, contexts, steps=4, fed=None):
    """Prefill ``batch`` prompts (layered), then ``steps`` decode steps of the greedy tokens, or of ``fed``'s
    (another run's, so that a near tie cannot send the two runs different tokens); returns the decode steps'
    logits, the tokens fed, and every layer's K and V planes at the end (host copies)."""
    import cupy as cp
    from pagedrt import PagedKVCache
    from pagedrt.engine.model import LlamaModel
    c = gguf.config
    rng = np.random.default_rng(batch)
    with PagedKVCache(c.num_layers, c.kv_heads, c.head_dim, 16, dtype, max_tokens=8192, max_seqs=8,
                      backend="cuda") as cache:
        m = LlamaModel(gguf, cache, graphs=graphs, fused=fused)
        assert (m.fused is not None) == fused
        with m.stream:
            prompts = [rng.integers(0, c.vocab_size, n) for n in contexts[:batch]]
            step = cache.step([], arrivals=prompts)
            logits = m.forward(step, cp.asarray(np.concatenate(prompts)))
            tokens = to_host(logits).argmax(1)
            out, inputs = [], []
            for i in range(steps):
                tokens = tokens if fed is None else fed[i]
                inputs.append(tokens)
                step = cache.step(None, 1, tokens)
                logits = to_host(m.forward(step, cp.asarray(tokens))).copy()
                out.append(logits)
                tokens = logits.argmax(1)
            planes = [to_host(p).copy() for p in cache.planes]
    return out, inputs, planes


CONTEXTS = [300, 17, 1000, 64, 129, 5, 777, 250]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim,q_heads,kv_heads", [(64, 9, 3), (128, 8, 1), (64, 4, 4), (128, 12, 1)])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_fused_step_matches_the_layered_step(dtype, head_dim, q_heads, kv_heads, batch):
    gguf = model(head_dim, q_heads, kv_heads)
    layered, fed, layered_planes = run(gguf, dtype, batch, False, False, CONTEXTS)
    fused, _, fused_planes = run(gguf, dtype, batch, True, False, CONTEXTS, fed=fed)
    tol = 0.02 if dtype == "float16" else 0.08  # of the logits' spread: rounding of another summation order
    for f, ref in zip(fused, layered):
        assert f.shape == ref.shape == (batch, gguf.config.vocab_size)
        assert np.abs(f - ref).max() / ref.std() < tol
        assert (f.argmax(1) == ref.argmax(1)).mean() >= 0.75  # near ties may go either way
    for f, ref in zip(fused_planes, layered_planes):  # the K/V each step wrote, and nothing else moved
        f32, r32 = (x.view(np.uint16).astype(np.uint32) for x in (f, ref))
        differ = f32 != r32
        assert differ.mean() < 0.05
        spread = np.abs(ref.astype(np.float32)).max()
        assert np.abs(f.astype(np.float32) - ref.astype(np.float32)).max() < 0.05 * spread


@pytest.mark.parametrize("batch", [1, 8])
def test_fused_step_with_weights_staged_and_streamed(batch):
    """A feed-forward too wide to stage: on a device that stages weights (compute capability 9.0, 227 KiB of shared
    memory a block), q/k/v's and o's weights are staged a layer ahead while gate/up's (eight tiles a block) and
    down's stream through registers, in one step that still matches the layered one."""
    import cupy as cp
    from pagedrt.engine import fused
    gguf = model(64, 9, 3, ffn=8192)
    device = cp.cuda.Device()
    mask, _ = fused.staging(gguf.config, 2, device.attributes["MultiProcessorCount"],
                            int(device.compute_capability), device.attributes["MaxSharedMemoryPerBlockOptin"])
    if int(device.compute_capability) >= fused.STAGING_CAPABILITY:
        assert mask == 0b0011
    layered, fed, _ = run(gguf, "float16", batch, False, False, CONTEXTS)
    fused_out, _, _ = run(gguf, "float16", batch, True, False, CONTEXTS, fed=fed)
    for f, ref in zip(fused_out, layered):
        tol = 0.02 * ref.std()
        assert np.abs(f - ref).max() < tol
        chosen = ref[np.arange(batch), f.argmax(1)]
        assert (chosen >= ref.max(1) - 2 * tol).all()  # the fused step's choice is the layered one's or a near tie


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fused_graphs_equal_eager_fused_steps(dtype):
    gguf = model(64, 9, 3)
    eager, _, eager_planes = run(gguf, dtype, 3, True, False, CONTEXTS, steps=5)
    graphed, _, graphed_planes = run(gguf, dtype, 3, True, True, CONTEXTS, steps=5)
    for e, g in zip(eager, graphed):
        np.testing.assert_array_equal(g, e)
    for e, g in zip(eager_planes, graphed_planes):
        np.testing.assert_array_equal(g.view(np.uint16), e.view(np.uint16))


def test_a_step_the_fused_kernel_does_not_take_is_refused_by_name():
    """Nine rows, or rows of more than one new token: a named error before anything is launched."""
    import cupy as cp
    from pagedrt import PagedKVCache
    from pagedrt.engine.model import LlamaModel
    from pagedrt.errors import UnsupportedConfigError
    gguf = model(64, 9, 3)
    c = gguf.config
    with PagedKVCache(c.num_layers, c.kv_heads, c.head_dim, 16, "float16", max_tokens=4096, max_seqs=16,
                      backend="cuda") as cache:
        m = LlamaModel(gguf, cache, graphs=False)
        with m.stream:
            prompts = [np.arange(5) + i for i in range(9)]
            step = cache.step([], arrivals=prompts)
            logits = cp.zeros((9, c.vocab_size), cp.float32)
            with pytest.raises(UnsupportedConfigError, match="1 to 8 rows of one new token"):
                m.fused.run(step, cp.asarray(np.concatenate(prompts)), logits)
            step = cache.step(None, 1, np.arange(9))
            with pytest.raises(UnsupportedConfigError, match="9 tokens in 9 rows"):
                m.fused.run(step, cp.arange(9, dtype=cp.int64), logits)
            assert not logits.any()


def test_a_model_with_a_fused_step_is_freed_when_dropped():
    """The fused step keeps the arrays it reads, not its model: dropping the model frees it without the cycle
    collector."""
    import gc
    import weakref
    from pagedrt import PagedKVCache
    from pagedrt.engine.model import LlamaModel
    gguf = model(64, 9, 3)
    c = gguf.config
    with PagedKVCache(c.num_layers, c.kv_heads, c.head_dim, 16, "float16", max_tokens=1024, max_seqs=2,
                      backend="cuda") as cache:
        m = LlamaModel(gguf, cache, graphs=False)
        assert m.fused is not None
        ref = weakref.ref(m)
        gc.disable()
        try:
            del m
            assert ref() is None
        finally:
            gc.enable()
