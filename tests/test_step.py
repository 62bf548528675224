"""The one-call step: the same bookkeeping as the building blocks it replaces, its device arrays, all or nothing."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

from pagedrt.errors import (DuplicateSequenceError, InvalidTokenCountError, InvalidTokenIdsError, PagedRTError,
                            PoolClosedError, PoolExhaustedError, SequenceFullError, TooManySequencesError,
                            UnknownSequenceError, UnsupportedConfigError)
from pagedrt.kernels import copy_blocks as kernel_copy_blocks
from helpers import to_host
from test_cache import (BS, SYSTEM_PROMPTS, PrefixMachine, check_allocator, frozen, kv_of, machine_test, small_cache,
                        write_tokens)


def by_blocks(cache, seqs=None, counts=1, token_ids=None, arrivals=(), arrival_tokens=None, forks=(), frees=()):
    """What ``cache.step`` does, made of the building blocks: (rows, slots, copies, arrived, cached, forked)."""
    if seqs is None:
        seqs = [s for s in cache.sequences if s not in set(frees)]
    if len(frees):
        cache.free(frees)
    forked = [cache.fork(p) for p in forks]
    arrived = [cache.add_sequence(p) for p in arrivals]
    cached = [cache.length(s) for s in arrived]
    slots, copies = cache.append(seqs, counts, token_ids=token_ids)
    chunks = [len(p) - c for p, c in zip(arrivals, cached)]
    if arrival_tokens is not None:
        chunks = np.minimum(np.broadcast_to(arrival_tokens, len(chunks)), chunks).tolist()
    if arrived:
        ids = np.concatenate([np.asarray(p[c:c + n]) for p, c, n in zip(arrivals, cached, chunks)])
        more, more_copies = cache.append(arrived, chunks, token_ids=ids)
        slots, copies = np.concatenate([slots, more]), np.concatenate([copies, more_copies])
    return list(seqs) + arrived, slots, copies, arrived, cached, forked


def state(cache):
    """Both caches' bookkeeping, without what differs between two pools (addresses, handles, times)."""
    a, t = cache.allocator, cache.tables
    return (t.table.tobytes(), t.lens.tobytes(), t.live.tobytes(), a.ref_count.tobytes(), a.is_free.tobytes(),
            a.chunk_mapped.tobytes(), a.index.cached.tobytes(), list(a.evictable), cache.prefix_stats())


def check_step(cache, step, rows, slots, copies):
    """The step's arrays say what the host's bookkeeping says."""
    t = cache.tables
    assert step.seqs.tolist() == list(rows)
    assert np.array_equal(to_host(step.slot_mapping), slots) and step.num_tokens == slots.size
    assert np.array_equal(step.copies, copies)
    assert np.array_equal(to_host(step.block_tables), t.table[rows])
    assert np.array_equal(to_host(step.seq_lens), t.lens[rows])
    qo = to_host(step.qo_indptr)
    assert qo[0] == 0 and qo[-1] == slots.size and np.array_equal(np.diff(qo), step.query_lens)
    assert np.array_equal(to_host(step.block_tables).shape, (len(rows), t.max_blocks_per_seq))


def test_a_decode_step_is_append_plus_the_metadata(backend):
    with small_cache(backend) as a, small_cache(backend) as b:
        for c in (a, b):
            seqs = [c.add_sequence() for _ in range(3)]
            c.append(seqs, [5, BS, 2 * BS - 1])
        for _ in range(BS + 2):  # crosses block boundaries
            step = a.step()
            rows, slots, copies, *_ = by_blocks(b)
            check_step(a, step, rows, slots, copies)
            assert state(a) == state(b)
        assert step.query_lens.tolist() == [1, 1, 1] and step.arrived.size == step.forked.size == 0


