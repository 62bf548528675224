"""A step is one transaction: whatever it raises, half-way or at any line, the cache is as before it."""

import json
import sys
import threading

import numpy as np
import pytest

from pagedrt import PagedKVCache, kernels
from pagedrt.blocks import Transaction
from pagedrt.blocks.prefix import CachedFree
from pagedrt.errors import (InvalidTokenCountError, InvalidTokenIdsError, PagedRTError, PoolExhaustedError,
                            UnknownSequenceError)
from test_cache import check_allocator, frozen, small_cache

BS = 8


def shared_swap_cache():
    """8 device and 8 host blocks of 8 float32 tokens, one layer and head of 64."""
    return PagedKVCache(1, 1, 64, BS, "float32", max_tokens=8 * BS, max_seqs=8, max_seq_len=8 * BS,
                        chunk_bytes=8 * BS * 64 * 4, backend="host", host_tokens=8 * BS)


def apply(cache, step, value):
    """Make the step's copies, then write ``value`` as every new token's K and V."""
    kernels.swap_blocks(cache.planes, step.swaps)
    kernels.copy_blocks(cache.planes, step.copies)
    if step.num_tokens:
        x = np.full((step.num_tokens, 1, 64), value, np.float32)
        kernels.write_kv(x, x, cache.k(0), cache.v(0), np.ascontiguousarray(step.slot_mapping))


def keys(cache, seq):
    """The first K element of each of ``seq``'s tokens, read through its table."""
    return cache.k(0)[cache.tables.blocks(seq), 0, :, 0].ravel()[:cache.length(seq)].tolist()


def test_a_step_failing_half_way_changes_nothing_and_succeeds_with_room():
    """swap_out=[B] with swap_in=[A], A and B sharing blocks, and an arrival: the device is short only once the
    swap-in has run. The step raises, nothing changed; with room the same step succeeds and K/V read back right."""
    with shared_swap_cache() as c:
        st = c.step(arrivals=[np.arange(16)])  # A: two full blocks
        a = int(st.arrived[0])
        apply(c, st, 1.0)
        st = c.step([], forks=[a])  # B shares both
        b = int(st.forked[0])
        apply(c, st, 0.0)
        apply(c, c.step([b], 8), 3.0)  # and writes a private third block
        apply(c, c.step([], swap_out=[a]), 0.0)  # A's blocks stay: B holds them
        st = c.step([], arrivals=[np.arange(40) + 1000])  # F: the other five device blocks
        f = int(st.arrived[0])
        apply(c, st, 2.0)
        before, stats = frozen(c), c.prefix_stats()
        with pytest.raises(PoolExhaustedError):
            c.step([], swap_out=[b], swap_in=[a], arrivals=[np.arange(24) + 5000])
        assert frozen(c) == before and c.prefix_stats() == stats and c.sequences == [a, b, f]
        check_allocator(c)
        assert keys(c, b) == [1.0] * 16 + [3.0] * 8 and keys(c, f) == [2.0] * 40
        c.free(f)
        st = c.step([], swap_out=[b], swap_in=[a], arrivals=[np.arange(24) + 5000])
        apply(c, st, 4.0)
        check_allocator(c)
        device = c.allocator.device_blocks  # B's private block moved out; the shared ones came back with A
        assert c.swapped == [b] and (c.tables.blocks(a) < device).all() and c.tables.blocks(b)[2] >= device
        assert keys(c, a) == [1.0] * 16 and keys(c, b) == [1.0] * 16 + [3.0] * 8
        assert st.query_lens.tolist() == [24] and keys(c, int(st.arrived[0])) == [4.0] * 24


def mixed_step_cache():
    c = PagedKVCache(1, 1, 64, BS, "float32", max_tokens=32 * BS, max_seqs=16, max_seq_len=16 * BS,
                     chunk_bytes=4 * BS * 64 * 4, backend="host", host_tokens=16 * BS)
    a, b = c.step(arrivals=[np.arange(20), np.arange(16) + 100]).arrived.tolist()
    d = int(c.step(forks=[a]).forked[0])
    e = int(c.step(arrivals=[np.arange(30) + 200]).arrived[0])
    return c, (a, b, d, e)


