"""The software layer: allocator invariants (a hypothesis state machine), block tables, translate, snapshots."""

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedrt import Pool
from pagedrt.blocks import BlockAllocator
from pagedrt.cache import PagedKVCache
from pagedrt.snapshot import load_snapshot
from pagedrt.memory import select_backend
from pagedrt.errors import (DoubleFreeError, DuplicateSequenceError, InvalidPositionError, InvalidTokenCountError,
                            PoolExhaustedError, PoolSizeError, SequenceFullError, SnapshotError, TooManySequencesError,
                            UnknownSequenceError, UnsupportedConfigError)
from helpers import to_host

LAYERS, HEADS, DIM, BS = 2, 2, 64, 8


def small_cache(backend="host", placement="plane", max_tokens=64 * BS, max_seqs=8, max_seq_len=24 * BS, **more):
    # 4 blocks per chunk on the host (4 KiB pages), so that sequences spread over
    # many chunks and trims happen; on a GPU a chunk is at least one 2 MiB page
    plane_block = HEADS * BS * DIM * 4
    unit = plane_block if placement == "plane" else 2 * LAYERS * plane_block
    chunk = np.lcm(4 * unit, select_backend(backend).page_bytes)
    return PagedKVCache(LAYERS, HEADS, DIM, BS, "float32", max_tokens=max_tokens, max_seqs=max_seqs,
                        max_seq_len=max_seq_len, placement=placement, chunk_bytes=int(chunk), backend=backend, **more)


