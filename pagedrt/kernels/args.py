"""Checks the launchers share: which array module, shapes, strides, dtypes, alignment.

Every check raises :class:`LaunchArgumentError` (or UnsupportedConfigError from
``configs``) before anything is launched or written. Helpers that talk to the
device import cupy lazily, so the NumPy path works without it.
"""

import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..errors import LaunchArgumentError
from ..spec import Array



def array_module(**arrays: Optional[Array]) -> Any:
    """numpy if every given array is a NumPy array, cupy if every one is a CuPy array on the current device;
    LaunchArgumentError otherwise (None entries are skipped)."""
    xp = array_kind(**arrays)
    if xp is np:
        return np
    device = xp.cuda.Device().id
    for name, a in arrays.items():
        if a is not None and a.device.id != device:
            raise LaunchArgumentError(
                f"{name} is on device {a.device.id} but the current device is {device}: "
                "move it, or launch under `with cupy.cuda.Device(...)`")
    return xp


def array_kind(**arrays: Optional[Array]) -> Any:
    """numpy if every given array is a NumPy array, cupy if every one is a CuPy array (on any devices)."""
    kinds: Dict[str, List[str]] = {}
    for name, a in arrays.items():
        if a is None:
            continue
        top = type(a).__module__.split(".")[0]
        if top not in ("numpy", "cupy") or not hasattr(a, "dtype"):
            raise LaunchArgumentError(f"{name} must be a NumPy or CuPy array, got {type(a).__name__}")
        kinds.setdefault(top, []).append(name)
    if len(kinds) > 1:
        raise LaunchArgumentError(
            f"arrays mix NumPy ({', '.join(kinds['numpy'])}) and CuPy ({', '.join(kinds['cupy'])}): "
            "pass all of them on the host or all on the device")
    if "cupy" not in kinds:
        return np
    import cupy
    return cupy


def check(condition: Any, message: Union[str, Callable[[], str]]) -> None:
    """Raise LaunchArgumentError unless ``condition``. ``message`` is a string, or a callable that
    builds one: launchers run these checks on every call, and formatting a message (dtype names
    above all) cost more host time than the launch itself (``python3 -m pagedrt.bench.launch``)."""
    if not condition:
        raise LaunchArgumentError(message() if callable(message) else message)


def c_contiguous(name: str, a: Array, ndim: int) -> None:
    """LaunchArgumentError unless ``a`` (called ``name`` in the message) is C-contiguous with ``ndim`` dimensions."""
    check(a.ndim == ndim, lambda: f"{name} must be {ndim}-D, got shape {a.shape}")
    check(a.flags.c_contiguous, lambda: f"{name} (shape {a.shape}, strides {a.strides}) must be C-contiguous: "
                                        f"pass {name}.copy() or an array made contiguous")


def int_array(name: str, a: Array, dtype: Any, ndim: int) -> None:
    """LaunchArgumentError unless ``a`` has ``dtype`` (int32 or int64) and ``ndim`` dimensions."""
    check(a.dtype == dtype, lambda: f"{name} must be {np.dtype(dtype).name}, got {a.dtype}: convert with "
                                    f"{name}.astype({np.dtype(dtype).name})")
    check(a.ndim == ndim, lambda: f"{name} must be {ndim}-D, got shape {a.shape}")


def positive_int(name: str, value: Any, upper: Optional[int] = None) -> Optional[int]:
    """``value`` as an int: None stays None, else LaunchArgumentError unless a positive int (not a bool) of at
    most ``upper``."""
    if value is None:
        return None
    check(isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1,
          lambda: f"{name} must be a positive int, got {value!r}")
    check(upper is None or value <= upper, lambda: f"{name}={value} exceeds its limit {upper}")
    return int(value)


@dataclass(frozen=True)
class Plane:
    """A checked K or V plane: [num_blocks, num_kv_heads, block_size, head_dim], blocks block_stride apart."""

    num_blocks: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    block_stride: int  # elements

    @property
    def block_elems(self) -> int:
        """Elements of one block: ``num_kv_heads * block_size * head_dim``."""
        return self.num_kv_heads * self.block_size * self.head_dim


