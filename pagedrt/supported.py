"""What pagedrt supports: the one list of dtypes, head dims, block sizes and group sizes.

The cache, the kernels and the CLI all check against these lists, so a value
is supported everywhere or nowhere. A failed check raises
:class:`~pagedrt.errors.UnsupportedConfigError` naming the value and the choices.
Dtypes and K/V dtypes are interpreted in one place, :mod:`pagedrt.spec`.
"""

from typing import Any, Optional, Sequence, TypeVar

import numpy as np

from .errors import UnsupportedConfigError

DTYPES = ("float16", "bfloat16", "float32")
FP8 = "float8_e4m3"  # K/V stored as float8 e4m3 with float32 scales per (layer, KV head): pagedrt.fp8
KV_DTYPES = DTYPES + (FP8,)  # what K/V planes may hold
KV_ITEMSIZES = {"float16": 2, "bfloat16": 2, "float32": 4, FP8: 1}  # bytes of one stored K/V value
FP8_DTYPES = ("float16", "bfloat16")  # q and output dtypes over FP8 planes
FP8_HEAD_DIMS = (64, 128)  # FP8 decode runs on tensor cores only (cuda_src/decode.cu: decode_fp8)
HEAD_DIMS = (64, 80, 96, 128, 256)  # decode's
PREFILL_HEAD_DIMS = (64, 128, 256)  # prefill's (whole groups of 8 16-byte chunks per row), so a cache's
BLOCK_SIZES = (8, 16, 32, 64, 128)
PLACEMENTS = ("plane", "block")  # how a pool's range holds the planes (pagedrt.layout)
GROUPS = tuple(range(1, 65))  # query heads per KV head (multi-query models reach 64): decode and prefill

# The largest cache the bookkeeping can describe. Block ids, lengths and positions are
# int32 in the tables kernels read; a sequence's length plus any count checked against
# it stays below 2**31; the table lives on the host and the device at once.
MAX_BLOCKS = 2**31 - 1          # block ids
MAX_SEQ_LEN = 2**30             # tokens in one sequence
MAX_SEQS = 2**20                # block-table rows
MAX_TABLE_ENTRIES = 2**30       # max_seqs x blocks per row (4 GiB of int32)
MAX_POOL_BYTES = 2**46          # one reservation: within a 47-bit user address space, and a GPU's

Choice = TypeVar("Choice", str, int)  # what a list of choices holds, and so what check() returns


def check(what: str, value: Any, supported: Sequence[Choice]) -> Choice:
    """``value`` if it is one of ``supported`` (and of their type: 64.0 is not a head_dim), else raise
    UnsupportedConfigError. NumPy integers come back as ints."""
    expected_type = str if isinstance(supported[0], str) else (int, np.integer)
    if not isinstance(value, expected_type) or isinstance(value, bool) or value not in supported:
        raise UnsupportedConfigError(
            f"{what}={value!r} is not supported: use one of {', '.join(map(str, supported))}")
    return value if isinstance(value, str) else int(value)


def check_positive(what: str, value: Any, limit: Optional[int] = None) -> int:
    """``value`` as an int if it is a positive int (not a bool; at most ``limit`` when given), else raise
    UnsupportedConfigError."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise UnsupportedConfigError(f"{what} must be a positive int, got {value!r:.80}")
    if limit is not None and value > limit:
        raise UnsupportedConfigError(f"{what}={value} is more than pagedrt supports: at most {limit}")
    return int(value)
