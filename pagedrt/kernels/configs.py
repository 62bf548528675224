"""What the kernels support, and the configurations that stand for all of them.

Kernels are compiled per (dtype, head_dim, block_size, group). ``sweep()`` is the
representative set: the base configuration and every value of each axis varied
alone, plus the heaviest group for every dtype x head_dim (registers and shared
memory grow with the group). The CI compile check and the GPU tests both use it.
"""

import functools
from dataclasses import dataclass

from ..errors import UnsupportedConfigError

from ..supported import (BLOCK_SIZES, DTYPES, FP8, FP8_DTYPES, FP8_HEAD_DIMS, GROUPS, HEAD_DIMS, check, check_fp8,
                         dtype_name, kv_dtype_name)

CUDA_TYPES = dict(zip(DTYPES, ("__half", "__nv_bfloat16", "float")))


@dataclass(frozen=True)
class Config:
    dtype: str       # a key of CUDA_TYPES
    head_dim: int
    block_size: int
    group: int       # query heads per KV head
    kv_dtype: str = None  # what the K/V planes hold when not ``dtype``: FP8 (float8 e4m3 bits)

    @property
    def cuda_type(self):
        return CUDA_TYPES[self.dtype]

    @property
    def itemsize(self):
        return 2 if self.dtype != "float32" else 4

    @property
    def fp8(self):
        return self.kv_dtype == FP8

    @property
    def kv_itemsize(self):
        """Bytes of one stored K or V element."""
        return 1 if self.fp8 else self.itemsize


BASE = Config("float16", 128, 16, 4)


@functools.lru_cache(maxsize=None)
def config(dtype, head_dim, block_size, group, groups=GROUPS, kv_dtype=None):
    """A checked :class:`Config`; raises UnsupportedConfigError naming the bad value. ``groups``: the group
    sizes the caller's kernel takes (decode's GROUPS, or prefill's PREFILL_GROUPS); ``kv_dtype``: what the
    planes hold (a storage dtype or name, uint8 meaning FP8; None: ``dtype``)."""
    name = dtype_name(dtype)
    check("head_dim", head_dim, HEAD_DIMS)
    check("block_size", block_size, BLOCK_SIZES)
    check("group (query heads per KV head)", group, groups)
    kv = None if kv_dtype is None else kv_dtype_name(kv_dtype)
    if kv == FP8:
        check_fp8(name, head_dim)
    elif kv is not None and kv != name:
        raise UnsupportedConfigError(f"K/V of {kv} with q of {name}: q and K/V must match, or K/V be {FP8}")
    return Config(name, head_dim, block_size, group, None if kv == name else kv)


def sweep():
    """The representative configurations, base first, without repeats."""
    out = [BASE]
    out += [Config(d, h, BASE.block_size, BASE.group) for d in CUDA_TYPES for h in HEAD_DIMS]
    out += [Config(BASE.dtype, BASE.head_dim, b, BASE.group) for b in BLOCK_SIZES]
    out += [Config(BASE.dtype, BASE.head_dim, BASE.block_size, g) for g in GROUPS]
    out += [Config(d, h, BASE.block_size, max(GROUPS)) for d in CUDA_TYPES for h in HEAD_DIMS]
    return list(dict.fromkeys(out))


def fp8_sweep():
    """The representative FP8 configurations (q of float16 or bfloat16 over float8 e4m3 K/V): every q dtype
    x head_dim at the base block size and group, every block size and every group at the base."""
    out = [Config(d, h, BASE.block_size, BASE.group, FP8) for d in FP8_DTYPES for h in FP8_HEAD_DIMS]
    out += [Config(BASE.dtype, BASE.head_dim, b, BASE.group, FP8) for b in BLOCK_SIZES]
    out += [Config(BASE.dtype, h, BASE.block_size, g, FP8) for h in FP8_HEAD_DIMS for g in GROUPS]
    return list(dict.fromkeys(out))
