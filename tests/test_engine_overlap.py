"""The overlapped generate loop (tokens sampled on the device, read one step late) against the plain one, the prefix
cache's ids given after the step (``cache.name_tokens``), padded decode batches, and the device sampler's output;
on the host backend (the GPU's own checks are tests/test_engine_overlap_gpu.py)."""

import time
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pagedrt import PagedKVCache
from pagedrt.blocks import prefix
from pagedrt.errors import InvalidTokenCountError, InvalidTokenIdsError, UnknownSequenceError

pytest.importorskip("gguf", reason="the engine reads GGUF with the gguf package: pip install 'pagedrt[model]'")

from pagedrt.engine import Engine, SamplingParams  # noqa: E402
from pagedrt.engine import padding, sampler  # noqa: E402
from test_engine import BEFORE, COMMON, PARAMS, PROMPTS  # noqa: E402

SIZES = [dict(max_seqs=16, kv_tokens=1 << 14), dict(max_seqs=6, kv_tokens=640, step_tokens=40),
         dict(max_seqs=4, kv_tokens=1 << 12, step_tokens=32)]


def outputs(results):
    return [([t.tolist() for t in r.tokens], r.finish_reasons, r.cached_tokens) for r in results]


@pytest.mark.parametrize("sizes", SIZES)
def test_the_overlapped_loop_generates_what_the_plain_loop_does(tiny, sizes):
    """Greedy, seeded top-p, forks, chunked prompts, prefix hits and full batches: the same tokens, reasons and
    cached prompt tokens, one step late (the extra rows' tokens are discarded, never recorded)."""
    runs = {}
    for overlap in (False, True):
        with Engine(tiny, backend="host", overlap=overlap, **sizes) as e:
            runs[overlap] = outputs(e.generate(PROMPTS, PARAMS)), e.stats
    (plain, ps), (overlapped, os_) = runs[False], runs[True]
    assert [(t, c) for t, _, c in plain] == BEFORE
    assert overlapped == plain
    assert os_.generated_tokens == ps.generated_tokens == sum(len(t) for r, _, _ in plain for t in r)
    assert os_.steps > ps.steps  # a sequence ends a step later


def test_a_stop_token_ends_a_sample_one_step_late_and_its_extra_token_is_discarded(tiny):
    for overlap in (False, True):
        with Engine(tiny, backend="host", max_seqs=4, kv_tokens=1 << 12, overlap=overlap) as e:
            free = greedy_tokens(e, "The dog", 12)
            e.stop_tokens = np.array([free[5]])
            r = e.generate(["The dog"], SamplingParams(max_tokens=12))[0]
            assert r.finish_reasons == ["stop"] and r.tokens[0].tolist() == free[:free.index(free[5])]
            assert e.stats.generated_tokens == 12 + free.index(free[5]) + 1
            assert e.scheduler.idle and e.cache.stats()["sequences"] == 0


class SlowStream:
    """A stand-in for the GPU's stream on the host backend: a step's tokens arrive ``prompt_s`` after a step with
    prompt tokens was queued, ``decode_s`` after a decode step (the event its token copy returns waits for it)."""

    def __init__(self, engine, prompt_s, decode_s):
        self.ready, forward, send = 0.0, engine.model.forward, engine._tokens.send

        def timed_forward(step, ids):
            self.cost = prompt_s if step.num_tokens > len(step.seqs) or len(step.arrived) else decode_s
            return forward(step, ids)

        def timed_send(count):
            host, _ = send(count)
            self.ready = max(self.ready, time.perf_counter()) + self.cost
            return host, self

        engine.model.forward, engine._tokens.send = timed_forward, timed_send

    def synchronize(self):
        time.sleep(max(0.0, self.ready - time.perf_counter()))


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_waiting_for_a_prompts_tokens_counts_as_prefill_time_in_either_loop(tiny, overlap):
    """Stats: the first decode step of the overlapped loop reads the prompt step's tokens, and that wait (here a
    second) is the prefill's time, not the decode's (which would make decode steps look seconds long)."""
    prompt_s = 1.0
    with Engine(tiny, backend="host", max_seqs=4, kv_tokens=1 << 12, overlap=overlap) as e:
        e.stop_tokens = np.empty(0, np.int64)
        SlowStream(e, prompt_s, 0.002)
        e.generate(["The dog"], SamplingParams(max_tokens=6))
        s = e.stats
    assert s.prefill_steps == 1 and s.decode_steps >= 5 and s.prefill_seconds >= prompt_s
    assert s.decode_seconds < prompt_s / 2, (s.decode_seconds, s.prefill_seconds)