def mixed_step(c, a, b, d, e):
    """Frees, a fork, arrivals (one with a prefix hit), a swap-out and appends in one step."""
    return c.step([a, b], [3, 9], np.arange(12), arrivals=[np.arange(20), np.arange(40) + 3000], frees=[d],
                  forks=[b], swap_out=[e])


def bookkeeping(cache):
    """The snapshot less what differs between two pools (addresses, handles) and the time."""
    snap = cache.snapshot()
    snap.pop("time")
    snap["pool"] = [(r["chunk"], r["state"], r["location"]) for r in snap["pool"]["chunks"]]
    return json.dumps(snap, sort_keys=True)


def test_an_interrupt_at_any_line_of_a_step_leaves_the_cache_as_before_or_as_after():
    """At every line of the software layer and the cache (the pool's own lines under interrupts are
    tests/test_atomic*'s)."""
    c, seqs = mixed_step_cache()
    mixed_step(c, *seqs)
    after = bookkeeping(c)
    c.close()
    points = 0
    for at in range(1, 100000):
        c, seqs = mixed_step_cache()
        before, lines = frozen(c), [0]

        def tracer(frame, event, arg):
            name = frame.f_code.co_filename
            if event == "line" and "pagedrt" in name and "memory" not in name:
                lines[0] += 1
                if lines[0] == at:
                    raise KeyboardInterrupt
            return tracer

        sys.settrace(tracer)
        try:
            mixed_step(c, *seqs)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        if lines[0] < at:  # the step ran every line without meeting the interrupt
            assert bookkeeping(c) == after
            c.close()
            break
        points += 1
        assert frozen(c) == before or bookkeeping(c) == after, at
        check_allocator(c)  # the same thread uses the cache on
        c.close()
    assert points > 300


def test_growth_never_releases_a_chunk_the_step_just_freed():
    """release_after=1: the step's swap-out frees chunk 0, whose blocks its own tier copies read."""
    c = PagedKVCache(1, 1, 64, BS, "float32", max_tokens=16 * BS, chunk_bytes=2 * BS * 64 * 4, backend="host",
                     host_tokens=8 * BS, growth=dict(low_blocks=0, high_blocks=1, release_after=1, background=False))
    with c:
        a, f = c.add_sequence(), c.add_sequence()
        apply(c, c.step([a], 2 * BS), 7.0)  # chunk 0
        apply(c, c.step([f], BS), 1.0)  # chunk 1
        st = c.step([], swap_out=[a])
        assert st.swaps[:, 0].tolist() == [0, 1] and c.growth.chunks_released == 0
        apply(c, st, 0.0)  # the copies read mapped memory
        assert keys(c, a) == [7.0] * 2 * BS
        c.step([])  # a tick later, idle and untouched: released
        assert c.growth.chunks_released == 1 and not c.allocator.chunk_mapped[0]


