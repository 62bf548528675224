"""Hostile input to the cache's public API: a named error, and nothing changed.

Each test here is a reproducer of a way bad input once crashed the process or left
the cache half-changed; the property test at the end drives the whole API with
hostile arguments mixed into valid operations.
"""

import os
import sys
import tempfile
import threading
import time

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pagedrt.cache import PagedKVCache
from pagedrt.errors import (ConcurrentUseError, InvalidTokenCountError, PagedRTError, PoolClosedError,
                            SequenceFullError)
from test_cache import BS, check_allocator, frozen, machine_test, small_cache

INT_DTYPES = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)


def tiny_cache():
    """8 blocks of 16 tokens in one chunk; rows of 8 blocks."""
    return PagedKVCache(1, 1, 64, 16, "float32", max_tokens=128, backend="host")


# --- 1: token counts that overflow int32 (or int64) ------------------------------------------

@pytest.mark.parametrize("seqs,counts", [
    ("a", 2**31 - 1), ("a", np.int32(2**31 - 1)), (None, 2**31 - 1), (["a"], [2**63 - 1]),
    ("a", 2**31), ("a", 2**64), ("a", np.uint64(2**64 - 1)), (["a"], np.array([2**63], np.uint64)),
    (["a"], [2**64]), ("a", 129), (None, [2**31 - 1, 1]),
])
def test_huge_token_counts_change_nothing(seqs, counts):
    with tiny_cache() as c:
        a = c.add_sequence()
        c.append(a, 3)
        c.fork(a)  # a and its fork share block 0
        seqs = {"a": a, None: None}[seqs] if not isinstance(seqs, list) else [a]
        before = frozen(c)
        if isinstance(counts, list) and counts[0] >= 2**64:  # no integer dtype holds it
            with pytest.raises(InvalidTokenCountError):
                c.append(seqs, counts)
            with pytest.raises(InvalidTokenCountError):
                c.can_append(seqs, counts)
        else:
            with pytest.raises(SequenceFullError, match="a block-table row holds 8 blocks"):
                c.append(seqs, counts)
            assert c.can_append(seqs, counts) is False
        assert frozen(c) == before
        assert c.stats()["free_blocks"] == 7 and c.allocator.ref_count[0] == 2
        fresh = c.add_sequence()
        c.append(fresh, 1)
        assert c.tables.blocks(fresh)[0] != 0  # the shared block is not handed out again


# --- 4: empty handle lists are no calls ---------------------------------------------------------

def test_empty_handle_lists_do_nothing():
    with tiny_cache() as c:
        a = c.add_sequence()
        c.append(a, 3)
        before = frozen(c)
        slots, copies = c.append([], 1)
        assert slots.size == 0 and copies.shape == (0, 2)
        assert c.append(np.array([], np.int64), [])[0].size == 0
        c.free([])
        assert c.can_append([], 5) is True
        assert c.block_tables([]).shape == (0, c.max_blocks_per_seq) and c.seq_lens([]).shape == (0,)
        assert frozen(c) == before


# --- 3: every call after close ---------------------------------------------------------------

CALLS = {
    "add_sequence": lambda c, a: c.add_sequence(), "append": lambda c, a: c.append(a, 1),
    "decode step": lambda c, a: c.append(None, 1), "fork": lambda c, a: c.fork(a), "free": lambda c, a: c.free(a),
    "can_append": lambda c, a: c.can_append(a, 1), "num_available_blocks": lambda c, a: c.num_available_blocks,
    "trim": lambda c, a: c.trim(), "length": lambda c, a: c.length(a), "sequences": lambda c, a: c.sequences,
    "k": lambda c, a: c.k(0), "v": lambda c, a: c.v(0), "planes": lambda c, a: c.planes,
    "block_tables": lambda c, a: c.block_tables(), "seq_lens": lambda c, a: c.seq_lens([a]),
    "block_mask": lambda c, a: c.block_mask(), "translate": lambda c, a: c.translate(a, 0),
    "stats": lambda c, a: c.stats(), "snapshot": lambda c, a: c.snapshot(),
    "write_snapshot": lambda c, a: c.write_snapshot(os.path.join(tempfile.mkdtemp(), "s.json")),
}


@pytest.mark.parametrize("name", CALLS)
def test_every_call_after_close_is_pool_closed(name):
    c = tiny_cache()
    a = c.add_sequence()
    c.append(a, 3)
    CALLS[name](c, a)  # works while open
    c.close()
    c.close()  # idempotent
    assert c.closed
    with pytest.raises(PoolClosedError, match="closed"):
        CALLS[name](c, a)
    assert "closed" in repr(c)


def test_closing_the_pool_closes_the_cache():
    c = tiny_cache()
    a = c.add_sequence()
    c.pool.close()
    with pytest.raises(PoolClosedError):
        c.append(a, 1)


# --- 2: two threads in one cache -------------------------------------------------------------

