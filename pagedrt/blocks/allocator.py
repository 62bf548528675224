"""Block ids over the pool's chunks: reference counts, chunk-aware free counts, mapping and trimming.

:class:`BlockAllocator` hands out block ids with reference counts. It is
chunk-aware: block ``b`` lives in chunk ``b // blocks_per_chunk``; it takes free
blocks from the fullest mapped chunks first (so that whole chunks fall empty),
maps more chunks when none are free, and :meth:`~BlockAllocator.trim` hands back
every chunk whose blocks are all free. With ``num_planes > 1`` the range is cut into
that many equal regions (one per layer and K/V) and allocator chunk ``k`` stands
for the k-th chunk of every region: they are mapped and released together.

A block whose reference count falls to zero while it is named in the prefix cache
(:mod:`pagedrt.blocks.prefix`) is *cached-free* instead of free, kept in the LRU
``evictable``. :meth:`~BlockAllocator.allocate` takes never-cached free blocks first,
then evicts cached-free blocks oldest first, and only then maps more chunks: a cached
block is memory already mapped. Since a cached-free block is not free,
:meth:`~BlockAllocator.trim` leaves its chunk mapped.

The host tier's blocks (:mod:`pagedrt.blocks.tiers`) are the allocator's last chunks;
``allocate``, ``grow`` and ``trim`` see device chunks only.

Chunks may be mapped ahead of demand (:mod:`pagedrt.growth`): such chunks are *in
flight* (``in_flight``) until adopted or given up; ``grow`` skips them, and an
``allocate`` short of blocks after eviction waits for them (``wait_in_flight``, set by
whoever maps ahead) before it maps what is still missing itself. Every chunk that
allocate, free, transfer or eviction touches is marked in ``touched``, for growth's
idle rule.

Every change is journaled (:mod:`pagedrt.blocks.transaction`); chunks mapped inside
a transaction that fails are released again. Counters live in ``stats``
(:class:`~pagedrt.blocks.stats.BlockStats`).
"""

from functools import partial
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence

import numpy as np

from ..errors import DoubleFreeError, InvalidTokenCountError, PoolExhaustedError, PoolSizeError
from .prefix import CachedFree, PrefixIndex
from .stats import BlockStats
from .tiers import HostTier
from .transaction import Transaction
from .util import ceil_div

if TYPE_CHECKING:
    from ..memory import Pool


