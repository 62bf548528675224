"""What the kernels support, and the configurations that stand for all of them.

Kernels are compiled per (dtype, head_dim, block_size, group). ``sweep()`` is the
representative set: the base configuration and every value of each axis varied
alone, plus the heaviest group for every dtype x head_dim (registers and shared
memory grow with the group). The CI compile check and the GPU tests both use it.
"""

import functools
from dataclasses import dataclass

import numpy as np

from ..errors import UnsupportedConfigError

CUDA_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}
HEAD_DIMS = (64, 80, 96, 128, 256)
BLOCK_SIZES = (8, 16, 32, 64, 128)
GROUPS = tuple(range(1, 9))


@dataclass(frozen=True)
class Config:
    dtype: str       # a key of CUDA_TYPES
    head_dim: int
    block_size: int
    group: int       # query heads per KV head

    @property
    def cuda_type(self):
        return CUDA_TYPES[self.dtype]

    @property
    def itemsize(self):
        return 2 if self.dtype != "float32" else 4


BASE = Config("float16", 128, 16, 4)


@functools.lru_cache(maxsize=None)
def dtype_name(dtype):
    """The supported name of a NumPy/CuPy dtype ("float16", "bfloat16", "float32"), else raise.

    Cached, as :func:`config` is: NumPy takes microseconds to name a dtype, and launchers ask on every call."""
    name = np.dtype(dtype).name
    if name not in CUDA_TYPES:
        raise UnsupportedConfigError(
            f"dtype {name} is not supported: use one of {', '.join(CUDA_TYPES)} "
            "(bfloat16 as ml_dtypes.bfloat16)")
    return name


def _check(what, value, supported):
    if value not in supported:
        raise UnsupportedConfigError(
            f"{what}={value} is not supported: use one of {', '.join(map(str, supported))}")


@functools.lru_cache(maxsize=None)
def config(dtype, head_dim, block_size, group):
    """A checked :class:`Config`; raises UnsupportedConfigError naming the bad value."""
    name = dtype_name(dtype)
    _check("head_dim", head_dim, HEAD_DIMS)
    _check("block_size", block_size, BLOCK_SIZES)
    _check("group (query heads per KV head)", group, GROUPS)
    return Config(name, head_dim, block_size, group)


def sweep():
    """The representative configurations, base first, without repeats."""
    out = [BASE]
    out += [Config(d, h, BASE.block_size, BASE.group) for d in CUDA_TYPES for h in HEAD_DIMS]
    out += [Config(BASE.dtype, BASE.head_dim, b, BASE.group) for b in BLOCK_SIZES]
    out += [Config(BASE.dtype, BASE.head_dim, BASE.block_size, g) for g in GROUPS]
    out += [Config(d, h, BASE.block_size, max(GROUPS)) for d in CUDA_TYPES for h in HEAD_DIMS]
    return list(dict.fromkeys(out))
