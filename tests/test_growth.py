"""Growth ahead of demand: the pool's claim / prepare / commit steps (host backend)."""

import threading

import pytest

from pagedrt import Pool
from pagedrt.errors import ChunkStateError, MappingLimitError, PoolClosedError
from test_pool import PAGE, FailingCall, assert_consistent, host_mappings, state


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

    def create(size, real=backend.create):
        started.set()
        assert go.wait(10)
        return real(size)
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