class BlockAllocator(HostTier):
    """Reference-counted block ids over a :class:`~pagedrt.memory.Pool`'s chunks.

    Parameters
    ----------
    pool : Pool
        The pool whose chunks hold the blocks; nothing is mapped here.
    blocks_per_chunk : int
        Blocks in one allocator chunk.
    num_planes : int
        Pool chunks per allocator chunk (plane-major placement: one per plane).
    host_chunks : int
        The last allocator chunks, the host tier's (mapped by :meth:`map_host`); at least one chunk is left to
        the device.

    Raises
    ------
    PoolSizeError
        A pool whose chunks do not split into ``num_planes``, or ``host_chunks`` out of range.

    Attributes
    ----------
    ref_count : numpy.ndarray
        int32 ``[max_blocks]``: references to each block (0: free or cached-free).
    is_free : numpy.ndarray
        bool ``[max_blocks]``: free blocks, in mapped chunks.
    chunk_mapped : numpy.ndarray
        bool ``[num_chunks]``: mapped allocator chunks.
    stats : BlockStats
        The counters.
    tx : Transaction
        The journal every change of the software layer goes through.
    """

    def __init__(self, pool: "Pool", blocks_per_chunk: int, num_planes: int = 1, host_chunks: int = 0):
        if pool.num_chunks % num_planes:
            raise PoolSizeError(f"the pool's {pool.num_chunks} chunks do not split into {num_planes} planes")
        self.pool = pool
        self.num_planes = num_planes
        self.blocks_per_chunk = blocks_per_chunk
        self.num_chunks = pool.num_chunks // num_planes    # allocator chunks (rows of pool chunks), both tiers
        if not 0 <= host_chunks < self.num_chunks:
            raise PoolSizeError(f"host_chunks={host_chunks} must leave at least one of {self.num_chunks} chunks to the "
                                f"device")
        self.device_chunks = self.num_chunks - host_chunks  # the device's chunks come first, the host tier's last
        self.max_blocks = self.num_chunks * blocks_per_chunk  # block ids of both tiers
        self.device_blocks = self.device_chunks * blocks_per_chunk
        self.host_blocks = host_chunks * blocks_per_chunk
        self.tx = Transaction()  # the journal every change of this layer goes through
        self.stats = BlockStats()
        self.ref_count = np.zeros(self.max_blocks, np.int32)
        self.is_free = np.zeros(self.max_blocks, bool)
        self.free_in_chunk = np.zeros(self.num_chunks, np.int64)
        self.chunk_mapped = np.zeros(self.num_chunks, bool)
        self.touched = np.zeros(self.num_chunks, bool)  # chunks allocate/free/transfer/evict changed (growth reads)
        self._free = 0            # free_in_chunk.sum() over device chunks, kept as it changes
        self._mapped_chunks = 0   # chunk_mapped.sum() over device chunks, likewise
        self.version = 0  # bumped whenever chunks are mapped or released
        self.num_shared = 0  # blocks with more than one reference: copy-on-write is possible
        self.index = PrefixIndex(self.max_blocks, self.tx)  # names of cached blocks
        self.evictable = CachedFree(self.tx)  # cached-free device blocks, oldest first
        self._host_free = 0  # free host-tier blocks
        self.host_evictable = CachedFree(self.tx)  # offloaded cached-free blocks in the host tier, oldest first
        self.in_flight = np.zeros(self.num_chunks, bool)  # chunks being mapped ahead: not mapped yet, grow skips them
        # set with in_flight (by a Growth): returns once no chunk is in flight (adopted or given up)
        self.wait_in_flight: Optional[Callable[[], None]] = None

    # --- what is where ---------------------------------------------------------------

    def pool_chunks(self, chunk: int) -> List[int]:
        """The pool chunks that allocator chunk ``chunk`` stands for (one per plane)."""
        return [p * self.num_chunks + chunk for p in range(self.num_planes)]

    @property
    def num_free(self) -> int:
        """Free device blocks."""
        return self._free

    @property
    def num_mapped_blocks(self) -> int:
        """Device blocks in mapped chunks."""
        return self._mapped_chunks * self.blocks_per_chunk

    @property
    def num_held(self) -> int:
        """Device blocks held by sequences."""
        return self.num_mapped_blocks - self.num_free - len(self.evictable)

    @property
    def num_available(self) -> int:
        """Device blocks :meth:`allocate` can still hand out: free, cached-free (evictable) and every block of
        unmapped chunks."""
        return self.device_blocks - self.num_held

    def usable_mask(self) -> np.ndarray:
        """bool ``[max_blocks]`` (both tiers): True where the block's chunk is mapped (free or held)."""
        return np.repeat(self.chunk_mapped, self.blocks_per_chunk)

    # --- allocation -------------------------------------------------------------------

    def can_allocate(self, n: int) -> bool:
        """Whether :meth:`allocate` of ``n`` blocks would succeed now."""
        return n <= self.num_available

    def allocate(self, n: int) -> np.ndarray:
        """Device blocks with reference count 1, fullest chunks first; grows the pool if needed.

        Free blocks first, then cached-free ones (evicted), then chunks in flight
        (waited for), and only then chunks this call maps itself.

        Parameters
        ----------
        n : int
            Blocks, ``>= 0``.

        Returns
        -------
        numpy.ndarray
            int32 ``[n]`` block ids.

        Raises
        ------
        InvalidTokenCountError
            ``n < 0``.
        PoolExhaustedError
            Fewer than ``n`` blocks available.
        DeviceOutOfMemoryError
            The device refused a chunk this call maps (the backend's error).
        """
        if n <= 0:
            if n == 0:
                return np.empty(0, np.int32)
            raise InvalidTokenCountError(f"cannot allocate {n} blocks: a block count is >= 0")
        if not self.can_allocate(n):
            raise PoolExhaustedError(
                f"asked for {n} blocks but only {self.num_free} are free and the reservation holds at most "
                f"{self.device_blocks} ({self.num_held} held): free sequences, or reserve a larger cache")
        short = n - self.num_free
        if short > len(self.evictable) and self.in_flight.any():
            self.wait_in_flight()
            short = n - self.num_free
        if short > 0:
            evict = min(short, len(self.evictable))
            if short > evict:  # may fail: before anything is evicted
                self.stats.sync_grows += 1  # an attempt on the critical path: counted even if its step fails
                self.grow(ceil_div(short - evict, self.blocks_per_chunk))
            if evict:
                self._evict(evict)
        tx, free, bpc = self.tx, self.free_in_chunk[:self.device_chunks], self.blocks_per_chunk  # a view
        fullest = int(np.where(free > 0, free, bpc + 1).argmin())
        if free[fullest] >= n:  # the common case: one chunk has enough
            ids = (np.flatnonzero(self.is_free[fullest * bpc:(fullest + 1) * bpc])[:n]
                   + fullest * bpc).astype(np.int32)
            tx.set(free, fullest, free[fullest] - n)
            self.touched[fullest] = True
        else:
            chunks = np.flatnonzero(free)
            chunks = chunks[np.argsort(free[chunks], kind="stable")]
            chunks = chunks[:int(np.searchsorted(np.cumsum(free[chunks]), n)) + 1]
            pos = np.flatnonzero(self.is_free.reshape(self.num_chunks, bpc)[chunks])[:n]
            ids = (chunks[pos // bpc] * bpc + pos % bpc).astype(np.int32)
            tx.save(free, chunks)
            np.subtract.at(free, ids // bpc, 1)
            self.touched[chunks] = True
        tx.attr(self, "_free", self._free - n)
        tx.set(self.is_free, ids, False)
        tx.set(self.ref_count, ids, 1)
        return ids

    def _evict(self, n):
        """Make the ``n`` least recently freed cached blocks free: offloaded to the host tier (the most recent of
        them, as many as it has room for) while the transaction records tier moves, else forgetting their names."""
        ids = np.array(self.evictable.take_oldest(n), np.int64)
        kept = min(n, self.num_host_available) if self.tx.moves is not None else 0
        for block in ids[:n - kept].tolist():
            self.index.forget(block)
        if kept:
            self._offload(ids[n - kept:])
        self._mark_free(ids)
        self.tx.count(self.stats, "evictions", n)

    def _mark_free(self, ids):
        """Blocks ``ids`` (int64, each once, held by none and not cached-free) become free."""
        tx, chunks = self.tx, ids // self.blocks_per_chunk
        tx.set(self.is_free, ids, True)
        tx.save(self.free_in_chunk, chunks)
        np.add.at(self.free_in_chunk, chunks, 1)
        self.touched[chunks] = True
        host = int(np.count_nonzero(ids >= self.device_blocks)) if self.host_blocks else 0
        if host:
            tx.attr(self, "_host_free", self._host_free + host)
        if ids.size > host:
            tx.attr(self, "_free", self._free + ids.size - host)

    def _add_shared(self, n):
        if n:
            self.tx.attr(self, "num_shared", self.num_shared + n)

    def claim_cached(self, block_ids: Sequence[int]) -> None:
        """One more reference to each of these cached blocks (a prefix hit); cached-free ones stop being evictable."""
        ids = np.asarray(block_ids, np.int64)
        refs = self.ref_count[ids]
        self.evictable.remove(ids[refs == 0].tolist())
        self._add_shared(int((refs == 1).sum()))
        self.tx.set(self.ref_count, ids, refs + 1)

    def share(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each held block (a fork); a block may appear more than once. DoubleFreeError for
        a block not held."""
        ids, counts = np.unique(np.asarray(block_ids, np.int64), return_counts=True)
        self._check_held(ids, np.ones_like(counts), "share")
        before = self.ref_count[ids]
        self.tx.set(self.ref_count, ids, before + counts.astype(np.int32))
        self._add_shared(int((before == 1).sum()))

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per occurrence; blocks reaching zero become free. All or nothing.

        A cached (named) block reaching zero becomes cached-free instead, the most
        recently used; of several freed at once, later ones in ``block_ids`` (the
        ends of sequences' chains) are evicted before earlier ones.

        Parameters
        ----------
        block_ids : int sequence or numpy.ndarray
            Held block ids, repeats allowed (one reference each).

        Raises
        ------
        DoubleFreeError
            An id out of range, or more references dropped than a block holds; nothing changes.
        """
        order = np.asarray(block_ids, np.int64)
        ids, counts = np.unique(order, return_counts=True)
        if ids.size == 0:
            return
        self._check_held(ids, counts, "free")
        before = self.ref_count[ids]
        after = before - counts.astype(np.int32)
        self.tx.set(self.ref_count, ids, after)
        self._add_shared(-int(((before > 1) & (after <= 1)).sum()))
        released = ids[after == 0]
        cached = self.index.cached[released]
        if cached.any():
            released = released[~cached]
            kept = order[self.index.cached[order] & (self.ref_count[order] == 0)]
            _, first = np.unique(kept, return_index=True)
            newest_last = kept[np.sort(first)[::-1]].tolist()  # the first of a chain the most recent
            device = [b for b in newest_last if b < self.device_blocks]
            self.evictable.push(device)
            if len(device) < len(newest_last):
                self.host_evictable.push([b for b in newest_last if b >= self.device_blocks])
            self.touched[kept // self.blocks_per_chunk] = True
        if released.size:
            self._mark_free(released)

    def _check_held(self, ids, counts, what):
        bad = (ids < 0) | (ids >= self.max_blocks)
        if bad.any():
            raise DoubleFreeError(f"cannot {what} block {ids[bad][0]}: block ids are 0..{self.max_blocks - 1}")
        short = self.ref_count[ids] < counts
        if short.any():
            b = ids[short][0]
            raise DoubleFreeError(
                f"cannot {what} block {b}: it holds {self.ref_count[b]} references, "
                f"{counts[short][0]} were dropped (a double free?)")

    # --- growing and trimming ---------------------------------------------------------

    def grow(self, n_chunks: int) -> List[int]:
        """Map ``n_chunks`` more device chunks, re-using holes (lowest first) before the frontier; never one in
        flight. Returns the chunks mapped; PoolExhaustedError when fewer remain (nothing mapped then)."""
        chunks = self.unmapped_chunks(n_chunks)
        if len(chunks) < n_chunks:
            raise PoolExhaustedError(
                f"cannot map {n_chunks} more chunks: {len(chunks)} remain in the reservation "
                f"({int(self.in_flight.sum())} more are being mapped ahead)")
        places = [c for k in chunks for c in self.pool_chunks(k)]
        self.tx.undo(partial(self.pool.unmap, places, self.pool.never_mapped(places)))  # before: undo may find none
        self.pool.map(places)
        self.adopt(chunks)
        return chunks

    def unmapped_chunks(self, n_chunks: int) -> List[int]:
        """The ``n_chunks`` lowest device chunks (or fewer, all there are) that are neither mapped nor in flight."""
        idle = ~(self.chunk_mapped | self.in_flight)[:self.device_chunks]
        return [int(k) for k in np.flatnonzero(idle)[:n_chunks]]

    def adopt(self, chunks: Sequence[int], fresh: Optional[List[int]] = None) -> None:
        """Make newly mapped chunks' blocks free. Inside a transaction that fails they are released again (and
        ``fresh``, the pool places of them never mapped before, forgotten: :meth:`Pool.unmap
        <pagedrt.memory.Pool.unmap>`); ``grow`` records that itself, before it maps."""
        tx, bpc = self.tx, self.blocks_per_chunk
        if fresh is not None:
            tx.undo(partial(self.pool.unmap, [c for k in chunks for c in self.pool_chunks(k)], fresh))
        blocks = np.concatenate([np.arange(k * bpc, (k + 1) * bpc) for k in chunks])
        tx.set(self.is_free, blocks, True)
        tx.set(self.chunk_mapped, chunks, True)
        tx.set(self.free_in_chunk, chunks, bpc)
        tx.attr(self, "_free", self._free + len(chunks) * bpc)
        tx.attr(self, "_mapped_chunks", self._mapped_chunks + len(chunks))
        tx.attr(self, "version", self.version + 1)

    def trim(self) -> List[int]:
        """Release every mapped device chunk whose blocks are all free; return their indices."""
        empty = np.flatnonzero((self.chunk_mapped & (self.free_in_chunk == self.blocks_per_chunk))[:self.device_chunks])
        if empty.size == 0:
            return []
        chunks = [int(k) for k in empty]
        self.release_chunks(chunks)
        return chunks

    def release_chunks(self, chunks: Sequence[int]) -> None:
        """Unmap these mapped chunks, every block of which is free, and free their memory. Between transactions
        only (trim, growth's tick): a release is not journaled."""
        self.pool.release([c for k in chunks for c in self.pool_chunks(k)])
        self.chunk_mapped[chunks] = False
        self.free_in_chunk[chunks] = 0
        self._free -= len(chunks) * self.blocks_per_chunk
        self._mapped_chunks -= len(chunks)
        self.is_free.reshape(self.num_chunks, self.blocks_per_chunk)[chunks] = False
        self.version += 1
