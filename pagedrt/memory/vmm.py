"""CUDA backend: the driver's virtual memory management calls, and nothing else.

``cuMemAddressReserve`` reserves the range; a chunk is a ``cuMemCreate`` allocation (a host-tier chunk one
located on the host NUMA node nearest the device) mapped with ``cuMemMap`` and enabled with
``cuMemSetAccess``, one call a contiguous run, for the backend's device and each device granted since
(:meth:`CudaBackend.grant_access`: VMM memory needs no ``cuCtxEnablePeerAccess``, the access list is the
whole of it). Views are CuPy arrays over ``cupy.cuda.UnownedMemory`` (no copy). Device chunks are exportable
as POSIX file descriptors where the device supports them. docs/ARCHITECTURE.md ("The pool (hardware layer)")
and docs/MULTIGPU.md say why and what views of holes and closed pools see.
"""

from typing import Any, Iterable, Optional, Sequence, Tuple

from .. import driver as drv
from ..errors import (BackendUnavailableError, CudaError, DeviceOutOfMemoryError, HostOutOfMemoryError,
                      MappingLimitError, PeerAccessError, UnsupportedConfigError)


class CudaBackend:
    """A :class:`~pagedrt.memory.backends.Backend` on CuPy's current device (module docstring); its methods
    are the protocol's.

    Raises
    ------
    BackendUnavailableError
        The device does not support virtual memory management (or CUDA is not usable).
    """

    name = "cuda"

    def __init__(self) -> None:
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
        self._access = [self._access_desc(self.device.ordinal)]  # read-write for this device (and those granted),
        # whatever the chunk's location
        # (allocation prop, NUMA node or None, granularity) once a host chunk is asked for
        self._host: Optional[Tuple[Any, Optional[int], int]] = None

    def _call(self, fn: str, *args: Any) -> Any:
        self.device.activate()
        return drv.call(self._d, fn, *args)

    def reserve(self, size: int) -> int:
        try:
            return int(self._call("cuMemAddressReserve", size, self.page_bytes, 0, 0))
        except CudaError as exc:
            raise MappingLimitError(
                f"cannot reserve {size} bytes ({size / 2**30:.6g} GiB) of GPU virtual address space: "
                f"cuMemAddressReserve failed with {exc.name} ({exc.text}); the limit is the device's "
                f"virtual address space less what this process has reserved already: reserve a "
                f"smaller pool") from exc

    def free(self, base: int, size: int) -> None:
        self._call("cuMemAddressFree", base, size)

    def create(self, size: int, location: str = "device") -> Any:
        if location == "device":
            return self._call("cuMemCreate", size, self._prop, 0)
        prop, node, _ = self._host_location()
        try:
            return self._call("cuMemCreate", size, prop, 0)
        except DeviceOutOfMemoryError as exc:
            where = "host memory" if node is None else f"host NUMA node {node}"
            raise HostOutOfMemoryError(
                f"the host refused {size} bytes of pinned memory on {where} for a host-tier chunk: cuMemCreate "
                f"failed with {exc.name} ({exc.text}); make the host tier smaller, or free pinned memory") from exc

    @property
    def host_page_bytes(self) -> int:
        """The mapping granularity of host-located chunks."""
        return self._host_location()[2]

    def location_id(self, location: str) -> Optional[int]:
        """The device ordinal of device chunks, the NUMA node of host chunks (None without one)."""
        return self.device.ordinal if location == "device" else self._host_location()[1]

    def _host_location(self) -> Tuple[Any, Optional[int], int]:
        """(allocation prop, NUMA node or None, granularity) of host-located chunks for this device."""
        if self._host is None:
            d = self._d
            numa = self._attribute("CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID", -1)
            node: Optional[int] = numa
            if numa >= 0 and self._attribute("CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", 0):
                kind = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
            elif self._attribute("CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", 0):
                kind, node = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST, None
            else:
                raise UnsupportedConfigError(
                    f"device {self.device.ordinal} (or this driver) cannot map host memory through virtual memory "
                    f"management: a host tier needs CUDA 12.2 or later and a device that supports it")
            prop = d.CUmemAllocationProp()
            prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            prop.location.type = kind
            prop.location.id = 0 if node is None else node
            flag = d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
            self._host = (prop, node, int(self._call("cuMemGetAllocationGranularity", prop, flag)))
        return self._host

    def _attribute(self, name: str, missing: int) -> int:
        """A device attribute, or ``missing`` where these bindings or this driver do not know it."""
        try:
            return int(self.device.attribute(name))
        except (AttributeError, CudaError):
            return missing

    def map(self, va: int, size: int, handle: Any) -> None:
        self._call("cuMemMap", va, size, 0, handle, 0)

    def set_access(self, va: int, size: int) -> None:
        self._call("cuMemSetAccess", va, size, self._access, len(self._access))

    def _access_desc(self, ordinal: int, flags: str = "CU_MEM_ACCESS_FLAGS_PROT_READWRITE") -> Any:
        d = self._d
        desc = d.CUmemAccessDesc()
        desc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = ordinal
        desc.flags = getattr(d.CUmemAccess_flags, flags)
        return desc

    @property
    def access_devices(self) -> Tuple[int, ...]:
        """The device ordinals every chunk is enabled for: this backend's device, then those granted."""
        return tuple(int(desc.location.id) for desc in self._access)

    def grant_access(self, ordinal: int, ranges: Sequence[Tuple[int, int]]) -> None:
        """Enable device ``ordinal`` to read and write every ``(va, size)`` of ``ranges`` (the mapped chunks' runs)
        and every chunk mapped from now on. A device already enabled is a no-op. Raises PeerAccessError, having
        changed nothing, for a device that does not exist or cannot access this backend's device's memory; if
        ``cuMemSetAccess`` fails part-way, the ranges already enabled are set back to no access for it."""
        count = int(self._call("cuDeviceGetCount"))
        own = self.device.ordinal
        if not isinstance(ordinal, int) or isinstance(ordinal, bool) or not 0 <= ordinal < count:
            raise PeerAccessError(f"device {ordinal!r:.40} cannot be granted access to the pool on device {own}: "
                                  f"there is no such device (this machine has devices 0..{count - 1})")
        if ordinal in self.access_devices:
            return
        peer = self._call("cuDeviceGet", ordinal)
        if not self._call("cuDeviceCanAccessPeer", peer, self.device.handle):
            raise PeerAccessError(f"device {ordinal} cannot access the memory of device {own} (cuDeviceCanAccessPeer "
                                  f"says no: no peer path between the two), so it cannot be granted access to this "
                                  f"pool; copy the blocks through NCCL (kernels.nccl) or host memory instead")
        desc, done = self._access_desc(ordinal), []
        try:
            for va, size in ranges:
                self._call("cuMemSetAccess", va, size, [desc], 1)
                done.append((va, size))
        except BaseException:
            revoke = self._access_desc(ordinal, "CU_MEM_ACCESS_FLAGS_PROT_NONE")
            for va, size in done:
                try:
                    self._call("cuMemSetAccess", va, size, [revoke], 1)
                except Exception:
                    pass
            raise
        self._access.append(desc)

    def unmap(self, va: int, size: int) -> None:
        self._call("cuMemUnmap", va, size)

    def release(self, handle: Any) -> None:
        self._call("cuMemRelease", handle)

    def retire(self, base: int, size: int, chunks: Iterable[Tuple[int, int, Any]]) -> None:
        """Unmap and release every ``(va, size, handle)`` of a closing pool."""
        for va, chunk_size, handle in chunks:
            self.unmap(va, chunk_size)
            self.release(handle)

    def check_exportable(self, location: str) -> None:
        """Raise UnsupportedConfigError unless chunks at ``location`` can be exported as POSIX file descriptors."""
        posix = self._d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        if location != "device":
            raise UnsupportedConfigError("host-tier chunks are not exportable: only device chunks are created with "
                                         "a POSIX file descriptor handle type")
        if self._prop.requestedHandleTypes != posix:
            raise UnsupportedConfigError(f"device {self.device.ordinal} does not support POSIX file descriptor "
                                         "handles (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED), "
                                         "so its chunks cannot be exported to another process")

    def export(self, handle: Any) -> int:
        """A new POSIX file descriptor for a chunk's allocation; the caller closes it. Only this backend exports
        (:meth:`check_exportable` first)."""
        posix = self._d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return int(self._call("cuMemExportToShareableHandle", handle, posix, 0))

    def import_handle(self, fd: int) -> Any:
        """The allocation handle of a chunk exported by another process, from its POSIX file descriptor ``fd`` (which
        stays the caller's to close); ``release`` it as any chunk's."""
        posix = self._d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return self._call("cuMemImportFromShareableHandle", fd, posix)

    @staticmethod
    def handle_id(handle: Any) -> int:
        return int(handle)

    def synchronize(self) -> None:
        self.device.synchronize()

    def close(self) -> None:
        self._call("cuDevicePrimaryCtxRelease", self.device.handle)

    def array(self, base: int, total: int, offset: int, shape: Tuple[int, ...], dtype: Any,
              strides: Tuple[int, ...], owner: Any) -> Any:
        import cupy
        mem = cupy.cuda.UnownedMemory(base, total, owner, self.device.ordinal)
        return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, offset), strides)
