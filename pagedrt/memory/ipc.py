"""Chunks of another process's pool, mapped here: KV shared between processes (prefill in one, decode in another).

The exporting process calls :meth:`Pool.export_chunks` (a POSIX file descriptor per chunk,
``cuMemExportToShareableHandle``) and :func:`send_chunks` over a Unix socket (``socket.send_fds``:
``SCM_RIGHTS`` makes the descriptors the receiver's too). The other process calls
:func:`receive_chunks`, which maps them one after another into a range of its own
(:class:`ImportedChunks`: ``cuMemImportFromShareableHandle``, ``cuMemAddressReserve``,
``cuMemMap``, ``cuMemSetAccess`` for its current device) and closes the received
descriptors: the imported handles keep the memory. Both processes then read and write the
same bytes; ordering between them is theirs to arrange (synchronize before telling the other).

The imported range is not a pool: it never grows, and kernels do not find it by address.
On the CUDA backend only; a device that is not the chunks' own must have peer access to it.
"""

import os
import socket
import weakref

import numpy as np

from .backends import select_backend
from .records import c_strides, extent
from ..errors import ChunkStateError, PoolClosedError, PoolSizeError, UnmappedRangeError

MAX_CHUNKS = 253  # descriptors in one message: Linux's SCM_MAX_FD
HEADER = b"pagedrt-chunks"


def send_chunks(sock, fds, chunk_bytes):
    """Send exported chunks' descriptors ``fds`` (from :meth:`Pool.export_chunks`, each ``chunk_bytes`` long) over
    the Unix socket ``sock`` in one message, for :func:`receive_chunks`. The descriptors stay the caller's to
    close (the receiver gets its own)."""
    fds = _fd_list(fds)
    _chunk_size(chunk_bytes)
    socket.send_fds(sock, [b"%s %d %d" % (HEADER, chunk_bytes, len(fds))], fds)


def receive_chunks(sock):
    """Receive one :func:`send_chunks` message from the Unix socket ``sock`` and map its chunks here: an
    :class:`ImportedChunks`. The received descriptors are closed, whether the import succeeds or not."""
    message, fds, _, _ = socket.recv_fds(sock, 256, MAX_CHUNKS)
    try:
        words = message.split()
        if len(words) != 3 or words[0] != HEADER or not all(w.isdigit() for w in words[1:]) \
                or int(words[2]) != len(fds):
            raise ChunkStateError(f"the message {message[:80]!r} with {len(fds)} descriptors is not one send_chunks "
                                  f"sent (or it was cut): expected '{HEADER.decode()} CHUNK_BYTES COUNT' and COUNT "
                                  "descriptors")
        return ImportedChunks(fds, int(words[1]))
    finally:
        for fd in fds:
            os.close(fd)


class ImportedChunks:
    """Chunks exported by another process's pool, mapped one after another into a range reserved here.

    ``fds``: their POSIX file descriptors, in order (they stay the caller's to close: the imported handles keep
    the memory); ``chunk_bytes``: the exporting pool's chunk size. Checked first (``PoolSizeError`` for no
    descriptors, too many or a size that is not a positive int; ``ChunkStateError`` for a descriptor that is not
    open here); a driver refusal part-way (a descriptor that is no exported chunk, a size larger than the chunk)
    undoes what was done and raises its ``CudaError``. Needs the CUDA backend (``BackendUnavailableError``).
    """

    def __init__(self, fds, chunk_bytes):
        fds = _fd_list(fds)
        _chunk_size(chunk_bytes)
        backend = select_backend("cuda")
        try:
            if chunk_bytes % backend.page_bytes:
                raise PoolSizeError(f"chunk_bytes={chunk_bytes} is not a whole number of pages "
                                    f"({backend.page_bytes} bytes): it cannot be the exporting pool's chunk size")
            size = len(fds) * chunk_bytes
            base = backend.reserve(size)
        except BaseException:
            backend.close()
            raise
        handles, mapped = [], []
        try:
            for fd in fds:
                handles.append(backend.import_handle(fd))
            for i, handle in enumerate(handles):
                backend.map(base + i * chunk_bytes, chunk_bytes, handle)
                mapped.append(i)
            backend.set_access(base, size)
        except BaseException:
            for i in mapped:
                backend.unmap(base + i * chunk_bytes, chunk_bytes)
            for handle in handles:
                backend.release(handle)
            backend.free(base, size)
            backend.close()
            raise
        self.base, self.size, self.chunk_bytes, self.num_chunks = base, size, chunk_bytes, len(fds)
        self.xp = backend.xp
        self._backend = backend
        self._range = _Range(backend, base, size, [(base + i * chunk_bytes, chunk_bytes, h)
                                                   for i, h in enumerate(handles)])
        self._finalizer = weakref.finalize(self, self._range.free)

    @property
    def closed(self):
        return self._range.retired

    def view(self, offset, shape, dtype, strides=None):
        """A CuPy array over the imported bytes (chunk k at ``k * chunk_bytes``), without a copy."""
        if self.closed:
            raise PoolClosedError("these imported chunks were closed; receive them again")
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in ((shape,) if isinstance(shape, int) else shape))
        strides = c_strides(shape, dtype.itemsize) if strides is None else tuple(strides)
        lo, hi = extent(offset, shape, strides, dtype.itemsize)
        if lo < 0 or hi > self.size:
            raise UnmappedRangeError(f"view bytes [{lo}, {hi}) fall outside the imported chunks [0, {self.size})")
        return self._backend.array(self.base, self.size, offset, shape, dtype, strides, self)

    def synchronize(self):
        self._backend.synchronize()

    def close(self):
        """Unmap and release the imported chunks (the exporter's memory lives on while it holds it). Idempotent. The
        range stays reserved until this object and its last view are gone; a view must not be used after close."""
        self._range.retire()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self.closed else f"{self.num_chunks} chunks of {self.chunk_bytes} bytes"
        return f"ImportedChunks(base={self.base:#x}, {state})"


class _Range:
    """The imported range and chunks, apart from their owner, so that a finalizer can end them."""

    def __init__(self, backend, base, size, chunks):
        self.backend, self.base, self.size, self.chunks = backend, base, size, chunks
        self.retired = False

    def retire(self):
        if not self.retired:
            self.retired = True
            self.backend.synchronize()
            self.backend.retire(self.base, self.size, self.chunks)

    def free(self):
        self.retire()
        self.backend.free(self.base, self.size)
        self.backend.close()


def _fd_list(fds):
    fds = list(fds)
    if not 1 <= len(fds) <= MAX_CHUNKS:
        raise PoolSizeError(f"{len(fds)} descriptors: pass 1 to {MAX_CHUNKS} (one message carries at most "
                            f"{MAX_CHUNKS})")
    for fd in fds:
        if not isinstance(fd, int) or isinstance(fd, bool) or fd < 0:
            raise ChunkStateError(f"{fd!r:.40} is not a file descriptor: pass the ints export_chunks returned")
        try:
            os.fstat(fd)
        except OSError as exc:
            raise ChunkStateError(f"file descriptor {fd} is not open in this process ({exc.strerror}): pass "
                                  "descriptors received here (receive_chunks) or made here") from None
    return fds


def _chunk_size(chunk_bytes):
    if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes <= 0:
        raise PoolSizeError(f"chunk_bytes must be a positive int, got {chunk_bytes!r:.40}")
