"""KVSpec: what a KV cache holds, said once; and the one place a dtype or K/V dtype is interpreted.

:meth:`KVSpec.build` checks and normalises a cache's shape (layers, KV heads,
head_dim, block size), its model dtype (q, k, v and the attention output), its K/V
dtype (what the planes store: the model's dtype, or :data:`~pagedrt.supported.FP8`)
and its placement, against the tables of :mod:`pagedrt.supported`. The cache builds
it once (``cache.spec``) and hands it down: the layout (:meth:`pagedrt.layout.Layout.plan`)
and everything that sizes or views planes read its derived fields (:attr:`~KVSpec.is_fp8`,
:attr:`~KVSpec.kv_numpy_dtype`, :attr:`~KVSpec.itemsize`, :attr:`~KVSpec.bytes_per_token`).

Launchers are called with bare arrays (``kernels.write_kv(k, v, k_plane, v_plane,
slots)``, ``attention.DecodePlan(q, k_plane, tables, lens)``), so what a plane holds
travels with it, in its NumPy dtype. NumPy has no float8: FP8 planes hold the bits as
uint8. A launcher learns a plane's K/V dtype through :func:`plane_kv_dtype` only, and
passes that name to :func:`pagedrt.kernels.configs.config`; no launcher tests dtypes of
its own. A cache's planes are views in ``spec.kv_numpy_dtype``, so a launcher reads from a
cache's plane what its spec says. Asking for FP8 takes its name (``kv_dtype="float8_e4m3"``):
a uint8 dtype says nothing of what its bytes mean, and is refused. The names elsewhere are
the canonical ones this module returns.
"""

import functools
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np

from .errors import UnsupportedConfigError
from .supported import (BLOCK_SIZES, DTYPES, FP8, FP8_DTYPES, FP8_HEAD_DIMS, HEAD_DIMS, KV_DTYPES, KV_ITEMSIZES,
                        PLACEMENTS, check, check_positive)

DTypeLike = Union[str, np.dtype, type]
Array = Any  # a numpy.ndarray (the host backend: the NumPy reference runs) or a cupy.ndarray (cupy imported lazily)


def dtype_name(dtype: DTypeLike) -> str:
    """The supported name of a model dtype.

    Parameters
    ----------
    dtype : str, numpy.dtype or type
        "float16", "bfloat16" or "float32", or a NumPy dtype (bfloat16 as ``ml_dtypes.bfloat16``).

    Returns
    -------
    str
        One of :data:`~pagedrt.supported.DTYPES`; UnsupportedConfigError for anything else.
    """
    try:
        return _dtype_name(dtype)
    except TypeError:  # unhashable: no dtype
        raise UnsupportedConfigError(
            f"dtype {dtype!r:.80} is not supported: use one of {', '.join(DTYPES)}") from None


@functools.lru_cache(maxsize=None)
def _dtype_name(dtype):
    """Cached: NumPy takes microseconds to name a dtype, and launchers ask on every call."""
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = repr(dtype)
    if name not in DTYPES:
        raise UnsupportedConfigError(
            f"dtype {name!r} is not supported: use one of {', '.join(DTYPES)} (bfloat16 as ml_dtypes.bfloat16)")
    return name


def numpy_dtype(dtype: DTypeLike) -> np.dtype:
    """The NumPy dtype of a supported model dtype or name; bfloat16 comes from the ml_dtypes package.

    Parameters
    ----------
    dtype : str, numpy.dtype or type
        As :func:`dtype_name` takes it.
    """
    name = dtype_name(dtype)
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise UnsupportedConfigError("bfloat16 needs the ml_dtypes package: pip install ml_dtypes") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def kv_dtype_of(kv_dtype: Optional[DTypeLike], dtype: str, head_dim: int) -> str:
    """The canonical K/V dtype that planes under q of ``dtype`` and ``head_dim`` store for the asked ``kv_dtype``.

    Parameters
    ----------
    kv_dtype : str, numpy.dtype, type or None
        None (the model's dtype), a model dtype, or :data:`~pagedrt.supported.FP8` (the name only: a uint8
        dtype says nothing of what its bytes mean).
    dtype : str
        The model's dtype (q and the attention output), a name from :data:`~pagedrt.supported.DTYPES`.
    head_dim : int
        A supported head_dim.

    Returns
    -------
    str
        ``dtype`` or FP8. UnsupportedConfigError for any other K/V dtype, and for FP8 where it is not supported
        (``dtype`` not in FP8_DTYPES, ``head_dim`` not in FP8_HEAD_DIMS).
    """
    if kv_dtype is None:
        return dtype
    if isinstance(kv_dtype, str) and kv_dtype == FP8:
        check("dtype (q and output over FP8 K/V)", dtype, FP8_DTYPES)
        check("head_dim (FP8 K/V)", head_dim, FP8_HEAD_DIMS)
        return FP8
    try:
        name = dtype_name(kv_dtype)
    except UnsupportedConfigError:
        raise UnsupportedConfigError(
            f"K/V dtype {kv_dtype!r:.80} is not supported: use one of {', '.join(KV_DTYPES)}") from None
    if name != dtype:
        raise UnsupportedConfigError(f"kv_dtype={name!r} with dtype={dtype!r}: K/V are stored in the model's dtype "
                                     f"or as {FP8}")
    return name


