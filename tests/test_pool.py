"""The pool contract (hardware layer), on the host backend and, with a GPU, on CUDA."""

import numpy as np
import pytest

from pagedrt import Pool
from pagedrt.errors import (BackendUnavailableError, ChunkStateError, PoolClosedError, PoolSizeError,
                            ReservationExceededError, UnknownChunkError, UnmappedRangeError)
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
