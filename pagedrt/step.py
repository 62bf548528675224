"""The step's device metadata: what the kernels read about the batch, uploaded once per step.

The software layer (:mod:`pagedrt.blocks`) decides, on the host, which blocks each
sequence holds, how long it is and which slots a step's new tokens go to. This module
owns the device side of those decisions.

:class:`StepMetadata` keeps the device block table ``[max_seqs, max_blocks_per_seq]``
and lengths current from the host's change log (:meth:`BlockTables.drain_changes
<pagedrt.blocks.BlockTables.drain_changes>`), and :meth:`StepMetadata.build` turns one
step (:meth:`BlockTables.step <pagedrt.blocks.BlockTables.step>`) into a :class:`Step`:
the slot mapping, the batch's block table and KV lengths, and the query offsets. All of
it travels as int64 through pinned staging (:class:`~pagedrt.staging.PinnedStaging`: two
buffers used in turn, so the host never overwrites one that a copy may still read) in
one asynchronous host-to-device copy, and one small kernel (``cuda_src/tables.cu``'s
``apply_step``) applies it. The step's arrays are fixed device buffers, sized by
``max_seqs`` and ``max_step_tokens`` and padded past the step, so a CUDA graph captured
over them stays valid from step to step. While the batch is the last step's (decode
steps), the kernel writes each changed table entry and length into the step's arrays
too; when the batch changes, a second launch (``gather_step``) gathers its rows afresh.

On the host backend the kernels' NumPy references read host arrays: the step's are
gathered from the host table, and there is nothing to upload.
"""

from typing import Any, Dict, NamedTuple, Tuple

import numpy as np

from . import source
from .blocks import BlockTables, StepResult
from .spec import Array
from .staging import PinnedStaging

THREADS = 256


class Step(NamedTuple):
    """One step's metadata, on the pool's device (NumPy arrays on the host backend).

    The batch is the scheduled sequences in the order given, then the arrivals. For batch
    row ``b``, its new tokens are ``slot_mapping[qo_indptr[b]:qo_indptr[b + 1]]``, its
    blocks ``block_tables[b]`` and its KV length after the step ``seq_lens[b]`` (cached
    tokens and new ones: a prefill chunk attends to ``seq_lens[b]`` keys with the last
    ``query_lens[b]`` as its queries). The arrays hold until the next step rewrites them
    in place (fixed buffers; on the host backend, possibly views of the host table). Copy
    ``swaps`` first, in order (``kernels.swap_blocks(cache.planes, step.swaps)``: swap-outs,
    swap-ins, offloads and reloads between the tiers), then ``copies``
    (``kernels.copy_blocks(cache.planes, step.copies)``), then write the new tokens; each is a
    no-op for none.

    Attributes
    ----------
    seqs : numpy.ndarray
        Host int64 ``[batch]``: the sequences, in batch order.
    query_lens : numpy.ndarray
        Host int64 ``[batch]``: new tokens per sequence.
    num_tokens : int
        New tokens of the whole step: ``query_lens.sum()``.
    slot_mapping : Array
        int64 ``[num_tokens]``: the new tokens' pool slots (``kernels.write_kv``).
    block_tables : Array
        int32 ``[batch, max_blocks_per_seq]``: each batch row's blocks, -1 past its last.
    seq_lens : Array
        int32 ``[batch]``: KV lengths after the step.
    qo_indptr : Array
        int32 ``[batch + 1]``: each sequence's first query token; the last is ``num_tokens``.
    copies : numpy.ndarray
        Host int32 ``[n, 2]``: the copy-on-write (src, dst) block pairs to copy first.
    arrived : numpy.ndarray
        Host int64 ``[arrivals]``: the arrivals' handles, in the order given.
    cached : numpy.ndarray
        Host int64 ``[arrivals]``: per arrival, its leading tokens found in the prefix cache.
    forked : numpy.ndarray
        Host int64 ``[forks]``: one child's handle per fork, in the order given.
    swaps : numpy.ndarray
        Host int32 ``[n, 2]``: the (src, dst) tier copies to make first, in order.
    """

    seqs: np.ndarray
    query_lens: np.ndarray
    num_tokens: int
    slot_mapping: Array
    block_tables: Array
    seq_lens: Array
    qo_indptr: Array
    copies: np.ndarray
    arrived: np.ndarray
    cached: np.ndarray
    forked: np.ndarray
    swaps: np.ndarray


