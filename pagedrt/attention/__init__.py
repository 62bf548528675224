"""Attention over the paged KV cache: plan once per step, run per layer.

:mod:`~pagedrt.attention.planner` cuts the work (launch geometry, split plan,
workspace layout, prefill work items; host code), :mod:`~pagedrt.attention.decode`
launches the decode kernel (``cuda_src/decode.cu``), :mod:`~pagedrt.attention.prefill`
the prefill kernels (``cuda_src/prefill.cu``; ``cuda_src/prefill_sm90.cu`` on H100/H200),
and :mod:`~pagedrt.attention.reference` holds the float64 references the tests compare
with and the host backend runs.
"""

from . import reference
from .decode import ContiguousDecodePlan, DecodePlan, contiguous_decode, paged_decode
from .planner import SplitPlan, plan_splits, workspace_bytes
from .prefill import PrefillPlan, paged_prefill

__all__ = ["ContiguousDecodePlan", "DecodePlan", "PrefillPlan", "SplitPlan", "contiguous_decode", "paged_decode",
           "paged_prefill", "plan_splits", "reference", "workspace_bytes"]
