"""The step's device metadata: what the kernels read about the batch, uploaded once per step.

The software layer (:mod:`pagedrt.blocks`) decides, on the host, which blocks each
sequence holds and how long it is. This module owns the device side of those
decisions: today the dense block table and the sequence lengths; the slot mapping
and the query offsets of a prefill step, and one call that builds a whole step
from the scheduler's decisions, belong here too.

:class:`StepMetadata` keeps the device copies current from the host's change log
(:meth:`BlockTables.drain_changes <pagedrt.blocks.BlockTables.drain_changes>`): the
changed entries and lengths travel as int64 (index, value) pairs through pinned
staging (two buffers used in turn, so the host never overwrites one that a copy
may still read) in one asynchronous host-to-device copy, and one small kernel
(``cuda_src/tables.cu``) applies them. On the host backend the kernels' NumPy references
read the host arrays themselves and there is nothing to upload.
"""

import numpy as np

from . import source


class StepMetadata:
    """The device block table ``[max_seqs, max_blocks_per_seq]`` and lengths ``[max_seqs]`` (int32).

    ``xp`` is the pool's array module: with NumPy, ``block_table`` and ``seq_lens``
    are the host arrays themselves. Call :meth:`upload` before the kernels read them.
    """

    def __init__(self, tables, xp):
        self.tables = tables
        tables.drain_changes()  # the copies below start from the state now
        if xp is np:
            tables.log_changes = False  # nothing to keep current: the host arrays are what kernels read
            self.block_table, self.seq_lens = tables.table, tables.lens
            self._staging = None
        else:
            self.block_table, self.seq_lens = xp.asarray(tables.table), xp.asarray(tables.lens)
            self._staging = _PinnedPairs(xp)
            self._apply = source.function("tables.cu", "pagedrt::apply_table_updates")

    def upload(self):
        """Bring ``block_table`` and ``seq_lens`` up to date: one copy and one launch, on the current stream."""
        changes = self.tables.drain_changes()
        if changes is None or self._staging is None:
            return
        n_entries, n_lens = changes.entries.size, changes.rows.size
        n = n_entries + n_lens
        if n == 0:  # changes of nothing (an append of no tokens)
            return
        updates = self._staging.send((changes.entries, changes.blocks), (changes.rows, changes.lens))
        self._apply(((n + 255) // 256,), (256,),
                    (self.block_table, self.seq_lens, updates, np.int32(n_entries), np.int32(n_lens)))


class _PinnedPairs:
    """int64 (index, value) pairs to a device buffer: double-buffered pinned staging, one async copy."""

    def __init__(self, cupy):
        self.cupy = cupy
        self._capacity = 0  # pairs each buffer holds
        self._turn = 0

    def _reserve(self, pairs):
        if pairs <= self._capacity:
            return
        import cupyx
        cupy = self.cupy
        cupy.cuda.get_current_stream().synchronize()  # the old buffers may still be read
        self._capacity = max(pairs, 2 * self._capacity, 1024)
        self._staging = [cupyx.empty_pinned(2 * self._capacity, np.int64) for _ in range(2)]
        self._copied = [None, None]
        self._device = cupy.empty(2 * self._capacity, np.int64)

    def send(self, *groups):
        """Copy the ``(indices, values)`` groups, in order, to the device; returns the device buffer.

        The copy is queued on the current stream, so work queued after it there reads
        the pairs; the buffer is overwritten by the next :meth:`send`.
        """
        n = sum(indices.size for indices, _ in groups)
        self._reserve(n)
        turn = self._turn = 1 - self._turn
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()
        pairs = self._staging[turn][:2 * n].reshape(-1, 2)
        start = 0
        for indices, values in groups:
            pairs[start:start + indices.size, 0] = indices
            pairs[start:start + indices.size, 1] = values
            start += indices.size
        cupy = self.cupy
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memcpyAsync(self._device.data.ptr, pairs.ctypes.data, pairs.nbytes,
                                      cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
        self._copied[turn] = stream.record()
        return self._device
