"""On a GPU: the overlapped generate loop (tokens sampled on the device, read a step late) against the plain loop,
and decode steps padded to a captured graph's batch size against eager steps of the real batch."""

import os

import numpy as np
import pytest

from helpers import to_host

pytestmark = pytest.mark.gpu
pytest.importorskip("gguf", reason="the engine reads GGUF with the gguf package: pip install 'pagedrt[model]'")

from test_engine import COMMON, PARAMS, PROMPTS  # noqa: E402

CHATS = ["What is paging in operating systems?", "Write a haiku about the sea.", "Name three prime numbers.",
         "Why is the sky blue?"]


def run(path, overlap, prompts, params, **sizes):
    """Tokens and stats of a greedy run without stop tokens: every sample runs to its length limit."""
    from pagedrt.engine import Engine
    with Engine(path, backend="cuda", overlap=overlap, **sizes) as e:
        e.stop_tokens = np.empty(0, np.int64)
        e.warm_up()
        results = e.generate(prompts, params)
        return [[t.tolist() for t in r.tokens] for r in results], e.stats


def test_overlapped_greedy_equals_the_plain_loop_on_the_tiny_model(tiny):
    """Requests whose batches pad to the same sizes in both loops (the overlapped loop's rows that end a step
    later take a padding row's place): the same tokens exactly. In the mixed workload of tests/test_engine.py a row
    ends a step later, so batches differ at times (a GEMM of other rows may round a logit otherwise, and a near tie
    flip): most tokens agree."""
    from pagedrt.engine import SamplingParams
    greedy = SamplingParams(max_tokens=24)
    same = [COMMON + "woods.", "What's the name of the cat?", "Paging the cache: blocks, tables, slots."]  # pad: 4
    for prompts in ([same[0]], same):
        plain, ps = run(tiny, False, prompts, greedy, max_seqs=8, kv_tokens=1 << 14)
        overlapped, os_ = run(tiny, True, prompts, greedy, max_seqs=8, kv_tokens=1 << 14)
        assert overlapped == plain and os_.generated_tokens == ps.generated_tokens
    plain, _ = run(tiny, False, PROMPTS, PARAMS, max_seqs=6, kv_tokens=640, step_tokens=40)
    overlapped, _ = run(tiny, True, PROMPTS, PARAMS, max_seqs=6, kv_tokens=640, step_tokens=40)
    pairs = [(a[:n], b[:n]) for p, o in zip(plain, overlapped) for a, b in zip(p, o) for n in [min(len(a), len(b))]]
    equal = sum(int((np.array(a) == np.array(b)).sum()) for a, b in pairs)
    total = sum(len(a) for a, _ in pairs)
    print(f"tiny, mixed workload: {equal} of {total} tokens equal")
    assert equal >= 0.5 * total


def test_overlapped_greedy_equals_the_plain_loop_on_the_real_model():
    from pagedrt.engine import SamplingParams, fetch
    path = os.environ.get("PAGEDRT_TEST_MODEL") or fetch.default_path()
    if not os.path.isfile(path):
        pytest.skip(f"the model file is not at {path}: pagedrt generate fetches it")
    for prompts in (CHATS[:1], CHATS):  # the first arrives a step before the others (their system prompt cached)
        plain, _ = run(path, False, prompts, SamplingParams(max_tokens=48), max_seqs=8)
        overlapped, _ = run(path, True, prompts, SamplingParams(max_tokens=48), max_seqs=8)
        print(f"SmolLM2, {len(prompts)} prompts: {plain[0][0][:12]} ...")
        assert overlapped == plain


def test_padded_decode_graphs_equal_eager_steps_and_write_no_other_slot(tiny):
    """Five sequences decode as a batch of 8 (three padding rows): the captured and replayed graph's real rows
    equal the padded eager step's, agree with the unpadded eager step's, and no K/V of the first block (which
    the padding rows read) changes."""
    import cupy as cp
    from pagedrt import PagedKVCache
    from pagedrt.engine import loader
    from pagedrt.engine.model import LlamaModel
    from pagedrt.engine.padding import Padding
    gguf = loader.load(tiny)
    c = gguf.config
    prompts = list(np.random.default_rng(4).integers(0, c.vocab_size, (5, 20)))
    caches, models, pads = [], [], []
    for graphs, padded in ((False, False), (False, True), (True, True)):  # eager, eager padded, graphs padded
        cache = PagedKVCache(c.num_layers, c.kv_heads, c.head_dim, 16, "float16", max_tokens=4096, max_seqs=8,
                             backend="cuda")
        caches.append(cache)
        models.append(LlamaModel(gguf, cache, graphs=graphs))
        pads.append(Padding(cache, 8) if padded else None)
    try:
        tokens = None
        for model, cache in zip(models, caches):
            with model.stream:
                step = cache.step([], arrivals=prompts)
                logits = to_host(model.forward(step, cp.asarray(np.concatenate(prompts))))
                tokens = logits.argmax(axis=1) if tokens is None else tokens
        for n in range(4):  # eager, captured, replayed, replayed
            out, first = [], []
            for model, cache, pad in zip(models, caches, pads):
                with model.stream:
                    step = cache.step(None, 1, tokens)
                    block = int(cache.tables.blocks(int(step.seqs[0]))[0])
                    first.append([to_host(cache.k(layer)[block]).copy() for layer in range(c.num_layers)] +
                                 [to_host(cache.v(layer)[block]).copy() for layer in range(c.num_layers)])
                    ids = np.zeros(8 if pad else 5, np.int64)
                    ids[:5] = tokens
                    logits = model.forward(pad.pad(step, 8) if pad else step, cp.asarray(ids))
                    out.append(to_host(logits)[:5].copy())
                    after = ([to_host(cache.k(layer)[block]) for layer in range(c.num_layers)] +
                             [to_host(cache.v(layer)[block]) for layer in range(c.num_layers)])
                    assert all(np.array_equal(a, b) for a, b in zip(first[-1], after))
            eager, eager_padded, graph = out
            np.testing.assert_allclose(graph, eager_padded, rtol=0, atol=1e-3)
            assert float(np.abs(eager_padded - eager).max() / eager.std()) < 0.02
            assert (eager_padded.argmax(1) == eager.argmax(1)).all()
            tokens = eager.argmax(axis=1)
        assert models[2].graph(8) is not None and models[2].graph(5) is None
    finally:
        for cache in caches:
            cache.close()
