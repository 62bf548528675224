"""The step's device metadata: what the kernels read about the batch, uploaded once per step.

The software layer (:mod:`pagedrt.blocks`) decides, on the host, which blocks each
sequence holds, how long it is and which slots a step's new tokens go to. This module
owns the device side of those decisions.

:class:`StepMetadata` keeps the device block table ``[max_seqs, max_blocks_per_seq]``
and lengths current from the host's change log (:meth:`BlockTables.drain_changes
<pagedrt.blocks.BlockTables.drain_changes>`), and :meth:`StepMetadata.build` turns one
step (:meth:`BlockTables.step <pagedrt.blocks.BlockTables.step>`) into a :class:`Step`:
the slot mapping, the batch's block table and KV lengths, and the query offsets. All of
it travels as int64 through pinned staging (two buffers used in turn, so the host never
overwrites one that a copy may still read) in one asynchronous host-to-device copy; two
small kernels (``cuda_src/tables.cu``) apply the table changes and gather the step's
arrays. Those land in fixed device buffers, sized by ``max_seqs`` and
``max_step_tokens`` and padded past the step, so a CUDA graph captured over them stays
valid from step to step.

On the host backend the kernels' NumPy references read host arrays: the step's are
gathered from the host table, and there is nothing to upload.
"""

from typing import NamedTuple

import numpy as np

from . import source

THREADS = 256


class Step(NamedTuple):
    """One step's metadata, on the pool's device (NumPy arrays on the host backend).

    The batch is the scheduled sequences in the order given, then the arrivals. For batch
    row ``b``, its new tokens are ``slot_mapping[qo_indptr[b]:qo_indptr[b + 1]]``, its
    blocks ``block_tables[b]`` and its KV length after the step ``seq_lens[b]`` (cached
    tokens and new ones: a prefill chunk attends to ``seq_lens[b]`` keys with the last
    ``query_lens[b]`` as its queries). Copy ``copies`` before writing the new tokens
    (``kernels.copy_blocks(cache.planes, step.copies)``, a no-op for none).
    """

    seqs: np.ndarray        # int64 [batch], host: the sequences, in batch order
    query_lens: np.ndarray  # int64 [batch], host: new tokens per sequence
    num_tokens: int
    slot_mapping: object    # int64 [num_tokens]: the new tokens' pool slots (write_kv)
    block_tables: object    # int32 [batch, max_blocks_per_seq]
    seq_lens: object        # int32 [batch]: KV lengths after the step
    qo_indptr: object       # int32 [batch + 1]: each sequence's first query token; the last is num_tokens
    copies: np.ndarray      # int32 [n, 2], host: the copy-on-write (src, dst) block pairs to copy first
    arrived: np.ndarray     # int64, host: the arrivals' handles, in the order given
    cached: np.ndarray      # int64, host: per arrival, its leading tokens found in the prefix cache
    forked: np.ndarray      # int64, host: one child's handle per fork, in the order given