def greedy_tokens(engine, prompt, max_tokens):
    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens))[0].tokens[0].tolist()


def names(engine):
    return set(engine.cache.allocator.index.block_of)


def chain_names(ids, block_size=16):
    """The prefix cache's names of every full block of ``ids``."""
    out, name = set(), prefix.ROOT
    ids = np.asarray(ids, np.int32)
    for start in range(0, ids.size - block_size + 1, block_size):
        name = prefix.chain_hash(name, ids[start:start + block_size])
        out.add(name)
    return out


def test_blocks_filled_by_tokens_read_a_step_late_are_named_for_their_tokens(tiny):
    """Every block the overlapped loop names holds the tokens its name stands for (prompt then generated ones);
    it names what the plain loop names, and more only where a sequence's extra step filled a block; a later
    prompt that repeats a prompt and its answer finds the answer's blocks cached."""
    prompts = [COMMON + "woods.", "Paging the cache: blocks, tables, slots.", COMMON + "house."]
    params = [SamplingParams(max_tokens=40), SamplingParams(max_tokens=33, n=2),
              SamplingParams(max_tokens=47, temperature=0.9, seed=2)]
    found = {}
    for overlap in (False, True):
        with Engine(tiny, backend="host", max_seqs=8, kv_tokens=1 << 14, overlap=overlap) as e:
            results = e.generate(prompts, params)
            found[overlap] = names(e)
            expected = set()
            for prompt, r in zip(prompts, results):
                ids = e.encode_prompt(prompt)
                for tokens in r.tokens:
                    expected |= chain_names(np.concatenate([ids, tokens]))
            assert found[overlap] <= expected
            if overlap:
                ids = e.encode_prompt(prompts[0])
                answer = results[0].tokens[0]
                again = e.generate([np.concatenate([ids, answer[:30]])], SamplingParams(max_tokens=2))[0]
                assert again.cached_tokens == (ids.size + 30) // 16 * 16 > ids.size
    assert found[False] <= found[True]
    generated = found[True] - set().union(*(chain_names(Engine.encode_prompt(e, p)) for p in prompts))
    assert generated  # blocks of generated tokens were named


def test_naming_tokens_after_the_step_names_the_blocks_ids_at_the_step_would(backend):
    """``cache.name_tokens`` after steps without ids names each full block as ``cache.step`` with the ids does;
    a sequence with an unknown id before names nothing; bad arguments are named errors that change nothing."""
    rng = np.random.default_rng(0)
    prompt, more = rng.integers(0, 1000, 20), rng.integers(0, 1000, 30)
    index = {}
    for late in (False, True):
        with PagedKVCache(2, 2, 64, 16, max_tokens=4096, max_seqs=4, backend=backend) as cache:
            seq = int(cache.step(arrivals=[prompt]).arrived[0])
            gap = int(cache.step([], arrivals=[prompt[:5]]).arrived[0])
            cache.step([gap], 1)  # an id never given: nothing of gap's is named from now on
            for token in more:
                cache.step([seq, gap], 1, None if late else [token, token])
                if late:
                    cache.name_tokens([seq, gap], 1, [token, token])
            index[late] = dict(cache.allocator.index.block_of)
            if late:
                before = (index[late], cache.tables.known.copy())
                for args, error in ((([seq], 1, [1, 2]), InvalidTokenIdsError),
                                    (([seq], 1, [-1]), InvalidTokenIdsError),
                                    (([seq], 99, [1] * 99), InvalidTokenCountError),
                                    (([7], 1, [1]), UnknownSequenceError)):
                    with pytest.raises(error):
                        cache.name_tokens(*args)
                assert dict(cache.allocator.index.block_of) == before[0]
                assert np.array_equal(cache.tables.known, before[1])
    assert index[True] == index[False]
    assert set(index[True]) == chain_names(np.concatenate([prompt, more]))


@settings(max_examples=40, deadline=None)
@given(max_seqs=st.integers(1, 1024), data=st.data())
def test_a_batch_pads_to_the_smallest_size_that_holds_it(max_seqs, data):
    sizes = padding.sizes(max_seqs)
    batch = data.draw(st.integers(1, max_seqs))
    pad = padding.Padding.size(type("P", (), {"sizes": sizes})(), batch)
    assert sizes[0] == 1 and sizes[-1] == max_seqs and list(sizes) == sorted(set(sizes))
    assert len(sizes) <= max_seqs.bit_length() + 1
    assert pad >= batch and pad in sizes and all(s < batch for s in sizes if s < pad)
    assert pad < 2 * batch or pad == 1


