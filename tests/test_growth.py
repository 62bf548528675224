"""Growth ahead of demand: the pool's claim / prepare / commit steps, the Growth policy, and the cache machines
run with a Growth attached (host backend)."""

import threading

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from pagedrt import Pool
from pagedrt.blocks import BlockAllocator
from pagedrt.errors import (ChunkStateError, DeviceOutOfMemoryError, MappingLimitError, PoolClosedError,
                            UnsupportedConfigError)
from pagedrt.growth import Growth
from test_cache import (BS, CacheMachine, PrefixMachine, check_allocator, frozen, machine_test, read_sequence,
                        small_cache, write_tokens)
from test_pool import PAGE, FailingCall, assert_consistent, host_mappings, state

BPC = 4  # blocks per allocator chunk in small_cache on the host; 16 chunks, 64 blocks


def growth_cache(background=True, low=BPC, high=2 * BPC, release_after=3, **kwargs):
    return small_cache(growth=dict(low_blocks=low, high_blocks=high, release_after=release_after,
                                   background=background), **kwargs)


def settle(growth):
    """Wait for the worker to finish every request and adopt the outcomes (as a tick would, later)."""
    growth._collect(block=True)


def mapped(cache):
    return np.flatnonzero(cache.allocator.chunk_mapped).tolist()


def failure(kind):
    return {"oom": DeviceOutOfMemoryError("cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"),
            "limit": MappingLimitError("injected: past vm.max_map_count")}[kind]


modes = pytest.mark.parametrize("background", [True, False], ids=["background", "inline"])


# --- the pool: claim, prepare, commit, discard --------------------------------------------------

def test_claimed_places_are_refused_until_committed_or_discarded():
    with Pool(8 * 16 * PAGE, 16 * PAGE, "host") as pool:
        pool.grow(2)
        prepared = pool.claim([2, 3])
        before = state(pool)
        for action, message in [(lambda: pool.map(3), "chunk 3 is already claimed"),
                                (lambda: pool.grow(1), "chunk 2 is already claimed"),
                                (lambda: pool.release(2), "cannot release chunk 2: it is being mapped"),
                                (lambda: pool.claim([4, 3]), "chunk 3 is already claimed"),
                                (lambda: pool.claim(1), "chunk 1 is already mapped"),
                                (lambda: pool.commit(prepared), "it is claimed")]:
            with pytest.raises(ChunkStateError, match=message):
                action()
            assert state(pool) == before
        assert not pool.is_mapped(2) and pool._claims.keys() == {2, 3}
        pool.prepare(prepared)
        assert state(pool) == before  # mapped in the range, not yet in the bookkeeping
        with pytest.raises(ChunkStateError, match="it is ready"):
            pool.prepare(prepared)
        pool.commit(prepared)
        assert [r.chunk for r in pool.mappings()] == [0, 1, 2, 3] and not pool._claims
        with pytest.raises(ChunkStateError, match="not a claim of this pool"):
            pool.commit(prepared)
        with pytest.raises(ChunkStateError, match="not a claim of this pool"):
            pool.discard(prepared)
        other = pool.claim([5])
        pool.prepare(other)
        pool.discard(other)  # unmapped and released again: the place is free
        assert_consistent(pool)
        assert pool.map(5) == [5]
        assert_consistent(pool)


def test_a_failed_preparation_undoes_its_own_work_only(monkeypatch):
    with Pool(16 * 16 * PAGE, 16 * PAGE, "host") as pool:
        pool.grow(2)
        b = pool._backend
        released = []
        monkeypatch.setattr(b, "release", lambda h, real=b.release: (released.append(h), real(h)))
        monkeypatch.setattr(b, "map", FailingCall(b.map, 3, MappingLimitError("injected map")))
        prepared = pool.claim([3, 4, 6, 7])
        before = state(pool)
        with pytest.raises(MappingLimitError, match="injected map"):
            pool.prepare(prepared)
        assert state(pool) == before and len(released) == 4 and pool._claims.keys() == {3, 4, 6, 7}
        pool.discard(prepared)
        monkeypatch.undo()
        assert not pool._claims and state(pool) == before
        assert_consistent(pool)
        assert pool.grow(2) == [2, 3]


