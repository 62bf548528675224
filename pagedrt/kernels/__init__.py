"""CUDA kernels (``cuda_src/``) behind thin launchers, each beside its NumPy float64 reference twin.

A launcher given NumPy arrays runs its twin (the host backend); given CuPy arrays
it checks every argument, then launches the kernel.
"""

from .copy import copy_blocks, copy_blocks_reference
from .decode import (DecodePlan, contiguous_decode, contiguous_decode_reference, merge_partials_reference,
                     paged_decode, paged_decode_reference, plan_splits, split_plan)
from .write import WritePlan, write_kv, write_kv_reference

__all__ = ["DecodePlan", "contiguous_decode", "contiguous_decode_reference", "copy_blocks",
           "copy_blocks_reference", "instances", "merge_partials_reference", "paged_decode", "paged_decode_reference",
           "plan_splits", "split_plan", "WritePlan", "write_kv", "write_kv_reference"]


def instances():
    """{cuda_src file: name expressions} the launchers use, over the representative configurations."""
    from . import copy, decode, validate, write
    out = {}
    for module in (decode, write, copy, validate):
        out.update(module.instances())
    return out