def test_a_mixed_step_arrives_with_a_cached_prefix_and_chunks_the_rest(backend):
    prompt = np.arange(500, 500 + 3 * BS + 3)
    with small_cache(backend) as c:
        first = c.step(arrivals=[prompt])
        assert first.cached.tolist() == [0] and first.query_lens.tolist() == [prompt.size]
        old = int(first.arrived[0])
        follow = np.concatenate([prompt[:2 * BS + 1], [9] * (2 * BS)])  # shares two full blocks
        step = c.step([old], 1, token_ids=[77], arrivals=[follow, prompt], arrival_tokens=[BS, 2])
        new, again = step.arrived.tolist()
        assert step.cached.tolist() == [2 * BS, 3 * BS]  # never the whole prompt: its last token is computed
        assert step.seqs.tolist() == [old, new, again] and step.query_lens.tolist() == [1, BS, 2]
        assert to_host(step.qo_indptr).tolist() == [0, 1, 1 + BS, 3 + BS]
        assert to_host(step.seq_lens).tolist() == [prompt.size + 1, 3 * BS, 3 * BS + 2]
        assert c.tables.blocks(new)[:2].tolist() == c.tables.blocks(old)[:2].tolist()
        assert c.tables.blocks(again)[:3].tolist() == c.tables.blocks(old)[:3].tolist()
        # the chunked prefill's next chunk: an ordinary scheduled sequence with its ids
        rest = follow[3 * BS:]
        nxt = c.step([new], [rest.size], token_ids=rest)
        assert to_host(nxt.seq_lens).tolist() == [follow.size]
        check_allocator(c)


def test_forks_frees_and_copy_on_write_in_one_step(backend):
    with small_cache(backend) as a, small_cache(backend) as b:
        for c in (a, b):
            x, y = c.add_sequence(), c.add_sequence()
            c.append([x, y], [BS + 3, 2 * BS])
        step = a.step([0], 2, forks=[0, 0], frees=[1])
        rows, slots, copies, _, _, forked = by_blocks(b, [0], 2, forks=[0, 0], frees=[1])
        check_step(a, step, rows, slots, copies)
        assert step.forked.tolist() == forked and step.copies.shape == (1, 2)  # the parent's tail, shared by two
        assert state(a) == state(b)
        step = a.step()  # both children and the parent: the children share the old tail; one keeps it
        rows, slots, copies, *_ = by_blocks(b)
        check_step(a, step, rows, slots, copies)
        assert state(a) == state(b)


def test_the_copies_and_slots_write_the_right_data(backend):
    with small_cache(backend) as c:
        first = c.step(arrivals=[np.arange(BS + 3)])
        x = int(first.arrived[0])
        data = np.random.default_rng(1).standard_normal((BS + 3, len(c.planes), 2, 64)).astype(np.float32)
        write_tokens(c, to_host(first.slot_mapping), data)
        step = c.step([x], 1, forks=[x])
        kernel_copy_blocks(c.planes, step.copies)
        child = int(step.forked[0])
        parent_tail, child_tail = c.tables.blocks(x)[1], c.tables.blocks(child)[1]
        assert parent_tail != child_tail and step.copies.tolist() == [[child_tail, parent_tail]]
        for p, plane in enumerate(c.planes):
            assert np.array_equal(to_host(plane[parent_tail, :, :3]), data[BS:, p].transpose(1, 0, 2))
            assert np.array_equal(to_host(plane[child_tail, :, :3]), data[BS:, p].transpose(1, 0, 2))


def test_bad_steps_raise_named_errors_and_change_nothing():
    with small_cache(max_tokens=16 * BS, max_seqs=4) as c:
        a, b = c.add_sequence(), c.add_sequence()
        c.append([a, b], [BS + 1, 3])
        before = frozen(c)
        cases = [
            (UnknownSequenceError, lambda: c.step([a, 7])),
            (UnknownSequenceError, lambda: c.step([a], frees=[a])),
            (UnknownSequenceError, lambda: c.step(forks=[b], frees=[b])),
            (UnknownSequenceError, lambda: c.step(frees=[3])),
            (DuplicateSequenceError, lambda: c.step([a, a])),
            (DuplicateSequenceError, lambda: c.step(frees=[a, a])),
            (InvalidTokenIdsError, lambda: c.step([a, b], 2, token_ids=[1, 2, 3])),
            (InvalidTokenIdsError, lambda: c.step(arrivals=[[1, -2]])),
            (InvalidTokenCountError, lambda: c.step(arrivals=[[]])),
            (InvalidTokenCountError, lambda: c.step(arrivals=[[1, 2]], arrival_tokens=0)),
            (InvalidTokenCountError, lambda: c.step(arrivals=[[1, 2]], arrival_tokens=[1, 2])),
            (InvalidTokenCountError, lambda: c.step([a], -1)),
            (InvalidTokenCountError, lambda: c.step([a, b], [100, c.metadata.max_step_tokens - 99])),
            (SequenceFullError, lambda: c.step([a], 24 * BS - 2, frees=[b])),
            (TooManySequencesError, lambda: c.step(forks=[a, a], arrivals=[[1]])),
            (PoolExhaustedError, lambda: c.step(arrivals=[np.arange(12 * BS)] * 2, frees=[a])),
        ]
        for error, call in cases:
            with pytest.raises(error):
                call()
            assert frozen(c) == before, error
        assert c.step(arrivals=[[1]]).arrived.tolist() == [2]  # and it still works


