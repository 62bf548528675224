"""Host backend: the operating system's virtual memory stands in for the GPU MMU.

The reservation is a private anonymous ``mmap(PROT_READ, MAP_NORESERVE)`` range (read-only zero pages); a
chunk is a memfd mapped into it with ``MAP_FIXED`` (a host-tier chunk one named ``pagedrt-chunk-host``),
enabled with ``mprotect``; a released chunk gets the zero pages back, and a closed pool's range becomes
scratch memory. docs/ARCHITECTURE.md ("The pool (hardware layer)") says why, and how
``vm.max_map_count`` is kept from leaving a hole unprotected.
"""

import ctypes
import errno
import mmap
import os
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import ChunkStateError, MappingLimitError, UnsupportedConfigError

PROT_NONE, PROT_READ, PROT_RW = 0, mmap.PROT_READ, mmap.PROT_READ | mmap.PROT_WRITE
MAP_SHARED, MAP_PRIVATE, MAP_ANONYMOUS = mmap.MAP_SHARED, mmap.MAP_PRIVATE, mmap.MAP_ANONYMOUS
MAP_FIXED, MAP_NORESERVE, MAP_FIXED_NOREPLACE = 0x10, 0x4000, 0x100000
MAP_FAILED = ctypes.c_void_p(-1).value
ANON = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE  # the reservation's holes and the closed range

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.msync.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def max_map_count() -> Optional[int]:
    """Linux's limit on mappings per process, or None where it cannot be read."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _os_error(call: str) -> Exception:
    err = ctypes.get_errno()
    if err == errno.ENOMEM and call in ("mmap", "mprotect"):
        exc = MappingLimitError(
            f"{call} failed with ENOMEM: the process has reached the operating system's limit on "
            f"memory mappings (vm.max_map_count = {max_map_count()}; each mapped chunk is one "
            f"mapping, so fewer, larger chunks need fewer) or on its address space: use larger chunks, "
            f"or raise the limit (sysctl vm.max_map_count)")
        exc.errno = err  # type: ignore[attr-defined]  # read as an OSError's
        return exc
    return OSError(err, f"{call}: {os.strerror(err)}")


def _mmap(addr: Optional[int], size: int, prot: int, flags: int, fd: int = -1) -> int:
    out = _libc.mmap(addr, size, prot, flags, fd, 0)
    if out in (None, MAP_FAILED):
        raise _os_error("mmap")
    if flags & MAP_FIXED_NOREPLACE and out != addr:  # a kernel before 4.17 took it as a hint
        _libc.munmap(out, size)
        raise OSError(errno.EEXIST, "mmap: MAP_FIXED_NOREPLACE is not supported")
    return out


def _munmap(addr: int, size: int) -> None:
    if _libc.munmap(addr, size):
        raise _os_error("munmap")


def _fully_mapped(addr: int, size: int) -> bool:
    """Whether every page of ``[addr, addr + size)`` is mapped (msync fails ENOMEM where not)."""
    return _libc.msync(addr, size, 0) == 0


class Memfd:
    """A chunk's physical memory: a memfd, opened when mapped and closed at once after
    (the mapping keeps the memory alive, so a pool holds no file descriptors)."""

    def __init__(self, size: int, name: str = "pagedrt-chunk"):
        self.size, self.name = size, name
        self.inode: Optional[int] = None  # once mapped

    def map_at(self, va: int, fixed: int = MAP_FIXED) -> None:
        """Open the memfd, map it at ``va`` (no access: ``set_access`` grants it) and close it again."""
        fd = os.memfd_create(self.name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, self.size)
            _mmap(va, self.size, PROT_NONE, MAP_SHARED | fixed, fd)
            self.inode = os.fstat(fd).st_ino
        finally:
            os.close(fd)


class HostBackend:
    """A :class:`~pagedrt.memory.backends.Backend` over the operating system's virtual memory (module docstring);
    its methods are the protocol's. ``reason`` says why it was chosen."""

    name = "host"
    xp = np

    def __init__(self, reason: str):
        self.reason = reason
        self.page_bytes = self.host_page_bytes = mmap.PAGESIZE
        self.gaps: Dict[int, int] = {}  # va -> size: released places the reservation could not be put back over

    def reserve(self, size: int) -> int:
        try:
            return _mmap(None, size, PROT_READ, ANON)
        except MappingLimitError:
            raise MappingLimitError(
                f"cannot reserve {size} bytes ({size / 2**30:.6g} GiB) of virtual address space: mmap "
                f"failed with ENOMEM; the limit is the process's address space (128 TiB of user space "
                f"on x86-64 Linux, less under `ulimit -v`) or its count of mappings (vm.max_map_count = "
                f"{max_map_count()}): reserve a smaller pool") from None

    def free(self, base: int, size: int) -> None:
        for start, n in self._segments(base, size):
            _munmap(start, n)
        for va in [va for va in self.gaps if base <= va < base + size]:
            del self.gaps[va]

    def create(self, size: int, location: str = "device") -> Memfd:
        return Memfd(size, "pagedrt-chunk" if location == "device" else "pagedrt-chunk-host")

    def map(self, va: int, size: int, handle: Memfd) -> None:
        if va in self.gaps:  # never replace what may have landed in a gap
            try:
                handle.map_at(va, MAP_FIXED_NOREPLACE)
            except OSError as exc:
                if exc.errno != errno.EEXIST:
                    raise
                raise ChunkStateError(
                    f"the chunk place at {va:#x} was taken by another mapping of this process while "
                    f"the pool could not reserve it; map another chunk") from None
            del self.gaps[va]
            return
        try:
            handle.map_at(va)
        except BaseException:
            # A kernel may have removed the reservation there before failing: put it back.
            if not _fully_mapped(va, size):
                self._reserve_hole(va, size)
            raise

    def set_access(self, va: int, size: int) -> None:
        if _libc.mprotect(va, size, PROT_RW):
            raise _os_error("mprotect")

    def unmap(self, va: int, size: int) -> None:
        """Put the reservation's zero pages back over a chunk (never a bare munmap, so that no
        other mapping of this process can land inside the pool's range). With the reservation's
        protection and flags the kernel merges it with its neighbours: no mapping is added."""
        try:
            _mmap(va, size, PROT_READ, ANON | MAP_FIXED)
            return
        except (MappingLimitError, OSError):
            pass
        # Past the limit Linux refuses every mmap; unmapping a whole chunk always succeeds and
        # lowers the count, so the zero pages then fit.
        _munmap(va, size)
        self._reserve_hole(va, size)

    def _reserve_hole(self, va: int, size: int) -> None:
        """Map the zero pages into the empty ``[va, va + size)``, replacing nothing. If that
        fails (another thread's mapping took the place), it is remembered as a gap: never
        mapped over, never unmapped by the pool."""
        try:
            _mmap(va, size, PROT_READ, ANON | MAP_FIXED_NOREPLACE)
        except (MappingLimitError, OSError):
            self.gaps[va] = size

    def release(self, handle: Memfd) -> None:
        pass  # unmapping freed the memory: nothing else holds it

    def retire(self, base: int, size: int, chunks: Iterable[Tuple[int, int, Memfd]]) -> None:
        """A closing pool: scratch memory over the whole range (see the module docstring);
        the chunks' memory goes with their last mapping. Falls back to unmapping the chunks
        first (past the mapping limit), then to read-only zero pages (no memory to commit)."""
        try:
            self._over_range(base, size, PROT_RW)
            return
        except (MappingLimitError, OSError):
            pass
        for va, n, _ in chunks:
            _munmap(va, n)
        try:
            self._over_range(base, size, PROT_RW)
        except (MappingLimitError, OSError):
            self._over_range(base, size, PROT_READ)

    def _over_range(self, base: int, size: int, prot: int) -> None:
        for start, n in self._segments(base, size):
            _mmap(start, n, prot, ANON | MAP_FIXED)

    def _segments(self, base: int, size: int) -> List[Tuple[int, int]]:
        """``[base, base + size)`` less the gaps, as (start, size) pieces."""
        pieces, start = [], base
        for va in sorted(va for va in self.gaps if base <= va < base + size):
            if va > start:
                pieces.append((start, va - start))
            start = va + self.gaps[va]
        if start < base + size:
            pieces.append((start, base + size - start))
        return pieces

    @staticmethod
    def handle_id(handle: Memfd) -> Optional[int]:
        return handle.inode

    @staticmethod
    def location_id(location: str) -> Optional[int]:
        return None  # memfds have no device, and no NUMA node is asked for

    access_devices: Tuple[int, ...] = ()  # no GPU reads this memory

    @staticmethod
    def grant_access(ordinal: int, ranges: Sequence[Tuple[int, int]]) -> None:
        raise UnsupportedConfigError(f"cannot grant device {ordinal!r:.40} access to a pool on the host backend: "
                                     "it has no GPU memory and no GPU to grant; peer access needs the CUDA backend")

    @staticmethod
    def check_exportable(location: str) -> None:
        raise UnsupportedConfigError("a pool on the host backend cannot export its chunks: its memfds are closed once "
                                     "mapped, and another process's GPU could not map them; export needs the CUDA "
                                     "backend")

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        pass

    def array(self, base: int, total: int, offset: int, shape: Tuple[int, ...], dtype: np.dtype,
              strides: Tuple[int, ...], owner: object) -> np.ndarray:
        buf: Any = (ctypes.c_char * total).from_address(base)
        buf.owner = owner  # the array keeps the pool (and so the mapping) alive
        return np.ndarray(shape, dtype, buffer=buf, offset=offset, strides=strides)
