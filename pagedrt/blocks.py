"""The software layer: block ids over the pool's chunks, and per-sequence block tables (host bookkeeping).

:class:`BlockAllocator` hands out block ids with reference counts. It is
chunk-aware: block ``b`` lives in chunk ``b // blocks_per_chunk``; it takes free
blocks from the fullest mapped chunks first (so that whole chunks fall empty),
maps more chunks when none are free, and :meth:`~BlockAllocator.trim` hands back
every chunk whose blocks are all free. With ``num_planes > 1`` the range is cut into
that many equal regions (one per layer and K/V) and allocator chunk ``k`` stands
for the k-th chunk of every region: they are mapped and released together.

The prefix cache (:mod:`pagedrt.prefix`) lives here too. A block whose reference
count falls to zero while it is named (cached) does not become free: it is
*cached-free*, kept with its data in a least-recently-used order (an ``OrderedDict``
keyed by block id: O(1) to add, remove or take the oldest). :meth:`~BlockAllocator.allocate`
takes never-cached free blocks first, then evicts cached-free blocks oldest first,
and only then maps more chunks: a cached block is memory already mapped, and growing
would map more while it holds data nobody may ask for again. Since a cached-free
block is not free, :meth:`~BlockAllocator.trim` leaves its chunk mapped; evicting it
is the allocator's job, when blocks are needed.

The host tier, when the cache has one, is the allocator's last ``host_chunks`` chunks:
block ids ``[device_blocks, max_blocks)`` in pinned host memory, mapped once at the
start (:meth:`~BlockAllocator.map_host`) and never released before the pool closes.
The tiers are kept apart: :meth:`~BlockAllocator.allocate`, ``grow`` and ``trim`` see
device chunks only; :meth:`~BlockAllocator.allocate_host` hands out host-tier blocks
(for swap-outs), and :meth:`~BlockAllocator.transfer` moves a block's references to
its copy in the other tier. While :attr:`~BlockAllocator.moves` is a list (a step or
a swap running), evicting a cached-free block *offloads* it instead when the host tier
has room: it is copied to a host-tier block that takes its name, cached-free there
(``host_evictable``, least recently used first), and every copy is recorded, in order,
in that list for the caller to make before anything writes into the blocks it reads.

Chunks may also be mapped ahead of demand, off the step's critical path
(:mod:`pagedrt.growth`): such chunks are *in flight* (``in_flight``) from the moment
their places are claimed until they are adopted as free blocks or given up;
:meth:`~BlockAllocator.grow` skips them, and an :meth:`~BlockAllocator.allocate` that
is short of blocks after eviction waits for them (through ``wait_in_flight``, which
whoever maps ahead sets) before it maps what is still missing itself.

:class:`BlockTables` keeps, per sequence, its length and its row of the dense
block table (logical block -> block id). A sequence's handle is its row. It logs
which table entries and lengths change; :mod:`pagedrt.step` drains that log to
keep the device's copies current. Everything here is NumPy on the host, and all
per-step work is vectorised: no per-token or per-sequence Python loops (the prefix
cache hashes each newly filled block and each looked-up block once, in a loop over
blocks).

Appends may carry the new tokens' ids. Per sequence the tables keep how many of its
leading tokens have known ids, the ids of its partly filled last block and the name
of its last full block; when a block whose ids are all known fills, it is named and
registered in the allocator's prefix index. :meth:`BlockTables.add` with a prompt
starts the sequence holding the longest chain of cached blocks the prompt begins with.

A sequence can be *swapped out* (:meth:`BlockTables.swap_out`): its device blocks move to
host-tier blocks (copies the caller makes, in the order given) and its row points at
them; :meth:`BlockTables.swap_in` moves them back. A block moves when every sequence
holding it is swapped out (copying a block another sequence keeps on the device would
free nothing), and every holder's row follows it, so a block is never in both tiers and
reference counts move with it. A swapped-out sequence is left out of "every live
sequence" (``seqs=None``), is never forked, and holds the only host-tier blocks that
sequences hold; given tokens explicitly, it appends (to device blocks) and attention
reads its host-tier blocks through the same pointers.
"""

from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from . import prefix
from .errors import (DoubleFreeError, DuplicateSequenceError, HostTierExhaustedError, InvalidTokenCountError,
                     PoolExhaustedError, PoolSizeError, SequenceFullError, SwapStateError, TooManySequencesError,
                     UnknownSequenceError)


