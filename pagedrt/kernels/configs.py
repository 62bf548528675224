"""What the kernels support, and the configurations that stand for all of them.

Kernels are compiled per (dtype, head_dim, block_size, group). ``sweep()`` is the
representative set: the base configuration and every value of each axis varied
alone (the groups: SWEEP_GROUPS), plus the heaviest groups, 8 and 64, for every
dtype x head_dim (registers and shared memory grow with the group). The CI compile check and the GPU tests
both use it.
"""

import functools
from dataclasses import dataclass
from typing import List, Optional

from ..spec import DTypeLike, dtype_name, kv_dtype_of
from ..supported import BLOCK_SIZES, DTYPES, FP8, FP8_DTYPES, FP8_HEAD_DIMS, GROUPS, HEAD_DIMS, check

CUDA_TYPES = dict(zip(DTYPES, ("__half", "__nv_bfloat16", "float")))


@dataclass(frozen=True)
class Config:
    """One compiled configuration of the kernels (made checked by :func:`config`)."""

    dtype: str       # a key of CUDA_TYPES
    head_dim: int
    block_size: int
    group: int       # query heads per KV head
    kv_dtype: Optional[str] = None  # what the K/V planes hold when not ``dtype``: FP8 (float8 e4m3 bits)

    @property
    def cuda_type(self) -> str:
        """The C++ type of ``dtype`` in ``cuda_src/``."""
        return CUDA_TYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        """Bytes of one q (or output) element."""
        return 2 if self.dtype != "float32" else 4

    @property
    def fp8(self) -> bool:
        """Whether the planes hold float8 e4m3 bits."""
        return self.kv_dtype == FP8

    @property
    def kv_itemsize(self) -> int:
        """Bytes of one stored K or V element."""
        return 1 if self.fp8 else self.itemsize


BASE = Config("float16", 128, 16, 4)
# The groups that stand for all 64: each of 1-8 (a thread block's heads on CUDA cores), then wider ones
# covering one, two and four m16 tiles of heads on tensor cores, non-powers of two and a prime (cut into
# single heads on CUDA cores: pagedrt.attention.planner.kernel_group).
SWEEP_GROUPS = tuple(range(1, 9)) + (12, 13, 16, 24, 40, 64)


@functools.lru_cache(maxsize=None)
def config(dtype: DTypeLike, head_dim: int, block_size: int, group: int, kv_dtype: Optional[str] = None) -> Config:
    """A checked :class:`Config`; raises UnsupportedConfigError naming the bad value.

    Parameters
    ----------
    dtype : str, numpy.dtype or type
        q's and the output's (:func:`pagedrt.spec.dtype_name`).
    head_dim, block_size, group : int
        From the tables of :mod:`pagedrt.supported`; ``group``: query heads per KV head.
    kv_dtype : str, optional
        What the planes hold, a canonical name (a cache's ``spec.kv_dtype``, or
        :func:`pagedrt.spec.plane_kv_dtype` of a plane); None: ``dtype``.
    """
    name = dtype_name(dtype)
    check("head_dim", head_dim, HEAD_DIMS)
    check("block_size", block_size, BLOCK_SIZES)
    check("group (query heads per KV head)", group, GROUPS)
    kv = kv_dtype_of(kv_dtype, name, head_dim)
    return Config(name, head_dim, block_size, group, None if kv == name else kv)


def sweep() -> List[Config]:
    """The representative configurations, base first, without repeats."""
    out = [BASE]
    out += [Config(d, h, BASE.block_size, BASE.group) for d in CUDA_TYPES for h in HEAD_DIMS]
    out += [Config(BASE.dtype, BASE.head_dim, b, BASE.group) for b in BLOCK_SIZES]
    out += [Config(BASE.dtype, BASE.head_dim, BASE.block_size, g) for g in SWEEP_GROUPS]
    out += [Config(d, h, BASE.block_size, g) for d in CUDA_TYPES for h in HEAD_DIMS for g in (8, max(GROUPS))]
    out.append(Config("float32", BASE.head_dim, BASE.block_size, 13))  # a prime group on CUDA cores: single heads
    return list(dict.fromkeys(out))


def fp8_sweep() -> List[Config]:
    """The representative FP8 configurations (q of float16 or bfloat16 over float8 e4m3 K/V): every q dtype
    x head_dim at the base block size and group, every block size at the base, and every group of SWEEP_GROUPS at
    each head_dim."""
    out = [Config(d, h, BASE.block_size, BASE.group, FP8) for d in FP8_DTYPES for h in FP8_HEAD_DIMS]
    out += [Config(BASE.dtype, BASE.head_dim, b, BASE.group, FP8) for b in BLOCK_SIZES]
    out += [Config(BASE.dtype, h, BASE.block_size, g, FP8) for h in FP8_HEAD_DIMS for g in SWEEP_GROUPS]
    return list(dict.fromkeys(out))
