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
from typing import TYPE_CHECKING, Any, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from .backends import select_backend
from .records import c_strides, extent
from ..errors import ChunkStateError, PoolClosedError, PoolSizeError, UnmappedRangeError

MAX_CHUNKS = 253  # descriptors in one message: Linux's SCM_MAX_FD
HEADER = b"pagedrt-chunks"

if TYPE_CHECKING:
    from .vmm import CudaBackend


def send_chunks(sock: socket.socket, fds: Iterable[int], chunk_bytes: int) -> None:
    """Send exported chunks' descriptors over a Unix socket in one message, for :func:`receive_chunks`.

    Parameters
    ----------
    sock : socket.socket
        A connected ``AF_UNIX`` socket.
    fds : iterable of int
        1 to 253 open descriptors (:meth:`Pool.export_chunks <pagedrt.memory.Pool.export_chunks>`); they stay
        the caller's to close (the receiver gets its own).
    chunk_bytes : int
        Each chunk's bytes (the exporting pool's chunk size).

    Raises
    ------
    PoolSizeError
        No descriptors, more than one message carries, or a size that is not a positive int.
    ChunkStateError
        A descriptor that is not open here.
    """
    fds = _fd_list(fds)
    _chunk_size(chunk_bytes)
    socket.send_fds(sock, [b"%s %d %d" % (HEADER, chunk_bytes, len(fds))], fds)


def receive_chunks(sock: socket.socket) -> "ImportedChunks":
    """Receive one :func:`send_chunks` message and map its chunks here; the received descriptors are closed,
    whether the import succeeds or not.

    Parameters
    ----------
    sock : socket.socket
        A connected ``AF_UNIX`` socket.

    Returns
    -------
    ImportedChunks
        The chunks, mapped in the order sent.

    Raises
    ------
    ChunkStateError
        A message that is not one ``send_chunks`` sent (or was cut); and what :class:`ImportedChunks` raises.
    """
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

    Parameters
    ----------
    fds : iterable of int
        Their POSIX file descriptors, in order; they stay the caller's to close (the imported handles keep the
        memory).
    chunk_bytes : int
        The exporting pool's chunk size, a whole number of pages.

    Raises
    ------
    PoolSizeError
        No descriptors, too many, or a size that is not a positive int or not whole pages.
    ChunkStateError
        A descriptor that is not open here.
    CudaError
        A driver refusal part-way (a descriptor that is no exported chunk, a size larger than the chunk); what
        was done is undone.
    BackendUnavailableError
        No CUDA backend.
    """

    def __init__(self, fds: Iterable[int], chunk_bytes: int):
        fds = _fd_list(fds)
        _chunk_size(chunk_bytes)
        backend: Any = select_backend("cuda")  # the CUDA backend: it imports handles
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
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._range.retired

    def view(self, offset: int, shape: Union[int, Sequence[int]], dtype: Any,
             strides: Optional[Sequence[int]] = None) -> Any:
        """A CuPy array over the imported bytes (chunk k at ``k * chunk_bytes``), without a copy.

        Parameters
        ----------
        offset : int
            Bytes from the first chunk's start.
        shape : int or int sequence
            The view's shape.
        dtype : numpy.dtype or name
            Its dtype.
        strides : int sequence, optional
            Byte strides; C-contiguous when None.

        Raises
        ------
        PoolClosedError
            After :meth:`close`.
        UnmappedRangeError
            Bytes outside the imported chunks.
        """
        if self.closed:
            raise PoolClosedError("these imported chunks were closed; receive them again")
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in ((shape,) if isinstance(shape, int) else shape))
        strides = c_strides(shape, dtype.itemsize) if strides is None else tuple(strides)
        lo, hi = extent(offset, shape, strides, dtype.itemsize)
        if lo < 0 or hi > self.size:
            raise UnmappedRangeError(f"view bytes [{lo}, {hi}) fall outside the imported chunks [0, {self.size})")
        return self._backend.array(self.base, self.size, offset, shape, dtype, strides, self)

    def synchronize(self) -> None:
        """Wait for the device's work (before telling the other process the bytes are written)."""
        self._backend.synchronize()

    def close(self) -> None:
        """Unmap and release the imported chunks (the exporter's memory lives on while it holds it). Idempotent. The
        range stays reserved until this object and its last view are gone; a view must not be used after close."""
        self._range.retire()

    def __enter__(self) -> "ImportedChunks":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.num_chunks} chunks of {self.chunk_bytes} bytes"
        return f"ImportedChunks(base={self.base:#x}, {state})"


class _Range:
    """The imported range and chunks, apart from their owner, so that a finalizer can end them."""

    def __init__(self, backend: "CudaBackend", base: int, size: int, chunks: List[Tuple[int, int, Any]]):
        self.backend, self.base, self.size, self.chunks = backend, base, size, chunks
        self.retired = False

    def retire(self) -> None:
        if not self.retired:
            self.retired = True
            self.backend.synchronize()
            self.backend.retire(self.base, self.size, self.chunks)

    def free(self) -> None:
        self.retire()
        self.backend.free(self.base, self.size)
        self.backend.close()


def _fd_list(fds: Iterable[int]) -> List[int]:
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


def _chunk_size(chunk_bytes: Any) -> None:
    if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes <= 0:
        raise PoolSizeError(f"chunk_bytes must be a positive int, got {chunk_bytes!r:.40}")
