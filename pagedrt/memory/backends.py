"""Pool backends: what one must offer (:class:`Backend`), and choosing one: CUDA when usable, else the host,
saying why."""

from typing import Any, Iterable, Optional, Protocol, Sequence, Tuple

from ..errors import BackendUnavailableError

BACKENDS = ("auto", "cuda", "host")


class Backend(Protocol):
    """The calls a :class:`~pagedrt.memory.Pool` makes of its backend: reserve a range, create chunks, map them
    into it and back out (:class:`~pagedrt.memory.vmm.CudaBackend`: the driver's virtual memory management;
    :class:`~pagedrt.memory.host.HostBackend`: mmap and memfds). Addresses and sizes are bytes, whole pages
    (:attr:`page_bytes`, or :attr:`host_page_bytes` for host-located chunks). The CUDA backend also exports
    chunks to other processes (``export``, ``import_handle``)."""

    @property
    def name(self) -> str:
        """``"cuda"`` or ``"host"``."""

    @property
    def xp(self) -> Any:
        """The array module of its views: ``cupy`` or ``numpy``."""

    @property
    def reason(self) -> str:
        """Why this backend was chosen, for a person to read."""

    @property
    def page_bytes(self) -> int:
        """The mapping granularity of device chunks."""

    @property
    def host_page_bytes(self) -> int:
        """The mapping granularity of host-located chunks."""

    @property
    def access_devices(self) -> Tuple[int, ...]:
        """The device ordinals every chunk is enabled for (none on the host backend)."""

    def reserve(self, size: int) -> int:
        """Reserve ``size`` bytes of address space; returns its base. MappingLimitError where refused."""

    def free(self, base: int, size: int) -> None:
        """Free the reservation ``[base, base + size)``, every chunk unmapped already."""

    def create(self, size: int, location: str = "device") -> Any:
        """A new chunk of ``size`` bytes, ``location`` ``"device"`` or ``"host"`` (the host tier); returns its
        handle. DeviceOutOfMemoryError or HostOutOfMemoryError where refused."""

    def map(self, va: int, size: int, handle: Any) -> None:
        """Map chunk ``handle`` at ``va`` (inside the reservation, unmapped); no access yet."""

    def set_access(self, va: int, size: int) -> None:
        """Enable reads and writes of the mapped ``[va, va + size)`` (one call a contiguous run)."""

    def unmap(self, va: int, size: int) -> None:
        """Unmap the chunk at ``va``, leaving an unmapped hole in the reservation."""

    def release(self, handle: Any) -> None:
        """Free an unmapped chunk's memory."""

    def retire(self, base: int, size: int, chunks: Iterable[Tuple[int, int, Any]]) -> None:
        """A closing pool: unmap and release every ``(va, size, handle)`` of ``chunks`` in ``[base, base + size)``."""

    def handle_id(self, handle: Any) -> Optional[int]:
        """A number naming chunk ``handle`` in records (snapshots, ``/proc/self/maps``); None before it is mapped
        (the host backend's)."""

    def location_id(self, location: str) -> Optional[int]:
        """The device ordinal of ``"device"`` chunks, the NUMA node of ``"host"`` ones; None where there is none."""

    def grant_access(self, ordinal: int, ranges: Sequence[Tuple[int, int]]) -> None:
        """Enable device ``ordinal`` over every ``(va, size)`` of ``ranges`` and every chunk mapped later;
        PeerAccessError (or UnsupportedConfigError on the host backend), having changed nothing, where it cannot."""

    def check_exportable(self, location: str) -> None:
        """UnsupportedConfigError unless chunks at ``location`` can be exported as POSIX file descriptors."""

    def synchronize(self) -> None:
        """Wait for the device's work, so that memory about to be unmapped is no longer read."""

    def close(self) -> None:
        """Release what the backend holds (the CUDA backend: its primary context)."""

    def array(self, base: int, total: int, offset: int, shape: Tuple[int, ...], dtype: Any,
              strides: Tuple[int, ...], owner: Any) -> Any:
        """An array over ``[base + offset, ...)`` of ``shape``, ``dtype`` and byte ``strides``, no copy, inside
        ``[base, base + total)``; it keeps ``owner`` alive."""


def select_backend(name: str = "auto") -> Backend:
    """A fresh backend.

    Parameters
    ----------
    name : str
        ``"cuda"``, ``"host"``, or ``"auto"``: CUDA when the current device supports virtual memory management,
        else the host (its :attr:`~Backend.reason` says why).

    Raises
    ------
    BackendUnavailableError
        An unknown name, or ``"cuda"`` where CUDA cannot be used.
    """
    if name not in BACKENDS:
        raise BackendUnavailableError(f"unknown backend {name!r}: choose one of {', '.join(BACKENDS)}")
    from .host import HostBackend
    if name == "host":
        return HostBackend("host: asked for explicitly")
    from .vmm import CudaBackend
    try:
        return CudaBackend()
    except BackendUnavailableError as exc:
        if name == "cuda":
            raise
        return HostBackend(f"host: {exc}")
