"""What pagedrt supports: the one list of dtypes, head dims, block sizes and group sizes.

The cache, the kernels and the CLI all check against these lists, so a value
is supported everywhere or nowhere. A failed check raises
:class:`~pagedrt.errors.UnsupportedConfigError` naming the value and the choices.
"""

import functools

import numpy as np

from .errors import UnsupportedConfigError

DTYPES = ("float16", "bfloat16", "float32")
HEAD_DIMS = (64, 80, 96, 128, 256)
BLOCK_SIZES = (8, 16, 32, 64, 128)
GROUPS = tuple(range(1, 9))  # query heads per KV head


def check(what, value, supported):
    """Raise UnsupportedConfigError unless ``value`` is one of ``supported``."""
    if value not in supported:
        raise UnsupportedConfigError(
            f"{what}={value!r} is not supported: use one of {', '.join(map(str, supported))}")


@functools.lru_cache(maxsize=None)
def dtype_name(dtype):
    """The supported name ("float16", "bfloat16", "float32") of a dtype or dtype name, else raise.

    Cached: NumPy takes microseconds to name a dtype, and launchers ask on every call."""
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


def numpy_dtype(dtype):
    """The NumPy dtype of a supported dtype or name; bfloat16 comes from the ml_dtypes package."""
    name = dtype_name(dtype)
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise UnsupportedConfigError("bfloat16 needs the ml_dtypes package: pip install ml_dtypes") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)
