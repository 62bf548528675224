"""The pool: one reserved virtual range, with physical chunks mapped into it on demand.

The range is cut into ``max_bytes // chunk_bytes`` chunk places. :meth:`Pool.grow` maps chunks at the frontier,
:meth:`Pool.map` at given places, :meth:`Pool.release` unmaps a chunk and frees its memory, leaving a hole; the
range never moves. The bookkeeping, checks and rollback live here; a backend (``vmm`` for CUDA, ``host`` for the
operating system's virtual memory) supplies the primitive calls.

Mapping is three steps, so that the backend's calls can run on another thread: :meth:`Pool.claim` (the pool's
thread) takes places for a :class:`Prepared`, :meth:`Pool.prepare` (any thread) makes, maps and enables its chunks,
:meth:`Pool.commit` adopts them or :meth:`Pool.discard` undoes them; ``map`` and ``grow`` take the three in a row.
Every operation completes or leaves the pool as it was (an interrupt included), except that a chunk the backend
cannot unmap while undoing a failed map stays mapped and is adopted.

Every pool is registered weakly: :func:`find_pool` answers which pool holds an address, and :attr:`Pool.version`
with :meth:`Pool.mapped_mask` say which chunks are mapped, so that kernels refuse memory that is not. A chunk's
location is ``"device"`` or ``"host"`` (pinned host memory read through the same pointers);
:meth:`Pool.grant_access` lets another GPU use the pool and :meth:`Pool.export_chunks` another process
(:mod:`pagedrt.memory.ipc`). What views see in holes and after :meth:`Pool.close` is in docs/ARCHITECTURE.md
("The pool (hardware layer)").
"""

import os
import threading
import weakref
from typing import Any, Collection, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from .backends import Backend, select_backend
from .records import ChunkRecord, c_strides, extent, runs
from ..errors import (ChunkStateError, PoolClosedError, PoolSizeError, ReservationExceededError,
                      UnknownChunkError, UnmappedRangeError)
from ..spec import Array, DTypeLike

MAPPED, RELEASED = "mapped", "released"
DEVICE, HOST = "device", "host"  # where a chunk's memory lives
LOCATIONS = (DEVICE, HOST)
CLAIMED, RUNNING, READY, FAILED, DONE = "claimed", "running", "ready", "failed", "done"  # a Prepared's states

_POOLS = []  # weak references to every pool made in this process, dead ones dropped as found


def find_pool(address: int) -> Optional["Pool"]:
    """The pool of this process whose reserved range ``[base, base + max_bytes)`` holds
    ``address`` (an int), open or closed; None if no live pool's range holds it."""
    address = int(address)
    found = None
    for ref in list(_POOLS):
        pool = ref()
        if pool is None:
            _POOLS.remove(ref)
        elif found is None and pool.base <= address < pool.base + pool.max_bytes:
            found = pool
    return found


