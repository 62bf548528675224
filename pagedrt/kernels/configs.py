"""What the kernels support, and the configurations that stand for all of them.

Kernels are compiled per (dtype, head_dim, block_size, group). ``sweep()`` is the
representative set: the base configuration and every value of each axis varied
alone, plus the heaviest group for every dtype x head_dim (registers and shared
memory grow with the group). The CI compile check and the GPU tests both use it.
"""

import functools
from dataclasses import dataclass

from ..supported import BLOCK_SIZES, DTYPES, GROUPS, HEAD_DIMS, check, dtype_name

CUDA_TYPES = dict(zip(DTYPES, ("__half", "__nv_bfloat16", "float")))


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
def config(dtype, head_dim, block_size, group, groups=GROUPS):
    """A checked :class:`Config`; raises UnsupportedConfigError naming the bad value. ``groups``: the group
    sizes the caller's kernel takes (decode's GROUPS, or prefill's PREFILL_GROUPS)."""
    name = dtype_name(dtype)
    check("head_dim", head_dim, HEAD_DIMS)
    check("block_size", block_size, BLOCK_SIZES)
    check("group (query heads per KV head)", group, groups)
    return Config(name, head_dim, block_size, group)


def sweep():
    """The representative configurations, base first, without repeats."""
    out = [BASE]
    out += [Config(d, h, BASE.block_size, BASE.group) for d in CUDA_TYPES for h in HEAD_DIMS]
    out += [Config(BASE.dtype, BASE.head_dim, b, BASE.group) for b in BLOCK_SIZES]
    out += [Config(BASE.dtype, BASE.head_dim, BASE.block_size, g) for g in GROUPS]
    out += [Config(d, h, BASE.block_size, max(GROUPS)) for d in CUDA_TYPES for h in HEAD_DIMS]
    return list(dict.fromkeys(out))
