"""Per-sequence block tables (host bookkeeping): rows, lengths, token ids; append with copy-on-write, fork, free.

:class:`BlockTables` keeps, per sequence, its length and its row of the dense block table (logical block -> block
id); a handle is its row. Changed entries and lengths go into a log that :mod:`pagedrt.step` drains. All per-step
work is vectorised NumPy (blocks are hashed one by one only when they fill or are looked up).

Appends may carry token ids, or :meth:`BlockTables.name` give them after: a block whose ids are all known is named
when it fills (:mod:`pagedrt.blocks.prefix`). Copy-on-write lives in :meth:`BlockTables._shared_tails`, swapping in
:class:`~pagedrt.blocks.tiers.SwapTables`, a whole step in :mod:`pagedrt.blocks.steps`. Every public call is one
transaction (:mod:`pagedrt.blocks.transaction`): all or nothing, whatever it raises.
"""

from functools import partial
from typing import TYPE_CHECKING, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from ..errors import (DuplicateSequenceError, InvalidTokenCountError, SequenceFullError, SwapStateError,
                      TooManySequencesError, UnknownSequenceError)
from . import prefix
from . import steps
from .tiers import SwapTables
from .util import NO_COPIES, NO_ROWS, ceil_div, joined, ranks

if TYPE_CHECKING:  # pagedrt.protocols imports pagedrt.step, which imports this package
    from ..protocols import Counts, Handles
    from .allocator import BlockAllocator
    from .steps import StepResult


