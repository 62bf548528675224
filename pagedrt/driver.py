"""Checked cuda-python driver calls, bound to CuPy's current device and its primary context.

Every driver call goes through :func:`call`, which raises :class:`CudaError` (or
:class:`DeviceOutOfMemoryError`) with the CUresult's name and text instead of
returning an error code. :func:`probe` says whether CUDA is usable here and why not.
"""

import functools
from dataclasses import dataclass
from typing import Any, Dict, Tuple

from .errors import BackendUnavailableError, CudaError, DeviceOutOfMemoryError


def load() -> Any:
    """Import and initialise the driver bindings; raise BackendUnavailableError saying why not."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise BackendUnavailableError(
            f"cuda-python is not installed ({exc}); install pagedrt[cuda13] or pagedrt[cuda12]") from None
    try:
        (err,) = driver.cuInit(0)
    except RuntimeError as exc:  # the bindings raise when libcuda.so cannot be loaded
        raise BackendUnavailableError(f"no CUDA driver found ({exc})") from None
    if err != driver.CUresult.CUDA_SUCCESS:
        raise BackendUnavailableError(f"cuInit failed: {_describe(driver, err)}")
    return driver


def _describe(driver: Any, err: Any) -> Tuple[str, str]:
    _, name = driver.cuGetErrorName(err)
    _, text = driver.cuGetErrorString(err)
    return (name or b"?").decode(), (text or b"?").decode()


def call(driver: Any, fn: str, *args: Any) -> Any:
    """Call ``driver.<fn>(*args)`` and return its outputs: None, the one output, or a tuple of them.

    Parameters
    ----------
    driver : module
        The bindings :func:`load` returned.
    fn : str
        A driver function's name (``"cuMemCreate"``).

    Raises
    ------
    DeviceOutOfMemoryError
        ``CUDA_ERROR_OUT_OF_MEMORY``.
    CudaError
        Any other CUresult but success, with its name and text.
    """
    result = getattr(driver, fn)(*args)
    err, out = result[0], result[1:]
    if err != driver.CUresult.CUDA_SUCCESS:
        name, text = _describe(driver, err)
        cls = DeviceOutOfMemoryError if err == driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY else CudaError
        raise cls(fn, name, text)
    if not out:
        return None
    return out[0] if len(out) == 1 else out


@dataclass(frozen=True)
class Device:
    """A CUDA device and its primary context (the one CuPy uses), made current on this thread."""

    driver: Any   # the bindings (load())
    ordinal: int
    handle: Any   # CUdevice
    context: Any  # its primary CUcontext

    def activate(self) -> None:
        """Make the primary context current on this thread."""
        call(self.driver, "cuCtxSetCurrent", self.context)

    def synchronize(self) -> None:
        """Wait for everything queued on the device."""
        self.activate()
        call(self.driver, "cuCtxSynchronize")

    def mem_info(self) -> Tuple[int, int]:
        """(free, total) device memory in bytes."""
        self.activate()
        return call(self.driver, "cuMemGetInfo")

    def attribute(self, name: str) -> int:
        """The device attribute ``name`` (``"CU_DEVICE_ATTRIBUTE_..."``); AttributeError where the bindings lack it."""
        attr = getattr(self.driver.CUdevice_attribute, name)
        return call(self.driver, "cuDeviceGetAttribute", attr, self.handle)


def current_device() -> Device:
    """Bind to CuPy's current device: retain its primary context and make it current; BackendUnavailableError
    without cuda-python, cupy, a driver or a device."""
    driver = load()
    try:
        import cupy
    except ImportError as exc:
        raise BackendUnavailableError(
            f"cupy is not installed ({exc}); install pagedrt[cuda13] or pagedrt[cuda12]") from None
    count = call(driver, "cuDeviceGetCount")
    if count == 0:
        raise BackendUnavailableError("the CUDA driver sees no device")
    ordinal = cupy.cuda.Device().id
    handle = call(driver, "cuDeviceGet", ordinal)
    context = call(driver, "cuDevicePrimaryCtxRetain", handle)
    device = Device(driver, ordinal, handle, context)
    device.activate()
    return device


@functools.cache
def primary_context(ordinal: int) -> Any:
    """The primary context of device ``ordinal`` (the one CuPy uses there), for calls that name contexts
    (``cuMemcpyPeerAsync``); retained once and kept for the process, as CuPy keeps it."""
    driver = load()
    return call(driver, "cuDevicePrimaryCtxRetain", call(driver, "cuDeviceGet", ordinal))


def allocation_prop(device: Device) -> Any:
    """Pinned device memory on ``device``: what every chunk of a CUDA pool is; exportable to another process as a
    POSIX file descriptor (``cuMemExportToShareableHandle``) where the device supports that handle type."""
    d = device.driver
    prop = d.CUmemAllocationProp()
    prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device.ordinal
    if device.attribute("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"):
        prop.requestedHandleTypes = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def page_granularity(device: Device) -> int:
    """The device's minimum mapping granularity in bytes (the page)."""
    d = device.driver
    flag = d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    return call(d, "cuMemGetAllocationGranularity", allocation_prop(device), flag)


def probe() -> Dict[str, Any]:
    """A dict describing the CUDA side of this machine: ``usable`` and ``reason`` always; where CUDA is usable,
    the device's name, ordinal, compute capability, multiprocessors, versions, memory and page size."""
    try:
        device = current_device()
    except BackendUnavailableError as exc:
        return {"usable": False, "reason": str(exc)}
    driver = device.driver
    import cupy
    name = call(driver, "cuDeviceGetName", 256, device.handle)
    version = call(driver, "cuDriverGetVersion")
    vmm = bool(device.attribute("CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"))
    info = {
        "usable": vmm,
        "reason": "CUDA driver and a VMM-capable device found" if vmm
        else "the device does not support CUDA virtual memory management",
        "device": name.split(b"\0", 1)[0].decode(),
        "ordinal": device.ordinal,
        "compute_capability": "{}.{}".format(
            device.attribute("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR"),
            device.attribute("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR")),
        "multiprocessors": device.attribute("CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT"),
        "driver_version": f"{version // 1000}.{version % 1000 // 10}",
        "runtime_version": _runtime_version(cupy),
        "cupy_version": cupy.__version__,
        "memory_total": device.mem_info()[1],
    }
    if vmm:
        info["page_bytes"] = page_granularity(device)
    call(driver, "cuDevicePrimaryCtxRelease", device.handle)  # current_device retained it
    return info


def _runtime_version(cupy: Any) -> str:
    v = cupy.cuda.runtime.runtimeGetVersion()
    return f"{v // 1000}.{v % 1000 // 10}"