class StepMetadata:
    """The device block table and lengths, and the fixed buffers of each step's arrays.

    Parameters
    ----------
    tables : BlockTables
        The host tables to keep current on the device (their change log is drained from now on).
    xp : module
        The pool's array module: with ``numpy``, ``block_table`` and ``seq_lens`` are the host arrays themselves
        and nothing is uploaded.
    max_step_tokens : int
        The most new tokens one step takes: the slot buffer's size.

    Attributes
    ----------
    block_table : Array
        int32 ``[max_seqs, max_blocks_per_seq]``; current after :meth:`upload` or :meth:`build`.
    seq_lens : Array
        int32 ``[max_seqs]``; as ``block_table``.
    max_step_tokens : int
        As given.
    """

    def __init__(self, tables: BlockTables, xp: Any, max_step_tokens: int):
        self.tables = tables
        self.max_step_tokens = max_step_tokens
        # (batch, tokens each) -> (query lengths, query offsets), read-only
        self._queries: Dict[Tuple[int, int], Tuple[np.ndarray, np.ndarray]] = {}
        tables.drain_changes()  # the copies below start from the state now
        if xp is np:
            tables.log_changes = False  # nothing to keep current: the host arrays are what kernels read
            self.block_table, self.seq_lens = tables.table, tables.lens
            self._staging = None
            return
        self.block_table, self.seq_lens = xp.asarray(tables.table), xp.asarray(tables.lens)
        self._staging = PinnedStaging(xp)
        self._apply = source.function("tables.cu", "pagedrt::apply_step")
        self._gather = source.function("tables.cu", "pagedrt::gather_step")
        rows, self._width = tables.table.shape
        self.buffers = {"slot_mapping": xp.full(max_step_tokens, -1, np.int64),
                        "block_tables": xp.full((rows, self._width), -1, np.int32),
                        "seq_lens": xp.zeros(rows, np.int32), "qo_indptr": xp.zeros(rows + 1, np.int32)}
        self._pos = xp.full(rows, -1, np.int32)  # each sequence's row in the step's arrays, -1 if none
        self._batch = _NONE      # the last step's sequences, in batch order
        self._padded = (0, 0)    # (tokens, batch) of the last step; slots and rows are padded past them
        self._views: Dict[Tuple[str, int], Array] = {}  # (name, size) -> a view of that buffer's first size rows
        self._grid = (4 * _multiprocessors(xp),)
        # The uploads and fills above are queued on this stream; steps may run on another that does not wait for it.
        xp.cuda.get_current_stream().synchronize()

    def upload(self) -> None:
        """Bring ``block_table`` and ``seq_lens`` up to date (and the last step's arrays with them): one copy and
        one launch, on the current stream."""
        if self._staging is None:
            return
        changes = self._changes()
        if changes[0].size or changes[2].size:
            self._launch(self._staging.send(_header(changes, 0, 0, 0, 0, self._width, 0, 0), *changes))

    def build(self, result: StepResult) -> Step:
        """One step's device metadata: one copy and one launch on the current stream, two when the batch is not
        the last step's (none on the host backend).

        Parameters
        ----------
        result : StepResult
            The software layer's step (:meth:`BlockTables.step <pagedrt.blocks.BlockTables.step>`).

        Returns
        -------
        Step
            Its arrays views of the fixed buffers (on the host backend, of the host table or gathered copies),
            valid until the next step rewrites them.
        """
        rows, counts = result.rows, result.counts
        query_lens, qo = self._query_offsets(rows.size, counts)
        n_tokens, batch = int(qo[-1]), int(rows.size)
        common = dict(seqs=rows, query_lens=query_lens, num_tokens=n_tokens, copies=result.copies,
                      arrived=result.arrived, cached=result.cached, forked=result.forked, swaps=result.swaps)
        if self._staging is None:
            t = self.tables
            first = int(rows[0]) if batch else 0
            if batch and int(rows[-1]) - first + 1 == batch and (np.diff(rows) == 1).all():  # consecutive: views
                table, lens = t.table[first:first + batch], t.lens[first:first + batch]
            else:
                table, lens = t.table[rows], t.lens[rows]
            return Step(slot_mapping=result.slots, block_tables=table, seq_lens=lens, qo_indptr=qo.astype(np.int32),
                        **common)
        changes = self._changes()
        gather = not (rows is self._batch or (rows.size == self._batch.size and np.array_equal(rows, self._batch)))
        clear_tokens, clear_batch = max(n_tokens, self._padded[0]), max(batch, self._padded[1])
        head = _header(changes, n_tokens, batch, clear_tokens, clear_batch, self._width, gather, self._pos.size + 1)
        if gather:
            pos = np.full(self._pos.size, -1, np.int64)
            pos[rows] = np.arange(batch)
            upload = self._staging.send(head, *changes, result.slots, qo, rows, pos)
        else:
            upload = self._staging.send(head, *changes, result.slots, qo)
        self._launch(upload)
        if gather:
            b = self.buffers
            self._gather(self._grid, (THREADS,), (self.block_table, self.seq_lens, upload, np.int32(self._pos.size),
                                                  self._pos, b["block_tables"], b["seq_lens"]))
        self._batch, self._padded = rows, (n_tokens, batch)
        return Step(slot_mapping=self._view("slot_mapping", n_tokens), block_tables=self._view("block_tables", batch),
                    seq_lens=self._view("seq_lens", batch), qo_indptr=self._view("qo_indptr", batch + 1), **common)

    def _query_offsets(self, batch, counts):
        """(query lengths, query offsets [batch + 1]) as int64; kept for one count for every row."""
        if not isinstance(counts, int):
            qo = np.zeros(batch + 1, np.int64)
            np.cumsum(counts, out=qo[1:])
            return counts, qo
        key = (batch, counts)
        found = self._queries.get(key)
        if found is None:
            found = (np.full(batch, counts, np.int64), np.arange(batch + 1, dtype=np.int64) * counts)
            for a in found:
                a.flags.writeable = False
            if len(self._queries) > 64:
                self._queries.clear()
            self._queries[key] = found
        return found

    def _changes(self):
        changes = self.tables.drain_changes()
        return (_NONE, _NONE, _NONE, _NONE) if changes is None else changes

    def _launch(self, upload):
        b = self.buffers
        self._apply(self._grid, (THREADS,), (self.block_table, self.seq_lens, upload, self._pos, b["block_tables"],
                                             b["seq_lens"], b["slot_mapping"], b["qo_indptr"]))

    def _view(self, name, size):
        view = self._views.get((name, size))
        if view is None:
            view = self._views[name, size] = self.buffers[name][:size]
        return view


def _header(changes, n_tokens, batch, clear_tokens, clear_batch, width, gather, qo_end):
    """The upload's header (cuda_src/tables.cu): the sizes its kernels read."""
    return np.array([changes[0].size, changes[2].size, n_tokens, batch, clear_tokens, clear_batch, width, gather,
                     qo_end], np.int64)


def _multiprocessors(cupy):
    return cupy.cuda.Device().attributes["MultiProcessorCount"]


_NONE = np.empty(0, np.int64)
_NONE.flags.writeable = False
