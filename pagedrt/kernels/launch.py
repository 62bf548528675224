"""Kernel launches through the driver's ``cuLaunchKernelEx``: programmatic dependent launch (PDL).

Inside :func:`dependent_launches` the plans' launches (``DecodePlan.run``, ``WritePlan.run``, and the decode
rows of a mixed step) go through :func:`launch_ex` with ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``
set; every other launch stays CuPy's. The kernels wait (``grid_dependency_wait`` in ``cuda_src/common.cuh``)
for the kernel before them: the write before it touches memory, the decode before it reads each sequence's
newest token and before it writes. Hence the contract inside :func:`dependent_launches`: what a decode reads
but the newest token of each sequence (its K/V, the tables, the lengths, q) is complete when the kernel two
launches before it is. docs/KERNELS.md ("Programmatic dependent launch") has the rest and the figures.
"""

import contextlib
import contextvars
import ctypes
import functools
from typing import Any, Dict, Iterator, List, Sequence, Tuple, cast

import numpy as np

from ..errors import LaunchArgumentError, UnsupportedConfigError

_programmatic = contextvars.ContextVar("pagedrt_programmatic_launch", default=False)
_CTYPES: Dict[np.dtype, Any] = {np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.int64): ctypes.c_int64,
           np.dtype(np.uint32): ctypes.c_uint32, np.dtype(np.int32): ctypes.c_int32,
           np.dtype(np.float32): ctypes.c_float}
_configs: Dict[tuple, Any] = {}  # (grid, block, shared_mem, stream, programmatic, cooperative) -> CUlaunchConfig
MIN_CAPABILITY = 90  # griddepcontrol and the launch attribute: compute capability 9.0 and later


def programmatic() -> bool:
    """Whether launches made now go through :func:`launch_ex` with programmatic stream serialization."""
    return _programmatic.get()


@contextlib.contextmanager
def dependent_launches() -> Iterator[None]:
    """Launch pagedrt's plans' kernels with programmatic dependent launch inside this block (this thread or task).

    Raises UnsupportedConfigError on a device below compute capability 9.0, and BackendUnavailableError
    without cuda-python."""
    import cupy
    _driver()
    capability = int(cupy.cuda.Device().compute_capability)
    if capability < MIN_CAPABILITY:
        raise UnsupportedConfigError(f"programmatic dependent launch needs compute capability 9.0 or later; this "
                                     f"device has {capability // 10}.{capability % 10}")
    token = _programmatic.set(True)
    try:
        yield
    finally:
        _programmatic.reset(token)


def kernel_params(args: Sequence[np.generic]) -> Tuple[int, Any]:
    """Kernel parameters as ``cuLaunchKernelEx`` takes them.

    Parameters
    ----------
    args : sequence of NumPy scalars
        uint64, int64, uint32, int32 or float32: the kernel's parameter types.

    Returns
    -------
    (int, object)
        The address of a ``void*`` array pointing at each argument's value, and the ctypes objects that hold
        them, to keep alive until the launch returns.

    Raises
    ------
    LaunchArgumentError
        An argument that is not one of those scalars.
    """
    values: List[Any] = []
    for i, a in enumerate(args):
        kind = _CTYPES.get(a.dtype) if isinstance(a, np.generic) else None
        if kind is None:
            raise LaunchArgumentError(f"kernel argument {i} is {type(a).__name__}: a launch through cuLaunchKernelEx "
                                      f"takes NumPy scalars of {', '.join(d.name for d in _CTYPES)}")
        values.append(kind(a.item()))
    pointers = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
    return ctypes.addressof(pointers), (values, pointers)


@functools.lru_cache(maxsize=1)
def _driver() -> Any:
    from .. import driver
    return driver.load()


def _dims(dims: Sequence[int]) -> Tuple[int, int, int]:
    return cast(Tuple[int, int, int], tuple(max(1, int(x)) for x in (tuple(dims) + (1, 1))[:3]))


def _config(drv: Any, grid: tuple, block: tuple, shared_mem: int, stream: int, programmatic_serialization: bool,
            cooperative: bool) -> Any:
    key = (grid, block, shared_mem, stream, programmatic_serialization, cooperative)
    config = _configs.get(key)
    if config is None:
        config = drv.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX, config.blockDimY, config.blockDimZ = block
        config.sharedMemBytes = shared_mem
        config.hStream = drv.CUstream(stream)
        attrs = []
        if programmatic_serialization:
            attr = drv.CUlaunchAttribute()
            attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            attrs.append(attr)
        if cooperative:
            attr = drv.CUlaunchAttribute()
            attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
            attr.value.cooperative = 1
            attrs.append(attr)
        config.attrs = attrs
        config.numAttrs = len(attrs)
        _configs[key] = config
    return config


def launch_ex(kernel: Any, grid: Sequence[int], block: Sequence[int], args: Sequence[np.generic],
              shared_mem: int = 0, *, programmatic_serialization: bool = True, cooperative: bool = False) -> None:
    """Launch ``kernel`` on the current stream with ``cuLaunchKernelEx``.

    Parameters
    ----------
    kernel : cupy.RawKernel
        Its handle is the ``CUfunction`` CuPy loaded (``kernel.kernel.ptr``).
    grid, block : int sequence
        Up to three dimensions each (missing ones are 1).
    args : sequence of NumPy scalars
        As :func:`kernel_params` takes them.
    shared_mem : int
        Dynamic shared memory in bytes.
    programmatic_serialization : bool
        Set ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``.
    cooperative : bool
        Set ``CU_LAUNCH_ATTRIBUTE_COOPERATIVE``: every block resident at once, or the launch fails (a grid-wide
        barrier inside the kernel then cannot hang).

    Raises
    ------
    CudaError
        Naming the driver's error.
    """
    import cupy
    from ..driver import call
    drv = _driver()
    stream = cupy.cuda.get_current_stream().ptr
    config = _config(drv, _dims(grid), _dims(block), int(shared_mem), stream, programmatic_serialization,
                     cooperative)
    params, _values = kernel_params(args)  # _values holds what params points at until the driver copied it
    call(drv, "cuLaunchKernelEx", config, drv.CUfunction(kernel.kernel.ptr), params, 0)


def launch(kernel: Any, grid: Sequence[int], block: Sequence[int], args: Sequence[Any], shared_mem: int = 0) -> None:
    """Launch as CuPy does, or through :func:`launch_ex` inside :func:`dependent_launches`."""
    if _programmatic.get():
        launch_ex(kernel, grid, block, args, shared_mem)
    else:
        kernel(grid, block, args, shared_mem=shared_mem)