class Prepared:
    """Chunk places claimed for mapping apart from the pool's bookkeeping (:meth:`Pool.claim`).

    :meth:`Pool.prepare` fills ``handles`` (chunk -> handle, every chunk mapped and
    enabled); :meth:`Pool.commit` adopts them or :meth:`Pool.discard` undoes them.
    ``stuck`` holds the chunks that a failed preparation could not unmap: still mapped,
    the pool adopts them when the claim is discarded, as a failed ``map`` does.
    """

    __slots__ = ("chunks", "location", "handles", "stuck", "state", "before")

    def __init__(self, chunks: List[int], location: str) -> None:
        self.chunks = chunks  # sorted pool chunk indices
        self.location = location  # "device" or "host"
        self.handles = {}
        self.stuck = {}
        self.state = CLAIMED
        self.before = (set(), {})  # the places' released flags and locations when claimed

    def __repr__(self):
        return f"Prepared(chunks={self.chunks}, {self.state})"


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

    def __init__(self, max_bytes: int, chunk_bytes: int, backend: Union[str, Backend] = "auto") -> None:
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
        self._location = {}      # chunk -> "device" or "host", for chunks ever mapped
        self._claims = {}        # chunk -> its Prepared, from claim() to commit() or discard()
        self._claims_lock = threading.Condition()  # guards the claims and their states; close waits on it
        self._closed = False
        self._version = 0
        self._mask = None        # (version, read-only mask) of the last mapped_mask()
        try:
            self.base = self._backend.reserve(max_bytes)
        except BaseException:
            if isinstance(backend, str):  # the backend is ours: let it go (CUDA: its context)
                self._backend.close()
            raise
        self._range = _Range(self._backend, self.base, max_bytes, chunk_bytes, self._handles, self._claims,
                             self._claims_lock)
        self._finalizer = weakref.finalize(self, self._range.free)
        _POOLS.append(weakref.ref(self))

    # --- what the pool is ----------------------------------------------------------

    @property
    def backend(self) -> str:
        """The backend's name: "cuda" or "host"."""
        return self._backend.name

    @property
    def backend_reason(self) -> str:
        """Why this backend was chosen, for a person to read."""
        return self._backend.reason

    @property
    def xp(self) -> Any:
        """The array module of this pool's memory: cupy for CUDA, numpy for host."""
        return self._backend.xp

    @property
    def frontier(self) -> int:
        """One past the highest chunk index ever mapped; grow() maps from here."""
        touched = self._handles.keys() | self._released
        return max(touched) + 1 if touched else 0

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the chunks mapped now."""
        return len(self._handles) * self.chunk_bytes

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closed

    @property
    def version(self) -> int:
        """A number bumped whenever chunks are mapped or released (and at close): a mask
        computed at one version holds until the version changes."""
        return self._version

    def mapped_mask(self) -> np.ndarray:
        """A read-only bool array ``[num_chunks]``, True where the chunk is mapped now
        (all False once closed). Cached: the same array until :attr:`version` changes."""
        if self._mask is None or self._mask[0] != self._version:
            mask = np.zeros(self.num_chunks, bool)
            mask[list(self._handles)] = True
            mask.flags.writeable = False
            self._mask = (self._version, mask)
        return self._mask[1]

    def is_mapped(self, chunk: int) -> bool:
        """Whether chunk index ``chunk`` is mapped now."""
        self._check_open()
        return chunk in self._handles

    def mappings(self) -> List[ChunkRecord]:
        """The chunk table: one :class:`ChunkRecord` per chunk ever mapped, by index."""
        self._check_open()
        records = []
        for chunk in sorted(self._handles.keys() | self._released):
            offset = chunk * self.chunk_bytes
            handle = self._handles.get(chunk)
            mapped = handle is not None
            location = self._location[chunk]
            records.append(ChunkRecord(
                chunk=chunk, va_start=self.base + offset, va_end=self.base + offset + self.chunk_bytes,
                offset=offset, size=self.chunk_bytes,
                handle=self._backend.handle_id(handle) if mapped else None,
                state=MAPPED if mapped else RELEASED, access="rw" if mapped else "none",
                location=location, location_id=self._backend.location_id(location),
                devices=self._backend.access_devices if mapped else ()))
        return records

    def location(self, chunk: int) -> str:
        """Where a chunk ever mapped lives (lived): "device" or "host"."""
        self._check_open()
        return self._location[chunk]

    @property
    def access_devices(self) -> Tuple[int, ...]:
        """The GPU ordinals that may read and write this pool's chunks: its own device first, then those granted
        (:meth:`grant_access`) in the order granted; () on the host backend."""
        return self._backend.access_devices

    def grant_access(self, device: int) -> None:
        """Let GPU ``device`` (an ordinal) read and write every chunk of this pool, those mapped now and those
        mapped later, through the pool's own addresses: what a kernel on that device needs to read blocks of this
        pool over NVLink (``kernels.transfer_blocks(..., mapped=True)``).

        The pool's own device, or one granted already, is a no-op: it may already. Checked first, the pool left
        as it was on refusal: :class:`~pagedrt.errors.PeerAccessError` for a device that does not exist or that
        cannot reach this pool's device (``cuDeviceCanAccessPeer``);
        :class:`~pagedrt.errors.UnsupportedConfigError` on the host backend, which has no GPU to grant. If the
        driver refuses part-way, the access already set is taken back and its error raised. A preparation under
        way on another thread is waited for, so that no chunk is mapped without the new device's access.
        """
        self._check_open()
        with self._claims_lock:
            self._claims_lock.wait_for(lambda: all(p.state != RUNNING for p in self._claims.values()))
            mapped = set(self._handles)
            for prepared in self._claims.values():  # prepared chunks, or those a failed preparation left mapped
                mapped.update(prepared.handles, prepared.stuck)
            size = self.chunk_bytes
            self._backend.grant_access(device, [(self.base + first * size, count * size)
                                                for first, count in runs(sorted(mapped))])

    def export_chunks(self, chunks: Union[int, Iterable[int]]) -> List[int]:
        """A new POSIX file descriptor for each of the given mapped device chunks, by chunk index: what another
        process maps to read and write the same memory (``cuMemExportToShareableHandle``; send them with
        :func:`pagedrt.memory.ipc.send_chunks`). The descriptors are the caller's to close once sent; the memory
        lives on while the other process holds it, even after this pool releases the chunk or closes.

        Checked first, nothing made on refusal: ``ChunkStateError`` for a chunk not mapped now (or being mapped),
        ``UnsupportedConfigError`` on the host backend, for host-tier chunks, and on a device without POSIX file
        descriptor handles. If the driver refuses part-way, the descriptors made so far are closed.
        """
        self._check_open()
        chunks = self._chunk_list(chunks)
        self._check_mapped(chunks, "export")
        for c in chunks:
            self._backend.check_exportable(self._location[c])
        fds = []
        try:
            for c in chunks:
                fds.append(self._backend.export(self._handles[c]))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    # --- growing and shrinking -----------------------------------------------------

    def grow(self, n: int = 1) -> List[int]:
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
        return self._map(list(range(start, start + n)))

    def map(self, chunks: Union[int, Iterable[int]], location: str = DEVICE) -> List[int]:
        """Map the given chunk places (never mapped, or released) with new chunks at ``location``
        ("device" or "host"); all or none."""
        self._check_open()
        return self._map(self._chunk_list(chunks), location)

    def release(self, chunks: Union[int, Iterable[int]]) -> None:
        """Unmap the given mapped chunks and free their physical memory, leaving holes."""
        self._check_open()
        chunks = self._chunk_list(chunks)
        self._check_mapped(chunks, "release")
        self._backend.synchronize()  # a running kernel may still read these chunks
        try:
            for c in chunks:  # if the backend refuses one, those before it stay released
                self._backend.unmap(self.base + c * self.chunk_bytes, self.chunk_bytes)
                self._backend.release(self._handles.pop(c))
                self._released.add(c)
        finally:
            self._version += 1

    def never_mapped(self, chunks: Iterable[int]) -> List[int]:
        """Those of ``chunks`` never mapped (nor released) so far."""
        return [c for c in chunks if c not in self._location]

    def unmap(self, chunks: Iterable[int], forget: Collection[int]) -> None:
        """Undo a map of ``chunks`` (a failed step's): release those mapped now, and forget that ``forget`` (of
        them, never mapped before it) ever were, so that :meth:`mappings` is as before the map."""
        self._check_open()
        mapped = [c for c in chunks if c in self._handles]
        if mapped:
            self.release(mapped)
        self._released.difference_update(forget)
        for c in forget:
            self._location.pop(c, None)

    def _map(self, chunks, location=DEVICE):
        """Claim, prepare and commit ``chunks`` on this thread. On any exception, an interrupt included, whatever
        part of the three ran is undone (:meth:`_abandon`) before it propagates."""
        prepared = Prepared(chunks, location)
        try:
            self._take(prepared)
            self.prepare(prepared)
            return self.commit(prepared)
        except BaseException:
            self._abandon(prepared)
            raise

    def _abandon(self, prepared):
        """Undo any prefix of :meth:`_take`, :meth:`prepare` and :meth:`commit` of ``prepared``: its places given
        back, the chunks it mapped unmapped and released, the pool's records as before the claim."""
        with self._claims_lock:
            ours = [c for c in prepared.chunks if self._claims.get(c) is prepared]
            taken = bool(ours) or prepared.state == DONE  # committed (DONE) or a claim still
            for c in ours:
                del self._claims[c]
            prepared.state = DONE
            if self._range.retired or not taken:  # close released its chunks; or it never took a place
                return
        for c in prepared.chunks:
            self._handles.pop(c, None)
            self._location.pop(c, None)
        self._released.update(prepared.before[0])
        self._location.update(prepared.before[1])
        self._adopt_stuck({**prepared.stuck, **self._undo(prepared.handles, list(prepared.handles))},
                          prepared.location)

    # --- mapping in three steps: claim, prepare (any thread), commit or discard ------

    def claim(self, chunks: Union[int, Iterable[int]], location: str = DEVICE) -> Prepared:
        """Take unmapped places (never mapped, or released) for a :class:`Prepared` of chunks at ``location``
        ("device" or "host"); nothing is mapped yet.

        Until the claim is committed or discarded, ``map``, ``grow``, ``release`` and
        other claims refuse its places. Call it on the thread that owns the pool.
        """
        self._check_open()
        prepared = Prepared(self._chunk_list(chunks), location)
        self._take(prepared)
        return prepared

    def _take(self, prepared):
        """Check the location, record what the claim's places were (for :meth:`_abandon`), then take them."""
        chunks, location = prepared.chunks, prepared.location
        if location not in LOCATIONS:
            raise PoolSizeError(f"location {location!r:.40} must be one of {', '.join(LOCATIONS)}")
        if location == HOST and self.chunk_bytes % self._backend.host_page_bytes:
            raise PoolSizeError(f"chunk_bytes={self.chunk_bytes} is not a whole number of host pages "
                                f"({self._backend.host_page_bytes} bytes): a host chunk cannot be that size")
        prepared.before = (self._released.intersection(chunks), {c: self._location[c] for c in chunks
                                                                  if c in self._location})
        with self._claims_lock:
            for c in chunks:
                if c in self._handles:
                    raise ChunkStateError(f"chunk {c} is already mapped")
                if c in self._claims:
                    raise ChunkStateError(f"chunk {c} is already claimed: it is being mapped")
            self._claims.update((c, prepared) for c in chunks)

    def prepare(self, prepared: Prepared) -> None:
        """Create, map and enable access to a claim's chunks: backend calls only, so any thread may run it.

        Touches none of the pool's bookkeeping (only the claim's state, under the
        claims' lock); :meth:`commit` adopts the chunks. On failure it undoes exactly
        what it did and raises; the claim stays until :meth:`discard`. Refused once the
        pool is closed (:class:`~pagedrt.errors.PoolClosedError`).
        """
        b, size = self._backend, self.chunk_bytes
        created, mapped, started = {}, [], False
        try:  # the claim goes RUNNING inside: an interrupt anywhere after leaves it READY or FAILED
            with self._claims_lock:
                if self._range.retired:
                    raise PoolClosedError("this pool was closed while chunks were claimed; create a new Pool")
                self._check_claim(prepared, CLAIMED, "prepare")
                started = True
                prepared.state = RUNNING
            for c in prepared.chunks:
                created[c] = b.create(size, prepared.location)
            for c in prepared.chunks:  # one statement maps a chunk and records it: no point in between
                mapped.append(b.map(self.base + c * size, size, created[c]) or c)
            for first, count in runs(prepared.chunks):  # one access call per contiguous run
                b.set_access(self.base + first * size, count * size)
            with self._claims_lock:
                prepared.handles, prepared.state = created, READY
                self._claims_lock.notify_all()
        except BaseException:
            if started:
                self._fail(prepared, created, mapped)
            raise

    def _fail(self, prepared, created, mapped):
        """A preparation stopped by an exception: a claim still RUNNING is undone and goes FAILED; waiters
        are woken either way."""
        stuck = self._undo(created, mapped) if prepared.state == RUNNING else {}  # only this thread changes it
        with self._claims_lock:
            if prepared.state == RUNNING:
                prepared.stuck, prepared.state = stuck, FAILED
            self._claims_lock.notify_all()

    def commit(self, prepared: Prepared) -> List[int]:
        """Adopt a prepared claim's chunks: mapped from now on, in :meth:`mappings` and :meth:`mapped_mask`.
        Returns their indices."""
        self._check_open()
        with self._claims_lock:
            self._check_claim(prepared, READY, "commit")
            self._handles.update(prepared.handles)
            self._released.difference_update(prepared.chunks)
            self._location.update((c, prepared.location) for c in prepared.chunks)
            self._version += 1
            self._unclaim(prepared)
        return prepared.chunks

    def discard(self, prepared: Prepared) -> None:
        """Give a claim's places back, unmapping and releasing whatever it mapped. After :meth:`close`
        there is nothing left to undo (close released the claim's chunks) and it does nothing."""
        with self._claims_lock:
            if self._range.retired:
                return
            self._check_claim(prepared, (CLAIMED, READY, FAILED), "discard")
            self._unclaim(prepared)
        self._adopt_stuck({**prepared.stuck, **self._undo(prepared.handles, list(prepared.handles))},
                          prepared.location)

    def _adopt_stuck(self, stuck, location):
        """Chunks the backend could not unmap are mapped: the pool keeps them."""
        if stuck:
            self._handles.update(stuck)
            self._released.difference_update(stuck)
            self._location.update((c, location) for c in stuck)
            self._version += 1

    def _check_claim(self, prepared, states, what):
        if not isinstance(prepared, Prepared) or self._claims.get(prepared.chunks[0]) is not prepared:
            raise ChunkStateError(f"cannot {what} {prepared!r}: it is not a claim of this pool (committed or "
                                  f"discarded already?)")
        if prepared.state not in states:
            raise ChunkStateError(f"cannot {what} {prepared!r}: it is {prepared.state}")

    def _unclaim(self, prepared):
        prepared.state = DONE  # first: a claim DONE or still held is one taken (_abandon)
        for c in prepared.chunks:
            del self._claims[c]

    def _undo(self, created, mapped):
        """Unmap ``mapped`` and release every handle in ``created``; backend calls only. Returns the chunks
        (chunk -> handle) that the backend would not unmap: they stay mapped, enabled if the backend lets it."""
        b, size = self._backend, self.chunk_bytes
        stuck = {}
        for c in mapped:
            try:
                b.unmap(self.base + c * size, size)
            except Exception:
                stuck[c] = created[c]
        for c, handle in created.items():
            if c not in stuck:
                b.release(handle)
        for c in stuck:  # usable as a mapped chunk should be, if the backend lets it
            try:
                b.set_access(self.base + c * size, size)
            except Exception:
                pass
        return stuck

    def _check_mapped(self, chunks, verb):
        """ChunkStateError naming the first of ``chunks`` not mapped now, and what it is instead."""
        for c in chunks:
            if c not in self._handles:
                state = ("being mapped (claimed)" if c in self._claims else
                         "already released" if c in self._released else "never mapped")
                raise ChunkStateError(f"cannot {verb} chunk {c}: it is {state}")

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

    def view(self, offset: int, shape: Union[int, Sequence[int]], dtype: DTypeLike,
             strides: Optional[Sequence[int]] = None, *, allow_holes: bool = False) -> Array:
        """An array (cupy for CUDA, numpy for host) over the pool's bytes, without a copy.

        The bytes it spans must all be mapped, unless ``allow_holes``: the cache
        uses that for per-layer views whose released blocks it never touches.
        On the host backend, holes (and the unmapped rest of the range) read as
        zeros, but writing into one through a view faults: pagedrt's own writes
        are refused before they reach a hole. After :meth:`close`, a host view
        reads zeros and its writes go nowhere. On CUDA, a kernel reading a hole
        or a closed pool's range faults (illegal address): never use a view there.
        """
        self._check_open()
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in ((shape,) if isinstance(shape, int) else shape))
        strides = c_strides(shape, dtype.itemsize) if strides is None else tuple(strides)
        lo, hi = extent(offset, shape, strides, dtype.itemsize)
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

    def synchronize(self) -> None:
        """Wait for the work on the pool's device (nothing to wait for on the host backend)."""
        self._check_open()
        self._backend.synchronize()

    def close(self) -> None:
        """Unmap and release every chunk. Idempotent; also runs when the pool is collected
        and at exit.

        Claimed chunks go too: a preparation running on another thread is waited for,
        prepared chunks are released with the mapped ones, and a preparation not yet
        started is refused (:class:`~pagedrt.errors.PoolClosedError`).

        The range stays reserved until the pool and its last view are gone (then the
        finalizer frees it), so its addresses are not handed to other memory meanwhile.
        The host backend maps scratch memory over it (views taken before close then read
        zeros rather than crash); on CUDA it is reserved and unmapped.
        """
        if not self._closed:
            self._closed = True
            self._version += 1
            self._range.retire()
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