def gated_create(monkeypatch, backend):
    """Make ``backend.create`` wait for ``go`` after setting ``started``: a preparation held mid-way."""
    started, go = threading.Event(), threading.Event()

    def create(*args, real=backend.create):
        started.set()
        assert go.wait(10)
        return real(*args)
    monkeypatch.setattr(backend, "create", create)
    return started, go


def test_close_waits_for_a_running_preparation_and_releases_what_it_mapped(monkeypatch):
    pool = Pool(8 * 16 * PAGE, 16 * PAGE, "host")
    pool.grow(1)
    running, waiting = pool.claim([2, 3]), pool.claim([5])
    started, go = gated_create(monkeypatch, pool._backend)
    errors = []
    worker = threading.Thread(target=lambda: errors.append(pool.prepare(running)))
    worker.start()
    assert started.wait(10)
    threading.Timer(0.05, go.set).start()
    pool.close()  # returns once the preparation has finished, then releases its chunks with the rest
    worker.join()
    assert errors == [None] and pool.closed
    base, size = pool.base, pool.max_bytes
    assert [(p, n) for _, _, p, n in host_mappings(base, base + size)] == [("rw-p", "")]  # scratch only
    with pytest.raises(PoolClosedError):
        pool.prepare(waiting)
    with pytest.raises(PoolClosedError):
        pool.commit(running)
    pool.discard(running)  # nothing left to undo
    pool.discard(waiting)


# --- the policy ---------------------------------------------------------------------------------

@modes
def test_tick_maps_ahead_under_the_low_watermark_and_nothing_above(background):
    with growth_cache(background) as cache:
        g = cache.growth
        g.tick()  # nothing spare: two chunks, up to the high watermark
        if background:
            assert g.in_flight == 2 and mapped(cache) == [] and g.spare_blocks == 2 * BPC
            check_allocator(cache)
            settle(g)
        assert mapped(cache) == [0, 1] and g.in_flight == 0 and cache.allocator.num_free == 2 * BPC
        check_allocator(cache)
        version = cache.pool.version
        g.tick()  # 8 spare: above the low watermark, not a chunk above the high one
        assert cache.pool.version == version and g.in_flight == 0
        seq = cache.add_sequence()
        cache.append(seq, 5 * BS)  # from the chunks mapped ahead: no grow in the append
        assert g.stats()["sync_grows"] == 0 and g.spare_blocks == 3
        g.tick()
        settle(g)
        assert mapped(cache) == [0, 1, 2, 3] and g.spare_blocks == 3 + 2 * BPC
        assert g.stats() == {"chunks_ahead": 4, "chunks_released": 0, "sync_grows": 0, "waits": 0, "failures": 0,
                             "in_flight": 0}
        check_allocator(cache)


class GateOnWait:
    """Stands in for the growth's result queue: opens ``gate`` when the caller blocks on it, so the worker
    cannot have finished before allocate waits."""

    def __init__(self, done, gate):
        self.done, self.gate = done, gate

    def get(self, block=True):
        if block:
            self.gate.set()
        return self.done.get(block=block)


def test_allocate_waits_for_chunks_in_flight_instead_of_mapping(monkeypatch):
    with growth_cache() as cache:
        g = cache.growth
        _, go = gated_create(monkeypatch, cache.pool._backend)
        g.tick()
        assert g.in_flight == 2
        monkeypatch.setattr(g, "_done", GateOnWait(g._done, go))
        seq = cache.add_sequence()
        maps = []
        monkeypatch.setattr(cache.pool, "map", lambda chunks: maps.append(chunks))  # would be a synchronous grow
        cache.append(seq, 3 * BS)
        assert g.stats()["waits"] == 1 and g.stats()["sync_grows"] == 0 and not maps
        assert mapped(cache) == [0, 1] and g.in_flight == 0 and cache.allocator.num_free == 2 * BPC - 3
        monkeypatch.undo()
        check_allocator(cache)


def test_allocate_takes_what_is_in_flight_then_grows_the_rest():
    with growth_cache(background=True) as cache:
        g = cache.growth
        g.tick()  # chunks 0 and 1 in flight
        seq = cache.add_sequence()
        cache.append(seq, 11 * BS)  # 8 blocks in flight, 3 more mapped here
        assert mapped(cache) == [0, 1, 2] and g.stats()["sync_grows"] == 1 and g.in_flight == 0
        check_allocator(cache)


