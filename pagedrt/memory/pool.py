"""The pool: one reserved virtual range, with physical chunks mapped into it on demand.

The range is cut into ``max_bytes // chunk_bytes`` chunk places. :meth:`Pool.grow`
maps new chunks at the frontier, :meth:`Pool.map` maps given places (never mapped
or released), :meth:`Pool.release` unmaps a chunk and frees its physical memory,
leaving a hole. The range never moves, so every pointer into it stays valid.

The bookkeeping, argument checks and rollback live here; a backend (``vmm`` for
CUDA, ``host`` for the operating system's virtual memory) supplies the primitive
calls. Every operation either completes or leaves the pool exactly as it was.
"""

import weakref
from dataclasses import asdict, dataclass

import numpy as np

from .backends import select_backend
from ..errors import (ChunkStateError, PoolClosedError, PoolSizeError, ReservationExceededError,
                      UnknownChunkError, UnmappedRangeError)

MAPPED, RELEASED = "mapped", "released"


@dataclass(frozen=True)
class ChunkRecord:
    """One row of the chunk table, as :meth:`Pool.mappings` returns it."""

    chunk: int          # chunk index: its place in the range, offset // chunk_bytes
    va_start: int       # first virtual address
    va_end: int         # one past the last virtual address
    offset: int         # bytes from the pool's base
    size: int           # bytes
    handle: int | None  # CUDA allocation handle, or the host memfd's inode; None once released
    state: str          # "mapped" or "released"
    access: str         # "rw" while mapped, "none" once released

    def as_dict(self):
        return asdict(self)


def _positive_multiple(name, value, unit, unit_name):
    if not isinstance(value, int) or isinstance(value, bool):
        raise PoolSizeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0 or value % unit:
        raise PoolSizeError(
            f"{name}={value} must be a positive multiple of the {unit_name} ({unit} bytes)")


