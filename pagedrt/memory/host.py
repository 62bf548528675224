"""Host backend: the operating system's virtual memory stands in for the GPU MMU.

The reservation is an ``mmap(PROT_NONE, MAP_NORESERVE)`` range; a chunk is a memfd
(anonymous shared memory) mapped into it with ``MAP_FIXED``; access is granted
with ``mprotect``; releasing a chunk maps the reservation back over it. The same
two layers, with Linux page tables in place of the GPU's. Each mapped chunk is
one kernel mapping (VMA), and Linux allows about 65,000 per process
(``vm.max_map_count``): use chunks of megabytes, not pages, for large pools.
"""

import ctypes
import mmap
import os

import numpy as np

PROT_NONE, PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
MAP_SHARED, MAP_PRIVATE, MAP_ANONYMOUS = mmap.MAP_SHARED, mmap.MAP_PRIVATE, mmap.MAP_ANONYMOUS
MAP_FIXED, MAP_NORESERVE = 0x10, 0x4000
MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def _os_error(call):
    err = ctypes.get_errno()
    return OSError(err, f"{call}: {os.strerror(err)}")


def _mmap(addr, size, prot, flags, fd=-1):
    out = _libc.mmap(addr, size, prot, flags, fd, 0)
    if out in (None, MAP_FAILED):
        raise _os_error("mmap")
    return out


class Memfd:
    """A chunk's physical memory: a memfd, opened when mapped and closed at once after
    (the mapping keeps the memory alive, so a pool holds no file descriptors)."""

    def __init__(self, size):
        self.size = size
        self.inode = None

    def map_at(self, va):
        fd = os.memfd_create("pagedrt-chunk", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, self.size)
            _mmap(va, self.size, PROT_NONE, MAP_SHARED | MAP_FIXED, fd)
            self.inode = os.fstat(fd).st_ino
        finally:
            os.close(fd)


class HostBackend:
    name = "host"
    xp = np

    def __init__(self, reason):
        self.reason = reason
        self.page_bytes = mmap.PAGESIZE

    def reserve(self, size):
        return _mmap(None, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)

    def free(self, base, size):
        if _libc.munmap(base, size):
            raise _os_error("munmap")

    def create(self, size):
        return Memfd(size)

    def map(self, va, size, handle):
        handle.map_at(va)

    def set_access(self, va, size):
        if _libc.mprotect(va, size, PROT_RW):
            raise _os_error("mprotect")

    def unmap(self, va, size):
        # Put the reservation back over the hole rather than munmap, so that no
        # other mapping of this process can land inside the pool's range.
        _mmap(va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE)

    def release(self, handle):
        pass  # unmapping freed the memory: nothing else holds it

    @staticmethod
    def handle_id(handle):
        return handle.inode

    def synchronize(self):
        pass

    def close(self):
        pass

    def array(self, base, total, offset, shape, dtype, strides, owner):
        buf = (ctypes.c_char * total).from_address(base)
        buf.owner = owner  # the array keeps the pool (and so the mapping) alive
        return np.ndarray(shape, dtype, buffer=buf, offset=offset, strides=strides)