def test_a_building_block_call_counts_as_use_for_growth():
    c = PagedKVCache(1, 1, 64, BS, "float32", max_tokens=16 * BS, chunk_bytes=2 * BS * 64 * 4, backend="host",
                     growth=dict(low_blocks=0, high_blocks=1, release_after=3, background=False))
    with c:
        f, g, h = (c.add_sequence() for _ in range(3))
        c.step([f], 2 * BS)  # chunk 0
        c.step([g], 2 * BS)  # chunk 1
        c.step([h], 1)  # chunk 2, one block spare
        c.step([], frees=[g])  # chunk 1 all free: a chunk more than the high watermark
        c.step([]), c.step([])  # chunk 1 idle for two ticks
        a = c.add_sequence()
        c.append(a, 2 * BS)  # between ticks: chunk 2's spare block and one of chunk 1
        assert sorted(set(c.tables.blocks(a) // 2)) == [1, 2]
        c.free(a)
        c.step([])  # chunk 1 is all free again, but was used since the last tick: its idle ticks start again
        assert c.allocator.chunk_mapped[1] and c.growth.chunks_released == 0
        c.step([]), c.step([])
        assert c.allocator.chunk_mapped[1]
        c.step([])
        assert not c.allocator.chunk_mapped[1] and c.growth.chunks_released == 1


def test_an_interrupt_right_after_the_lock_is_taken_leaves_it_free():
    with small_cache() as c:
        for at in range(1, 4):
            lines = [0]

            def tracer(frame, event, arg):
                if event == "line" and frame.f_code.co_name == "exclusive":
                    lines[0] += 1
                    if lines[0] == at:
                        raise KeyboardInterrupt
                return tracer

            sys.settrace(tracer)
            try:
                c.step([])
            except KeyboardInterrupt:
                pass
            finally:
                sys.settrace(None)
            other = []
            thread = threading.Thread(target=lambda: other.append(c.sequences))  # the lock is free for others too
            thread.start()
            thread.join()
            assert other == [[]]


@pytest.mark.parametrize("kwargs", [dict(frees=None), dict(forks=None), dict(swap_out=None), dict(swap_in=None),
                                    dict(arrivals=None)])
def test_none_for_a_list_means_none(kwargs):
    with small_cache() as c:
        s = c.add_sequence()
        st = c.step(**kwargs)
        assert st.seqs.tolist() == [s] and st.num_tokens == 1 and st.arrived.size == st.forked.size == 0


def test_one_handle_is_a_free_as_free_takes_it():
    with small_cache() as c:
        s, t = c.add_sequence(), c.add_sequence()
        c.append([s, t], 3)
        st = c.step(frees=s)
        assert c.sequences == [t] and st.seqs.tolist() == [t]
        check_allocator(c)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(arrivals=5), InvalidTokenIdsError, "arrivals must be a list of prompts"),
    (dict(arrivals=[np.arange(10)], arrival_tokens=2**63), InvalidTokenCountError, "at most"),
    (dict(arrivals=[np.arange(10)], arrival_tokens=np.uint64(2**64 - 1)), InvalidTokenCountError, "at most"),
    (dict(arrivals=[np.arange(10)], arrival_tokens=[2**63]), InvalidTokenCountError, "at most"),
    (dict(arrivals=[np.arange(10)], arrival_tokens=2**70), InvalidTokenCountError, "ints >= 1"),
    (dict(arrival_tokens=[5, 6, 7]), InvalidTokenCountError, "given for no arrivals"),
    (dict(arrivals=[], arrival_tokens=1), InvalidTokenCountError, "given for no arrivals"),
    (dict(frees=[99]), UnknownSequenceError, "does not exist"),
])
def test_bad_step_arguments_are_named_errors_and_change_nothing(kwargs, error, words):
    with small_cache() as c:
        c.append(c.add_sequence(), 5)
        before = frozen(c)
        with pytest.raises(error, match=words) as raised:
            c.step(**kwargs)
        assert isinstance(raised.value, PagedRTError) and frozen(c) == before


def test_an_interrupt_at_any_opcode_of_an_eviction_from_the_lru_leaves_it_as_before():
    """Between two bytecodes, as a signal handler's KeyboardInterrupt can land (SIGALRM found it): a block popped
    from the LRU but not yet recorded for the undo would be lost from it."""
    points = 0
    for at in range(1, 10000):
        tx = Transaction()
        lru = CachedFree(tx)
        lru.push([5, 1, 4, 2, 3])
        seen = [0]

        def tracer(frame, event, arg):
            if frame.f_code is not CachedFree.take_oldest.__code__:
                return None
            frame.f_trace_opcodes = True
            if event == "opcode":
                seen[0] += 1
                if seen[0] == at:
                    raise KeyboardInterrupt
            return tracer

        sys.settrace(tracer)
        try:
            taken = tx.run(lambda: lru.take_oldest(3))
        except KeyboardInterrupt:
            taken = None
        finally:
            sys.settrace(None)
        if taken is not None:
            assert taken == [5, 1, 4] and list(lru) == [2, 3]
            break
        points += 1
        assert list(lru) == [5, 1, 4, 2, 3], at
    assert points > 20
