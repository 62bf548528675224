"""Steps in flight: where a step's sampled tokens are written on the device, and how they reach the host.

The sampler writes a step's tokens into a device buffer; one asynchronous copy brings them into pinned host
memory and an event marks their arrival. So the host schedules and uploads step n+1 while step n runs, and
reads step n's tokens (:meth:`Flight.tokens`) after step n+1 is queued: step n+1's decode rows take their input
ids from step n's device buffer (:attr:`Flight.where`), never from the host. Two buffer pairs are used in turn:
a step's sampler and copy are queued after the step before has read the other pair's device buffer, and the
host reads a pair's pinned buffer before the step after next is queued. On the host backend the buffers are
NumPy arrays and nothing waits.
"""

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np

from ..spec import Array


class TokenBuffers:
    """Two (device buffer, pinned host buffer, event) triples of ``size`` int64 tokens, used in turn.

    Parameters
    ----------
    size : int
        The most tokens a step draws (the cache's rows: every draw becomes a sequence).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._pairs = None
        self._turn = 0

    def next(self, logits: Array) -> Array:
        """The device buffer (int64 [size], on ``logits``' device) the next step's sampler writes."""
        if self._pairs is None:
            self._pairs = [self._pair(logits) for _ in range(2)]
        self._turn = 1 - self._turn
        return self._pairs[self._turn][0]

    def _pair(self, logits):
        if isinstance(logits, np.ndarray):
            return np.zeros(self.size, np.int64), None, None
        import cupy
        import cupyx
        with logits.device:
            return (cupy.zeros(self.size, np.int64), cupyx.empty_pinned(self.size, np.int64),
                    cupy.cuda.Event(disable_timing=True))

    def send(self, count: int) -> Tuple[np.ndarray, Optional[Any]]:
        """Queue the copy of the current buffer's first ``count`` tokens to the host, on the current stream;
        returns (host array, event), the event None on the host backend."""
        device, host, event = self._pairs[self._turn]
        if host is None:
            return device, None
        import cupy
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memcpyAsync(host.ctypes.data, device.data.ptr, 8 * count,
                                      cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        event.record(stream)
        return host, event


@dataclass
class Flight:
    """A step whose tokens the host has not read yet.

    ``device``: the buffer its ``count`` draws were written to (int64 [size], on the device); ``host`` and
    ``event``: where they arrive and when. Draw ``index[i]`` is the next token of sequence ``handles[i]``
    (decoding rows and prompts that ended), which was in its ``epoch[i]`` then; ``forks``: (request, first draw,
    n) per prompt that ended, its draws after the first being its children's first tokens. ``where``: int64
    [rows], the draw of each handle's next token, -1 for none. ``decoding``: whether every row decoded.
    """

    device: object
    host: np.ndarray
    event: object
    count: int
    handles: np.ndarray
    index: np.ndarray
    epoch: np.ndarray
    forks: list
    where: np.ndarray
    decoding: bool

    def tokens(self) -> np.ndarray:
        """The draws, int64 [count], a host copy: waits for the step to end."""
        if self.event is not None:
            self.event.synchronize()
        return self.host[:self.count].copy()