class StepMetadata:
    """The device block table and lengths (int32), and the fixed buffers of each step's arrays.

    ``xp`` is the pool's array module: with NumPy, ``block_table`` and ``seq_lens``
    are the host arrays themselves. Call :meth:`upload` before kernels read them.
    """

    def __init__(self, tables, xp, max_step_tokens):
        self.tables = tables
        self.max_step_tokens = max_step_tokens
        tables.drain_changes()  # the copies below start from the state now
        if xp is np:
            tables.log_changes = False  # nothing to keep current: the host arrays are what kernels read
            self.block_table, self.seq_lens = tables.table, tables.lens
            self._staging = None
            return
        self.block_table, self.seq_lens = xp.asarray(tables.table), xp.asarray(tables.lens)
        self._staging = _PinnedStaging(xp)
        self._apply = source.function("tables.cu", "pagedrt::apply_table_updates")
        self._gather = source.function("tables.cu", "pagedrt::gather_step")
        rows, width = tables.table.shape
        self.buffers = {"slot_mapping": xp.full(max_step_tokens, -1, np.int64),
                        "block_tables": xp.full((rows, width), -1, np.int32),
                        "seq_lens": xp.zeros(rows, np.int32), "qo_indptr": xp.zeros(rows + 1, np.int32)}
        self._views = {}          # (name, size) -> a view of that buffer's first size rows
        self._padded = (0, 0)     # (tokens, batch) written by the last step; the buffers are padded past them
        self._grid = (4 * _multiprocessors(xp),)

    def upload(self):
        """Bring ``block_table`` and ``seq_lens`` up to date: one copy and one launch, on the current stream."""
        if self._staging is None:
            return
        entries, blocks, rows, lens = self._changes()
        n = entries.size + rows.size
        if n:
            self._send_changes(self._staging.send(entries, blocks, rows, lens), entries.size, rows.size)

    def build(self, result):
        """The :class:`Step` of ``result`` (a :class:`~pagedrt.blocks.StepResult`): one copy and two launches
        on the current stream (none on the host backend)."""
        counts = np.broadcast_to(np.asarray(result.counts, np.int64), result.rows.shape)
        qo = np.zeros(result.rows.size + 1, np.int64)
        np.cumsum(counts, out=qo[1:])
        n_tokens, batch = int(qo[-1]), int(result.rows.size)
        common = dict(seqs=result.rows, query_lens=counts, num_tokens=n_tokens, copies=result.copies,
                      arrived=result.arrived, cached=result.cached, forked=result.forked)
        if self._staging is None:
            t = self.tables
            return Step(slot_mapping=result.slots, block_tables=t.table[result.rows], seq_lens=t.lens[result.rows],
                        qo_indptr=qo.astype(np.int32), **common)
        entries, blocks, rows, lens = self._changes()
        device = self._staging.send(entries, blocks, rows, lens, result.slots, result.rows, qo)
        if entries.size or rows.size:
            self._send_changes(device, entries.size, rows.size)
        clear_tokens, clear_batch = max(n_tokens, self._padded[0]), max(batch, self._padded[1])
        b = self.buffers
        step = device[2 * (entries.size + rows.size):]
        self._gather(self._grid, (THREADS,), (
            self.block_table, self.seq_lens, np.int32(self.block_table.shape[1]), step, np.int32(n_tokens),
            np.int32(batch), np.int32(clear_tokens), np.int32(clear_batch),
            b["slot_mapping"], b["block_tables"], b["seq_lens"], b["qo_indptr"]))
        self._padded = (n_tokens, batch)
        return Step(slot_mapping=self._view("slot_mapping", n_tokens), block_tables=self._view("block_tables", batch),
                    seq_lens=self._view("seq_lens", batch), qo_indptr=self._view("qo_indptr", batch + 1), **common)

    def _changes(self):
        changes = self.tables.drain_changes()
        if changes is None:
            return _NONE, _NONE, _NONE, _NONE
        return changes

    def _send_changes(self, device, n_entries, n_lens):
        n = n_entries + n_lens
        self._apply(((n + THREADS - 1) // THREADS,), (THREADS,),
                    (self.block_table, self.seq_lens, device, np.int32(n_entries), np.int32(n_lens)))

    def _view(self, name, size):
        view = self._views.get((name, size))
        if view is None:
            view = self._views[name, size] = self.buffers[name][:size]
        return view


class _PinnedStaging:
    """int64 data to a device buffer: double-buffered pinned staging, one async copy.

    What :meth:`send` takes: (index, value) pairs as two arrays each, for the table
    changes and the length changes, then any plain arrays; pairs are interleaved.
    """

    def __init__(self, cupy):
        self.cupy = cupy
        self._capacity = 0  # int64 words each buffer holds
        self._turn = 0

    def _reserve(self, words):
        if words <= self._capacity:
            return
        import cupyx
        cupy = self.cupy
        cupy.cuda.get_current_stream().synchronize()  # the old buffers may still be read
        self._capacity = max(words, 2 * self._capacity, 4096)
        self._staging = [cupyx.empty_pinned(self._capacity, np.int64) for _ in range(2)]
        self._copied = [None, None]
        self._device = cupy.empty(self._capacity, np.int64)

    def send(self, entries, blocks, rows, lens, *arrays):
        """Copy the pairs, then ``arrays``, to the device; returns the device buffer (overwritten by the next
        :meth:`send`). The copy is queued on the current stream, so work queued after it there reads them."""
        n = 2 * (entries.size + rows.size) + sum(a.size for a in arrays)
        self._reserve(n)
        turn = self._turn = 1 - self._turn
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()
        host = self._staging[turn]
        pairs = host[:2 * (entries.size + rows.size)].reshape(-1, 2)
        pairs[:entries.size, 0], pairs[:entries.size, 1] = entries, blocks
        pairs[entries.size:, 0], pairs[entries.size:, 1] = rows, lens
        start = pairs.size
        for a in arrays:
            host[start:start + a.size] = a
            start += a.size
        cupy = self.cupy
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memcpyAsync(self._device.data.ptr, host.ctypes.data, 8 * n,
                                      cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
        self._copied[turn] = stream.record()
        return self._device


def _multiprocessors(cupy):
    return cupy.cuda.Device().attributes["MultiProcessorCount"]


_NONE = np.empty(0, np.int64)
_NONE.flags.writeable = False
