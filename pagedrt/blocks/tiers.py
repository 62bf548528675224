"""The host tier of the allocator: host-tier blocks, moves between the tiers, offload on eviction, reload.

When the cache has a host tier, it is the allocator's last ``host_chunks`` chunks:
block ids ``[device_blocks, max_blocks)`` in pinned host memory, mapped once at the
start (:meth:`~HostTier.map_host`) and never released before the pool closes.
:meth:`~HostTier.allocate_host` hands out host-tier blocks (for swap-outs), and
:meth:`~HostTier.transfer` moves a block's references to its copy in the other tier.

While the transaction records tier moves (a step or a swap: :attr:`Transaction.moves
<pagedrt.blocks.transaction.Transaction.moves>`), evicting a cached-free device block
*offloads* it when the host tier has room (:meth:`~HostTier._offload`): it is copied to a
host-tier block that takes its name, cached-free there (``host_evictable``, least
recently used first), and every copy is recorded, in order, for the caller to make
before anything writes into the blocks it reads. A later prefix hit on an offloaded
block brings it back (:meth:`~HostTier.reload`).

:class:`HostTier` is a mixin of :class:`~pagedrt.blocks.allocator.BlockAllocator` and
:class:`SwapTables` one of :class:`~pagedrt.blocks.tables.BlockTables` (swapping whole
sequences out and in), each sharing its class's state.
"""

from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..errors import HostTierExhaustedError, SwapStateError
from .util import ceil_div, pairs, ranks

if TYPE_CHECKING:
    from ..protocols import Handles


