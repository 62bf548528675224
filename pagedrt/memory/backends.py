"""Choosing a pool backend: CUDA when usable, else the host, saying why."""

from ..errors import BackendUnavailableError

BACKENDS = ("auto", "cuda", "host")


def select_backend(name="auto"):
    """A fresh backend instance for ``name`` ("auto", "cuda" or "host")."""
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