def ceil_div(a, b):
    return -(-a // b)


class BlockAllocator:
    """Reference-counted block ids over a :class:`~pagedrt.memory.Pool`'s chunks."""

    def __init__(self, pool, blocks_per_chunk, num_planes=1, host_chunks=0):
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
        self.ref_count = np.zeros(self.max_blocks, np.int32)
        self.is_free = np.zeros(self.max_blocks, bool)
        self.free_in_chunk = np.zeros(self.num_chunks, np.int64)
        self.chunk_mapped = np.zeros(self.num_chunks, bool)
        self._free = 0            # free_in_chunk.sum(), kept as it changes
        self._mapped_chunks = 0   # chunk_mapped.sum(), likewise
        self.version = 0  # bumped whenever chunks are mapped or released
        self.num_shared = 0  # blocks with more than one reference: copy-on-write is possible
        self.index = prefix.PrefixIndex(self.max_blocks)  # names of cached blocks
        self.evictable = OrderedDict()  # cached-free blocks (named, reference count 0), oldest first
        self.evictions = 0
        self._host_free = 0  # free host-tier blocks
        self.host_evictable = OrderedDict()  # offloaded cached-free blocks in the host tier, oldest first
        self.offloads = self.reloads = self.host_evictions = 0
        self.moves = None  # while a list: offload on eviction, and record every tier copy (src, dst) in order
        self.in_flight = np.zeros(self.num_chunks, bool)  # chunks being mapped ahead: not mapped yet, grow skips them
        self.wait_in_flight = None  # set with in_flight: returns once no chunk is in flight (adopted or given up)
        self.sync_grows = 0  # times allocate mapped chunks itself

    # --- what is where ---------------------------------------------------------------

    def pool_chunks(self, chunk):
        """The pool chunks that allocator chunk ``chunk`` stands for (one per plane)."""
        return [p * self.num_chunks + chunk for p in range(self.num_planes)]

    @property
    def num_free(self):
        """Free device blocks."""
        return self._free

    @property
    def num_mapped_blocks(self):
        """Device blocks in mapped chunks."""
        return self._mapped_chunks * self.blocks_per_chunk

    @property
    def num_held(self):
        """Device blocks held by sequences."""
        return self.num_mapped_blocks - self.num_free - len(self.evictable)

    @property
    def num_available(self):
        """Device blocks :meth:`allocate` can still hand out: free, cached-free (evictable) and every block of
        unmapped chunks."""
        return self.device_blocks - self.num_held

    @property
    def num_host_free(self):
        return self._host_free

    @property
    def num_host_available(self):
        """Host-tier blocks :meth:`allocate_host` can hand out: free, and those of offloaded cached blocks."""
        return self._host_free + len(self.host_evictable)

    @property
    def num_host_held(self):
        """Host-tier blocks held by (swapped-out) sequences."""
        return self.host_blocks - self._host_free - len(self.host_evictable)

    def usable_mask(self):
        """Per block id of both tiers: True where its chunk is mapped (free or held)."""
        return np.repeat(self.chunk_mapped, self.blocks_per_chunk)

    # --- allocation -------------------------------------------------------------------

    def can_allocate(self, n):
        return n <= self.num_available

    def allocate(self, n):
        """``n`` block ids with reference count 1, fullest chunks first; grows the pool if needed.

        Free blocks first, then cached-free ones (evicted), then chunks in flight
        (waited for), and only then chunks this call maps itself. Chunks that arrive
        while it waits stay mapped even if the grow after them fails.
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
                self.sync_grows += 1
                self.grow(ceil_div(short - evict, self.blocks_per_chunk))
            if evict:
                self._evict(evict)
        free, bpc = self.free_in_chunk[:self.device_chunks], self.blocks_per_chunk  # a view: the device's chunks
        fullest = int(np.where(free > 0, free, bpc + 1).argmin())
        if free[fullest] >= n:  # the common case: one chunk has enough
            ids = (np.flatnonzero(self.is_free[fullest * bpc:(fullest + 1) * bpc])[:n]
                   + fullest * bpc).astype(np.int32)
            free[fullest] -= n
        else:
            chunks = np.flatnonzero(free)
            chunks = chunks[np.argsort(free[chunks], kind="stable")]
            chunks = chunks[:int(np.searchsorted(np.cumsum(free[chunks]), n)) + 1]
            pos = np.flatnonzero(self.is_free.reshape(self.num_chunks, bpc)[chunks])[:n]
            ids = (chunks[pos // bpc] * bpc + pos % bpc).astype(np.int32)
            np.subtract.at(free, ids // bpc, 1)
        self._free -= n
        self.is_free[ids] = False
        self.ref_count[ids] = 1
        return ids

    def _evict(self, n):
        """Make the ``n`` least recently freed cached blocks free: offloaded to the host tier (the most recent of
        them, as many as it has room for) while :attr:`moves` is a list, else forgetting their names."""
        ids = np.array([self.evictable.popitem(last=False)[0] for _ in range(n)], np.int64)
        kept = min(n, self.num_host_available) if self.moves is not None else 0
        for block in ids[:n - kept].tolist():
            self.index.forget(block)
        if kept:
            src = ids[n - kept:]
            dst = self.allocate_host(kept)
            self.ref_count[dst] = 0
            for d, h in zip(src.tolist(), dst.tolist()):
                self.index.move(d, h)
                self.host_evictable[h] = None
            self.moves.append((src, dst))
            self.offloads += kept
        self.is_free[ids] = True
        np.add.at(self.free_in_chunk, ids // self.blocks_per_chunk, 1)
        self._free += n
        self.evictions += n

    def allocate_host(self, n):
        """``n`` host-tier block ids with reference count 1: free ones first, then those of offloaded cached blocks
        (least recently used first, forgetting their names). HostTierExhaustedError, changing nothing, when short."""
        if n > self.num_host_available:
            raise HostTierExhaustedError(
                f"asked for {n} host-tier blocks but {self._host_free} are free and {len(self.host_evictable)} hold "
                f"offloaded cache blocks, of {self.host_blocks} ({self.num_host_held} held by swapped-out "
                f"sequences): swap fewer sequences out, free some, or make the cache with a larger host tier")
        if n > self._host_free:
            self._drop_host(n - self._host_free)
        ids = (np.flatnonzero(self.is_free[self.device_blocks:])[:n] + self.device_blocks).astype(np.int32)
        self.is_free[ids] = False
        np.subtract.at(self.free_in_chunk, ids // self.blocks_per_chunk, 1)
        self._host_free -= n
        self.ref_count[ids] = 1
        return ids

    def _drop_host(self, n):
        """Make the ``n`` least recently offloaded cached blocks free, forgetting their names."""
        ids = np.array([self.host_evictable.popitem(last=False)[0] for _ in range(n)], np.int64)
        for block in ids.tolist():
            self.index.forget(block)
        self.is_free[ids] = True
        np.add.at(self.free_in_chunk, ids // self.blocks_per_chunk, 1)
        self._host_free += n
        self.host_evictions += n

    def transfer(self, src, dst):
        """Move every reference of blocks ``src`` to their copies ``dst`` (just allocated, in the other tier): the
        sources are released (free, or cached-free when named: the name stays with them)."""
        refs = self.ref_count[src].astype(np.int64)
        self.ref_count[dst] = refs
        self.num_shared += int((refs > 1).sum())
        self.free(np.repeat(np.asarray(src, np.int64), refs))

    def reserve_offloaded(self, block_ids):
        """Take these offloaded cached blocks out of the host tier's LRU, so nothing drops them (a step's prefix
        hits on them, about to be reloaded)."""
        for block in block_ids:
            del self.host_evictable[block]

    def reload(self, host_ids, holders):
        """Bring reserved offloaded blocks back to the device: a new device block each, with ``holders`` references
        and the name; the host-tier blocks go free. Records the copies in :attr:`moves`; returns the device ids."""
        host_ids = np.asarray(host_ids, np.int64)
        dst = self.allocate(host_ids.size).astype(np.int64)
        holders = np.asarray(holders, np.int32)
        self.ref_count[dst] = holders
        self.num_shared += int((holders > 1).sum())
        for h, d in zip(host_ids.tolist(), dst.tolist()):
            self.index.move(h, d)
        self.is_free[host_ids] = True
        np.add.at(self.free_in_chunk, host_ids // self.blocks_per_chunk, 1)
        self._host_free += host_ids.size
        self.moves.append((host_ids, dst))
        self.reloads += host_ids.size
        return dst

    def claim_cached(self, block_ids):
        """One more reference to each of these cached blocks (a prefix hit); cached-free ones stop being evictable."""
        ids = np.asarray(block_ids, np.int64)
        refs = self.ref_count[ids]
        for block in ids[refs == 0].tolist():
            del self.evictable[block]
        self.num_shared += int((refs == 1).sum())
        self.ref_count[ids] += 1

    def share(self, block_ids):
        """Add one reference to each held block (a fork); a block may appear more than once."""
        ids, counts = np.unique(np.asarray(block_ids, np.int64), return_counts=True)
        self._check_held(ids, np.ones_like(counts), "share")
        before = self.ref_count[ids]
        self.ref_count[ids] += counts.astype(np.int32)
        self.num_shared += int((before == 1).sum())

    def free(self, block_ids):
        """Drop one reference per occurrence; blocks reaching zero become free. All or nothing.

        A cached (named) block reaching zero becomes cached-free instead, the most
        recently used; of several freed at once, later ones in ``block_ids`` (the
        ends of sequences' chains) are evicted before earlier ones.
        """
        order = np.asarray(block_ids, np.int64)
        ids, counts = np.unique(order, return_counts=True)
        if ids.size == 0:
            return
        self._check_held(ids, counts, "free")
        before = self.ref_count[ids]
        self.ref_count[ids] -= counts.astype(np.int32)
        after = self.ref_count[ids]
        self.num_shared -= int(((before > 1) & (after <= 1)).sum())
        released = ids[after == 0]
        cached = self.index.cached[released]
        if cached.any():
            released = released[~cached]
            kept = order[self.index.cached[order] & (self.ref_count[order] == 0)]
            for block in kept[::-1].tolist():
                lru = self.evictable if block < self.device_blocks else self.host_evictable
                lru[block] = None
                lru.move_to_end(block)
        self.is_free[released] = True
        np.add.at(self.free_in_chunk, released // self.blocks_per_chunk, 1)
        host = int(np.count_nonzero(released >= self.device_blocks)) if self.host_blocks else 0
        self._free += released.size - host
        self._host_free += host

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

    def grow(self, n_chunks):
        """Map ``n_chunks`` more chunks, re-using holes (lowest first) before the frontier; never one in flight."""
        chunks = self.unmapped_chunks(n_chunks)
        if len(chunks) < n_chunks:
            raise PoolExhaustedError(
                f"cannot map {n_chunks} more chunks: {len(chunks)} remain in the reservation "
                f"({int(self.in_flight.sum())} more are being mapped ahead)")
        self.pool.map([c for k in chunks for c in self.pool_chunks(k)])
        self.adopt(chunks)
        return chunks

    def unmapped_chunks(self, n_chunks):
        """The ``n_chunks`` lowest device chunks (or fewer, all there are) that are neither mapped nor in flight."""
        idle = ~(self.chunk_mapped | self.in_flight)[:self.device_chunks]
        return [int(k) for k in np.flatnonzero(idle)[:n_chunks]]

    def map_host(self):
        """Map the host tier's chunks (pinned host memory; slow, so once, ahead of need): all or none."""
        chunks = list(range(self.device_chunks, self.num_chunks))
        if not chunks:
            return
        self.pool.map([c for k in chunks for c in self.pool_chunks(k)], "host")
        self.is_free[self.device_blocks:] = True
        self.chunk_mapped[chunks] = True
        self.free_in_chunk[chunks] = self.blocks_per_chunk
        self._host_free = self.host_blocks
        self.version += 1

    def adopt(self, chunks):
        """Make newly mapped chunks' blocks free."""
        for k in chunks:
            self.is_free[k * self.blocks_per_chunk:(k + 1) * self.blocks_per_chunk] = True
        self.chunk_mapped[chunks] = True
        self.free_in_chunk[chunks] = self.blocks_per_chunk
        self._free += len(chunks) * self.blocks_per_chunk
        self._mapped_chunks += len(chunks)
        self.version += 1

    def trim(self):
        """Release every mapped device chunk whose blocks are all free; return their indices."""
        empty = np.flatnonzero((self.chunk_mapped & (self.free_in_chunk == self.blocks_per_chunk))[:self.device_chunks])
        if empty.size == 0:
            return []
        chunks = [int(k) for k in empty]
        self.release_chunks(chunks)
        return chunks

    def release_chunks(self, chunks):
        """Unmap these mapped chunks, every block of which is free, and free their memory."""
        self.pool.release([c for k in chunks for c in self.pool_chunks(k)])
        self.chunk_mapped[chunks] = False
        self.free_in_chunk[chunks] = 0
        self._free -= len(chunks) * self.blocks_per_chunk
        self._mapped_chunks -= len(chunks)
        self.is_free.reshape(self.num_chunks, self.blocks_per_chunk)[chunks] = False
        self.version += 1


class BlockTables:
    """Sequences: a length and a block-table row each, with a log of what changed.

    ``seq`` handles are rows of the table; a freed handle may be given to a later sequence.
    """

    def __init__(self, allocator, block_size, max_seqs, max_blocks_per_seq):
        self.allocator = allocator
        self.block_size = block_size
        self.max_seqs = max_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.row_tokens = max_blocks_per_seq * block_size  # the most tokens a sequence can hold
        self.table = np.full((max_seqs, max_blocks_per_seq), -1, np.int32)
        self.lens = np.zeros(max_seqs, np.int32)
        self.live = np.zeros(max_seqs, bool)
        self.swapped = np.zeros(max_seqs, bool)  # live sequences swapped out to the host tier
        self._shift = block_size.bit_length() - 1  # block sizes are powers of two
        self._iota = np.arange(max_seqs)
        self._mark = np.zeros(max_seqs, np.int64)  # scratch for the duplicate check
        self._live_cache = None                    # np.flatnonzero(live & ~swapped), until that changes
        self._free_rows = list(range(max_seqs - 1, -1, -1))
        self.known = np.zeros(max_seqs, np.int64)              # leading tokens whose ids are known
        self.tail = np.zeros((max_seqs, block_size), np.int32)  # the ids in the partly filled last block
        self.chain = [prefix.ROOT] * max_seqs                   # the name of the last full block
        self.log_changes = True     # False where no device copy reads the log (the host backend)
        self._changed_entries = []  # (rows, cols) of table entries changed since the last drain
        self._changed_lens = []     # rows whose length changed since the last drain

    # --- queries ------------------------------------------------------------------------

    @property
    def sequences(self):
        return np.flatnonzero(self.live)

    @property
    def swapped_sequences(self):
        return np.flatnonzero(self.swapped)

    def blocks(self, seq):
        """The block ids of one sequence, in logical order."""
        row = self.row(seq)
        return self.table[row, :ceil_div(int(self.lens[row]), self.block_size)].copy()

    def row(self, seq):
        """One live sequence's handle as an int (a list of exactly one handle is accepted too)."""
        rows = self.rows(seq)
        if rows.size != 1:
            raise UnknownSequenceError(f"one sequence handle expected, got {rows.size}")
        return int(rows[0])

    def rows(self, seqs):
        """``seqs`` (one handle or many) as an int64 array, each checked to be a live sequence.

        An empty list gives no rows (every call over no sequences does nothing).
        """
        try:
            rows = np.asarray(seqs)
        except (ValueError, TypeError):  # ragged nesting, or what NumPy cannot hold
            raise UnknownSequenceError(f"sequence handles must be ints, got {seqs!r:.80}") from None
        if rows.ndim > 1:
            raise UnknownSequenceError(f"sequence handles must be one int or a flat list, got shape {rows.shape}")
        if rows.dtype.kind not in "iu":
            if rows.size == 0:
                return _NO_ROWS
            raise UnknownSequenceError(f"sequence handles must be ints, got {rows.dtype}")
        if rows.ndim == 0:
            rows = rows.reshape(1)
        if rows.size and (rows.astype(np.uint64).max() >= self.max_seqs or not self.live[rows].all()):
            bad = (rows < 0) | (rows >= self.max_seqs)
            bad[~bad] = ~self.live[rows[~bad]]
            raise UnknownSequenceError(f"sequence {rows[bad][0]} does not exist (never added, or freed)")
        return rows.astype(np.int64, copy=False)

    # --- changes ------------------------------------------------------------------------

    def add(self, prompt=None):
        """A new sequence; returns its handle.

        With ``prompt`` (token ids), the sequence starts holding the longest chain of
        cached blocks equal to the prompt's leading full blocks, but never the whole
        prompt (at least its last token is left to compute), and its length is the
        tokens those blocks hold. Without, it starts empty. The chain stops at the first
        block offloaded to the host tier: only :meth:`step` brings such blocks back.
        """
        if prompt is not None:
            prompt = prefix.check_token_ids(prompt, None, "prefix")
        row = self._add_row()
        self.known[row], self.chain[row] = 0, prefix.ROOT
        if prompt is not None:
            self._start(row, prompt, self.match(prompt))
        return row

    def match(self, prompt, reload=False):
        """(block ids, name of the last): the cached blocks a sequence for ``prompt`` would start with.

        The longest chain of cached blocks equal to the prompt's leading full blocks,
        never the whole prompt (its last token is left to compute); with ``reload``
        offloaded (host-tier) blocks count too, else the chain stops at the first.
        Changes nothing.
        """
        most = min(max(prompt.size - 1, 0) >> self._shift, self.max_blocks_per_seq)
        blocks, name = self.allocator.index.match(prompt, self.block_size, most)
        if not reload:
            host = np.flatnonzero(blocks >= self.allocator.device_blocks)
            if host.size:
                blocks = blocks[:host[0]]
                name = int(self.allocator.index.name[blocks[-1]]) if blocks.size else prefix.ROOT
        return blocks, name

    def _start(self, row, prompt, match, claim=True):
        """Start new row ``row`` holding the cached blocks of ``match`` (claimed here, unless the caller did);
        count the lookup."""
        blocks, name = match
        index = self.allocator.index
        index.lookups += 1
        index.queried_tokens += prompt.size
        index.hit_blocks += blocks.size
        index.hit_tokens += blocks.size * self.block_size
        if blocks.size:
            if claim:
                self.allocator.claim_cached(blocks)
            self._set_entries(np.full(blocks.size, row), np.arange(blocks.size), blocks)
            self._set_lens(np.array([row]), blocks.size * self.block_size)
            self.known[row], self.chain[row] = blocks.size * self.block_size, name

    def _add_row(self):
        if not self._free_rows:
            raise TooManySequencesError(
                f"all {self.max_seqs} block-table rows hold live sequences: free one, or make the cache "
                f"with a larger max_seqs")
        row = self._free_rows.pop()
        self.live[row] = True
        self._live_cache = None
        return row

    def append(self, seqs, counts, token_ids=None):
        """Make room for ``counts`` more tokens in each of ``seqs``.

        Returns ``(slot_mapping, copies)``: int64 pool slots (block_id * block_size +
        slot) for the new tokens, sequence by sequence; and int32 ``[n, 2]`` (src,
        dst) block pairs to copy before writing, where a sequence's shared, partly
        filled last block was replaced by a private copy (copy-on-write).
        All or nothing: on error no sequence changes. ``seqs=None`` means every
        live sequence, in handle order; ``counts`` is one int for every sequence
        or one per sequence. One token for every live sequence is the decode
        step, and has a fast path.

        ``token_ids``, if given, are the new tokens' ids (one flat array, sequence by
        sequence, ``sum(counts)`` long, each in [0, 2**31)); blocks they fill are named
        and cached (:mod:`pagedrt.prefix`). A sequence that ever appended without ids
        caches no block from then on.
        """
        rows, step = self._request(seqs, counts)
        return self._append_rows(rows, step, token_ids)

    def _append_rows(self, rows, step, token_ids):
        """:meth:`append` for checked ``rows`` (live, each once) and ``step`` (from :meth:`_counts`)."""
        if token_ids is not None:
            total = step * rows.size if isinstance(step, int) else int(step.sum())
            token_ids = prefix.check_token_ids(token_ids, total, "token_ids")
            before = self.lens[rows].astype(np.int64)
        result = self._append_one(rows) if isinstance(step, int) and step == 1 else None
        if result is None:
            result = self._append(rows, step)
        if token_ids is not None and token_ids.size:
            self._record_tokens(rows, before, np.broadcast_to(step, rows.shape).astype(np.int64), token_ids)
        return result

    def step(self, seqs, counts, token_ids, arrivals, arrival_tokens, forks, frees, max_tokens, swap_out=(),
             swap_in=()):
        """One engine step's decisions, all or nothing: frees, forks, arrivals' prefix hits, swap-outs, swap-ins,
        then the appends.

        ``seqs``/``counts``/``token_ids`` are as for :meth:`append` (``seqs=None``: every
        live sequence not freed now and not swapped out after the swaps). ``arrivals`` are
        new sequences' prompts (token ids); each starts holding the cached blocks its prompt
        begins with (offloaded ones are brought back to the device) and appends
        ``arrival_tokens`` more of the prompt (one int for all, one per arrival, or None for
        the whole uncached rest). ``forks`` are parent handles, one child each (a parent may
        repeat; never a swapped-out one); a child shares its parent's blocks as they were
        before this step's tokens. ``frees`` are handles to free. ``swap_out`` and ``swap_in``
        are handles to move to the host tier and back (:meth:`swap_out`). At most
        ``max_tokens`` new tokens in all.

        Every check runs before anything changes, including whether the device's blocks and
        the host tier's suffice (with those the frees and swap-outs give back and without
        cached-free blocks an arrival takes), so an error leaves the tables and the allocator
        exactly as they were. Returns a :class:`StepResult`; the batch is ``seqs`` in order,
        then the arrivals; its ``swaps`` are the tier copies to make first, in order.
        """
        if not (len(arrivals) or len(forks) or len(frees) or len(swap_out) or len(swap_in)):
            rows, step = self._request(seqs, counts)  # append alone is all or nothing
            self._check_step_tokens(rows, step, 0, max_tokens)
            slots, copies = self._append_rows(rows, step, token_ids)
            return StepResult(rows, step, slots, copies, _NO_ROWS, _NO_ROWS, _NO_ROWS, _NO_COPIES)
        plan = self._plan_step(seqs, counts, token_ids, arrivals, arrival_tokens, forks, frees, max_tokens,
                               swap_out, swap_in)
        rows, step, prompts, matches, chunk, parents, freed, unmapped, out_rows, in_rows = plan
        if unmapped > 0:  # map before anything changes: a mapping that fails leaves the step undone
            self._map_ahead(unmapped)
        a = self.allocator
        a.moves = moves = []
        try:
            if freed.size:
                self.free(freed)
            forked = np.array([self.fork(int(p)) for p in parents], np.int64)
            arrived = np.empty(len(prompts), np.int64)
            for i, (blocks, _) in enumerate(matches):  # claimed now, so that no swap or reload evicts them
                arrived[i] = row = self._add_row()
                self.known[row], self.chain[row] = 0, prefix.ROOT
                a.claim_cached(blocks[blocks < a.device_blocks])
            offloaded, holders = _offloaded_hits(matches, a.device_blocks)
            a.reserve_offloaded(offloaded.tolist())
            if out_rows.size:
                self._swap_out(out_rows)
            if in_rows.size:
                self._swap_in(in_rows)
            reloaded = a.reload(offloaded, holders) if offloaded.size else _NO_ROWS
            for row, prompt, (blocks, name) in zip(arrived.tolist(), prompts, matches):
                self._start(row, prompt, (_translate(blocks, offloaded, reloaded), name), claim=False)
            cached = self.lens[arrived].astype(np.int64)
            slots, copies = self._append_rows(rows, step, token_ids)
            if arrived.size:
                ids = np.concatenate([p[c:c + n] for p, c, n in zip(prompts, cached.tolist(), chunk.tolist())])
                new_slots, new_copies = self._append_rows(arrived, chunk, ids)
                slots, copies = np.concatenate([slots, new_slots]), np.concatenate([copies, new_copies])
                rows, step = (np.concatenate([rows, arrived]),
                              np.concatenate([np.broadcast_to(step, rows.shape), chunk]))
        finally:
            a.moves = None
        return StepResult(rows, step, slots, copies, arrived, cached, forked, _pairs(moves))

    # --- the host tier: swapping sequences out and in ---------------------------------------

    def swap_out(self, seqs):
        """Move the device blocks of ``seqs`` (live, not swapped out, each once) to the host tier.

        A block moves when every sequence holding it is swapped out once this is done, and
        every holder's row then points at its host-tier copy; blocks that sequences still on
        the device hold stay. Returns the int32 ``[n, 2]`` (src, dst) block pairs to copy, in
        order (``kernels.swap_blocks``), before anything writes into the device blocks they
        free. All or nothing: HostTierExhaustedError when the host tier is short.
        """
        rows = self._swap_rows(seqs, "swap_out", False)
        return self._recorded(lambda: self._swap_out(rows))

    def swap_in(self, seqs):
        """Move every host-tier block of ``seqs`` (swapped out, each once) back to the device; the pairs to copy
        first, in order, as for :meth:`swap_out`. All or nothing: PoolExhaustedError when the device is short."""
        rows = self._swap_rows(seqs, "swap_in", True)
        return self._recorded(lambda: self._swap_in(rows))

    def can_swap_out(self, seqs):
        """Whether :meth:`swap_out` of ``seqs`` would succeed now: the host tier holds the blocks it moves."""
        rows = self._swap_rows(seqs, "swap_out", False)
        return self._out_blocks(rows, self.swapped_sequences).size <= self.allocator.num_host_available

    def can_swap_in(self, seqs):
        """Whether :meth:`swap_in` of ``seqs`` would succeed now: the device has room for their host-tier blocks."""
        rows = self._swap_rows(seqs, "swap_in", True)
        return self.allocator.can_allocate(self._in_blocks(rows).size)

    def _swap_rows(self, seqs, what, swapped):
        rows = self._distinct(self.rows(seqs), what, f"{what} each sequence once")
        wrong = self.swapped[rows] != swapped
        if wrong.any():
            state = "already swapped out" if not swapped else "not swapped out"
            raise SwapStateError(f"{what}: sequence {rows[wrong][0]} is {state}")
        return rows

    def _recorded(self, move):
        """Run ``move()`` with the allocator recording its tier copies; return them as pairs, in order."""
        a = self.allocator
        a.moves = moves = []
        try:
            move()
        finally:
            a.moves = None
        return _pairs(moves)

    def _swap_out(self, rows):
        swapped = self.swapped_sequences
        src = self._out_blocks(rows, swapped)
        dst = self.allocator.allocate_host(src.size)  # the last step that can fail
        self._move(np.union1d(rows, swapped), src, dst)
        self.swapped[rows] = True
        self._live_cache = None

    def _swap_in(self, rows):
        src = self._in_blocks(rows)
        dst = self.allocator.allocate(src.size)  # the last step that can fail
        self._move(self.swapped_sequences, src, dst)
        self.swapped[rows] = False
        self._live_cache = None

    def _out_blocks(self, rows, swapped, dropped=None, claimed=None):
        """The device blocks a swap-out of ``rows`` moves (sorted): those they hold whose every holder is in
        ``rows`` or ``swapped``. ``dropped``/``claimed``: references a step's frees drop and its prefix hits add
        first (for its plan)."""
        holders = np.union1d(rows, swapped)
        held = self._held_blocks(holders)
        held = held[held < self.allocator.device_blocks]
        blocks, occurrences = np.unique(held, return_counts=True)
        refs = self.allocator.ref_count[blocks].astype(np.int64)
        if dropped is not None:
            refs += _occurrences(blocks, claimed) - _occurrences(blocks, dropped)
        mine = np.isin(blocks, self._held_blocks(rows))
        return blocks[mine & (refs == occurrences)]

    def _in_blocks(self, rows):
        """The host-tier blocks ``rows`` hold (sorted)."""
        held = self._held_blocks(rows)
        return np.unique(held[held >= self.allocator.device_blocks])

    def _move(self, holders, src, dst):
        """Point every entry of ``holders`` that holds a block of ``src`` (sorted) at its copy in ``dst``; move the
        references; record the copies."""
        if not src.size:
            return
        nb = ceil_div(self.lens[holders].astype(np.int64), self.block_size)
        held_rows, held_cols = np.repeat(holders, nb), ranks(nb)
        ids = self.table[held_rows, held_cols]
        at = np.minimum(np.searchsorted(src, ids), src.size - 1)
        hit = src[at] == ids
        self._set_entries(held_rows[hit], held_cols[hit], dst[at[hit]])
        a = self.allocator
        a.transfer(src, dst)
        a.moves.append((src, dst))

    def _map_ahead(self, blocks):
        """Make ``blocks`` more blocks usable without mapping: chunks in flight first (waited for), then mapped."""
        a = self.allocator
        if a.in_flight.any():
            free = a.num_free
            a.wait_in_flight()
            blocks -= a.num_free - free
        if blocks > 0:
            a.sync_grows += 1
            a.grow(ceil_div(blocks, a.blocks_per_chunk))

    def _plan_step(self, seqs, counts, token_ids, arrivals, arrival_tokens, forks, frees, max_tokens, swap_out,
                   swap_in):
        """Every check of :meth:`step`, changing nothing; the validated decisions."""
        freed = np.sort(self._distinct(self.rows(frees), "step's frees", "free each sequence once"))
        parents = self.rows(forks)
        gone = np.isin(parents, freed)
        if gone.any():
            raise UnknownSequenceError(f"sequence {parents[gone][0]} is forked and freed in one step: fork it, or "
                                       f"free it")
        out_rows, in_rows = self._swap_rows(swap_out, "swap_out", False), self._swap_rows(swap_in, "swap_in", True)
        for moved in (out_rows, in_rows):
            gone = np.isin(moved, freed)
            if gone.any():
                raise UnknownSequenceError(f"sequence {moved[gone][0]} is swapped and freed in one step")
        swapped = self.swapped.copy()
        swapped[out_rows] = True
        away = swapped[parents]
        if away.any():
            raise SwapStateError(f"sequence {parents[away][0]} is forked but swapped out: swap it in first")
        swapped[in_rows] = False
        if seqs is None:
            rows = np.flatnonzero(self.live & ~swapped)
            rows = rows[~np.isin(rows, freed)]
        else:
            rows = self._distinct(self.rows(seqs), "step", "sum its counts instead")
            gone = np.isin(rows, freed)
            if gone.any():
                raise UnknownSequenceError(f"sequence {rows[gone][0]} is given tokens and freed in one step")
        step = self._counts(rows, counts)
        if token_ids is not None:
            total = step * rows.size if isinstance(step, int) else int(step.sum())
            prefix.check_token_ids(token_ids, total, "token_ids")
        prompts = [prefix.check_token_ids(p, None, f"arrivals[{i}]") for i, p in enumerate(arrivals)]
        rows_after = int(self.live.sum()) - freed.size + parents.size + len(prompts)
        if rows_after > self.max_seqs:
            raise TooManySequencesError(
                f"the step would leave {rows_after} live sequences but the block table has {self.max_seqs} rows: "
                f"free some first, or make the cache with a larger max_seqs")
        matches = [self.match(p, reload=True) for p in prompts]
        cached = np.array([m[0].size for m in matches], np.int64) << self._shift
        rest = np.array([p.size for p in prompts], np.int64) - cached
        chunk = self._arrival_chunks(arrival_tokens, rest, len(prompts))
        if chunk.size and (cached + chunk).max() > self.row_tokens:
            self._too_many(int((cached + chunk).max()))
        self._check_step_tokens(rows, step, int(chunk.sum()), max_tokens)
        old, old_nb, new_nb = self._block_counts(rows, step)
        self._check_capacity(rows, old + step, new_nb)
        need = int((new_nb - old_nb).sum()) + int((ceil_div(cached + chunk, self.block_size) -
                                                   (cached >> self._shift)).sum())
        need += self._step_copies(rows, step, old, old_nb, freed, parents)
        a = self.allocator
        hits = [m[0][m[0] < a.device_blocks] for m in matches]
        offloaded = _offloaded_hits(matches, a.device_blocks)[0]
        need += offloaded.size + self._in_blocks(in_rows).size  # reloads and swap-ins take device blocks
        released = self._step_released(freed, hits)
        dropped = self._held_blocks(freed)
        out_blocks = self._out_blocks(out_rows, np.setdiff1d(self.swapped_sequences, freed), dropped,
                                      np.concatenate([_NO_ROWS] + [h.astype(np.int64) for h in hits]))
        released += out_blocks.size
        available = a.num_available + released
        if need > available:
            raise PoolExhaustedError(
                f"the step needs {need} blocks but {available} would be available: free sequences, schedule fewer "
                f"tokens, swap some out, or reserve a larger cache")
        host_dropped, drops = np.unique(dropped[dropped >= a.device_blocks], return_counts=True)
        host_available = (a.num_host_available - offloaded.size
                          + int((a.ref_count[host_dropped] == drops).sum()))
        if out_blocks.size > host_available:
            raise HostTierExhaustedError(
                f"the step swaps out {out_blocks.size} blocks but the host tier would have {host_available}: swap "
                f"fewer sequences out, free swapped-out ones, or make the cache with a larger host tier")
        unmapped = need - a.num_free - len(a.evictable) - released  # blocks to map, after all this step frees
        return rows, step, prompts, matches, chunk, parents, freed, unmapped, out_rows, in_rows

    def _arrival_chunks(self, arrival_tokens, rest, n):
        """How many prompt tokens each arrival appends now: at least one, at most its uncached rest."""
        if arrival_tokens is None:
            chunk = rest
        else:
            try:
                chunk = np.broadcast_to(np.asarray(arrival_tokens), (n,))
            except ValueError:
                raise InvalidTokenCountError(f"arrival_tokens must be one int or one per arrival ({n}), got "
                                             f"{arrival_tokens!r:.80}") from None
            if chunk.size and (chunk.dtype.kind not in "iu" or chunk.min() < 1):
                raise InvalidTokenCountError(f"arrival_tokens must be ints >= 1, got {arrival_tokens!r:.80}")
            chunk = np.minimum(chunk.astype(np.int64), rest)
        if chunk.size and chunk.min() < 1:
            raise InvalidTokenCountError(f"arrivals[{int(chunk.argmin())}] is empty: a prompt has a token at least")
        return chunk

    @staticmethod
    def _check_step_tokens(rows, step, more, max_tokens):
        total = (step * rows.size if isinstance(step, int) else int(step.sum())) + more
        if total > max_tokens:
            raise InvalidTokenCountError(f"the step has {total} new tokens but steps hold at most {max_tokens} "
                                         f"(max_step_tokens): split the prompt into chunks")

    def _step_copies(self, rows, step, old, old_nb, freed, parents):
        """Private copies of shared tail blocks the appends take once this step's frees and forks are done."""
        if self.allocator.num_shared == 0 and not parents.size:  # frees only lower reference counts
            return 0
        tail = (old & (self.block_size - 1)) != 0
        if not isinstance(step, int):
            tail &= step > 0
        elif step == 0:
            return 0
        tails = self.table[rows[tail], old_nb[tail] - 1]
        if not tails.size:
            return 0
        blocks, holders = np.unique(tails, return_counts=True)
        refs = self.allocator.ref_count[blocks].astype(np.int64)
        refs -= _occurrences(blocks, self._held_blocks(freed))
        refs += _occurrences(blocks, self._held_blocks(parents))
        return int(np.where(refs > holders, holders, holders - 1).sum())

    def _step_released(self, freed, hits):
        """Device blocks this step's frees make available, less the cached-free ones its arrivals' ``hits`` (device
        block ids, per arrival) take."""
        dropped = self._held_blocks(freed)
        dropped = dropped[dropped < self.allocator.device_blocks]
        blocks, drops = np.unique(dropped, return_counts=True)
        released = int((self.allocator.ref_count[blocks] == drops).sum())
        claimed = np.unique(np.concatenate([_NO_ROWS] + [h.astype(np.int64) for h in hits]))
        if claimed.size:
            refs = self.allocator.ref_count[claimed] - _occurrences(claimed, dropped)
            released -= int((refs == 0).sum())
        return released

    def _held_blocks(self, rows):
        """Every block held by ``rows`` (a row may repeat), as int64."""
        nb = ceil_div(self.lens[rows].astype(np.int64), self.block_size)
        return self.table[np.repeat(rows, nb), ranks(nb)].astype(np.int64)

    def _append(self, rows, step):
        old, old_nb, new_nb = self._block_counts(rows, step)
        self._check_capacity(rows, old + step, new_nb)
        tail_rows, tail_cols, tail_src = self._shared_tails(rows, old, old_nb, step)
        need = new_nb - old_nb
        ids = self.allocator.allocate(int(need.sum()) + tail_src.size)  # the last step that can fail
        copies = self._copy_on_write(tail_rows, tail_cols, tail_src, ids[:tail_src.size])
        self._place_new_blocks(rows, old_nb, need, ids[tail_src.size:], step)
        slots = self._slots(rows, old, step)
        self._set_lens(rows, old + step)
        return slots, copies

    def _record_tokens(self, rows, old, counts, token_ids):
        """Keep the ids of rows whose earlier ids are all known; name and register each block they fill."""
        starts = np.cumsum(counts) - counts  # each row's first id in token_ids
        ok = self.known[rows] == old
        if not ok.all():
            rows, old, counts, starts = rows[ok], old[ok], counts[ok], starts[ok]
        self.known[rows] = old + counts
        shift, mask = self._shift, self.block_size - 1
        within = old & mask
        run = within + counts  # the row's partly filled block's ids, then the new ones
        run_start = np.cumsum(run) - run
        r = ranks(run)
        from_tail = r < np.repeat(within, run)
        at = np.where(from_tail, 0, np.repeat(starts - within, run) + r)
        ids = np.where(from_tail, self.tail[np.repeat(rows, run), r & mask], token_ids[at])
        full, rest = run >> shift, run & mask
        self.tail[np.repeat(rows, rest), ranks(rest)] = ids[np.repeat(run_start + (full << shift), rest) + ranks(rest)]
        if not full.any():
            return
        k = ranks(full)
        block_rows = np.repeat(rows, full)
        blocks = self.table[block_rows, np.repeat(old >> shift, full) + k]
        filled = ids[(np.repeat(run_start, full) + (k << shift))[:, None] + np.arange(self.block_size)]
        index, chain, device = self.allocator.index, self.chain, self.allocator.device_blocks
        for row, block, tokens in zip(block_rows.tolist(), blocks.tolist(), filled):
            chain[row] = prefix.chain_hash(chain[row], tokens)
            if block < device:  # a swapped-out sequence's host-tier block stays unnamed: only offloads name those
                index.register(block, chain[row], tokens)

    def can_append(self, seqs, counts):
        """Whether ``append(seqs, counts)`` would succeed now.

        True when every sequence's row is wide enough and the free blocks, with those
        of chunks not mapped yet, cover the new blocks and the private copies of shared
        tail blocks. Bad arguments raise as :meth:`append` does.
        """
        try:
            rows, step = self._request(seqs, counts)
        except SequenceFullError:  # a count larger than any row holds
            return False
        old, old_nb, new_nb = self._block_counts(rows, step)
        if self._overflow(new_nb) is not None:
            return False
        copies = self._shared_tails(rows, old, old_nb, step)[2].size
        return self.allocator.can_allocate(int((new_nb - old_nb).sum()) + copies)

    def _append_one(self, rows):
        """append(rows, 1), the decode step: one new block at most per row and, unless a row's partly filled
        last block is shared, nothing to copy; None (nothing changed) when one is, for the general path."""
        shift, mask = self._shift, self.block_size - 1
        old = self.lens[rows]
        within, cols = old & mask, old >> shift
        if self.allocator.num_shared:  # blocks shared by forks or prefix hits: is a tail about to be written?
            tails = within != 0
            if (self.allocator.ref_count[self.table[rows[tails], cols[tails]]] > 1).any():
                return None
        fresh = np.flatnonzero(within == 0)  # these start a new block
        if fresh.size and cols[fresh].max() >= self.max_blocks_per_seq:
            i = fresh[cols[fresh].argmax()]
            raise SequenceFullError(
                f"sequence {rows[i]} would hold {old[i] + 1} tokens but a block-table row holds "
                f"{self.max_blocks_per_seq} blocks ({self.row_tokens} tokens)")
        ids = self.allocator.allocate(fresh.size)
        if fresh.size:
            self._set_entries(rows[fresh], cols[fresh], ids)
        slots = (self.table[rows, cols].astype(np.int64) << shift) | within
        self._set_lens(rows, old + 1)
        return slots, _NO_COPIES

    # --- the steps of an append -------------------------------------------------------------

    def _request(self, seqs, counts):
        """The rows to update (live, each once) and their token counts.

        The counts come back as one int for every row, or an int64 array, one per row,
        each checked against a row's capacity before any arithmetic on them, so sums
        of lengths and counts stay far inside int64.
        """
        if seqs is None:
            rows = self._live_rows()
        else:
            rows = self._distinct(self.rows(seqs), "append", "sum its counts instead")
        return rows, self._counts(rows, counts)

    def _counts(self, rows, counts):
        """``counts`` for ``rows``: one int for every row, or an int64 array, one per row, each checked."""
        if isinstance(counts, (int, np.integer)) and not isinstance(counts, bool):
            if counts < 0:
                raise InvalidTokenCountError(f"token counts must be >= 0, got {counts}")
            if counts > self.row_tokens:
                self._too_many(counts)
            return int(counts)
        try:
            counts = np.asarray(counts)
        except (ValueError, TypeError):
            raise InvalidTokenCountError(f"token counts must be ints, got {counts!r:.80}") from None
        if counts.dtype.kind not in "iu" and counts.size:  # [] is no counts, of NumPy's default float64
            raise InvalidTokenCountError(f"token counts must be ints, got {counts.dtype}")
        if counts.shape != rows.shape:
            raise InvalidTokenCountError(f"token counts of shape {counts.shape} given for {rows.size} sequences")
        if counts.size:
            if counts.min() < 0:
                raise InvalidTokenCountError(f"token counts must be >= 0, got {counts.min()}")
            if counts.max() > self.row_tokens:
                self._too_many(counts.max())
        return counts.astype(np.int64)

    def _too_many(self, count):
        raise SequenceFullError(f"{count} more tokens do not fit any sequence: a block-table row holds "
                                f"{self.max_blocks_per_seq} blocks ({self.row_tokens} tokens)")

    def _block_counts(self, rows, step):
        """Each row's length now (int64), and its blocks before and after ``step`` more tokens."""
        shift, mask = self._shift, self.block_size - 1
        old = self.lens[rows].astype(np.int64)
        return old, (old + mask) >> shift, (old + step + mask) >> shift

    def _overflow(self, new_nb):
        """The index of a row that would need more blocks than a table row holds, or None."""
        if new_nb.size and new_nb.max() > self.max_blocks_per_seq:
            return int(new_nb.argmax())
        return None

    def _check_capacity(self, rows, new, new_nb):
        i = self._overflow(new_nb)
        if i is not None:
            raise SequenceFullError(
                f"sequence {rows[i]} would hold {new[i]} tokens ({new_nb[i]} blocks) but a block-table row "
                f"holds {self.max_blocks_per_seq} blocks ({self.row_tokens} tokens)")

    def _shared_tails(self, rows, old, old_nb, step):
        """(rows, cols, block ids) of partly filled last blocks held by others, about to be written."""
        if self.allocator.num_shared == 0 or (isinstance(step, int) and step == 0):
            return _NO_ROWS, _NO_ROWS, _NO_ROWS
        tail = (old & (self.block_size - 1)) != 0
        if not isinstance(step, int):
            tail &= step > 0
        tail_rows, tail_cols = rows[tail], old_nb[tail] - 1
        tail_blocks = self.table[tail_rows, tail_cols]
        shared = self.allocator.ref_count[tail_blocks] > 1
        if shared.any():  # when every holder appends now, the first keeps the original
            blocks, first, holders = np.unique(tail_blocks, return_index=True, return_counts=True)
            keep = first[self.allocator.ref_count[blocks] == holders]
            shared[keep] = False
        return tail_rows[shared], tail_cols[shared], tail_blocks[shared]

    def _copy_on_write(self, rows, cols, src, dst):
        """Give each row its private ``dst`` in place of the shared ``src``; the (src, dst) pairs to copy."""
        if not src.size:
            return _NO_COPIES
        self.allocator.free(src)
        self._set_entries(rows, cols, dst)
        return np.stack([src, dst], axis=1).astype(np.int32)

    def _place_new_blocks(self, rows, old_nb, need, ids, step):
        """Put ``ids`` in the table after each row's last block, ``need[i]`` of them for row ``i``."""
        if not ids.size:
            return
        if isinstance(step, int) and step <= self.block_size:  # at most one new block per row
            grew = need.astype(bool)
            self._set_entries(rows[grew], old_nb[grew], ids)
        else:
            self._set_entries(np.repeat(rows, need), np.repeat(old_nb, need) + ranks(need), ids)

    def _slots(self, rows, old, step):
        """The pool slots of the new tokens, row by row, once their blocks are in the table."""
        shift, mask = self._shift, self.block_size - 1
        if isinstance(step, int) and step == 1:
            return (self.table[rows, old >> shift].astype(np.int64) << shift) | (old & mask)
        counts = np.broadcast_to(step, rows.shape)
        token_rows = np.repeat(rows, counts)
        pos = np.repeat(old.astype(np.int64), counts) + ranks(counts)
        return (self.table[token_rows, pos >> shift].astype(np.int64) << shift) | (pos & mask)

    def _set_entries(self, rows, cols, block_ids):
        self.table[rows, cols] = block_ids
        if self.log_changes:
            self._changed_entries.append((rows, cols))

    def _set_lens(self, rows, lens):
        self.lens[rows] = lens
        if self.log_changes:
            self._changed_lens.append(rows)

    def _distinct(self, rows, what, hint):
        """``rows``, checked to hold no row twice."""
        if rows.size > 1:
            iota = self._iota[:rows.size]
            self._mark[rows] = iota
            again = self._mark[rows] != iota
            if again.any():
                raise DuplicateSequenceError(f"sequence {rows[again][0]} appears twice in one {what}: {hint}")
        return rows

    def _live_rows(self):
        """Every live sequence not swapped out: the batch of ``seqs=None``."""
        if self._live_cache is None:
            self._live_cache = np.flatnonzero(self.live & ~self.swapped)
        return self._live_cache

    # --- forks and frees ---------------------------------------------------------------------

    def fork(self, seq):
        """A new sequence sharing every block of ``seq`` (parallel sampling, beam search); never a swapped-out one."""
        parent = self.row(seq)
        if self.swapped[parent]:
            raise SwapStateError(f"sequence {parent} is forked but swapped out: swap it in first")
        blocks = self.blocks(parent)
        child = self._add_row()
        self.known[child], self.chain[child] = self.known[parent], self.chain[parent]
        self.tail[child] = self.tail[parent]
        self.allocator.share(blocks)
        self._set_entries(np.full(blocks.size, child), np.arange(blocks.size), blocks)
        self._set_lens(np.array([child]), self.lens[parent])
        return child

    def free(self, seqs):
        """Free sequences, each given once: drop their references to their blocks; their handles may be reused."""
        rows = np.sort(self._distinct(self.rows(seqs), "free", "free each sequence once"))
        nb = ceil_div(self.lens[rows].astype(np.int64), self.block_size)
        held_rows, held_cols = np.repeat(rows, nb), ranks(nb)
        self.allocator.free(self.table[held_rows, held_cols])
        self._set_entries(held_rows, held_cols, -1)
        self._set_lens(rows, 0)
        self.live[rows] = False
        self.swapped[rows] = False
        self._live_cache = None
        self._free_rows.extend(int(r) for r in rows[::-1])

    # --- the change log -------------------------------------------------------------------

    def drain_changes(self):
        """What changed since the last drain, and an empty log: a :class:`Changes`, or None if nothing did.

        The step module drains it to bring the device's copies of the table and the
        lengths up to date; nothing else reads the log.
        """
        if not (self._changed_entries or self._changed_lens):
            return None
        width, logged = self.max_blocks_per_seq, self._changed_entries
        if len(logged) == 1:
            entries = logged[0][0] * width + logged[0][1]
        else:
            entries = np.concatenate([r * width + c for r, c in logged]) if logged else _NO_ROWS
        rows = _joined(self._changed_lens)
        self._changed_entries.clear()
        self._changed_lens.clear()
        return Changes(entries, self.table.ravel()[entries], rows, self.lens[rows])


class StepResult(NamedTuple):
    """What one :meth:`BlockTables.step` did, on the host."""

    rows: np.ndarray     # int64 [batch]: the step's sequences in batch order (scheduled, then arrivals)
    counts: object       # their new tokens: one int for every row, or int64 [batch]
    slots: np.ndarray    # int64 [tokens]: the new tokens' pool slots, row by row
    copies: np.ndarray   # int32 [n, 2]: (src, dst) blocks to copy before writing (copy-on-write)
    arrived: np.ndarray  # int64: the arrivals' handles, in the order given
    cached: np.ndarray   # int64: per arrival, its leading tokens found in the prefix cache
    forked: np.ndarray   # int64: the children's handles, one per fork, in the order given
    swaps: np.ndarray    # int32 [n, 2]: (src, dst) tier copies (swaps, offloads, reloads) to make first, in order


def _pairs(moves):
    """A list of (src, dst) id arrays as one int32 ``[n, 2]`` array of pairs, in order."""
    if not moves:
        return _NO_COPIES
    return np.stack([np.concatenate([m[0] for m in moves]), np.concatenate([m[1] for m in moves])],
                    axis=1).astype(np.int32)


def _offloaded_hits(matches, device_blocks):
    """The host-tier (offloaded) blocks in the arrivals' matches, each once in order of first appearance, and how
    many arrivals hit each."""
    hits = np.concatenate([_NO_ROWS] + [m[0][m[0] >= device_blocks].astype(np.int64) for m in matches])
    blocks, first, counts = np.unique(hits, return_index=True, return_counts=True)
    order = np.argsort(first)
    return blocks[order], counts[order]


def _translate(blocks, src, dst):
    """``blocks`` with each id found in ``src`` replaced by its ``dst``."""
    if not src.size:
        return blocks
    out = blocks.astype(np.int64)
    for s, d in zip(src.tolist(), dst.tolist()):
        out[out == s] = d
    return out.astype(np.int32)


def _joined(arrays):
    """One array of a list of int64 arrays (the list's only one as it is)."""
    if len(arrays) == 1:
        return arrays[0]
    return np.concatenate(arrays) if arrays else _NO_ROWS


def _occurrences(values, items):
    """For each of the sorted unique ``values``, how many times it occurs in ``items``."""
    if not items.size:
        return np.zeros(values.size, np.int64)
    items = np.sort(items)
    return np.searchsorted(items, values, "right") - np.searchsorted(items, values, "left")


class Changes(NamedTuple):
    """Table entries and lengths changed since the last drain, with their values now.

    An entry or row may appear more than once, always with the same value, so the
    changes may be applied in any order.
    """

    entries: np.ndarray  # int64 flat indices into the table: row * max_blocks_per_seq + logical block
    blocks: np.ndarray   # int32 block ids now held there (-1: none)
    rows: np.ndarray     # int64 rows whose length changed
    lens: np.ndarray     # int32 their lengths now


_NO_COPIES = np.empty((0, 2), np.int32)
_NO_ROWS = np.empty(0, np.int64)
for _empty in (_NO_COPIES, _NO_ROWS):
    _empty.flags.writeable = False


def ranks(counts):
    """For counts [2, 3] -> [0, 1, 0, 1, 2]: the index of each item within its group."""
    total = int(counts.sum())
    starts = np.cumsum(counts) - counts
    return np.arange(total) - np.repeat(starts, counts)