@pytest.mark.gpu
def test_a_graph_captured_over_the_step_buffers_reads_every_later_step():
    """The step's arrays are fixed buffers, rewritten in place: a CUDA graph captured once reads each new step,
    and what lies past the step is padding (slot -1, length 0, offsets at the token count)."""
    import cupy
    with small_cache("cuda") as c:
        c.step(arrivals=[np.arange(k, k + 3 + 5 * k) for k in range(3)])
        first = c.step()
        buffers = c.metadata.buffers
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            seen = {name: cupy.empty_like(buf) for name, buf in buffers.items()}
            stream.begin_capture()
            for name, buf in buffers.items():
                cupy.copyto(seen[name], buf)
            graph = stream.end_capture()
            for k in range(2 * BS):
                step = c.step(counts=1 + k % 3, frees=[0] if k == BS else ())
                graph.launch(stream)
                stream.synchronize()
                assert step.slot_mapping.data.ptr == buffers["slot_mapping"].data.ptr
                assert step.block_tables.data.ptr == first.block_tables.data.ptr
                batch, tokens = step.seqs.size, step.num_tokens
                got = {name: to_host(a) for name, a in seen.items()}
                check_step(c, step, step.seqs, got["slot_mapping"][:tokens], step.copies)
                assert np.array_equal(got["block_tables"][:batch], c.tables.table[step.seqs])
                assert (got["slot_mapping"][tokens:] == -1).all() and (got["block_tables"][batch:] == -1).all()
                assert (got["seq_lens"][batch:] == 0).all() and (got["qo_indptr"][batch + 1:] == tokens).all()


@st.composite
def decisions(draw, live, max_seqs):
    """A step's decisions over ``live`` handles: mostly sane, sometimes impossible (too many tokens, blocks, rows)."""
    live = sorted(live)
    frees = draw(st.lists(st.sampled_from(live), unique=True, max_size=2)) if live else []
    left = [s for s in live if s not in frees]
    forks = draw(st.lists(st.sampled_from(left), max_size=2)) if left else []
    arrivals = draw(st.lists(st.tuples(st.integers(0, len(SYSTEM_PROMPTS)),
                                       st.lists(st.integers(0, 3), min_size=1, max_size=3 * BS)), max_size=2))
    prompts = [np.concatenate([SYSTEM_PROMPTS[k] if k < len(SYSTEM_PROMPTS) else [], tail]).astype(np.int64)
               for k, tail in arrivals]
    chunk = draw(st.one_of(st.none(), st.integers(1, 2 * BS))) if prompts else None  # none without arrivals
    if draw(st.booleans()) or not left:
        seqs, counts = None, draw(st.sampled_from([1, 1, 2, BS]))
        n = len(left)
    else:
        seqs = draw(st.lists(st.sampled_from(left), unique=True, min_size=1))
        counts = draw(st.lists(st.integers(0, 3 * BS), min_size=len(seqs), max_size=len(seqs)))
        n = sum(counts)
    ids = draw(st.one_of(st.none(), st.just(True)))
    if ids:
        total = n * counts if isinstance(counts, int) and seqs is None else n
        ids = np.arange(total) % 5
    return dict(seqs=seqs, counts=counts, token_ids=ids, arrivals=prompts, arrival_tokens=chunk, forks=forks,
                frees=frees)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_step_does_what_its_building_blocks_do_or_nothing(data):
    """Twin caches: one steps, one runs the building blocks. The same bookkeeping when the step succeeds; when it
    fails, nothing changed, and the building blocks on a replayed twin fail too (a step runs the building blocks'
    own operations, each mapping when its allocation asks)."""
    history = []
    make = lambda: small_cache(max_tokens=32 * BS, max_seqs=5, max_seq_len=12 * BS, max_step_tokens=10**4)  # noqa: E731
    with make() as a, make() as b:
        for _ in range(12):
            d = data.draw(decisions(a.sequences, 5))
            before = frozen(a)
            try:
                step = a.step(**d)
            except PagedRTError as exc:
                assert frozen(a) == before
                with make() as replay:
                    for done in history:
                        by_blocks(replay, **done)
                    with pytest.raises(PagedRTError):
                        by_blocks(replay, **d)
                assert not isinstance(exc, (UnknownSequenceError, DuplicateSequenceError, InvalidTokenIdsError))
                continue
            rows, slots, copies, arrived, cached, forked = by_blocks(b, **d)
            check_step(a, step, rows, slots, copies)
            assert (step.arrived.tolist(), step.cached.tolist(), step.forked.tolist()) == (arrived, cached, forked)
            assert state(a) == state(b)
            check_allocator(a)
            history.append(d)


