"""The pool contract (hardware layer), on the host backend and, with a GPU, on CUDA."""

import ctypes
import errno
import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pagedrt import Pool
from pagedrt.errors import (BackendUnavailableError, ChunkStateError, HostOutOfMemoryError, MappingLimitError,
                            PoolClosedError, PoolSizeError, ReservationExceededError, UnknownChunkError,
                            UnmappedRangeError)
from pagedrt.memory import find_pool, host
from helpers import to_host

MiB = 1 << 20


def make_pool(backend, chunks=256, chunk_bytes=2 * MiB):
    pool = Pool(chunks * chunk_bytes, chunk_bytes, backend=backend)
    assert pool.backend == backend
    return pool


def fill(pool, chunk, seed):
    """Write a seeded random pattern over one chunk; return it."""
    pattern = np.random.default_rng(seed).integers(0, 2**32, pool.chunk_bytes // 4, dtype=np.uint32)
    view = pool.view(chunk * pool.chunk_bytes, pattern.shape, np.uint32)
    view[...] = pool.xp.asarray(pattern)
    return pattern


def read(pool, chunk):
    return to_host(pool.view(chunk * pool.chunk_bytes, pool.chunk_bytes // 4, np.uint32))


def state(pool):
    return [r.as_dict() for r in pool.mappings()], pool.frontier, pool.mapped_bytes


def test_grow_release_remap_close(backend):
    with make_pool(backend) as pool:
        base = pool.base
        assert pool.page_bytes > 0 and pool.chunk_bytes % pool.page_bytes == 0
        assert pool.grow(3) == [0, 1, 2]
        assert pool.mapped_bytes == 3 * pool.chunk_bytes
        pool.release(1)
        records = pool.mappings()
        assert [(r.chunk, r.state, r.access) for r in records] == [
            (0, "mapped", "rw"), (1, "released", "none"), (2, "mapped", "rw")]
        assert records[1].handle is None and records[0].handle is not None
        for r in records:
            assert r.va_start == base + r.offset == base + r.chunk * pool.chunk_bytes
            assert r.va_end - r.va_start == r.size == pool.chunk_bytes
        assert pool.grow() == [3]  # the frontier is past the hole
        assert pool.map(1) == [1]
        fill(pool, 1, seed=7)  # the re-mapped chunk is usable
        assert [r.state for r in pool.mappings()] == ["mapped"] * 4
        assert pool.base == base
    assert pool.closed
    pool.close()  # idempotent


def test_pattern_survives_100_grows_and_releases(backend):
    with make_pool(backend, chunks=128) as pool:
        base = pool.base
        pool.grow(2)
        first = fill(pool, 0, seed=1)
        second = fill(pool, 1, seed=2)
        for _ in range(100):
            pool.grow(1)
            assert pool.base == base
        assert np.array_equal(read(pool, 0), first)
        for c in range(2, 102, 3):  # holes everywhere else
            pool.release(c)
        assert np.array_equal(read(pool, 0), first)
        assert np.array_equal(read(pool, 1), second)
        mapped = [r.chunk for r in pool.mappings() if r.state == "mapped"]
        assert mapped == [c for c in range(102) if c < 2 or (c - 2) % 3]
        assert pool.mapped_bytes == len(mapped) * pool.chunk_bytes
        assert pool.base == base


def test_views_are_windows_onto_the_same_bytes(backend):
    with make_pool(backend, chunks=8) as pool:
        pool.grow(4)
        words = pool.view(0, (4, pool.chunk_bytes // 4), np.float32)
        data = np.random.default_rng(3).standard_normal(words.shape).astype(np.float32)
        words[...] = pool.xp.asarray(data)
        strided = pool.view(pool.chunk_bytes, (3, 16), np.float32, strides=(pool.chunk_bytes, 4))
        assert np.array_equal(to_host(strided), data[1:4, :16])
        tail = pool.view(3 * pool.chunk_bytes + 8, 2, np.float32)
        tail[...] = pool.xp.asarray(np.array([5.5, -1.25], np.float32))
        assert np.array_equal(to_host(words[3, 2:4]), [5.5, -1.25])


@pytest.mark.parametrize("max_bytes,chunk_bytes", [
    (0, 2 * MiB), (-4 * MiB, 2 * MiB), (4 * MiB, 0), (4 * MiB, -2 * MiB),
    (4 * MiB, 2 * MiB + 1), (5 * MiB, 2 * MiB), (4 * MiB, 2.0 * MiB), (4.0 * MiB, 2 * MiB)])
def test_bad_sizes(backend, max_bytes, chunk_bytes):
    with pytest.raises(PoolSizeError, match="must be"):
        Pool(max_bytes, chunk_bytes, backend=backend)


def test_bad_input_leaves_the_pool_unchanged(backend):
    with make_pool(backend, chunks=8) as pool:
        pool.grow(3)
        pool.release(2)
        before = state(pool)
        bad = [
            (ReservationExceededError, "reservation holds 8 chunks", lambda: pool.grow(6)),
            (PoolSizeError, "positive int", lambda: pool.grow(0)),
            (PoolSizeError, "positive int", lambda: pool.grow(-1)),
            (ChunkStateError, "already released", lambda: pool.release(2)),
            (ChunkStateError, "never mapped", lambda: pool.release(5)),
            (ChunkStateError, "never mapped", lambda: pool.release([0, 5])),
            (ChunkStateError, "twice", lambda: pool.release([0, 0])),
            (UnknownChunkError, "does not exist", lambda: pool.release(8)),
            (UnknownChunkError, "does not exist", lambda: pool.release(-1)),
            (ChunkStateError, "already mapped", lambda: pool.map([2, 1])),
            (UnknownChunkError, "does not exist", lambda: pool.map(99)),
            (UnmappedRangeError, "not mapped", lambda: pool.view(pool.chunk_bytes, pool.chunk_bytes, np.uint16)),
            (UnmappedRangeError, "outside the reservation", lambda: pool.view(-4, 4, np.uint8)),
            (UnmappedRangeError, "outside the reservation", lambda: pool.view(pool.max_bytes - 2, 4, np.uint8)),
        ]
        for error, message, action in bad:
            with pytest.raises(error, match=message):
                action()
            assert state(pool) == before


def test_use_after_close(backend):
    pool = make_pool(backend, chunks=4)
    pool.grow(1)
    pool.close()
    for action in (lambda: pool.grow(1), lambda: pool.release(0), lambda: pool.map(1),
                   lambda: pool.mappings(), lambda: pool.view(0, 4, np.uint8), lambda: pool.is_mapped(0),
                   lambda: pool.synchronize()):
        with pytest.raises(PoolClosedError, match="closed"):
            action()


class FailingCall:
    """Wraps a backend primitive so that its n-th call raises."""

    def __init__(self, fn, fail_at, error):
        self.fn, self.fail_at, self.error, self.calls = fn, fail_at, error, 0

    def __call__(self, *args):
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.error
        return self.fn(*args)


@pytest.mark.parametrize("primitive,fail_at", [("create", 3), ("map", 1), ("map", 4), ("set_access", 2)])
def test_failed_grow_rolls_back_only_its_own_chunks(backend, primitive, fail_at, monkeypatch):
    with make_pool(backend, chunks=16) as pool:
        pool.grow(2)
        keep = fill(pool, 1, seed=5)
        pool.release(0)
        pool.grow(1)  # chunks: 0 released, 1 and 2 mapped; the next grow maps 3..
        before = state(pool)
        b = pool._backend
        released = []
        monkeypatch.setattr(b, "release", lambda h, real=b.release: (released.append(h), real(h)))
        monkeypatch.setattr(b, primitive, FailingCall(getattr(b, primitive), fail_at, OSError("injected")))
        with pytest.raises(OSError, match="injected"):
            pool.map([0, 3, 4, 6, 7])  # two contiguous runs: 0 and 3-4 and 6-7
        assert state(pool) == before
        created = fail_at - 1 if primitive == "create" else 5
        assert len(released) == created  # every handle this grow created, and no other, was freed
        monkeypatch.undo()
        assert np.array_equal(read(pool, 1), keep)
        assert pool.grow(2) == [3, 4]


def test_unknown_backend():
    with pytest.raises(BackendUnavailableError, match="unknown backend"):
        Pool(4 * MiB, 2 * MiB, backend="tpu")


def test_auto_backend_says_why():
    with Pool(4 * MiB, 2 * MiB, backend="auto") as pool:
        assert pool.backend in ("cuda", "host")
        assert pool.backend_reason.startswith(pool.backend + ":")


def reservations():
    """The address-space reservations of this process (inaccessible private mappings), as (start, end)."""
    return sorted((start, end) for start, end, perms, _ in host_mappings() if perms == "---p")


def test_absurd_size_is_a_named_error_and_leaks_nothing(backend):
    before = reservations() if backend == "host" else None
    with pytest.raises(MappingLimitError, match=f"cannot reserve {1 << 62} bytes.*reserve a smaller pool"):
        Pool(1 << 62, 4 * MiB, backend=backend)
    if backend == "host":  # Python's own allocator may map memory meanwhile; no reservation may be left
        assert set(reservations()) <= set(before)  # (a closed pool's range may be freed meanwhile)
    with make_pool(backend, chunks=4) as pool:  # and the backend is still usable
        pool.grow(1)


# --- the registry: which pool holds an address, and which of its chunks are mapped -------------

def test_find_pool(backend):
    a, b = make_pool(backend, chunks=4), make_pool(backend, chunks=8)
    for pool in (a, b):
        assert find_pool(pool.base) is pool
        assert find_pool(pool.base + pool.max_bytes - 1) is pool
        assert find_pool(np.uint64(pool.base + pool.chunk_bytes)) is pool
    outside = [x for x in (a.base - 1, a.base + a.max_bytes, b.base - 1, b.base + b.max_bytes)
               if not (a.base <= x < a.base + a.max_bytes or b.base <= x < b.base + b.max_bytes)]
    assert outside and all(find_pool(x) not in (a, b) for x in outside)  # other tests' pools may live there
    assert find_pool(0) is None
    a.close()
    assert find_pool(a.base) is a  # closed pools are still found while they live
    base = b.base
    b.close()
    del b, pool
    gc.collect()
    assert find_pool(base) is None  # dead pools drop out


def test_version_and_mapped_mask(backend):
    with make_pool(backend, chunks=8) as pool:
        mask = pool.mapped_mask()
        assert mask.dtype == bool and mask.shape == (8,) and not mask.any()
        assert not mask.flags.writeable
        v0 = pool.version
        assert pool.mapped_mask() is mask  # cached while the version holds
        pool.grow(3)
        assert pool.version > v0
        assert pool.mapped_mask().tolist() == [True] * 3 + [False] * 5
        v1 = pool.version
        pool.release([0, 2])
        assert pool.version > v1
        assert pool.mapped_mask().tolist() == [False, True] + [False] * 6
        v2 = pool.version
        with pytest.raises(ChunkStateError):
            pool.release(0)  # refused: nothing changed
        pool.view(pool.chunk_bytes, 4, np.uint8)
        pool.mappings()
        assert pool.version == v2
        pool.map([0, 5])
        assert pool.version > v2
        assert np.flatnonzero(pool.mapped_mask()).tolist() == [0, 1, 5]
        assert mask.tolist() == [False] * 8  # a mask handed out earlier never changes
    v3 = pool.version
    assert not pool.mapped_mask().any() and pool.version >= v3


# --- the host backend: what views see, and the operating system's limits ----------------------

PAGE = os.sysconf("SC_PAGE_SIZE")


def host_mappings(lo=0, hi=1 << 64):
    """(start, end, perms, name) of every mapping of this process that overlaps [lo, hi)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start < hi and end > lo:
                out.append((start, end, fields[1], fields[5] if len(fields) > 5 else ""))
    return out


def real_chunks(pool):
    """What is really mapped in the pool's range: chunk index -> "rw" for memfd chunks; and
    whether all the rest is the reservation's read-only anonymous zero pages."""
    chunks, rest_ok = {}, True
    for start, end, perms, name in host_mappings(pool.base, pool.base + pool.max_bytes):
        if "pagedrt-chunk" in name:
            assert (start - pool.base) % pool.chunk_bytes == 0 and end - start == pool.chunk_bytes
            chunks[(start - pool.base) // pool.chunk_bytes] = perms[:2]
        else:
            rest_ok &= perms.startswith("r--p") and name == ""
    return chunks, rest_ok


def assert_consistent(pool):
    chunks, rest_ok = real_chunks(pool)
    mapped = [r.chunk for r in pool.mappings() if r.state == "mapped"]
    assert sorted(chunks) == mapped and rest_ok
    assert set(chunks.values()) <= {"rw"}
    assert np.flatnonzero(pool.mapped_mask()).tolist() == mapped


class MapLimit:
    """Stands in for libc in pagedrt.memory.host, as Linux behaves past vm.max_map_count: from
    the ``fail_at``-th call of ``call`` on, every mmap and mprotect fails with ENOMEM, until a
    munmap lowers the count of mappings (then the limit is not reached any more)."""

    def __init__(self, call, fail_at, munmap_frees=True):
        self.real, self.call, self.fail_at, self.calls, self.full = host._libc, call, fail_at, 0, False
        self.munmap_frees = munmap_frees

    def _maybe_fail(self, name, fn, *args):
        if name == self.call:
            self.calls += 1
            self.full |= self.calls == self.fail_at
        if self.full:
            ctypes.set_errno(errno.ENOMEM)
            return host.MAP_FAILED if name == "mmap" else -1
        return fn(*args)

    def mmap(self, *args):
        return self._maybe_fail("mmap", self.real.mmap, *args)

    def mprotect(self, *args):
        return self._maybe_fail("mprotect", self.real.mprotect, *args)

    def munmap(self, *args):
        self.full &= not self.munmap_frees
        return self.real.munmap(*args)

    def msync(self, *args):
        return self.real.msync(*args)


@pytest.mark.parametrize("call,fail_at", [("mmap", 1), ("mmap", 3), ("mmap", 5), ("mprotect", 1),
                                          ("mprotect", 3)])
def test_mapping_limit_mid_grow_rolls_back_without_new_mappings(call, fail_at, monkeypatch):
    with make_pool("host", chunks=16, chunk_bytes=16 * PAGE) as pool:
        pool.grow(2)
        keep = fill(pool, 1, seed=5)
        pool.release(0)
        pool.grow(1)
        before, version = state(pool), pool.version
        limit = MapLimit(call, fail_at)
        monkeypatch.setattr(host, "_libc", limit)
        with pytest.raises(MappingLimitError, match=r"vm\.max_map_count = .*use larger chunks") as info:
            pool.map([0, 3, 4, 6, 7])  # the rollback's own mmap fails too, until a munmap
        assert info.value.errno == errno.ENOMEM
        assert state(pool) == before and pool.version == version
        assert_consistent(pool)
        assert not pool._backend.gaps
        monkeypatch.undo()
        assert np.array_equal(read(pool, 1), keep)
        assert pool.grow(2) == [3, 4]
        assert_consistent(pool)


def test_mapping_limit_during_release_and_close(monkeypatch):
    pool = make_pool("host", chunks=16, chunk_bytes=16 * PAGE)
    pool.grow(6)
    keep = fill(pool, 1, seed=9)
    view = pool.view(0, (6, pool.chunk_bytes // 4), np.uint32)
    monkeypatch.setattr(host, "_libc", MapLimit("mmap", 1))
    host._libc.full = True  # at the limit before the call
    pool.release([2, 4])  # each: the zero pages are refused, the chunk unmapped, then they fit
    host._libc.full = True
    monkeypatch.undo()
    assert_consistent(pool)
    assert np.array_equal(view[1], keep)
    assert not view[2].any()  # a released chunk reads as zeros
    monkeypatch.setattr(host, "_libc", MapLimit("mmap", 1))
    host._libc.full = True
    pool.close()  # the scratch mapping is refused until the chunks are unmapped
    monkeypatch.undo()
    assert not view.any()
    assert all(p == "rw-p" and n == "" for _, _, p, n in host_mappings(pool.base, pool.base + pool.max_bytes))


def test_a_place_that_cannot_be_reserved_again_is_a_gap(monkeypatch):
    with make_pool("host", chunks=8, chunk_bytes=16 * PAGE) as pool:
        pool.grow(3)
        monkeypatch.setattr(host, "_libc", MapLimit("mmap", 1, munmap_frees=False))
        host._libc.full = True
        pool.release(1)  # unmapped, but the zero pages cannot go back: the place stays empty
        monkeypatch.undo()
        va = pool.base + pool.chunk_bytes
        assert pool._backend.gaps == {va: pool.chunk_bytes}
        assert_consistent(pool)
        assert host_mappings(va, va + pool.chunk_bytes) == []
        pool.map(1)  # into the gap without replacing anything; the gap is gone
        assert not pool._backend.gaps and not read(pool, 1).any()
        pool.release(1)
        assert_consistent(pool)


def test_unmap_refused_mid_rollback_adopts_the_chunk(backend, monkeypatch):
    with make_pool(backend, chunks=16) as pool:
        pool.grow(1)
        b = pool._backend
        released = []
        monkeypatch.setattr(b, "release", lambda h, real=b.release: (released.append(h), real(h)))
        monkeypatch.setattr(b, "map", FailingCall(b.map, 3, MappingLimitError("injected map")))
        unmap = FailingCall(b.unmap, 2, OSError(errno.ENOMEM, "injected unmap"))
        monkeypatch.setattr(b, "unmap", unmap)
        with pytest.raises(MappingLimitError, match="injected map"):
            pool.grow(3)  # chunks 1 and 2 map, 3 fails; undoing 2 is refused
        monkeypatch.undo()
        # chunk 2 is still mapped, so the pool keeps it: its bookkeeping is what is mapped
        assert [r.chunk for r in pool.mappings()] == [0, 2]
        assert len(released) == 2  # chunk 1's handle and chunk 3's, never chunk 2's
        if backend == "host":
            assert_consistent(pool)
        fill(pool, 2, seed=3)
        assert pool.grow(1) == [3]
        pool.map(1)
        pool.release([1, 2])


def test_real_mapping_limit_in_a_subprocess():
    """Grow a pool of one-page chunks until Linux's real vm.max_map_count refuses: the error is
    named, the pool's bookkeeping equals the process's mappings, and it still grows and closes."""
    script = textwrap.dedent("""
        import numpy as np, sys
        sys.path.insert(0, "tests")
        from pagedrt import Pool
        from pagedrt.errors import MappingLimitError
        from pagedrt.memory import host
        from test_pool import assert_consistent
        limit = host.max_map_count()
        page = host.mmap.PAGESIZE
        pool = Pool((limit + 20000) * page, page, backend="host")
        view = pool.view(0, 8, np.uint8, allow_holes=True)
        try:
            while True:
                pool.grow(1000)
        except MappingLimitError as exc:
            assert "vm.max_map_count" in str(exc)
        mapped = pool.mapped_bytes // page
        assert limit - 2000 < mapped < limit, (mapped, limit)
        pool.release(list(range(0, 4000)))  # room for Python itself, which needs mappings too
        assert_consistent(pool)
        assert pool.grow(10)[0] == mapped
        pool.map([5])
        pool.view(5 * page, 4, np.uint8)[...] = 7
        assert_consistent(pool)
        pool.close()
        assert not view.any()
        print("ok", limit, mapped)
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    done = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stdout + done.stderr


def test_holes_read_as_zeros_on_the_host():
    with make_pool("host", chunks=8, chunk_bytes=16 * PAGE) as pool:
        pool.grow(3)
        fill(pool, 0, seed=1)
        fill(pool, 1, seed=2)
        pool.release(1)
        whole = pool.view(0, pool.max_bytes // 4, np.uint32, allow_holes=True)
        str(whole)  # reading across holes and the never-mapped tail does not crash
        words = pool.chunk_bytes // 4
        assert whole[:words].any() and not whole[words:].any()
        pool.map(1)
        assert not read(pool, 1).any()  # a re-mapped chunk starts from zeros
        assert_consistent(pool)


def test_views_after_close_read_zeros_on_the_host():
    pool = make_pool("host", chunks=8, chunk_bytes=16 * PAGE)
    pool.grow(4)
    pool.release(2)
    fill(pool, 0, seed=4)
    view = pool.view(0, pool.max_bytes // 4, np.uint32, allow_holes=True)
    base, size = pool.base, pool.max_bytes
    pool.close()
    assert not view.any()  # reads of a stale view give zeros
    view[:1000] = 5  # writes go to scratch memory, nowhere that matters
    assert view[:1000].sum() == 5000
    assert find_pool(base) is pool
    assert [p for _, _, p, _ in host_mappings(base, base + size)] == ["rw-p"]
    del pool
    gc.collect()
    assert host_mappings(base, base + size)  # the view still holds the range
    del view
    gc.collect()
    assert host_mappings(base, base + size) == [] and find_pool(base) is None


# --- the host tier: host-located chunks in the same range ----------------------------------------------------

def test_host_chunks_map_beside_device_chunks_and_say_where_they_live(backend):
    with make_pool(backend, chunks=8) as pool:
        pool.grow(2)
        assert pool.map([4, 5], "host") == [4, 5]
        records = {r.chunk: r for r in pool.mappings()}
        assert [records[c].location for c in (0, 1, 4, 5)] == ["device", "device", "host", "host"]
        if backend == "cuda":
            assert records[0].location_id == pool._backend.device.ordinal
            assert records[4].location_id is None or records[4].location_id >= 0
        else:
            assert all(r.location_id is None for r in records.values())
            assert_consistent(pool)
        data = fill(pool, 4, seed=11)  # written and read through the same kind of view
        assert np.array_equal(read(pool, 4), data)
        assert pool.mapped_mask().tolist() == [True, True, False, False, True, True, False, False]
        pool.release(4)
        assert {r.chunk: (r.state, r.location) for r in pool.mappings()}[4] == ("released", "host")
        assert pool.location(5) == "host" and pool.grow() == [6]  # grow maps device chunks
        with pytest.raises(PoolSizeError, match="location"):
            pool.map(7, "disk")


@pytest.mark.parametrize("fail_at", [1, 2])
def test_pinned_memory_refused_is_named_and_undoes_the_map(backend, fail_at, monkeypatch):
    with make_pool(backend, chunks=8) as pool:
        pool.grow(1)
        pool.map(3, "host")
        before = state(pool)
        b = pool._backend
        if backend == "cuda":  # the driver refuses: cuMemCreate of a host-located chunk, out of memory
            from pagedrt.errors import DeviceOutOfMemoryError
            real, creates = b._call, []

            def call(fn, *args):
                if fn == "cuMemCreate" and args[1] is not b._prop:
                    creates.append(fn)
                    if len(creates) == fail_at:
                        raise DeviceOutOfMemoryError(fn, "CUDA_ERROR_OUT_OF_MEMORY", "injected")
                return real(fn, *args)
            monkeypatch.setattr(b, "_call", call)
        else:
            monkeypatch.setattr(b, "create", FailingCall(b.create, fail_at, HostOutOfMemoryError("injected")))
        with pytest.raises(HostOutOfMemoryError, match="pinned memory|injected"):
            pool.map([4, 5], "host")
        assert state(pool) == before
        monkeypatch.undo()
        if backend == "host":
            assert_consistent(pool)
        assert pool.map([4, 5], "host") == [4, 5]
