"""CUDA backend: the driver's virtual memory management calls, and nothing else.

cuMemAddressReserve reserves the range; a chunk is a cuMemCreate allocation
mapped with cuMemMap; cuMemSetAccess enables reads and writes (one call per
contiguous run, since its cost is per call); release is cuMemUnmap + cuMemRelease;
close unmaps and releases every chunk, and cuMemAddressFree frees the range once
the pool and its views are gone (so no later allocation takes those addresses
while a view may live). Arrays are CuPy arrays over ``cupy.cuda.UnownedMemory``,
so no copy is ever made. Holes stay unmapped (unlike the host backend's read-only
zero pages), and so does a closed pool's range: a kernel that reads either faults
with an illegal address, so pagedrt's launches refuse both before they start.
"""

from .. import driver as drv
from ..errors import BackendUnavailableError, CudaError, MappingLimitError


class CudaBackend:
    name = "cuda"

    def __init__(self):
        self.device = drv.current_device()
        if not self.device.attribute("CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"):
            raise BackendUnavailableError(
                f"device {self.device.ordinal} does not support CUDA virtual memory management")
        import cupy
        self.xp = cupy
        self.reason = f"cuda: device {self.device.ordinal} supports virtual memory management"
        d = self.device.driver
        self._d = d
        self._prop = drv.allocation_prop(self.device)
        self.page_bytes = drv.page_granularity(self.device)
        access = d.CUmemAccessDesc()
        access.location = self._prop.location
        access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]

    def _call(self, fn, *args):
        self.device.activate()
        return drv.call(self._d, fn, *args)

    def reserve(self, size):
        try:
            return int(self._call("cuMemAddressReserve", size, self.page_bytes, 0, 0))
        except CudaError as exc:
            raise MappingLimitError(
                f"cannot reserve {size} bytes ({size / 2**30:.6g} GiB) of GPU virtual address space: "
                f"cuMemAddressReserve failed with {exc.name} ({exc.text}); the limit is the device's "
                f"virtual address space less what this process has reserved already: reserve a "
                f"smaller pool") from exc

    def free(self, base, size):
        self._call("cuMemAddressFree", base, size)

    def create(self, size):
        return self._call("cuMemCreate", size, self._prop, 0)

    def map(self, va, size, handle):
        self._call("cuMemMap", va, size, 0, handle, 0)

    def set_access(self, va, size):
        self._call("cuMemSetAccess", va, size, self._access, 1)

    def unmap(self, va, size):
        self._call("cuMemUnmap", va, size)

    def release(self, handle):
        self._call("cuMemRelease", handle)

    def retire(self, base, size, chunks):
        """Unmap and release every ``(va, size, handle)`` of a closing pool."""
        for va, chunk_size, handle in chunks:
            self.unmap(va, chunk_size)
            self.release(handle)

    @staticmethod
    def handle_id(handle):
        return int(handle)

    def synchronize(self):
        self.device.synchronize()

    def close(self):
        self._call("cuDevicePrimaryCtxRelease", self.device.handle)

    def array(self, base, total, offset, shape, dtype, strides, owner):
        import cupy
        mem = cupy.cuda.UnownedMemory(base, total, owner, self.device.ordinal)
        return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, offset), strides)