class _Range:
    """A pool's range and chunks, apart from the pool, so that a finalizer can end them."""

    def __init__(self, backend, base, size, chunk_bytes, handles, claims, claims_lock):
        self.backend, self.base, self.size, self.chunk_bytes = backend, base, size, chunk_bytes
        self.handles, self.claims, self.claims_lock = handles, claims, claims_lock  # the pool's own
        self.retired = False

    def retire(self):
        """Unmap and release every chunk (the host leaves scratch memory over the range): those mapped,
        and those of claims, once a preparation under way on another thread has finished."""
        if not self.retired:
            with self.claims_lock:
                self.retired = True  # no preparation starts from now on
                self.claims_lock.wait_for(lambda: all(p.state != RUNNING for p in self.claims.values()))
                for prepared in set(self.claims.values()):
                    self.handles.update(prepared.handles)
                    self.handles.update(prepared.stuck)
                    prepared.state = DONE
                self.claims.clear()
            self.backend.synchronize()
            self.backend.retire(self.base, self.size,
                                [(self.base + c * self.chunk_bytes, self.chunk_bytes, h)
                                 for c, h in sorted(self.handles.items())])
            self.handles.clear()

    def free(self):
        """Retire, then free the range and let the backend go; run once, by the finalizer."""
        self.retire()
        self.backend.free(self.base, self.size)
        self.backend.close()