class FixedBuffers:
    """A stand-in cache whose ``metadata.buffers`` hold a host step's arrays as a CUDA cache's fixed buffers do:
    slot -1, block -1, length 0 and the token count as query offset past the step."""

    def __init__(self, step, rows, width, slots):
        n, b = step.num_tokens, len(step.seqs)
        buffers = dict(slot_mapping=np.full(slots, -1, np.int64), block_tables=np.full((rows, width), -1, np.int32),
                       seq_lens=np.zeros(rows, np.int32), qo_indptr=np.full(rows + 1, n, np.int32))
        buffers["slot_mapping"][:n], buffers["block_tables"][:b] = step.slot_mapping, step.block_tables
        buffers["seq_lens"][:b], buffers["qo_indptr"][:b + 1] = step.seq_lens, step.qo_indptr
        self.xp, self.metadata = np, SimpleNamespace(buffers=buffers)


def test_a_padded_decode_step_computes_the_real_rows_and_writes_nothing_else(tiny):
    """Five rows padded to eight (host references, which check every length and table entry): the real rows'
    logits and K/V are the unpadded step's, and the block the padding rows read is left as it was."""
    from pagedrt.engine import loader
    from pagedrt.engine.model import LlamaModel
    gguf = loader.load(tiny)
    c = gguf.config
    prompts = list(np.random.default_rng(4).integers(0, c.vocab_size, (5, 20)))
    caches = [PagedKVCache(c.num_layers, c.kv_heads, c.head_dim, 16, "float16", max_tokens=4096, max_seqs=8,
                           backend="host") for _ in range(2)]
    try:
        models = [LlamaModel(gguf, cache, graphs=False) for cache in caches]
        for model, cache in zip(models, caches):
            step = cache.step([], arrivals=prompts)
            tokens = model.forward(step, np.concatenate(prompts)).argmax(axis=1)
        for _ in range(3):
            plain, padded = caches[0].step(None, 1, tokens), caches[1].step(None, 1, tokens)
            fixed = FixedBuffers(padded, 8, caches[1].max_blocks_per_seq, 64)
            padded = padding.Padding(fixed, 8).pad(padded, 8)
            assert padded.num_tokens == len(padded.seqs) == 8 and (padded.slot_mapping[5:] == -1).all()
            first = int(caches[1].tables.blocks(int(padded.seqs[0]))[0])
            before = [caches[1].k(layer)[first].copy() for layer in range(c.num_layers)]
            logits = models[1].forward(padded, np.concatenate([tokens, np.zeros(3, np.int64)]))
            expected = models[0].forward(plain, tokens)
            np.testing.assert_allclose(logits[:5], expected, rtol=0, atol=1e-4)
            assert all(np.array_equal(caches[1].k(layer)[first], b) for layer, b in enumerate(before))
            for seq in plain.seqs.tolist():  # every real row's K and V as the unpadded step wrote them
                blocks = [cache.tables.blocks(seq) for cache in caches]
                for layer in range(c.num_layers):
                    for plane in ("k", "v"):
                        a, b = (getattr(cache, plane)(layer)[ids].astype(np.float32) for cache, ids in zip(caches,
                                                                                                         blocks))
                        np.testing.assert_allclose(b, a, rtol=0, atol=1e-3)
            tokens = expected.argmax(axis=1)
    finally:
        for cache in caches:
            cache.close()


def test_the_sampler_writes_its_tokens_into_the_buffer_given():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((5, 50)).astype(np.float32)
    logits[2, [7, 30]] = 9.0  # a tie: the first largest
    out = np.full(8, -1, np.int64)
    tokens = sampler.sample(logits, np.arange(5), np.zeros(5), np.ones(5), np.zeros(5), out)
    assert tokens.base is out or tokens is out[:5] or np.shares_memory(tokens, out)
    assert out[:5].tolist() == np.argmax(logits, axis=1).tolist() and out[2] == 7 and (out[5:] == -1).all()
    rows, temperature = np.array([4, 4, 0]), np.array([0.0, 0.8, 1.2])
    draws = sampler.uniforms(sampler.seeds(5, 3), np.zeros(3, np.int64))
    alone = sampler.sample(logits, rows, temperature, np.full(3, 0.9), draws)
    sampler.sample(logits, rows, temperature, np.full(3, 0.9), draws, out)
    assert out[:3].tolist() == alone.tolist() and out[0] == np.argmax(logits[4])