class StepMachine(PrefixMachine):
    """The prefix machine, plus whole engine steps: frees, forks, arrivals with shared prompts and chunks, and a
    decode token for the rest, in one call; the data written through the step's slots reads back."""

    @rule(free=st.integers(0, 100), fork=st.integers(0, 100), system=st.integers(0, len(SYSTEM_PROMPTS)),
          suffix=st.lists(st.integers(0, 3), max_size=2 * BS), chunk=st.integers(1, 3 * BS), tokens=st.integers(0, 3))
    def engine_step(self, free, fork, system, suffix, chunk, tokens):
        live = sorted(self.data)
        frees = [live[free % len(live)]] if live and free % 3 == 0 else []
        left = [s for s in live if s not in frees]
        forks = [left[fork % len(left)]] if left and fork % 2 == 0 else []
        prompt = np.concatenate([SYSTEM_PROMPTS[system] if system < len(SYSTEM_PROMPTS) else [], suffix, [1]])
        prompt = prompt.astype(np.int64)
        ids = np.full(len(left), tokens)
        before = frozen(self.cache)
        try:
            step = self.cache.step(None, 1, token_ids=ids, arrivals=[prompt], arrival_tokens=chunk, forks=forks,
                                   frees=frees)
        except (PoolExhaustedError, SequenceFullError, TooManySequencesError):
            assert frozen(self.cache) == before
            return
        for seq in frees:
            del self.data[seq]
            self.freed(seq)
        for parent, child in zip(forks, step.forked.tolist()):
            self.data[child] = self.data[parent].copy()
            self.forked(parent, child)
        new = int(step.arrived[0])
        cached = int(step.cached[0])
        self.data[new] = kv_of(prompt[:cached], np.arange(cached))
        self.ids[new] = prompt[:cached]
        kernel_copy_blocks(self.cache.planes, step.copies)
        all_ids = np.concatenate([ids, prompt[cached:cached + int(step.query_lens[-1])]])
        positions = np.concatenate([np.arange(self.cache.length(s) - n, self.cache.length(s))
                                    for s, n in zip(step.seqs.tolist(), step.query_lens.tolist())])
        write_tokens(self.cache, to_host(step.slot_mapping), kv_of(all_ids, positions))
        starts = to_host(step.qo_indptr)
        for b, seq in enumerate(step.seqs.tolist()):
            part = all_ids[starts[b]:starts[b + 1]]
            self.ids[seq] = np.concatenate([self.known_ids(seq), part])
            self.data[seq] = np.concatenate([self.data[seq], kv_of(part, positions[starts[b]:starts[b + 1]])])


TestStepMachine = machine_test(StepMachine, 40, 40)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "8", 2**40])
def test_bad_max_step_tokens(bad):
    with pytest.raises(UnsupportedConfigError, match="max_step_tokens"):
        small_cache(max_step_tokens=bad)


def test_a_step_after_close_is_a_named_error():
    c = small_cache()
    c.close()
    with pytest.raises(PoolClosedError):
        c.step(arrivals=[[1, 2, 3]])
