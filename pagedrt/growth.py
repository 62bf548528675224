"""Growth ahead of demand: chunks mapped before allocation needs them, off the step's critical path.

:class:`Growth` keeps spare blocks (free, cached-free, in flight) between a low and a high watermark: under
``low_blocks`` a :meth:`Growth.tick` claims chunks and a worker thread maps them (backend calls only; every piece
of bookkeeping changes on the caller's thread); a chunk untouched and all free for ``release_after`` ticks is
released while spare blocks stay at ``high_blocks`` or more. docs/ARCHITECTURE.md ("Growth ahead of demand")
says why, and what the worker may and may not do.
"""

import queue
import threading
import weakref
from typing import Any, Dict, Optional

import numpy as np

from .blocks import BlockAllocator
from .blocks.util import ceil_div
from .errors import PoolClosedError, UnsupportedConfigError


class Growth:
    """Maps ``allocator``'s chunks ahead of demand and releases idle ones, one :meth:`tick` per step.

    Call :meth:`tick` (and the cache) from one thread; the worker thread, started at the first request, only
    runs backend calls. :meth:`close` stops the worker.

    Parameters
    ----------
    allocator : BlockAllocator
        The allocator whose chunks it maps; it waits on this Growth's chunks in flight from now on.
    low_blocks : int
        The low watermark, ``>= 0``: under it spare blocks, a tick asks for chunks up to ``high_blocks``.
    high_blocks : int
        The high watermark, ``>= max(1, low_blocks)``: idle chunks are released only while spare blocks stay at
        it or more.
    release_after : int
        Ticks, ``>= 1``, a chunk must stay all free and untouched before it is released.
    background : bool
        Map on a worker thread (True) or inside :meth:`tick`, on the caller's thread (False).

    Raises
    ------
    UnsupportedConfigError
        A watermark or ``release_after`` that is not an int in range, or an allocator that has a Growth already.

    Attributes
    ----------
    last_error : BaseException or None
        The exception of the last failed preparation; requests pause until the allocator's chunks change.
    chunks_ahead, chunks_released, waits, failures : int
        Counters (:meth:`stats`).
    """

    def __init__(self, allocator: BlockAllocator, *, low_blocks: int, high_blocks: int, release_after: int,
                 background: bool = True) -> None:
        for name, value, least in (("low_blocks", low_blocks, 0), ("high_blocks", high_blocks, 1),
                                   ("release_after", release_after, 1)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < least:
                raise UnsupportedConfigError(f"growth {name} must be an int >= {least}, got {value!r:.80}")
        if high_blocks < low_blocks:
            raise UnsupportedConfigError(
                f"growth high_blocks={high_blocks} is under low_blocks={low_blocks}: the high watermark must be "
                f"at least the low one")
        if allocator.wait_in_flight is not None:
            raise UnsupportedConfigError("this allocator has a Growth already: close it first")
        self.allocator, self.pool = allocator, allocator.pool
        self.low_blocks, self.high_blocks, self.release_after = int(low_blocks), int(high_blocks), int(release_after)
        self.background = bool(background)
        self.last_error: Optional[BaseException] = None  # the exception of the last failed preparation
        self.chunks_ahead = self.chunks_released = self.waits = self.failures = 0
        self._idle = np.zeros(allocator.device_chunks, np.int64)  # per device chunk: consecutive ticks all free
        self._paused = None   # the allocator's version at the last failure: no requests until it changes
        self._pending = 0     # requests handed to the worker and not taken back yet
        self._todo: queue.SimpleQueue[Any]  # (pool, chunks, claim) to prepare; None stops the worker
        self._done: queue.SimpleQueue[Any]  # (chunks, claim, the exception or None) prepared
        self._todo, self._done = queue.SimpleQueue(), queue.SimpleQueue()
        self._worker = None
        self._stop = weakref.finalize(self, self._todo.put, None)  # the worker ends when this object goes
        self._closed = False
        allocator.wait_in_flight = _weak_wait(self)

    @property
    def in_flight(self) -> int:
        """Chunks being mapped ahead now."""
        return int(np.count_nonzero(self.allocator.in_flight))

    @property
    def spare_blocks(self) -> int:
        """Blocks allocate can hand out without mapping: free, cached-free and in flight."""
        a = self.allocator
        return a.num_free + len(a.evictable) + self.in_flight * a.blocks_per_chunk

    def stats(self) -> Dict[str, int]:
        """The counters: ``chunks_ahead`` (mapped ahead), ``chunks_released`` (by the hysteresis), ``sync_grows``
        (times ``allocate`` mapped chunks itself, on the critical path), ``waits`` (times ``allocate`` blocked on
        chunks in flight), ``failures``, and ``in_flight`` (chunks being mapped now)."""
        return {"chunks_ahead": self.chunks_ahead, "chunks_released": self.chunks_released,
                "sync_grows": self.allocator.stats.sync_grows, "waits": self.waits, "failures": self.failures,
                "in_flight": self.in_flight}

    def tick(self) -> None:
        """Once per step, between steps: adopt chunks the worker has mapped, then map ahead or release.

        Never waits for the worker; with ``background=False`` it maps here, itself. :meth:`stats` counts what
        it did.

        Raises
        ------
        PoolClosedError
            After :meth:`close`, or once the cache's pool is closed.
        BaseException
            An interrupt that stopped a preparation, raised again once its chunks are given back (an
            ``Exception`` is kept in :attr:`last_error` instead).
        """
        if self._closed or self.pool.closed:
            raise PoolClosedError("growth.tick(): this growth (or its cache) was closed")
        if self._pending:
            self._collect(block=False)
        a = self.allocator
        empty = a.free_in_chunk[:a.device_chunks] == a.blocks_per_chunk  # all free (only mapped chunks hold free ones)
        np.multiply(self._idle + 1, empty & ~a.touched[:a.device_chunks], out=self._idle)
        a.touched[:] = False
        spare = self.spare_blocks
        if spare < self.low_blocks:
            if self._paused != a.version:
                self._request(ceil_div(self.high_blocks - spare, a.blocks_per_chunk))
        elif spare - a.blocks_per_chunk >= self.high_blocks:
            self._release((spare - self.high_blocks) // a.blocks_per_chunk)

    def _request(self, n_chunks):
        """Claim the ``n_chunks`` lowest unmapped chunks and map them: on the worker, or here."""
        a = self.allocator
        chunks = a.unmapped_chunks(n_chunks)
        if not chunks:
            return
        prepared = self.pool.claim([c for k in chunks for c in a.pool_chunks(k)])
        a.in_flight[chunks] = True
        if not self.background:
            self._finish(chunks, prepared, _prepare(self.pool, prepared))
            return
        if self._worker is None:
            self._worker = threading.Thread(target=_work, args=(self._todo, self._done), name="pagedrt-growth",
                                            daemon=True)
            self._worker.start()
        self._todo.put((self.pool, chunks, prepared))
        self._pending += 1

    def _release(self, most):
        """Release up to ``most`` chunks that have been all free for ``release_after`` ticks, highest first."""
        idle = np.flatnonzero(self._idle >= self.release_after)[::-1][:most]
        if idle.size:
            chunks = [int(k) for k in idle]
            self.allocator.release_chunks(chunks)
            self._idle[chunks] = 0
            self.chunks_released += len(chunks)

    def _collect(self, block):
        """Adopt (or give up) the worker's finished requests; with ``block``, every pending one."""
        while self._pending:
            try:
                item = self._done.get(block=block)
            except queue.Empty:
                return
            self._pending -= 1
            self._finish(*item)

    def _finish(self, chunks, prepared, error):
        """One request's outcome, on the caller's thread: its chunks become free blocks, or its places go back."""
        self.allocator.in_flight[chunks] = False
        if error is None:
            fresh = self.pool.never_mapped(prepared.chunks)  # a step that fails after adopting them forgets them
            self.pool.commit(prepared)
            self.allocator.adopt(chunks, fresh)
            self.chunks_ahead += len(chunks)
        else:
            self.pool.discard(prepared)
            self.last_error = error
            self.failures += 1
            self._paused = self.allocator.version
            if not isinstance(error, Exception):  # an interrupt, say: the places are back, now it goes on
                raise error

    def _wait(self):
        """The allocator's ``wait_in_flight``: adopt what is finished, then block on the rest."""
        self._collect(block=False)
        if self._pending:
            self.waits += 1
            self._collect(block=True)

    def close(self) -> None:
        """Stop the worker, wait for the preparation under way and discard every uncommitted one. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop()
        if self._worker is not None:
            self._worker.join()
        while self._pending:
            chunks, prepared, _ = self._done.get()
            self._pending -= 1
            self.allocator.in_flight[chunks] = False
            self.pool.discard(prepared)
        self.allocator.wait_in_flight = None

    def __repr__(self) -> str:
        return (f"Growth(low_blocks={self.low_blocks}, high_blocks={self.high_blocks}, "
                f"release_after={self.release_after}, background={self.background}, {self.stats()})")


def _weak_wait(growth):
    """``growth._wait`` through a weak reference: the allocator must not hold its Growth, or a cache dropped
    without ``close()`` would be a cycle (allocator, growth) that keeps the pool's mappings until the cycle
    collector runs."""
    method = weakref.WeakMethod(growth._wait)

    def wait():
        wait_now = method()
        if wait_now is not None:  # a Growth collected has no request left to wait for
            wait_now()
    return wait


def _prepare(pool, prepared):
    """Run a claim's backend calls; the exception that stopped them, or None."""
    try:
        pool.prepare(prepared)
    except BaseException as exc:  # handed to the caller's thread, never lost with the worker
        return exc
    return None


def _work(todo, done):
    """The worker thread: prepare each claim handed over, hand the outcome back; stop at None."""
    while _serve(todo, done):
        pass


def _serve(todo, done):
    """One request. Its own frame, so the worker holds no pool while it waits for the next."""
    item = todo.get()
    if item is None:
        return False
    pool, chunks, prepared = item
    done.put((chunks, prepared, _prepare(pool, prepared)))
    return True