def write_tokens(cache, slots, values):
    """Scatter ``values`` [tokens, planes, heads, dim] to their slots in every plane (NumPy or CuPy)."""
    xp = cache.xp
    blocks, within = xp.asarray(slots // BS), xp.asarray(slots % BS)
    for p, plane in enumerate(cache.planes):
        plane[blocks, :, within, :] = xp.asarray(values[:, p])


def read_sequence(cache, seq):
    """Gather a sequence's K/V through its block-table row: [len, planes, heads, dim]."""
    n = cache.length(seq)
    row = to_host(cache.block_tables([seq]))[0]
    pos = np.arange(n)
    blocks, within = row[pos // BS], pos % BS
    return np.stack([to_host(plane[cache.xp.asarray(blocks), :, cache.xp.asarray(within), :])
                     for plane in cache.planes], axis=1)


def copy_blocks(cache, copies):
    for plane in cache.planes:
        src, dst = cache.xp.asarray(copies[:, 0]), cache.xp.asarray(copies[:, 1])
        plane[dst] = plane[src]


def check_allocator(cache):
    """The allocator's invariants: reference counts are the tables' holders; free, held or cached-free, one each;
    the prefix index and the eviction order agree; counts per chunk."""
    a, t = cache.allocator, cache.tables
    holders = np.zeros(a.max_blocks, np.int64)
    for seq in t.sequences:
        np.add.at(holders, t.blocks(seq), 1)
    assert np.array_equal(a.ref_count, holders)
    mapped = a.usable_mask()
    index = a.index
    idle = np.zeros(a.max_blocks, bool)
    idle[list(a.evictable) + list(a.host_evictable)] = True
    assert len(a.evictable) + len(a.host_evictable) == int(idle.sum())
    assert all(b < a.device_blocks for b in a.evictable) and all(b >= a.device_blocks for b in a.host_evictable)
    assert np.array_equal(idle, index.cached & (a.ref_count == 0))  # cached-free = named and held by none
    assert (a.is_free.astype(int) + (a.ref_count > 0) + idle <= 1).all()
    assert np.array_equal(a.is_free | (a.ref_count > 0) | idle, mapped)  # released chunks hold nothing
    device = a.device_blocks
    assert a.num_free + a.num_held + len(a.evictable) == a.num_mapped_blocks == int(mapped[:device].sum())
    assert sorted(index.block_of.values()) == np.flatnonzero(index.cached).tolist() == sorted(index.tokens)
    assert all(int(index.name[b]) == name for name, b in index.block_of.items())
    assert cache.num_available_blocks == device - a.num_held
    assert np.array_equal(a.free_in_chunk, a.is_free.reshape(a.num_chunks, -1).sum(1))
    assert a.num_free == int(a.free_in_chunk[:a.device_chunks].sum())
    assert a.num_mapped_blocks == int(a.chunk_mapped[:a.device_chunks].sum()) * a.blocks_per_chunk
    assert a.chunk_mapped[a.device_chunks:].all() and a.num_host_free == int(a.is_free[device:].sum())
    assert a.num_host_held == int((a.ref_count[device:] > 0).sum())
    assert not (index.cached[device:] & (a.ref_count[device:] > 0)).any()  # offloaded blocks are cached-free
    assert not (t.swapped & ~t.live).any()
    for seq in t.sequences:  # only a swapped-out sequence holds host-tier blocks
        assert t.swapped[seq] or (t.blocks(seq) < device).all()
    assert a.num_shared == int((a.ref_count > 1).sum())
    pool_mapped = {r.chunk for r in cache.pool.mappings() if r.state == "mapped"}
    assert pool_mapped == {c for k in np.flatnonzero(a.chunk_mapped) for c in a.pool_chunks(int(k))}
    assert not (a.in_flight & a.chunk_mapped).any()  # chunks being mapped ahead are claimed in the pool, not mapped
    assert set(cache.pool._claims) == {c for k in np.flatnonzero(a.in_flight) for c in a.pool_chunks(int(k))}


class CacheMachine(RuleBasedStateMachine):
    """Random add / append / fork / free / trim / grow, checking both layers after every step."""

    backend, placement = "host", "plane"
    cache_args = {}  # more keywords of small_cache, for subclasses

    def __init__(self):
        super().__init__()
        self.cache = small_cache(self.backend, self.placement, **self.cache_args)
        self.data = {}  # seq -> what was written, [len, planes, heads, dim]
        self.rng = np.random.default_rng(0)

    def teardown(self):
        self.cache.close()

    @rule()
    def add(self):
        try:
            seq = self.cache.add_sequence()
        except TooManySequencesError:
            assert len(self.data) == self.cache.tables.max_seqs
            return
        self.data[seq] = np.zeros((0, 2 * LAYERS, HEADS, DIM), np.float32)

    @precondition(lambda self: self.data)
    @rule(picks=st.lists(st.integers(0, 100), min_size=1, max_size=4, unique=True),
          counts=st.lists(st.integers(0, 3 * BS), min_size=4, max_size=4))
    def append(self, picks, counts):
        live = sorted(self.data)
        seqs = sorted({live[p % len(live)] for p in picks})
        counts = np.array(counts[:len(seqs)])
        before = self.cache.snapshot()
        fits = self.cache.can_append(seqs, counts)
        try:
            slots, copies = self.cache.append(seqs, counts)
        except (PoolExhaustedError, SequenceFullError):
            after = self.cache.snapshot()
            before.pop("time"), after.pop("time")
            assert after == before  # nothing changed
            assert not fits
            return
        assert fits
        assert slots.dtype == np.int64 and slots.size == counts.sum()
        copy_blocks(self.cache, copies)
        values = self.rng.standard_normal((slots.size, 2 * LAYERS, HEADS, DIM)).astype(np.float32)
        write_tokens(self.cache, slots, values)
        for seq, part in zip(seqs, np.split(values, np.cumsum(counts)[:-1])):
            self.data[seq] = np.concatenate([self.data[seq], part])

    @precondition(lambda self: self.data)
    @rule()
    def decode_step(self):
        """One token for every live sequence (the fast path when nothing is shared)."""
        fits = self.cache.can_append(None, 1)
        try:
            slots, copies = self.cache.append(None, 1)
        except (PoolExhaustedError, SequenceFullError):
            assert not fits
            return
        assert fits
        seqs = sorted(self.data)
        assert slots.size == len(seqs)
        copy_blocks(self.cache, copies)
        values = self.rng.standard_normal((len(seqs), 2 * LAYERS, HEADS, DIM)).astype(np.float32)
        write_tokens(self.cache, slots, values)
        for seq, value in zip(seqs, values):
            self.data[seq] = np.concatenate([self.data[seq], value[None]])

    @precondition(lambda self: self.data)
    @rule(pick=st.integers(0, 100))
    def fork(self, pick):
        parent = sorted(self.data)[pick % len(self.data)]
        try:
            child = self.cache.fork(parent)
        except TooManySequencesError:
            return
        self.data[child] = self.data[parent].copy()
        self.forked(parent, child)

    def forked(self, parent, child):
        """A hook for subclasses that model more per sequence."""

    @precondition(lambda self: self.data)
    @rule(pick=st.integers(0, 100))
    def free(self, pick):
        seq = sorted(self.data)[pick % len(self.data)]
        self.cache.free(seq)
        del self.data[seq]
        self.freed(seq)
        with pytest.raises(UnknownSequenceError):
            self.cache.length(seq)

    def freed(self, seq):
        """A hook for subclasses that model more per sequence."""

    @rule()
    def trim(self):
        a = self.cache.allocator
        empty = set(np.flatnonzero(a.chunk_mapped & (a.free_in_chunk == a.blocks_per_chunk)).tolist())
        assert set(self.cache.trim()) == empty
        assert not (a.chunk_mapped & (a.free_in_chunk == a.blocks_per_chunk)).any()

    @rule()
    def grow(self):
        a = self.cache.allocator
        if a.unmapped_chunks(1):
            a.grow(1)

    @invariant()
    def blocks_are_free_xor_held_and_counted(self):
        assert sorted(self.data) == self.cache.sequences
        check_allocator(self.cache)

    @invariant()
    def device_tables_match_and_data_reads_back(self):
        t = self.cache.tables
        table, lens = to_host(self.cache.block_tables()), to_host(self.cache.seq_lens())
        assert np.array_equal(table, t.table) and np.array_equal(lens, t.lens)
        for seq, expected in self.data.items():
            assert self.cache.length(seq) == len(expected)
            assert np.array_equal(read_sequence(self.cache, seq), expected)

    @invariant()
    def translate_agrees_with_numpy_addresses(self):
        if not self.data:
            return
        seq = max(self.data, key=lambda s: len(self.data[s]))
        n = len(self.data[seq])
        if n == 0:
            return
        pos = int(self.rng.integers(n))
        layer, kv, head = int(self.rng.integers(LAYERS)), "kv"[int(self.rng.integers(2))], int(self.rng.integers(HEADS))
        tr = self.cache.translate(seq, pos, layer, kv, head)
        block = self.cache.tables.blocks(seq)[pos // BS]
        plane = self.cache.k(layer) if kv == "k" else self.cache.v(layer)
        element = plane[block, head, pos % BS]
        address = element.__array_interface__["data"][0] if isinstance(element, np.ndarray) else element.data.ptr
        assert (tr.layer, tr.kv, tr.kv_head) == (layer, kv, head)
        assert (tr.logical_block, tr.slot, tr.block_id) == (pos // BS, pos % BS, block)
        assert tr.virtual_address == address == self.cache.pool.base + tr.pool_offset
        chunk_bytes = self.cache.pool.chunk_bytes
        assert (tr.chunk, tr.chunk_offset) == divmod(tr.pool_offset, chunk_bytes)
        assert tr.page == tr.chunk_offset // self.cache.pool.page_bytes
        assert self.cache.pool.is_mapped(tr.chunk)


def machine_test(machine, examples, steps):
    case = machine.TestCase
    case.settings = settings(max_examples=examples, stateful_step_count=steps, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
    return case


class BlockMajorMachine(CacheMachine):
    placement = "block"


class CudaMachine(CacheMachine):
    backend = "cuda"


SYSTEM_PROMPTS = [np.random.default_rng(k).integers(0, 1000, n) for k, n in enumerate((2 * BS + 3, 3 * BS, BS - 1))]


def kv_of(tokens, positions):
    """The K/V the prefix machine writes for tokens at positions: a function of both, so cached data is checkable."""
    base = (tokens.astype(np.float32) * 7 + positions.astype(np.float32) * 13)[:, None, None, None]
    return base + np.arange(2 * LAYERS * HEADS * DIM, dtype=np.float32).reshape(2 * LAYERS, HEADS, DIM)


class PrefixMachine(CacheMachine):
    """The cache machine with prompts that share prefixes (system prompts and small-vocabulary suffixes), token ids
    on appends and decode steps, forks of cached sequences, and a pool small enough to evict.

    The model keeps every sequence's token ids (-1 where appended without ids); after every step each cached block
    held by a sequence holds the ids that sequence has there, and the data read back equals the data written."""

    cache_args = dict(max_tokens=24 * BS, max_seqs=6, max_seq_len=12 * BS)

    def __init__(self):
        super().__init__()
        self.ids = {}

    def known_ids(self, seq):
        """The model's token ids of ``seq``, -1 for tokens appended without ids (by CacheMachine's rules)."""
        ids = self.ids.get(seq, np.empty(0, np.int64))
        self.ids[seq] = np.concatenate([ids, np.full(len(self.data[seq]) - ids.size, -1)])
        return self.ids[seq]

    def forked(self, parent, child):
        self.ids[child] = self.known_ids(parent).copy()

    def freed(self, seq):
        self.ids.pop(seq, None)

    @rule(system=st.integers(0, len(SYSTEM_PROMPTS)), suffix=st.lists(st.integers(0, 3), max_size=2 * BS))
    def add_prompt(self, system, suffix):
        prompt = np.concatenate([SYSTEM_PROMPTS[system] if system < len(SYSTEM_PROMPTS) else [], suffix])
        prompt = prompt.astype(np.int64)
        stats = self.cache.prefix_stats()
        try:
            seq = self.cache.add_sequence(prompt)
        except TooManySequencesError:
            return
        cached = self.cache.length(seq)
        assert cached % BS == 0 and cached <= max(prompt.size - 1, 0)
        after = self.cache.prefix_stats()
        assert after["hit_tokens"] - stats["hit_tokens"] == cached
        assert after["queried_tokens"] - stats["queried_tokens"] == prompt.size
        assert np.array_equal(self.cache.allocator.index.cached[self.cache.tables.blocks(seq)],
                              np.ones(cached // BS, bool))
        self.data[seq] = kv_of(prompt[:cached], np.arange(cached))
        self.ids[seq] = prompt[:cached]
        self._append_ids([seq], [prompt.size - cached], prompt[cached:])

    @precondition(lambda self: self.data)
    @rule(tokens=st.lists(st.integers(0, 3), min_size=6, max_size=6))
    def decode_step_with_ids(self, tokens):
        seqs = sorted(self.data)
        self._append_ids(seqs, [1] * len(seqs), np.array((tokens * 2)[:len(seqs)]), all_seqs=True)

    def _append_ids(self, seqs, counts, ids, all_seqs=False):
        before = self.cache.snapshot()
        fits = self.cache.can_append(seqs, counts)
        try:
            slots, copies = self.cache.append(None if all_seqs else seqs, 1 if all_seqs else counts, token_ids=ids)
        except (PoolExhaustedError, SequenceFullError):
            after = self.cache.snapshot()
            before.pop("time"), after.pop("time")
            assert after == before and not fits
            return
        assert fits
        copy_blocks(self.cache, copies)
        starts = np.cumsum(counts) - counts
        positions = np.concatenate([np.arange(self.cache.length(s) - n, self.cache.length(s))
                                    for s, n in zip(seqs, counts)])
        write_tokens(self.cache, slots, kv_of(ids, positions))
        for seq, start, n in zip(seqs, starts, counts):
            part = ids[start:start + n]
            self.ids[seq] = np.concatenate([self.known_ids(seq), part])
            self.data[seq] = np.concatenate([self.data[seq], kv_of(part, positions[start:start + n])])

    @invariant()
    def cached_blocks_hold_their_holders_ids(self):
        index, t = self.cache.allocator.index, self.cache.tables
        for seq in self.data:
            blocks = t.blocks(seq)
            for j in np.flatnonzero(index.cached[blocks]):
                assert np.array_equal(index.tokens[int(blocks[j])], self.known_ids(seq)[j * BS:(j + 1) * BS])
        assert self.cache.num_cached_blocks == int(index.cached.sum())


TestPlaneMajor = machine_test(CacheMachine, 30, 30)
TestBlockMajor = machine_test(BlockMajorMachine, 30, 30)
TestPrefix = machine_test(PrefixMachine, 50, 50)
TestCudaPlaneMajor = pytest.mark.gpu(machine_test(CudaMachine, 10, 25))


# --- bad input: named errors, nothing changed -------------------------------------------------

def frozen(cache):
    snap = cache.snapshot()
    snap.pop("time")
    return json.dumps(snap, sort_keys=True)


def test_bad_input_changes_nothing():
    with small_cache() as cache:
        a, b, c, d = (cache.add_sequence() for _ in range(4))
        cache.append([a, b], [30, 9])
        before = frozen(cache)
        cases = [
            (PoolExhaustedError, r"asked for 59 blocks but only 2 are free .* at most 64 \(6 held\)",
             lambda: cache.append([b, c, d], [7 + 19 * BS, 20 * BS, 20 * BS])),
            (SequenceFullError, "holds 24 blocks", lambda: cache.append(a, 24 * BS)),
            (InvalidTokenCountError, ">= 0", lambda: cache.append([a, b], [4, -1])),
            (InvalidTokenCountError, "must be ints", lambda: cache.append(a, 1.5)),
            (DuplicateSequenceError, f"sequence {a} appears twice in one append", lambda: cache.append([a, b, a], 1)),
            (DuplicateSequenceError, f"sequence {b} appears twice in one free", lambda: cache.free([b, c, b])),
            (UnknownSequenceError, "sequence 5 does not exist", lambda: cache.append([a, 5], 1)),
            (UnknownSequenceError, "sequence 99 does not exist", lambda: cache.fork(99)),
            (UnknownSequenceError, "-1 does not exist", lambda: cache.free(-1)),
            (InvalidPositionError, "has no token 9: its positions are 0..8", lambda: cache.translate(b, 9)),
            (InvalidPositionError, "has no token 1.5", lambda: cache.translate(b, 1.5)),
            (UnsupportedConfigError, "layer 0.0 does not exist", lambda: cache.translate(a, 0, layer=0.0)),
            (UnknownSequenceError, "one sequence handle expected, got 0", lambda: cache.translate([], 0)),
            (UnknownSequenceError, "one sequence handle expected, got 2", lambda: cache.fork([a, b])),
            (UnknownSequenceError, "must be ints, got float64", lambda: cache.free([1.0])),
            (UnknownSequenceError, "flat list", lambda: cache.append([[a, b]], 1)),
            (InvalidTokenCountError, r"shape \(1, 2\) given for 2", lambda: cache.append([a, b], [[1, 2]])),
            (UnsupportedConfigError, "layer 2 does not exist", lambda: cache.translate(a, 0, layer=2)),
            (UnsupportedConfigError, "kv 'q' must be", lambda: cache.translate(a, 0, kv="q")),
            (DoubleFreeError, "holds 0 references", lambda: cache.allocator.free([60])),
            (DoubleFreeError, "holds 1 references, 2 were dropped",
             lambda: cache.allocator.free(np.repeat(cache.tables.blocks(b)[:1], 2))),
        ]
        for error, message, action in cases:
            with pytest.raises(error, match=message):
                action()
            assert frozen(cache) == before
        cache.free(a)
        with pytest.raises(UnknownSequenceError, match="freed"):
            cache.append(a, 1)


def test_allocator_refuses_a_pool_that_does_not_split_into_its_planes():
    page = select_backend("host").page_bytes
    with Pool(4 * page, page, "host") as pool:
        with pytest.raises(PoolSizeError, match="4 chunks do not split into 3 planes"):
            BlockAllocator(pool, 1, 3)


def test_too_many_sequences():
    with small_cache(max_seqs=2) as cache:
        cache.add_sequence(), cache.add_sequence()
        with pytest.raises(TooManySequencesError, match="all 2 block-table rows"):
            cache.add_sequence()


@pytest.mark.parametrize("kwargs,message", [
    (dict(dtype="int8"), "dtype 'int8' is not supported"),
    (dict(head_dim=100), "head_dim=100"),
    (dict(block_size=12), "block_size=12"),
    (dict(num_layers=0), "num_layers must be a positive int"),
    (dict(placement="diagonal"), "placement='diagonal'"),
    (dict(max_bytes=1 << 20), "exactly one of max_tokens or max_bytes"),
    (dict(max_tokens=-5), "max_tokens must be a positive int"),
    (dict(max_tokens=0), "max_tokens must be a positive int, got 0"),
    (dict(max_bytes=0, max_tokens=None), "max_bytes must be a positive int, got 0"),
    (dict(head_dim=64.0), "head_dim=64.0 is not supported"),
    (dict(block_size=16.0), "block_size=16.0 is not supported"),
    (dict(block_size=True), "block_size=True is not supported"),
    (dict(dtype=object()), "dtype .* is not supported"),
    (dict(dtype=[]), r"dtype \[\] is not supported"),
    (dict(max_seqs=2**40), "max_seqs=1099511627776 is more than pagedrt supports: at most 1048576"),
    (dict(max_seqs=2.0), "max_seqs must be a positive int, got 2.0"),
    (dict(max_tokens=2**62), "more than block ids .* can name: at most 2147483647"),
    (dict(max_bytes=2**62, max_tokens=None), "more than block ids .* can name"),
    (dict(max_seq_len=10**9), "has 16000000000 entries; at most 1073741824"),
    (dict(max_seq_len=2**31), "max_seq_len=2147483648 is more than pagedrt supports"),
    (dict(max_tokens=2**30 * 16, num_layers=64), "reserve .* bytes of address space; one reservation takes at most"),
    (dict(chunk_bytes=4096.0), "chunk_bytes=4096.0 must be a positive multiple"),
    (dict(backend=3), "backend=3 must be a name or a backend"),
    (dict(chunk_bytes=12345), "chunk_bytes=12345 must be a positive multiple"),
])
def test_unsupported_configs(kwargs, message):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="float16",
                max_tokens=1024, backend="host") | kwargs
    with pytest.raises(UnsupportedConfigError, match=message):
        PagedKVCache(**args)


def test_growth_is_lazy_and_trim_gives_chunks_back():
    with small_cache() as cache:
        assert cache.pool.mapped_bytes == 0
        seqs = [cache.add_sequence() for _ in range(4)]
        cache.append(seqs, 8 * BS)  # 32 blocks = 8 chunks of 4
        assert cache.allocator.num_mapped_blocks == 32
        assert cache.pool.mapped_bytes == 8 * cache.layout.num_planes * cache.pool.chunk_bytes
        cache.free(seqs[:2])
        released = cache.trim()
        assert len(released) == 4  # fullest-first packing left whole chunks empty
        assert cache.pool.mapped_bytes == 4 * cache.layout.num_planes * cache.pool.chunk_bytes
        held = set(cache.tables.blocks(seqs[2])) | set(cache.tables.blocks(seqs[3]))
        assert not held & {b for k in released for b in range(4 * k, 4 * k + 4)}


def test_stats_count_shared_tokens_once():
    with small_cache() as cache:
        parent = cache.add_sequence()
        cache.append(parent, BS + 3)
        child = cache.fork(parent)
        stats = cache.stats()
        assert stats["tokens"] == 2 * (BS + 3) and stats["stored_tokens"] == BS + 3
        cache.append(child, 1)  # copy-on-write: the child's tail block is its own now
        stats = cache.stats()
        assert stats["stored_tokens"] == BS + 3 + 4 and stats["held_blocks"] == 3
        assert stats["token_bytes"] == stats["stored_tokens"] * cache.layout.bytes_per_token


def test_can_append_counts_row_width_free_blocks_and_copy_on_write():
    with small_cache() as cache:  # 64 blocks, rows of 24
        parent = cache.add_sequence()
        cache.append(parent, BS + 3)  # one full block, one partial
        child = cache.fork(parent)
        fillers = [cache.add_sequence() for _ in range(3)]
        cache.append(fillers, [24 * BS, 24 * BS, 13 * BS])
        assert cache.num_available_blocks == 1
        assert cache.can_append(child, 1)  # its private copy of the shared tail takes the last block
        assert not cache.can_append(child, BS)  # a new block and the copy: two
        assert cache.can_append(parent, BS - 3)  # fills its tail: the copy alone
        assert not cache.can_append(fillers[0], 1)  # its row is full
        assert cache.can_append(fillers, 0)
        before = frozen(cache)
        for error, action in ((DuplicateSequenceError, lambda: cache.can_append([child, child], 1)),
                              (UnknownSequenceError, lambda: cache.can_append(99, 1)),
                              (InvalidTokenCountError, lambda: cache.can_append([child, parent], [1]))):
            with pytest.raises(error):
                action()
        assert frozen(cache) == before
        with pytest.raises(PoolExhaustedError):
            cache.append(child, BS)
        cache.append(child, 1)
        assert cache.num_available_blocks == 0 and not cache.can_append(None, 1)
        cache.free(fillers[2])
        assert cache.num_available_blocks == 13 and not cache.can_append(None, 1)  # full rows still
        cache.free(fillers[:2])
        assert cache.num_available_blocks == 61 and cache.can_append(None, 1)


def test_fork_then_append_copies_only_the_shared_tail():
    with small_cache() as cache:
        parent = cache.add_sequence()
        cache.append(parent, BS + 3)  # one full block, one partial
        child = cache.fork(parent)
        _, copies = cache.append(child, 1)
        pb, cb = cache.tables.blocks(parent), cache.tables.blocks(child)
        assert pb[0] == cb[0] and pb[1] != cb[1]
        assert copies.tolist() == [[pb[1], cb[1]]]
        assert cache.allocator.ref_count[pb[0]] == 2 and cache.allocator.ref_count[pb[1]] == 1
        _, copies = cache.append(parent, 1)  # no longer shared: no copy
        assert copies.shape == (0, 2)


def test_snapshot_round_trip_and_bad_files(tmp_path):
    with small_cache() as cache:
        s = cache.add_sequence()
        cache.append(s, 20)
        path = tmp_path / "snap.json"
        cache.write_snapshot(path)
        snap = load_snapshot(path)
        assert snap["version"] == 1 and snap["sequences"] == [
            {"seq": s, "length": 20, "blocks": cache.tables.blocks(s).tolist(), "swapped": False}]
        assert snap["pool"]["base"] == cache.pool.base
        assert [c["chunk"] for c in snap["pool"]["chunks"]] == [r.chunk for r in cache.pool.mappings()]
        assert not list(tmp_path.glob(".snapshot-*"))  # the temp file was renamed, not left
    with pytest.raises(SnapshotError, match="no snapshot"):
        load_snapshot(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SnapshotError, match="cannot read"):
        load_snapshot(tmp_path / "bad.json")
    snap["version"] = 2
    (tmp_path / "new.json").write_text(json.dumps(snap))
    with pytest.raises(SnapshotError, match="version 2"):
        load_snapshot(tmp_path / "new.json")
    (tmp_path / "other.json").write_text(json.dumps({"schema": "x"}))
    with pytest.raises(SnapshotError, match="not a pagedrt snapshot"):
        load_snapshot(tmp_path / "other.json")


# --- the change log and the step's upload -------------------------------------------------

def test_change_log_names_every_changed_entry_and_length():
    with small_cache() as cache:
        t = cache.tables
        assert not t.log_changes  # the host backend's kernels read the host arrays: nothing is logged
        t.log_changes = True      # as on a GPU, where the step module drains the log
        table, lens = t.table.copy(), t.lens.copy()  # a copy that only the drained changes update

        def apply_changes():
            changes = t.drain_changes()
            assert changes.entries.dtype == np.int64 and changes.rows.dtype == np.int64
            table.ravel()[changes.entries] = changes.blocks
            lens[changes.rows] = changes.lens
            assert np.array_equal(table, t.table) and np.array_equal(lens, t.lens)

        a, b = cache.add_sequence(), cache.add_sequence()
        cache.append([a, b], [BS + 3, 2 * BS])
        apply_changes()
        child = cache.fork(a)
        cache.append(child, 1)  # copy-on-write of the shared tail
        cache.append(None, 1)
        apply_changes()
        cache.free([a, b])
        apply_changes()
        assert t.drain_changes() is None  # nothing changed since the last drain


def assert_device_matches(cache):
    assert np.array_equal(to_host(cache.block_tables()), cache.tables.table)
    assert np.array_equal(to_host(cache.seq_lens()), cache.tables.lens)


@pytest.mark.gpu
def test_step_upload_keeps_the_device_tables_equal_to_the_host():
    with small_cache("cuda", max_tokens=2048 * BS, max_seqs=64) as cache:
        first = [cache.add_sequence() for _ in range(8)]
        cache.append(first, np.arange(1, 9) * 5)
        assert_device_matches(cache)
        children = [cache.fork(s) for s in first[:3]]
        cache.append(children, 1)
        cache.append(None, 1)
        cache.free(first[1:3])
        assert_device_matches(cache)
        more = [cache.add_sequence() for _ in range(55)]
        cache.append(more, 20 * BS)  # 1100 table entries and 55 lengths: the staging buffers regrow
        assert_device_matches(cache)
        for _ in range(3):
            cache.append(None, 1)
            assert_device_matches(cache)
        cache.free(more[::2])
        cache.append(children, BS)
        assert_device_matches(cache)
        assert np.array_equal(to_host(cache.block_tables(children)), cache.tables.table[children])