@modes
def test_release_after_idle_ticks_and_only_above_the_high_watermark(background):
    with growth_cache(background, release_after=3) as cache:
        g = cache.growth
        g.tick()
        settle(g)
        seq = cache.add_sequence()
        cache.append(seq, 6 * BPC * BS)  # 24 blocks: 8 mapped ahead, 4 chunks grown in the append
        assert mapped(cache) == list(range(6)) and g.stats()["sync_grows"] == 1
        g.tick()
        settle(g)
        assert mapped(cache) == list(range(8))
        cache.free(seq)  # 32 free blocks, 8 chunks all free; the free touched chunks 0-5 (6 and 7 are idle already)
        for _ in range(3):
            g.tick()
            assert mapped(cache)[:6] == list(range(6))  # not idle long enough: touched at the first of these ticks
        g.tick()  # the third idle tick after the free's: down to the high watermark, the highest chunks first
        assert mapped(cache) == [0, 1] and g.spare_blocks == g.high_blocks and g.chunks_released == 6
        for _ in range(5):
            g.tick()
        assert mapped(cache) == [0, 1] and g.chunks_released == 6 and g.in_flight == 0
        check_allocator(cache)


def test_a_chunk_busy_at_a_tick_counts_its_idle_ticks_again():
    with growth_cache(False, low=0, high=1, release_after=3) as cache:
        g = cache.growth
        a, b, c = (cache.add_sequence() for _ in range(3))
        cache.append(a, 3 * BPC * BS)  # chunks 0..2
        cache.append(b, 1)  # chunk 3, which stays in use
        cache.free(a)  # touches chunks 0..2: the tick after counts their idle ticks from zero
        g.tick(), g.tick(), g.tick()
        cache.append(c, BPC * BS)  # the rest of chunk 3, and one block of chunk 0
        assert sorted(set(cache.tables.blocks(c) // BPC)) == [0, 3]
        g.tick()  # chunks 1 and 2 have been all free and untouched for three ticks
        assert mapped(cache) == [0, 3]
        cache.free(c)
        g.tick(), g.tick(), g.tick()
        assert mapped(cache) == [0, 3]  # chunk 0 has been all free and untouched for two ticks only
        g.tick()
        assert mapped(cache) == [3]


def test_cached_free_blocks_keep_their_chunk():
    with growth_cache(False, low=0, high=BPC, release_after=2) as cache:
        g = cache.growth
        prompt = np.arange(4 * BS + 1)
        a = cache.add_sequence()
        cache.append(a, prompt.size, token_ids=prompt)  # 4 named blocks in chunk 0 and a fifth in chunk 1
        b = cache.add_sequence()
        cache.append(b, 7 * BS)  # the rest of chunk 1, and chunk 2
        cache.free([a, b])  # chunk 0: 4 cached-free blocks; chunks 1 and 2: all free
        assert len(cache.allocator.evictable) == 4 and g.spare_blocks == 12
        for _ in range(4):
            g.tick()
        assert mapped(cache) == [0] and g.spare_blocks == 4  # cached-free blocks are spare, but not free
        c = cache.add_sequence(prefix=prompt)
        assert cache.length(c) == 4 * BS  # the cached blocks are still there
        check_allocator(cache)


@modes
@pytest.mark.parametrize("kind", ["oom", "limit"])
def test_a_failed_preparation_is_recorded_and_allocation_maps_itself(background, kind, monkeypatch):
    with growth_cache(background) as cache:
        g, b = cache.growth, cache.pool._backend
        error = failure(kind)
        monkeypatch.setattr(b, "create", FailingCall(b.create, 2, error))
        g.tick()
        settle(g)
        assert g.last_error is error
        assert g.failures == 1 and g.in_flight == 0 and mapped(cache) == [] and not cache.pool._claims
        assert_consistent(cache.pool)
        check_allocator(cache)
        g.tick()  # no new request until the allocator's chunks change
        assert g.in_flight == 0 and mapped(cache) == [] and g.failures == 1
        monkeypatch.setattr(b, "create", FailingCall(b.create, 1, failure(kind)))
        seq = cache.add_sequence()
        before = frozen(cache)
        with pytest.raises(type(failure(kind))):
            cache.append(seq, 1)  # memory is really out: the named error, and nothing changed
        assert frozen(cache) == before and g.stats()["sync_grows"] == 1
        monkeypatch.undo()
        cache.append(seq, 1)  # maps one chunk itself
        assert mapped(cache) == [0] and g.stats()["sync_grows"] == 2
        g.tick()  # the chunks changed: growth asks again
        settle(g)
        assert mapped(cache) == [0, 1, 2] and g.chunks_ahead == 2
        check_allocator(cache)
        assert_consistent(cache.pool)


def test_close_with_work_in_flight(monkeypatch):
    cache = growth_cache()
    g = cache.growth
    started, go = gated_create(monkeypatch, cache.pool._backend)
    g.tick()
    assert started.wait(10)
    threading.Timer(0.05, go.set).start()
    cache.close()  # joins the worker, discards what it mapped, then closes the pool
    assert cache.closed and g._pending == 0 and g.in_flight == 0 and not g._worker.is_alive()
    assert cache.allocator.wait_in_flight is None
    base, size = cache.pool.base, cache.pool.max_bytes
    assert [(p, n) for _, _, p, n in host_mappings(base, base + size)] == [("rw-p", "")]
    g.close()
    cache.close()  # both idempotent
    with pytest.raises(PoolClosedError):
        g.tick()


def test_closing_the_growth_alone_leaves_the_cache_as_without_one():
    with growth_cache() as cache:
        g = cache.growth
        g.tick()
        g.close()  # the chunks in flight are given up
        assert g.in_flight == 0 and mapped(cache) == [] and not cache.pool._claims
        seq = cache.add_sequence()
        cache.append(seq, 1)
        assert mapped(cache) == [0]
        check_allocator(cache)
        Growth(cache.allocator, low_blocks=0, high_blocks=1, release_after=1).close()  # a new one may attach


@pytest.mark.parametrize("kwargs,message", [
    (dict(low_blocks=-1), "low_blocks must be an int >= 0"),
    (dict(high_blocks=0, low_blocks=0), "high_blocks must be an int >= 1"),
    (dict(release_after=0), "release_after must be an int >= 1"),
    (dict(low_blocks=1.5), "low_blocks must be an int"),
    (dict(low_blocks=9, high_blocks=8), "high_blocks=8 is under low_blocks=9"),
])
def test_bad_watermarks(kwargs, message):
    with small_cache() as cache:
        with pytest.raises(UnsupportedConfigError, match=message):
            Growth(cache.allocator, **(dict(low_blocks=4, high_blocks=8, release_after=3) | kwargs))
        assert cache.allocator.wait_in_flight is None


def test_the_cache_growth_keyword():
    with small_cache(growth=True) as cache:
        g = cache.growth
        assert (g.low_blocks, g.high_blocks, g.release_after, g.background) == (BPC, 2 * BPC, 64, True)
        with pytest.raises(UnsupportedConfigError, match="has a Growth already"):
            Growth(cache.allocator, low_blocks=0, high_blocks=1, release_after=1)
    with small_cache(growth={"background": False, "release_after": 5}) as cache:
        g = cache.growth
        assert (g.low_blocks, g.high_blocks, g.release_after, g.background) == (BPC, 2 * BPC, 5, False)
    for off in (None, False):
        with small_cache(growth=off) as cache:
            assert cache.growth is None
    for bad, message in [("yes", "must be None, False, True or a dict"), ({"low": 1}, r"unknown keys \['low'\]"),
                         ({"low_blocks": 9}, "high_blocks=8 is under low_blocks=9")]:
        with pytest.raises(UnsupportedConfigError, match=message):
            small_cache(growth=bad)


# --- the cache machines, with a Growth attached and a tick rule ---------------------------------

class GrowthRules:
    """A tick rule for the cache machines, and what each tick may do: release only chunks all free (nothing held
    or cached-free in them) for ``release_after`` ticks, only down to the high watermark, never in the tick that
    asks for more; after a tick, spare blocks are at the low watermark or every chunk is mapped or in flight."""

    growth = dict(low_blocks=BPC, high_blocks=2 * BPC, release_after=2, background=True)

    def __init__(self):
        super().__init__()
        self.idle = np.zeros(self.cache.allocator.num_chunks, np.int64)  # ticks each chunk was all free before

    @rule(ticks=st.integers(1, 3))
    def tick(self, ticks):
        for _ in range(ticks):
            self.tick_once()

    def tick_once(self):
        a, g = self.cache.allocator, self.cache.growth
        was_mapped, was_in_flight = a.chunk_mapped.copy(), a.in_flight.copy()
        empty = was_mapped & (a.free_in_chunk == a.blocks_per_chunk)
        self.idle = (self.idle + 1) * empty
        released_before = g.chunks_released
        g.tick()
        released = was_mapped & ~a.chunk_mapped
        asked = (a.in_flight | a.chunk_mapped) & ~(was_in_flight | was_mapped)
        assert g.chunks_released - released_before == released.sum()
        assert (empty[released]).all() and (self.idle[released] >= g.release_after - 1).all()
        if released.any():
            assert g.spare_blocks >= g.high_blocks and not asked.any()
        assert g.spare_blocks >= g.low_blocks or not a.unmapped_chunks(1)

    @rule()
    def settle(self):
        settle(self.cache.growth)

    @invariant()
    def no_failure(self):
        assert self.cache.growth.last_error is None


class GrowthMachine(GrowthRules, CacheMachine):
    cache_args = dict(growth=GrowthRules.growth)


class InlineGrowthMachine(GrowthRules, CacheMachine):
    cache_args = dict(growth=GrowthRules.growth | dict(background=False))


class GrowthPrefixMachine(GrowthRules, PrefixMachine):
    cache_args = PrefixMachine.cache_args | dict(growth=GrowthRules.growth | dict(low_blocks=2, high_blocks=6,
                                                                                   release_after=2))


TestGrowth = machine_test(GrowthMachine, 30, 30)
TestInlineGrowth = machine_test(InlineGrowthMachine, 30, 30)
TestGrowthPrefix = machine_test(GrowthPrefixMachine, 40, 50)


class CudaGrowthMachine(GrowthRules, CacheMachine):
    backend = "cuda"
    cache_args = GrowthMachine.cache_args


TestCudaGrowth = pytest.mark.gpu(machine_test(CudaGrowthMachine, 10, 25))


# --- the CUDA backend ---------------------------------------------------------------------------

@pytest.mark.gpu
def test_growth_on_the_cuda_backend():
    with small_cache("cuda", max_tokens=4 * 512 * BS, max_seq_len=1024 * BS,
                     growth=dict(low_blocks=1, high_blocks=512, release_after=2)) as cache:
        g, bpc = cache.growth, cache.allocator.blocks_per_chunk
        assert bpc == 512  # a 2 MiB page per plane
        g.tick()
        seq = cache.add_sequence()
        slots, _ = cache.append(seq, 700 * BS)  # chunk 0 from the worker, chunk 1 mapped here
        assert mapped(cache) == [0, 1] and g.chunks_ahead == 1 and g.stats()["sync_grows"] == 1
        values = np.random.default_rng(1).standard_normal((slots.size, 4, 2, 64)).astype(np.float32)
        write_tokens(cache, slots, values)
        assert np.array_equal(read_sequence(cache, seq), values)
        check_allocator(cache)
        cache.free(seq)
        g.tick()  # the free touched both chunks: their idle count starts again here
        g.tick(), g.tick()  # all free for two ticks: one chunk goes, 512 spare stay
        assert mapped(cache) == [0] and g.chunks_released == 1
        check_allocator(cache)


@pytest.mark.gpu
@pytest.mark.alone
def test_growth_meets_real_device_out_of_memory():
    from pagedrt.driver import current_device
    chunk = 4 << 30
    total = current_device().mem_info()[1]
    with Pool((total // chunk + 8) * chunk, chunk, "cuda") as pool:
        start = pool._backend.device.mem_info()[0]
        allocator = BlockAllocator(pool, 1)
        g = Growth(allocator, low_blocks=1, high_blocks=allocator.num_chunks, release_after=1)
        g.tick()  # asks for more chunks than the device holds
        settle(g)
        assert isinstance(g.last_error, DeviceOutOfMemoryError) and g.in_flight == 0 and not pool._claims
        assert pool.mapped_bytes == 0 and abs(pool._backend.device.mem_info()[0] - start) <= 64 << 20
        with pytest.raises(DeviceOutOfMemoryError):
            allocator.allocate(allocator.num_chunks - 4)  # allocate maps itself, and memory is really out
        assert allocator.allocate(2).size == 2 and g.stats()["sync_grows"] == 2
        g.close()