def plane_kv_dtype(plane_dtype: np.dtype) -> Optional[str]:
    """What a K or V plane of NumPy dtype ``plane_dtype`` holds when it is not q's dtype: the one reading of it.

    Parameters
    ----------
    plane_dtype : numpy.dtype
        The plane's ``dtype``.

    Returns
    -------
    str or None
        :data:`~pagedrt.supported.FP8` for uint8 planes (float8 e4m3 bits: NumPy has no float8), else None: the
        plane holds its own dtype, which a launcher requires to be q's.
    """
    return FP8 if plane_dtype == np.uint8 else None


@dataclass(frozen=True)
class KVSpec:
    """What a KV cache holds: its shape, model dtype, K/V dtype and placement, checked (:meth:`build`).

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim, block_size : int
        The cache's shape: a block holds ``block_size`` tokens of ``num_kv_heads`` heads of ``head_dim``
        values, for K and for V of every layer.
    dtype : numpy.dtype
        The model's dtype: q, k, v and the attention output.
    kv_dtype : str
        What the planes store, a name from :data:`~pagedrt.supported.KV_DTYPES`: ``dtype``'s name, or FP8.
    placement : str
        "plane" or "block" (:mod:`pagedrt.layout`).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: np.dtype
    kv_dtype: str
    placement: str = "plane"

    @classmethod
    def build(cls, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
              dtype: DTypeLike = "float16", kv_dtype: Optional[DTypeLike] = None,
              placement: str = "plane") -> "KVSpec":
        """The checked, normalised spec; UnsupportedConfigError naming the first bad value.

        Parameters
        ----------
        num_layers, num_kv_heads : int
            Positive.
        head_dim, block_size : int
            From :data:`~pagedrt.supported.HEAD_DIMS` and :data:`~pagedrt.supported.BLOCK_SIZES` (FP8: head_dim
            from FP8_HEAD_DIMS).
        dtype : str, numpy.dtype or type
            The model's dtype (:func:`numpy_dtype`).
        kv_dtype : str, numpy.dtype, type or None
            What the planes store (:func:`kv_dtype_of`); None: ``dtype``.
        placement : str
            One of :data:`~pagedrt.supported.PLACEMENTS`.
        """
        num_layers, num_kv_heads = check_positive("num_layers", num_layers), check_positive("num_kv_heads", num_kv_heads)
        head_dim = check("head_dim", head_dim, HEAD_DIMS)
        block_size = check("block_size", block_size, BLOCK_SIZES)
        placement = check("placement", placement, PLACEMENTS)
        dtype = numpy_dtype(dtype)
        kv = kv_dtype_of(kv_dtype, dtype.name, head_dim)
        return cls(num_layers, num_kv_heads, head_dim, block_size, dtype, kv, placement)

    @property
    def is_fp8(self) -> bool:
        """Whether the planes hold float8 e4m3 bits (under float32 scales per layer and KV head)."""
        return self.kv_dtype == FP8

    @property
    def kv_numpy_dtype(self) -> np.dtype:
        """The NumPy dtype planes are held in: uint8 (the bits) for FP8, else the model's dtype."""
        return np.dtype(np.uint8) if self.is_fp8 else self.dtype

    @property
    def itemsize(self) -> int:
        """Bytes of one stored K or V value."""
        return KV_ITEMSIZES[self.kv_dtype]

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token over every layer and KV head."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def scales_shape(self) -> Optional[tuple]:
        """FP8: the shape of the scales, [num_layers, 2 (K then V), num_kv_heads]; else None."""
        return (self.num_layers, 2, self.num_kv_heads) if self.is_fp8 else None

    def shard(self, parts: int) -> "KVSpec":
        """The spec of one of ``parts`` shards that split the KV heads evenly (``parts`` divides them)."""
        return KVSpec(self.num_layers, self.num_kv_heads // parts, self.head_dim, self.block_size, self.dtype,
                      self.kv_dtype, self.placement)