def test_the_bench_puts_the_peers_figures_of_the_same_batch_and_context_beside_ours():
    from pagedrt.bench.generate import peer_rows
    peers = [{"case": "1x547", "peer": "torch+fi graph", "step_ms": 0.5},
             {"case": "256x547", "peer": "torch+fi graph", "step_ms": 2.0},
             {"case": "256x2067", "peer": "torch.compile gpt-fast", "step_ms": 4.0},
             {"case": "1x547", "peer": "torch.compile gpt-fast", "error": "RuntimeError: no"}]
    rows = [{"batch": 1, "context": 547, "step_ms": 1.0}, {"batch": 256, "context": 2067, "step_ms": 3.0}]
    beside = peer_rows(peers, rows)
    assert [(r["batch"], r["context"], r["peer"]) for r in beside] == [(1, 547, "torch+fi graph"),
                                                                      (256, 2067, "torch.compile gpt-fast")]
    assert [r["ratio"] for r in beside] == [2.0, 0.75]


@pytest.mark.parametrize("max_tokens", [1, 2, 17])
def test_samples_that_end_at_their_first_tokens_end_alike_in_both_loops(tiny, max_tokens):
    """Forks whose first token is their last (drawn by the parent's step, read after the fork), seeded samples and
    a request arriving while the others end: the same results, and the cache empty after."""
    prompts = [COMMON + "woods.", "The dog", "Paging the cache"]
    params = [SamplingParams(max_tokens=max_tokens, n=3), SamplingParams(max_tokens=max_tokens, n=2, temperature=1.0,
                                                                          seed=9), SamplingParams(max_tokens=3)]
    runs = []
    for overlap in (False, True):
        with Engine(tiny, backend="host", max_seqs=4, kv_tokens=1 << 12, overlap=overlap) as e:
            runs.append(outputs(e.generate(prompts, params)))
            assert e.scheduler.idle and e.cache.stats()["sequences"] == 0
    assert runs[0] == runs[1]
    assert [len(t) for r, _, _ in runs[1] for t in r] == [max_tokens] * 5 + [3]


WORDS = ["The dog", COMMON, "Paging the cache", "What's the name of the cat?", "woods.", "house. ", "12 more"]


class RowModel:
    """A stand-in forward whose logits of a row depend on its last token and its length alone, whatever else the
    batch holds: what the loops must agree on exactly (a real model's rounding depends on the batch a little)."""

    def __init__(self, vocab, seed):
        rng = np.random.default_rng(seed)
        self.token, self.position = 3 * rng.standard_normal((2, vocab, vocab)).astype(np.float32)
        self.stream = __import__("contextlib").nullcontext()

    def forward(self, step, ids):
        last = np.asarray(step.qo_indptr[1:], np.int64) - 1
        return self.token[np.asarray(ids)[last]] + self.position[np.asarray(step.seq_lens) % len(self.position)]


@settings(max_examples=40, deadline=None)
@given(data=st.data(), max_seqs=st.integers(2, 8), step_tokens=st.sampled_from([16, 40, 2048]))
def test_any_workload_generates_the_same_in_both_loops(tiny, data, max_seqs, step_tokens):
    """Random prompts (sharing prefixes at times), samples, lengths, temperatures, stop tokens and cache sizes,
    over :class:`RowModel`: the overlapped loop's tokens and reasons equal the plain loop's, every block either
    names holds the tokens its name stands for, and the cache is left empty."""
    count = data.draw(st.integers(1, 5))
    prompts = ["".join(data.draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=4))) for _ in range(count)]
    params = [SamplingParams(max_tokens=data.draw(st.integers(1, 20)), n=data.draw(st.integers(1, max_seqs)),
                             temperature=data.draw(st.sampled_from([0.0, 0.7])), seed=data.draw(st.integers(0, 9)))
              for _ in range(count)]
    stops = data.draw(st.lists(st.integers(0, 338), max_size=12))
    runs = []
    for overlap in (False, True):
        with Engine(tiny, backend="host", max_seqs=max_seqs, kv_tokens=1 << 12, step_tokens=step_tokens,
                    overlap=overlap) as e:
            e.model, e.stop_tokens = RowModel(e.config.vocab_size, 0), np.array(stops, np.int64)
            results = e.generate(prompts, params)
            runs.append([([t.tolist() for t in r.tokens], r.finish_reasons) for r in results])
            assert e.scheduler.idle and e.cache.stats()["sequences"] == 0
            expected = set()
            for prompt, r in zip(prompts, results):
                ids = e.encode_prompt(prompt)
                for tokens, reason in zip(r.tokens, r.finish_reasons):  # a stop token may be in the cache
                    for tail in ([[s] for s in stops] if reason == "stop" else [[]]):
                        expected |= chain_names(np.concatenate([ids, tokens, np.array(tail, np.int64)]))
            assert names(e) <= expected
    assert runs[1] == runs[0]