class Pool:
    """A growable pool of device (CUDA) or host memory at a fixed virtual address.

    ``backend`` is "auto" (CUDA when a driver and a VMM-capable device are usable,
    else host), "cuda", "host", or a backend made by :func:`select_backend` (to
    read its page size first); ``backend_reason`` says why that one was chosen.
    """

    def __init__(self, max_bytes, chunk_bytes, backend="auto"):
        self._backend = select_backend(backend) if isinstance(backend, str) else backend
        page = self._backend.page_bytes
        _positive_multiple("chunk_bytes", chunk_bytes, page, "page size")
        _positive_multiple("max_bytes", max_bytes, chunk_bytes, "chunk size")
        self.page_bytes = page
        self.chunk_bytes = chunk_bytes
        self.max_bytes = max_bytes
        self.num_chunks = max_bytes // chunk_bytes
        self._handles = {}       # chunk -> backend handle, for mapped chunks
        self._released = set()   # chunks mapped once and released since
        self._closed = False
        self.base = self._backend.reserve(max_bytes)
        self._finalizer = weakref.finalize(self, _close_backend, self._backend, self.base,
                                           max_bytes, chunk_bytes, self._handles)

    # --- what the pool is ----------------------------------------------------------

    @property
    def backend(self):
        return self._backend.name

    @property
    def backend_reason(self):
        return self._backend.reason

    @property
    def xp(self):
        """The array module of this pool's memory: cupy for CUDA, numpy for host."""
        return self._backend.xp

    @property
    def frontier(self):
        """One past the highest chunk index ever mapped; grow() maps from here."""
        touched = self._handles.keys() | self._released
        return max(touched) + 1 if touched else 0

    @property
    def mapped_bytes(self):
        return len(self._handles) * self.chunk_bytes

    @property
    def closed(self):
        return self._closed

    def is_mapped(self, chunk):
        self._check_open()
        return chunk in self._handles

    def mappings(self):
        """The chunk table: one :class:`ChunkRecord` per chunk ever mapped, by index."""
        self._check_open()
        records = []
        for chunk in sorted(self._handles.keys() | self._released):
            offset = chunk * self.chunk_bytes
            handle = self._handles.get(chunk)
            mapped = handle is not None
            records.append(ChunkRecord(
                chunk=chunk, va_start=self.base + offset, va_end=self.base + offset + self.chunk_bytes,
                offset=offset, size=self.chunk_bytes,
                handle=self._backend.handle_id(handle) if mapped else None,
                state=MAPPED if mapped else RELEASED, access="rw" if mapped else "none"))
        return records

    # --- growing and shrinking -----------------------------------------------------

    def grow(self, n=1):
        """Map ``n`` new chunks at the frontier; return their indices."""
        self._check_open()
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise PoolSizeError(f"grow(n={n!r}): n must be a positive int number of chunks")
        start = self.frontier
        if start + n > self.num_chunks:
            raise ReservationExceededError(
                f"grow({n}) needs chunks {start}..{start + n - 1} but the reservation holds "
                f"{self.num_chunks} chunks of {self.chunk_bytes} bytes ({self.max_bytes} bytes); "
                f"{self.num_chunks - start} remain at the frontier: reserve a larger pool")
        chunks = list(range(start, start + n))
        self._map(chunks)
        return chunks

    def map(self, chunks):
        """Map the given chunk places (never mapped, or released); all or none."""
        self._check_open()
        chunks = self._chunk_list(chunks)
        for c in chunks:
            if c in self._handles:
                raise ChunkStateError(f"chunk {c} is already mapped")
        self._map(chunks)
        return chunks

    def release(self, chunks):
        """Unmap the given mapped chunks and free their physical memory, leaving holes."""
        self._check_open()
        chunks = self._chunk_list(chunks)
        for c in chunks:
            if c not in self._handles:
                state = "already released" if c in self._released else "never mapped"
                raise ChunkStateError(f"cannot release chunk {c}: it is {state}")
        self._backend.synchronize()  # a running kernel may still read these chunks
        for c in chunks:
            self._backend.unmap(self.base + c * self.chunk_bytes, self.chunk_bytes)
            self._backend.release(self._handles.pop(c))
            self._released.add(c)

    def _map(self, chunks):
        """Create, map and enable access to ``chunks``; undo exactly what was done on failure."""
        b, size = self._backend, self.chunk_bytes
        created, mapped = {}, []
        try:
            for c in chunks:
                created[c] = b.create(size)
            for c in chunks:
                b.map(self.base + c * size, size, created[c])
                mapped.append(c)
            for first, count in _runs(chunks):  # one access call per contiguous run
                b.set_access(self.base + first * size, count * size)
        except BaseException:
            for c in mapped:
                b.unmap(self.base + c * size, size)
            for handle in created.values():
                b.release(handle)
            raise
        self._handles.update(created)
        self._released.difference_update(chunks)

    def _chunk_list(self, chunks):
        chunks = [chunks] if isinstance(chunks, int) else list(chunks)
        if not chunks:
            raise PoolSizeError("no chunks given")
        for c in chunks:
            if not isinstance(c, int) or isinstance(c, bool) or not 0 <= c < self.num_chunks:
                raise UnknownChunkError(
                    f"chunk {c!r} does not exist: chunk indices are 0..{self.num_chunks - 1}")
        if len(set(chunks)) != len(chunks):
            raise ChunkStateError(f"chunk list {chunks} names a chunk twice")
        return sorted(chunks)

    # --- arrays over the pool ------------------------------------------------------

    def view(self, offset, shape, dtype, strides=None, *, allow_holes=False):
        """An array (cupy for CUDA, numpy for host) over the pool's bytes, without a copy.

        The bytes it spans must all be mapped, unless ``allow_holes``: the cache
        uses that for per-layer views whose released blocks it never touches.
        Arrays must not be used after the pool is closed.
        """
        self._check_open()
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in ((shape,) if isinstance(shape, int) else shape))
        strides = _c_strides(shape, dtype.itemsize) if strides is None else tuple(strides)
        lo, hi = _extent(offset, shape, strides, dtype.itemsize)
        if lo < 0 or hi > self.max_bytes:
            raise UnmappedRangeError(
                f"view bytes [{lo}, {hi}) fall outside the reservation [0, {self.max_bytes})")
        if not allow_holes and hi > lo:
            missing = [c for c in range(lo // self.chunk_bytes, (hi - 1) // self.chunk_bytes + 1)
                       if c not in self._handles]
            if missing:
                raise UnmappedRangeError(
                    f"view bytes [{lo}, {hi}) cover chunks that are not mapped: {missing}")
        return self._backend.array(self.base, self.max_bytes, offset, shape, dtype, strides, self)

    # --- lifetime ------------------------------------------------------------------

    def synchronize(self):
        self._check_open()
        self._backend.synchronize()

    def close(self):
        """Unmap and release every chunk and free the range. Idempotent; also runs at exit."""
        if not self._closed:
            self._closed = True
            self._finalizer()
            self._released.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_open(self):
        if self._closed:
            raise PoolClosedError("this pool was closed; create a new Pool")

    def __repr__(self):
        state = "closed" if self._closed else f"{len(self._handles)}/{self.num_chunks} chunks mapped"
        return (f"Pool({self.backend}, base={self.base:#x}, max_bytes={self.max_bytes}, "
                f"chunk_bytes={self.chunk_bytes}, {state})")


def _close_backend(backend, base, max_bytes, chunk_bytes, handles):
    backend.synchronize()
    for c, handle in sorted(handles.items()):
        backend.unmap(base + c * chunk_bytes, chunk_bytes)
        backend.release(handle)
    handles.clear()
    backend.free(base, max_bytes)
    backend.close()


def _runs(sorted_chunks):
    """(first, count) for each run of consecutive indices."""
    runs = []
    for c in sorted_chunks:
        if runs and runs[-1][0] + runs[-1][1] == c:
            runs[-1][1] += 1
        else:
            runs.append([c, 1])
    return [tuple(r) for r in runs]


def _c_strides(shape, itemsize):
    strides, step = [], itemsize
    for s in reversed(shape):
        strides.append(step)
        step *= max(s, 1)
    return tuple(reversed(strides))


def _extent(offset, shape, strides, itemsize):
    """[lo, hi) byte range an array of this layout touches."""
    if any(s == 0 for s in shape):
        return offset, offset
    lo = offset + sum((n - 1) * st for n, st in zip(shape, strides) if st < 0)
    hi = offset + sum((n - 1) * st for n, st in zip(shape, strides) if st > 0) + itemsize
    return lo, hi