def plane(name: str, a: Array) -> Plane:
    """Check a plane's layout and describe it: 4-D ``[num_blocks, num_kv_heads, block_size, head_dim]``,
    C-contiguous inside a block, any block stride of at least a block and a multiple of 16 bytes;
    LaunchArgumentError otherwise."""
    check(a.ndim == 4,
          lambda: f"{name} must be 4-D [num_blocks, num_kv_heads, block_size, head_dim], got shape {a.shape}")
    n, h, b, d = (int(x) for x in a.shape)
    check(min(n, h, b, d) >= 1, lambda: f"{name} has an empty dimension: shape {a.shape}")
    size = a.itemsize
    inner = (h * b * d * size, b * d * size, d * size, size)
    check(tuple(a.strides[1:]) == inner[1:],
          lambda: f"{name} must be C-contiguous inside a block (strides [..., {inner[1]}, {inner[2]}, {inner[3]}] "
                  f"bytes), got strides {a.strides}: a plane is [blocks, kv heads, slots, head_dim] with only the "
                  "block stride free")
    stride = a.strides[0]
    check(stride >= inner[0] and stride % 16 == 0,
          lambda: f"{name} has block stride {stride} bytes: it must be at least one block ({inner[0]} bytes) "
                  "and a multiple of 16 bytes")
    return Plane(n, h, b, d, stride // size)


def aligned(name: str, a: Array) -> None:
    """LaunchArgumentError unless device array ``a`` starts on a 16-byte boundary (kernels read 16-byte vectors)."""
    check(a.data.ptr % 16 == 0, lambda: f"{name} starts at {a.data.ptr:#x}, not 16-byte aligned: pass an array "
                                        "whose data starts on a 16-byte boundary (e.g. a fresh copy)")


def same_layout(name: str, a: Array, layout: tuple, what: str) -> None:
    """Check that ``a`` has the (shape, strides, dtype) ``layout`` of the plan's ``what`` (a plan's run)."""
    check((a.shape, a.strides, a.dtype) == layout,
          lambda: f"{name} ({a.dtype}, shape {a.shape}, strides {a.strides}) must match the plan's {what} "
                  f"({layout[2]}, shape {layout[0]}, strides {layout[1]}): planes of the same shape and block "
                  "stride")


@dataclass(frozen=True)
class RunArrays:
    """What a plan's run accepts, recorded when the plan is made: arrays of the plan's type (NumPy or
    CuPy), q (and out) C-contiguous of the plan's q shape and dtype, K and V planes of the plan's layout
    (shape, strides, dtype) and, for planes in a pool, a pool still open (``spans``, a
    :class:`~pagedrt.kernels.validate.Spans`)."""

    array_type: type
    q_shape: tuple
    q_dtype: Any
    layout: tuple  # the K plane's (shape, strides, dtype)
    what: str      # what the layout is called in messages: "K plane", or "k" for contiguous K/V
    spans: Any     # a validate.Spans

    def check(self, q: Array, k_cache: Array, v_cache: Array, out: Optional[Array]) -> None:
        """Raise LaunchArgumentError (PoolClosedError for a closed pool) unless one run's arrays fit the plan."""
        array_type = self.array_type
        check(type(q) is array_type and type(k_cache) is array_type and type(v_cache) is array_type
              and (out is None or type(out) is array_type),
              lambda: f"q, k_cache, v_cache and out must be {array_type.__module__}.{array_type.__name__}s, as "
                      "the plan's: NumPy or CuPy arrays, not a mix")
        if self.spans.pools:
            self.spans.check_open()
        shape, dtype = self.q_shape, self.q_dtype
        check(q.shape == shape and q.dtype == dtype and q.flags.c_contiguous,
              lambda: f"q must be C-contiguous {dtype} of shape {shape}, as the plan's, got {q.dtype} {q.shape}")
        same_layout("k_cache", k_cache, self.layout, self.what)
        same_layout("v_cache", v_cache, self.layout, self.what)
        if out is not None:
            check(out.shape == shape and out.dtype == dtype and out.flags.c_contiguous,
                  lambda: f"out must be C-contiguous {dtype} of q's shape {shape}, got {out.dtype} {out.shape}")


def check_scales(kv_heads: Optional[int], array_type: Any, k_scale: Optional[Array], v_scale: Optional[Array]) -> None:
    """Raise LaunchArgumentError unless the scales fit the planes: for FP8 planes (``kv_heads`` not None) two
    contiguous float32 arrays of ``kv_heads`` entries of ``array_type``; for other planes none."""
    if kv_heads is None:
        check(k_scale is None and v_scale is None,
              "k_scale and v_scale are for FP8 (float8_e4m3) planes only: these planes hold q's dtype")
        return
    scales: Tuple[Tuple[str, Any], ...] = (("k_scale", k_scale), ("v_scale", v_scale))
    for name, a in scales:
        check(a is not None, lambda: f"FP8 (float8_e4m3) planes need {name}: float32 [{kv_heads}], one scale per "
                                     "KV head of this layer (cache.k_scale(layer), cache.v_scale(layer))")
        check(type(a) is array_type and a.dtype == np.float32 and a.shape == (kv_heads,) and a.flags.c_contiguous,
              lambda: f"{name} must be a contiguous float32 {array_type.__module__} array of shape ({kv_heads},) "
                      f"(one scale per KV head), got {type(a).__name__} {getattr(a, 'dtype', '')} "
                      f"{getattr(a, 'shape', '')}")


def scale_keywords(kv_heads: Optional[int], k_scale: Optional[Array], v_scale: Optional[Array]) -> Dict[str, Array]:
    """The scales as a reference takes them: ``k_scale=``, ``v_scale=`` for FP8 planes (``kv_heads`` not None),
    none for other planes."""
    return {} if kv_heads is None else {"k_scale": k_scale, "v_scale": v_scale}


def scale_pointers(device: Optional[int], kv_heads: Optional[int], k_scale: Optional[Array],
                   v_scale: Optional[Array]) -> Tuple[np.uint64, ...]:
    """The scales as a kernel takes them, after its other arguments: their pointers for FP8 planes (``kv_heads``
    not None; on the plan's device, as :func:`device_pointers` checks; a kernel reads them one float at a time,
    so a view such as ``cache.v_scale(layer)``, 4 bytes past a 16-byte boundary with one KV head, will do),
    nothing for other planes."""
    if kv_heads is None:
        return ()
    on_device(device, (k_scale, v_scale))
    return ptr(k_scale), ptr(v_scale)


def store(result: np.ndarray, out: Optional[np.ndarray]) -> np.ndarray:
    """A plan's host result, written into ``out`` when the caller gave one."""
    if out is None:
        return result
    out[...] = result
    return out


def device_pointers(device: Optional[int], names: Sequence[str], arrays: Sequence[Array]) -> List[np.uint64]:
    """Kernel arguments for device arrays (a plan's run): on the plan's ``device``, which must be the
    current one, and 16-byte aligned."""
    on_device(device, arrays)
    pointers = [a.data.ptr for a in arrays]
    if any(p % 16 for p in pointers):
        for name, a in zip(names, arrays):
            aligned(name, a)
    return [np.uint64(p) for p in pointers]


def on_device(device: Optional[int], arrays: Sequence[Array]) -> None:
    """Check that the current device is the plan's ``device`` and that ``arrays`` are on it."""
    import cupy
    check(cupy.cuda.Device().id == device and all(a.device.id == device for a in arrays),
          lambda: f"the plan was made on device {device}: run it there, with arrays on that device")


def ptr(a: Array) -> np.uint64:
    """A device array's address as a kernel argument (independent of how CuPy treats its dtype)."""
    return np.uint64(a.data.ptr)


NULL = np.uint64(0)


@functools.lru_cache(maxsize=None)
def multiprocessors(device_id: int) -> int:
    """The streaming multiprocessors of CUDA device ``device_id`` (cached)."""
    import cupy
    return cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"]