class HostTier:
    """The host-tier methods of :class:`~pagedrt.blocks.allocator.BlockAllocator`."""

    @property
    def num_host_free(self) -> int:
        """Host-tier blocks free now (those of offloaded cached blocks not counted)."""
        return self._host_free

    @property
    def num_host_available(self) -> int:
        """Host-tier blocks :meth:`allocate_host` can hand out: free, and those of offloaded cached blocks."""
        return self._host_free + len(self.host_evictable)

    @property
    def num_host_held(self) -> int:
        """Host-tier blocks held by (swapped-out) sequences."""
        return self.host_blocks - self._host_free - len(self.host_evictable)

    def map_host(self) -> None:
        """Map the host tier's chunks (pinned host memory; slow, so once, ahead of need): all or none. At
        construction, outside any transaction."""
        chunks = list(range(self.device_chunks, self.num_chunks))
        if not chunks:
            return
        self.pool.map([c for k in chunks for c in self.pool_chunks(k)], "host")
        self.is_free[self.device_blocks:] = True
        self.chunk_mapped[chunks] = True
        self.free_in_chunk[chunks] = self.blocks_per_chunk
        self._host_free = self.host_blocks
        self.version += 1

    def allocate_host(self, n: int) -> np.ndarray:
        """``n`` host-tier block ids (int32) with reference count 1: free ones first, then those of offloaded cached
        blocks (least recently used first, forgetting their names). HostTierExhaustedError when short."""
        if n > self.num_host_available:
            raise HostTierExhaustedError(
                f"asked for {n} host-tier blocks but {self._host_free} are free and {len(self.host_evictable)} hold "
                f"offloaded cache blocks, of {self.host_blocks} ({self.num_host_held} held by swapped-out "
                f"sequences): swap fewer sequences out, free some, or make the cache with a larger host tier")
        if n > self._host_free:
            self._drop_host(n - self._host_free)
        tx = self.tx
        ids = (np.flatnonzero(self.is_free[self.device_blocks:])[:n] + self.device_blocks).astype(np.int32)
        tx.set(self.is_free, ids, False)
        chunks = ids // self.blocks_per_chunk
        tx.save(self.free_in_chunk, chunks)
        np.subtract.at(self.free_in_chunk, chunks, 1)
        tx.attr(self, "_host_free", self._host_free - n)
        tx.set(self.ref_count, ids, 1)
        return ids

    def _drop_host(self, n):
        """Make the ``n`` least recently offloaded cached blocks free, forgetting their names."""
        ids = np.array(self.host_evictable.take_oldest(n), np.int64)
        for block in ids.tolist():
            self.index.forget(block)
        self._mark_free(ids)
        self.tx.count(self.stats, "host_evictions", n)

    def _offload(self, src):
        """Copy cached-free device blocks ``src`` (int64, just evicted) to new host-tier blocks that take their
        names, cached-free there; record the copies."""
        dst = self.allocate_host(src.size)
        self.tx.set(self.ref_count, dst, 0)
        for d, h in zip(src.tolist(), dst.tolist()):
            self.index.move(d, h)
        self.host_evictable.push(dst.tolist())
        self.tx.moves.append((src, dst))
        self.tx.count(self.stats, "offloads", src.size)

    def transfer(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Move every reference of blocks ``src`` to their copies ``dst`` (just allocated, in the other tier): the
        sources are released (free, or cached-free when named: the name stays with them)."""
        refs = self.ref_count[src].astype(np.int64)
        self.tx.set(self.ref_count, dst, refs)
        self._add_shared(int((refs > 1).sum()))
        self.free(np.repeat(np.asarray(src, np.int64), refs))

    def reserve_offloaded(self, block_ids: Sequence[int]) -> None:
        """Take these offloaded cached blocks out of the host tier's LRU, so nothing drops them (a step's prefix
        hits on them, about to be reloaded)."""
        self.host_evictable.remove(list(block_ids))

    def reload(self, host_ids: np.ndarray, holders: np.ndarray) -> np.ndarray:
        """Bring reserved offloaded blocks back to the device: a new device block each, with ``holders`` references
        and the name; the host-tier blocks go free. Records the copies; returns the device ids (int64)."""
        host_ids = np.asarray(host_ids, np.int64)
        dst = self.allocate(host_ids.size).astype(np.int64)
        holders = np.asarray(holders, np.int32)
        self.tx.set(self.ref_count, dst, holders)
        self._add_shared(int((holders > 1).sum()))
        for h, d in zip(host_ids.tolist(), dst.tolist()):
            self.index.move(h, d)
        self._mark_free(host_ids)
        self.tx.moves.append((host_ids, dst))
        self.tx.count(self.stats, "reloads", host_ids.size)
        return dst


class SwapTables:
    """Swapping sequences between the tiers: the swap methods of :class:`~pagedrt.blocks.tables.BlockTables`.

    A sequence can be *swapped out* (:meth:`swap_out`): its device blocks move to
    host-tier blocks (copies the caller makes, in the order given) and its row points at
    them; :meth:`swap_in` moves them back. A block moves when every sequence holding it
    is swapped out (copying a block another sequence keeps on the device would free
    nothing), and every holder's row follows it, so a block is never in both tiers and
    reference counts move with it. A swapped-out sequence is left out of "every live
    sequence" (``seqs=None``), is never forked, and holds the only host-tier blocks that
    sequences hold; given tokens explicitly, it appends (to device blocks) and attention
    reads its host-tier blocks through the same pointers.
    """

    def swap_out(self, seqs: "Handles") -> np.ndarray:
        """Move the device blocks of ``seqs`` (live, not swapped out, each once) to the host tier.

        A block moves when every sequence holding it is swapped out once this is done, and
        every holder's row then points at its host-tier copy; blocks that sequences still on
        the device hold stay. Returns the int32 ``[n, 2]`` (src, dst) block pairs to copy, in
        order (``kernels.swap_blocks``), before anything writes into the device blocks they
        free. All or nothing: HostTierExhaustedError when the host tier is short.
        """
        rows = self._swap_rows(seqs, "swap_out", False)
        return self._recorded(lambda: self._swap_out(rows))

    def swap_in(self, seqs: "Handles") -> np.ndarray:
        """Move every host-tier block of ``seqs`` (swapped out, each once) back to the device; the pairs to copy
        first, in order, as for :meth:`swap_out`. All or nothing: PoolExhaustedError when the device is short."""
        rows = self._swap_rows(seqs, "swap_in", True)
        return self._recorded(lambda: self._swap_in(rows))

    def can_swap_out(self, seqs: "Handles") -> bool:
        """Whether :meth:`swap_out` of ``seqs`` would succeed now: the host tier holds the blocks it moves."""
        rows = self._swap_rows(seqs, "swap_out", False)
        return self._out_blocks(rows, self.swapped_sequences).size <= self.allocator.num_host_available

    def can_swap_in(self, seqs: "Handles") -> bool:
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
        """Run ``move()`` as one transaction that records its tier copies; return them as pairs, in order."""
        def recorded():
            move()
            return pairs(self.tx.moves)
        return self.tx.run(recorded, moves=True)

    def _swap_out(self, rows):
        swapped = self.swapped_sequences
        src = self._out_blocks(rows, swapped)
        dst = self.allocator.allocate_host(src.size)
        self._move(np.union1d(rows, swapped), src, dst)
        self.tx.set(self.swapped, rows, True)
        self.tx.attr(self, "_live_cache", None)

    def _swap_in(self, rows):
        src = self._in_blocks(rows)
        dst = self.allocator.allocate(src.size)
        self._move(self.swapped_sequences, src, dst)
        self.tx.set(self.swapped, rows, False)
        self.tx.attr(self, "_live_cache", None)

    def _out_blocks(self, rows, swapped):
        """The device blocks a swap-out of ``rows`` moves (sorted): those they hold whose every holder is in
        ``rows`` or ``swapped``."""
        holders = np.union1d(rows, swapped)
        held = self._held_blocks(holders)
        held = held[held < self.allocator.device_blocks]
        blocks, occurrences = np.unique(held, return_counts=True)
        refs = self.allocator.ref_count[blocks].astype(np.int64)
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
        self.allocator.transfer(src, dst)
        self.tx.moves.append((src, dst))
