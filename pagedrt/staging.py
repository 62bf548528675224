"""int64 arrays to the device through pinned host memory, without waiting for the stream.

A copy from pageable host memory makes the host wait until the stream has run everything
queued before it; from pinned memory the copy is queued and the host goes on. Two pinned
buffers are used in turn, and one is refilled only after its last copy has left it, so the
host never overwrites bytes a queued copy still has to read. The step's metadata
(:mod:`pagedrt.step`) and the block transfers' pairs (:mod:`pagedrt.kernels.copy`) travel so.
"""

from typing import Any, Optional

import numpy as np

from .spec import Array


class PinnedStaging:
    """int64 arrays to one device array, one after another: double-buffered pinned staging, one async copy.

    Parameters
    ----------
    cupy : module
        The ``cupy`` module (passed in: this layer imports it only where a device is).
    """

    def __init__(self, cupy: Any):
        self.cupy = cupy
        self._capacity = 0  # int64 words each buffer holds
        self._turn = 0

    def _reserve(self, words: int) -> None:
        if words <= self._capacity:
            return
        import cupyx
        cupy = self.cupy
        cupy.cuda.get_current_stream().synchronize()  # the old buffers may still be read
        self._capacity = max(words, 2 * self._capacity, 4096)
        self._staging = [cupyx.empty_pinned(self._capacity, np.int64) for _ in range(2)]
        self._copied = [cupy.cuda.Event(disable_timing=True) for _ in range(2)]  # recorded after each copy
        self._pending = [False, False]
        self._device = cupy.empty(self._capacity, np.int64)

    def send(self, *arrays: np.ndarray, out: Optional[Array] = None) -> Array:
        """Copy ``arrays`` to the device, in order, in one copy queued on the current stream (work queued after
        it there reads them).

        Parameters
        ----------
        *arrays : numpy.ndarray, int64
            Host arrays of any shape, sent flattened, one after another.
        out : cupy.ndarray, int64, optional
            Contiguous, at least their total size; None: a device buffer this staging keeps, overwritten by the
            next :meth:`send`.

        Returns
        -------
        cupy.ndarray
            ``out``, or the kept buffer (its first ``sum(a.size)`` words are the arrays').
        """
        n = sum(a.size for a in arrays)
        self._reserve(n)
        turn = self._turn = 1 - self._turn
        if self._pending[turn]:
            self._copied[turn].synchronize()
        host = self._staging[turn]
        start = 0
        for a in arrays:
            host[start:start + a.size] = a.ravel()
            start += a.size
        cupy = self.cupy
        stream = cupy.cuda.get_current_stream()
        device = self._device if out is None else out
        cupy.cuda.runtime.memcpyAsync(device.data.ptr, host.ctypes.data, 8 * n, cupy.cuda.runtime.memcpyHostToDevice,
                                      stream.ptr)
        self._copied[turn].record(stream)
        self._pending[turn] = True
        return device