class BlockTables(SwapTables):
    """Sequences: a length and a block-table row each, with a log of what changed.

    ``seq`` handles are rows of the table; a freed handle may be given to a later sequence. Every public call
    that changes something is one transaction: a named error (:mod:`pagedrt.errors`) changes nothing.

    Parameters
    ----------
    allocator : BlockAllocator
        Where blocks come from; its transaction is the tables' too.
    block_size : int
        Tokens a block holds (a power of two).
    max_seqs : int
        Rows: the most live sequences.
    max_blocks_per_seq : int
        Columns: the most blocks one sequence holds.

    Attributes
    ----------
    table : numpy.ndarray
        int32 ``[max_seqs, max_blocks_per_seq]``: each row's block ids in logical order, -1 past its last.
    lens : numpy.ndarray
        int32 ``[max_seqs]``: each row's tokens (0 for a row not live).
    live, swapped : numpy.ndarray
        bool ``[max_seqs]``: the rows that are live sequences, and those swapped out to the host tier.
    """

    def __init__(self, allocator: "BlockAllocator", block_size: int, max_seqs: int, max_blocks_per_seq: int):
        self.allocator = allocator
        self.tx = allocator.tx  # one journal for the allocator, the index and the tables
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
        self._changed_entries: List[Tuple[np.ndarray, np.ndarray]] = []  # (rows, cols) changed since the drain
        self._changed_lens: List[np.ndarray] = []  # rows whose length changed since the last drain

    # --- queries ------------------------------------------------------------------------

    @property
    def sequences(self) -> np.ndarray:
        """int64 ``[n]``: the live sequences' handles, in handle order."""
        return np.flatnonzero(self.live)

    @property
    def swapped_sequences(self) -> np.ndarray:
        """int64 ``[n]``: the swapped-out sequences' handles, in handle order."""
        return np.flatnonzero(self.swapped)

    def blocks(self, seq: int) -> np.ndarray:
        """The block ids of live sequence ``seq`` in logical order: int32 ``[ceil(length / block_size)]``, a copy."""
        row = self.row(seq)
        return self.table[row, :ceil_div(int(self.lens[row]), self.block_size)].copy()

    def row(self, seq: "Handles") -> int:
        """One live sequence's handle as an int (or a list of one); else UnknownSequenceError."""
        rows = self.rows(seq)
        if rows.size != 1:
            raise UnknownSequenceError(f"one sequence handle expected, got {rows.size}")
        return int(rows[0])

    def rows(self, seqs: "Handles") -> np.ndarray:
        """``seqs`` (one handle or many), each checked to be a live sequence.

        Returns
        -------
        numpy.ndarray
            int64 ``[n]`` in the order given; an empty list gives no rows (a call over none does nothing).

        Raises
        ------
        UnknownSequenceError
            Handles that are not ints, not flat, or not live sequences.
        """
        try:
            rows = np.asarray(seqs)
        except (ValueError, TypeError):  # ragged nesting, or what NumPy cannot hold
            raise UnknownSequenceError(f"sequence handles must be ints, got {seqs!r:.80}") from None
        if rows.ndim > 1:
            raise UnknownSequenceError(f"sequence handles must be one int or a flat list, got shape {rows.shape}")
        if rows.dtype.kind not in "iu":
            if rows.size == 0:
                return NO_ROWS
            raise UnknownSequenceError(f"sequence handles must be ints, got {rows.dtype}")
        if rows.ndim == 0:
            rows = rows.reshape(1)
        if rows.size and (rows.astype(np.uint64).max() >= self.max_seqs or not self.live[rows].all()):
            bad = (rows < 0) | (rows >= self.max_seqs)
            bad[~bad] = ~self.live[rows[~bad]]
            raise UnknownSequenceError(f"sequence {rows[bad][0]} does not exist (never added, or freed)")
        return rows.astype(np.int64, copy=False)

    # --- changes ------------------------------------------------------------------------

    def add(self, prompt: Optional[Sequence[int]] = None) -> int:
        """A new sequence; returns its handle (TooManySequencesError when every row is live).

        With ``prompt`` (token ids), the sequence starts holding the longest chain of
        cached blocks equal to the prompt's leading full blocks, but never the whole
        prompt (at least its last token is left to compute), and its length is the
        tokens those blocks hold. Without, it starts empty. The chain stops at the first
        block offloaded to the host tier: only :meth:`step` brings such blocks back.
        """
        if prompt is not None:
            prompt = prefix.check_token_ids(prompt, None, "prefix")
        return self.tx.run(lambda: self._add(prompt))

    def _add(self, prompt):
        row = self._add_row()
        if prompt is not None:
            self._start(row, prompt, self.match(prompt))
        return row

    def match(self, prompt: np.ndarray, reload: bool = False) -> Tuple[np.ndarray, int]:
        """The cached blocks a sequence for ``prompt`` would start with; changes nothing.

        The longest chain of cached blocks equal to the prompt's leading full blocks,
        never the whole prompt (its last token is left to compute).

        Parameters
        ----------
        prompt : numpy.ndarray
            The prompt's token ids, checked (``prefix.check_token_ids``): int32 ``[n]``.
        reload : bool
            Whether offloaded (host-tier) blocks count too; else the chain stops at the first.

        Returns
        -------
        blocks : numpy.ndarray
            The chain's block ids, in logical order.
        name : int
            The name of its last block (``prefix.ROOT`` for none).
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
        tx, stats = self.tx, self.allocator.stats
        tx.count(stats, "lookups", 1)
        tx.count(stats, "queried_tokens", prompt.size)
        tx.count(stats, "hit_blocks", blocks.size)
        tx.count(stats, "hit_tokens", blocks.size * self.block_size)
        if blocks.size:
            if claim:
                self.allocator.claim_cached(blocks)
            self._set_entries(np.full(blocks.size, row), np.arange(blocks.size), blocks)
            self._set_lens(np.array([row]), blocks.size * self.block_size)
            tx.set(self.known, row, blocks.size * self.block_size)
            self._set_chain(row, name)

    def _set_chain(self, row, name):
        self.tx.undo(partial(self.chain.__setitem__, row, self.chain[row]))
        self.chain[row] = name

    def _add_row(self):
        if not self._free_rows:
            raise TooManySequencesError(
                f"all {self.max_seqs} block-table rows hold live sequences: free one, or make the cache "
                f"with a larger max_seqs")
        free_rows, tx = self._free_rows, self.tx
        row = free_rows[-1]
        tx.undo(partial(_restore_tail, free_rows, len(free_rows), [row]))
        free_rows.pop()
        tx.set(self.live, row, True)
        tx.attr(self, "_live_cache", None)
        tx.set(self.known, row, 0)
        self._set_chain(row, prefix.ROOT)
        return row

    def append(self, seqs: Optional["Handles"], counts: "Counts",
               token_ids: Optional[Sequence[int]] = None) -> Tuple[np.ndarray, np.ndarray]:
        """Make room for ``counts`` more tokens in each of ``seqs`` (None: every live sequence, in handle order;
        ``counts``: one int for all or one each; one token each, the decode step, has a fast path).

        Returns ``(slot_mapping, copies)``: int64 pool slots (block_id * block_size + slot) of the new tokens,
        sequence by sequence, and int32 ``[n, 2]`` (src, dst) block pairs to copy before writing, where a shared,
        partly filled last block was replaced by a private copy (copy-on-write). All or nothing. ``token_ids``:
        the new tokens' ids (flat, ``sum(counts)``, each in [0, 2**31)); blocks they fill are named and cached
        (:mod:`pagedrt.blocks.prefix`). Ids not given now can be given after (:meth:`name`); a block holding a
        token whose id never came is not cached, nor any after it.
        """
        rows, step = self._request(seqs, counts)
        return self.tx.run(lambda: self._append_rows(rows, step, token_ids))

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

    def name(self, seqs: "Handles", counts: "Counts", token_ids: Sequence[int]) -> None:
        """The ids of the last ``counts`` tokens appended to ``seqs`` without ids, learnt after the step: the blocks
        they fill are named as :meth:`append`'s ids would have (none past an id never given). Bad arguments raise
        as :meth:`append`'s, changing nothing."""
        rows, step = self._request(seqs, counts)
        step = np.broadcast_to(step, rows.shape).astype(np.int64)
        old = self.lens[rows].astype(np.int64) - step
        if (old < 0).any():
            raise InvalidTokenCountError(f"{int(step[old < 0][0])} tokens named but the sequence holds fewer")
        ids = prefix.check_token_ids(token_ids, int(step.sum()), "token_ids")
        if ids.size:
            self.tx.run(lambda: self._record_tokens(rows, old, step, ids))

    def step(self, seqs: Optional["Handles"], counts: "Counts", token_ids: Optional[Sequence[int]],
             arrivals: Optional[Sequence[Sequence[int]]], arrival_tokens: Optional["Counts"],
             forks: Optional["Handles"], frees: Optional["Handles"], max_tokens: int,
             swap_out: Optional["Handles"] = (), swap_in: Optional["Handles"] = ()) -> "StepResult":
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

        ``None`` for any of the lists means none; ``frees`` (like ``forks``, ``swap_out``
        and ``swap_in``) may be one handle. The arguments are checked first; the operations
        then run as one transaction (:mod:`pagedrt.blocks.steps`), so an error, wherever it
        is raised, leaves the tables and the allocator exactly as they were. Returns a
        :class:`~pagedrt.blocks.steps.StepResult`; the batch is ``seqs`` in order, then the
        arrivals; its ``swaps`` are the tier copies to make first, in order.
        """
        return steps.run(self, seqs, counts, token_ids, arrivals, arrival_tokens, forks, frees, max_tokens,
                         swap_out, swap_in)

    def _held_blocks(self, rows):
        """Every block held by ``rows`` (a row may repeat), as int64."""
        nb = ceil_div(self.lens[rows].astype(np.int64), self.block_size)
        return self.table[np.repeat(rows, nb), ranks(nb)].astype(np.int64)

    def _append(self, rows, step):
        old, old_nb, new_nb = self._block_counts(rows, step)
        self._check_capacity(rows, old + step, new_nb)
        tail_rows, tail_cols, tail_src = self._shared_tails(rows, old, old_nb, step)
        need = new_nb - old_nb
        ids = self.allocator.allocate(int(need.sum()) + tail_src.size)
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
        self.tx.set(self.known, rows, old + counts)
        shift, mask = self._shift, self.block_size - 1
        within = old & mask
        if (counts == 1).all():  # a decode step's token a row: into the tail, whose block it may fill
            self.tx.set(self.tail, (rows, within), token_ids[starts])
            block_rows = rows[within == mask]
            blocks, filled = self.table[block_rows, old[within == mask] >> shift], self.tail[block_rows]
        else:
            run = within + counts  # the row's partly filled block's ids, then the new ones
            run_start = np.cumsum(run) - run
            r = ranks(run)
            from_tail = r < np.repeat(within, run)
            at = np.where(from_tail, 0, np.repeat(starts - within, run) + r)
            ids = np.where(from_tail, self.tail[np.repeat(rows, run), r & mask], token_ids[at])
            full, rest = run >> shift, run & mask
            self.tx.set(self.tail, (np.repeat(rows, rest), ranks(rest)),
                        ids[np.repeat(run_start + (full << shift), rest) + ranks(rest)])
            k = ranks(full)
            block_rows = np.repeat(rows, full)
            blocks = self.table[block_rows, np.repeat(old >> shift, full) + k]
            filled = ids[(np.repeat(run_start, full) + (k << shift))[:, None] + np.arange(self.block_size)]
        index, chain, device = self.allocator.index, self.chain, self.allocator.device_blocks
        for row, block, tokens in zip(block_rows.tolist(), blocks.tolist(), filled):
            self._set_chain(row, prefix.chain_hash(chain[row], tokens))
            if block < device:  # a swapped-out sequence's host-tier block stays unnamed: only offloads name those
                index.register(block, chain[row], tokens)

    def can_append(self, seqs: Optional["Handles"], counts: "Counts") -> bool:
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
        if self.allocator.num_shared and self._shared_tails(rows, old, cols + (within != 0), 1)[0].size:
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
        return slots, NO_COPIES

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
            return NO_ROWS, NO_ROWS, NO_ROWS
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
            return NO_COPIES
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
        """Table entries ``(rows, cols)`` set to ``block_ids``, journaled and logged; a rollback logs them again
        (the drain reads current values, so the device's copies follow the undo too)."""
        if self.log_changes:
            self.tx.undo(partial(self._changed_entries.append, (rows, cols)))
            self._changed_entries.append((rows, cols))
        self.tx.set(self.table, (rows, cols), block_ids)

    def _set_lens(self, rows, lens):
        if self.log_changes:
            self.tx.undo(partial(self._changed_lens.append, rows))
            self._changed_lens.append(rows)
        self.tx.set(self.lens, rows, lens)

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

    def fork(self, seq: int) -> int:
        """A new sequence sharing every block of ``seq`` (parallel sampling, beam search); returns its handle.
        SwapStateError for a swapped-out ``seq``, TooManySequencesError when every row is live."""
        parent = self.row(seq)
        if self.swapped[parent]:
            raise SwapStateError(f"sequence {parent} is forked but swapped out: swap it in first")
        return self.tx.run(lambda: self._fork(parent))

    def _fork(self, parent):
        blocks = self.table[parent, :ceil_div(int(self.lens[parent]), self.block_size)].copy()
        child = self._add_row()
        tx = self.tx
        tx.set(self.known, child, self.known[parent])
        self._set_chain(child, self.chain[parent])
        tx.set(self.tail, child, self.tail[parent])
        self.allocator.share(blocks)
        self._set_entries(np.full(blocks.size, child), np.arange(blocks.size), blocks)
        self._set_lens(np.array([child]), self.lens[parent])
        return child

    def free(self, seqs: "Handles") -> None:
        """Free sequences, each given once: drop their references to their blocks; their handles may be reused."""
        rows = np.sort(self._distinct(self.rows(seqs), "free", "free each sequence once"))
        self.tx.run(lambda: self._free(rows))

    def _free(self, rows):
        """Free ``rows`` (sorted, live, each once)."""
        nb = ceil_div(self.lens[rows].astype(np.int64), self.block_size)
        held_rows, held_cols = np.repeat(rows, nb), ranks(nb)
        self.allocator.free(self.table[held_rows, held_cols])
        self._set_entries(held_rows, held_cols, -1)
        self._set_lens(rows, 0)
        tx, free_rows = self.tx, self._free_rows
        tx.set(self.live, rows, False)
        tx.set(self.swapped, rows, False)
        tx.attr(self, "_live_cache", None)
        tx.undo(partial(_restore_tail, free_rows, len(free_rows) + 1, []))
        free_rows.extend(int(r) for r in rows[::-1])

    # --- the change log -------------------------------------------------------------------

    def drain_changes(self) -> Optional["Changes"]:
        """What changed since the last drain, and an empty log: a :class:`Changes`, or None if nothing did.

        The step module drains it to bring the device's copies of the table and the
        lengths up to date; nothing else reads the log. Inside a transaction that fails
        the drained entries are logged again (the upload may not have happened).
        """
        if not (self._changed_entries or self._changed_lens):
            return None
        width, logged = self.max_blocks_per_seq, self._changed_entries
        if len(logged) == 1:
            entries = logged[0][0] * width + logged[0][1]
        else:
            entries = np.concatenate([r * width + c for r, c in logged]) if logged else NO_ROWS
        rows = joined(self._changed_lens)
        self.tx.undo(partial(self._relog, entries, rows))
        self._changed_entries.clear()
        self._changed_lens.clear()
        return Changes(entries, self.table.ravel()[entries], rows, self.lens[rows])

    def _relog(self, entries, rows):
        """Log flat table ``entries`` and length ``rows`` as changed again."""
        self._changed_entries.append((entries // self.max_blocks_per_seq, entries % self.max_blocks_per_seq))
        self._changed_lens.append(rows)


class Changes(NamedTuple):
    """Table entries and lengths changed since the last drain, with their values now.

    An entry or row may appear more than once, always with the same value, so the
    changes may be applied in any order.
    """

    entries: np.ndarray  # int64 [n] flat indices into the table: row * max_blocks_per_seq + logical block
    blocks: np.ndarray   # int32 [n] block ids now held there (-1: none)
    rows: np.ndarray     # int64 [m] rows whose length changed
    lens: np.ndarray     # int32 [m] their lengths now


def _restore_tail(items, n, last):
    """``items`` cut to its first ``n - 1`` items and then ``last`` (a list of at most one) appended: undoes a pop
    (``n`` the length before it) or an extend (``n`` one more than the length before, ``last`` empty)."""
    del items[n - 1:]
    items.extend(last)