def test_threads_hammering_one_cache_get_concurrent_use_errors_never_shared_blocks():
    """Threads add, append to and free their own sequences of one cache: each call succeeds, or raises
    ConcurrentUseError having changed nothing, so no block lands in two tables."""
    threads, rounds = 4, 200
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, inside the cache's calls
    try:
        with small_cache(max_tokens=1024 * BS, max_seqs=16, max_seq_len=64 * BS) as c:
            lengths = [{} for _ in range(threads)]  # per thread: its sequences and their lengths
            conflicts, failures = [0] * threads, []

            def work(i):
                rng, own = np.random.default_rng(i), lengths[i]
                for _ in range(rounds):
                    try:
                        if len(own) < 3:
                            own[c.add_sequence()] = 0
                            continue
                        seq = list(own)[rng.integers(len(own))]
                        count = int(rng.integers(1, 3 * BS))
                        if own[seq] + count > 64 * BS:
                            c.free(seq)
                            del own[seq]
                        else:
                            c.append(seq, count)
                            own[seq] += count
                        c.block_tables(), c.can_append(None, 1)
                    except ConcurrentUseError:
                        conflicts[i] += 1
                    except Exception as exc:  # noqa: BLE001 - anything else is the failure under test
                        failures.append(exc)

            start = time.monotonic()
            while sum(conflicts) == 0 and time.monotonic() - start < 5:
                pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
                for t in pool:
                    t.start()
                for t in pool:
                    t.join()
            assert not failures
            assert sum(conflicts) > 0
            check_allocator(c)
            expected = {seq: n for own in lengths for seq, n in own.items()}
            assert c.sequences == sorted(expected)
            assert all(c.length(seq) == n for seq, n in expected.items())
            held = np.concatenate([c.tables.blocks(s) for s in c.sequences])
            assert np.unique(held).size == held.size  # no block in two tables
    finally:
        sys.setswitchinterval(switch)


# --- 5: the whole API, hostile arguments mixed with valid operations ------------------------------

def _numpy_ints():
    return st.sampled_from(INT_DTYPES).flatmap(
        lambda dt: st.integers(int(np.iinfo(dt).min), int(np.iinfo(dt).max)).map(dt))


SCALARS = st.one_of(
    st.integers(-2**70, 2**70), st.integers(-3, 40), st.floats(allow_nan=True), st.none(), st.booleans(),
    _numpy_ints(), st.just(np.bool_(True)), st.text(max_size=2), st.just(b"k"), st.just(object()),
    st.complex_numbers(max_magnitude=4))
HOSTILE = st.one_of(
    SCALARS, st.lists(SCALARS, max_size=3), st.just([]), st.just(()), st.just({}),
    st.lists(st.integers(0, 7), max_size=4),  # live or not, duplicates likely
    hnp.arrays(st.sampled_from(INT_DTYPES + (np.float64, np.bool_)), hnp.array_shapes(min_dims=0, max_dims=3,
                                                                                      max_side=3)))
READS = ("can_append", "translate", "length", "block_tables", "seq_lens", "stats", "snapshot", "can_swap_out",
         "can_swap_in")


class HostileMachine(RuleBasedStateMachine):
    """Valid operations and hostile ones on one cache; after a failing call, a named error and no change."""

    def __init__(self):
        super().__init__()
        self.cache = small_cache(max_tokens=32 * BS, max_seqs=6, max_seq_len=8 * BS, host_tokens=8 * BS)

    def teardown(self):
        self.cache.close()

    def live(self, pick):
        seqs = self.cache.sequences
        return seqs[pick % len(seqs)] if seqs else pick % 6

    @rule()
    def add(self):
        self.call("add_sequence")

    @rule(pick=st.integers(0, 50), count=st.integers(0, 2 * BS))
    def append(self, pick, count):
        self.call("append", self.live(pick), count)

    @rule(prompt=st.lists(st.integers(0, 2), max_size=3 * BS))
    def add_prompt(self, prompt):
        """A prompt from a three-token vocabulary: cached blocks are shared often."""
        before = self.cache.sequences
        self.call("add_sequence", prompt)
        seq = next(iter(set(self.cache.sequences) - set(before)), None)
        if seq is not None:
            cached = self.cache.length(seq)
            self.call("append", seq, len(prompt) - cached, prompt[cached:])

    @rule()
    def decode_step(self):
        self.call("append", None, 1)

    @rule(pick=st.integers(0, 50))
    def fork(self, pick):
        self.call("fork", self.live(pick))

    @rule(pick=st.integers(0, 50))
    def free(self, pick):
        self.call("free", self.live(pick))

    @rule()
    def trim(self):
        self.call("trim")

    @rule(pick=st.integers(0, 50))
    def swap(self, pick):
        seq = self.live(pick)
        self.call("swap_in" if seq in self.cache.swapped else "swap_out", [seq])

    @rule(data=st.data(), name=st.sampled_from(
        ("add_sequence", "append", "can_append", "fork", "free", "trim", "swap_out", "swap_in") + READS),
        pick=st.integers(0, 50), hostile=st.lists(st.booleans(), min_size=5, max_size=5))
    def hostile_call(self, data, name, pick, hostile):
        """A call whose arguments are each a live handle / small valid value, or something hostile."""
        def arg(i, valid):
            return data.draw(HOSTILE) if hostile[i] else valid
        seq = self.live(pick)
        args = {
            "add_sequence": (arg(0, None),), "trim": (), "stats": (), "snapshot": (),
            "append": (arg(0, [seq]), arg(1, 1), arg(2, None) if hostile[3] else arg(2, [1])),
            "can_append": (arg(0, seq), arg(1, 3)),
            "fork": (arg(0, seq),), "free": (arg(0, [seq, seq]),), "length": (arg(0, seq),),
            "translate": (arg(0, seq), arg(1, 0), arg(2, 0), arg(3, "k"), arg(4, 0)),
            "block_tables": (arg(0, [seq]),), "seq_lens": (arg(0, None),),
            "swap_out": (arg(0, [seq]),), "swap_in": (arg(0, [seq]),), "can_swap_out": (arg(0, [seq]),),
            "can_swap_in": (arg(0, [seq]),),
        }[name]
        self.call(name, *args)

    def call(self, name, *args):
        before = frozen(self.cache)
        try:
            getattr(self.cache, name)(*args)
        except PagedRTError:
            assert frozen(self.cache) == before
        else:
            if name in READS:
                assert frozen(self.cache) == before

    @invariant()
    def allocator_is_consistent(self):
        check_allocator(self.cache)


TestHostileAPI = machine_test(HostileMachine, 40, 30)
