"""CUDA kernels (``cuda_src/``) behind thin launchers: K/V writes, block copies, table checks; and the copy
engines' block moves between tiers (``swap_blocks``) and between two caches, on one GPU or two
(``BlockTransfer``, ``transfer_blocks``).

A launcher given NumPy arrays runs its NumPy reference (``*_reference``, the host
backend); given CuPy arrays it checks every argument, then launches the kernel.
Attention has its own package, :mod:`pagedrt.attention`.
"""

from .copy import (BlockTransfer, copy_blocks, copy_blocks_reference, swap_blocks, swap_blocks_reference,
                   transfer_blocks, transfer_blocks_reference)
from .validate import release_buffers
from .write import WritePlan, write_kv, write_kv_reference

__all__ = ["BlockTransfer", "WritePlan", "copy_blocks", "copy_blocks_reference", "instances", "release_buffers",
           "swap_blocks", "swap_blocks_reference", "transfer_blocks", "transfer_blocks_reference", "write_kv",
           "write_kv_reference"]


def instances() -> dict:
    """{cuda_src file: name expressions} of this package's launchers, over the representative configurations."""
    from . import copy, validate, write
    out = {}
    for module in (write, copy, validate):
        out.update(module.instances())
    return out
