"""What pagedrt supports: the one list of dtypes, head dims, block sizes and group sizes.

The cache, the kernels and the CLI all check against these lists, so a value
is supported everywhere or nowhere. A failed check raises
:class:`~pagedrt.errors.UnsupportedConfigError` naming the value and the choices.
"""

import functools

import numpy as np

from .errors import UnsupportedConfigError

DTYPES = ("float16", "bfloat16", "float32")
FP8 = "float8_e4m3"  # K/V stored as float8 e4m3 with float32 scales per (layer, KV head): pagedrt.fp8
KV_DTYPES = DTYPES + (FP8,)  # what K/V planes may hold
FP8_DTYPES = ("float16", "bfloat16")  # q and output dtypes over FP8 planes
FP8_HEAD_DIMS = (64, 128)  # FP8 decode runs on tensor cores only (cuda_src/decode.cu: decode_fp8)
HEAD_DIMS = (64, 80, 96, 128, 256)  # decode's
PREFILL_HEAD_DIMS = (64, 128, 256)  # prefill's (whole groups of 8 16-byte chunks per row), so a cache's
BLOCK_SIZES = (8, 16, 32, 64, 128)
GROUPS = tuple(range(1, 65))  # query heads per KV head (multi-query models reach 64): decode and prefill

# The largest cache the bookkeeping can describe. Block ids, lengths and positions are
# int32 in the tables kernels read; a sequence's length plus any count checked against
# it stays below 2**31; the table lives on the host and the device at once.
MAX_BLOCKS = 2**31 - 1          # block ids
MAX_SEQ_LEN = 2**30             # tokens in one sequence
MAX_SEQS = 2**20                # block-table rows
MAX_TABLE_ENTRIES = 2**30       # max_seqs x blocks per row (4 GiB of int32)
MAX_POOL_BYTES = 2**46          # one reservation: within a 47-bit user address space, and a GPU's


def check(what, value, supported):
    """``value`` if it is one of ``supported`` (and of their type: 64.0 is not a head_dim), else raise
    UnsupportedConfigError. NumPy integers come back as ints."""
    expected_type = str if isinstance(supported[0], str) else (int, np.integer)
    if not isinstance(value, expected_type) or isinstance(value, bool) or value not in supported:
        raise UnsupportedConfigError(
            f"{what}={value!r} is not supported: use one of {', '.join(map(str, supported))}")
    return value if isinstance(value, str) else int(value)


def dtype_name(dtype):
    """The supported name ("float16", "bfloat16", "float32") of a dtype or dtype name, else raise."""
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


def kv_dtype_name(dtype):
    """The name of a K/V storage dtype: one of KV_DTYPES, or a dtype: uint8 is how FP8 planes are held
    (NumPy has no float8), so a uint8 plane is an FP8 one."""
    if isinstance(dtype, str) and dtype == FP8:
        return FP8
    try:
        if not isinstance(dtype, str) and np.dtype(dtype) == np.uint8:
            return FP8
    except TypeError:
        pass
    try:
        return dtype_name(dtype)
    except UnsupportedConfigError:
        raise UnsupportedConfigError(
            f"K/V dtype {dtype!r:.80} is not supported: use one of {', '.join(KV_DTYPES)}") from None


def kv_numpy_dtype(dtype):
    """The NumPy dtype K/V planes of a storage dtype are held in: uint8 (the bits) for FP8."""
    name = kv_dtype_name(dtype)
    return np.dtype(np.uint8) if name == FP8 else numpy_dtype(name)


def check_fp8(dtype, head_dim):
    """Raise UnsupportedConfigError unless q/out dtype ``dtype`` and ``head_dim`` may go with FP8 K/V."""
    check("dtype (q and output over FP8 K/V)", dtype_name(dtype), FP8_DTYPES)
    check("head_dim (FP8 K/V)", head_dim, FP8_HEAD_DIMS)


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
