"""Attention over the paged KV cache: plan once per step, run per layer.

:mod:`~pagedrt.attention.planner` cuts the work (launch geometry, split plan,
workspace layout; host code), :mod:`~pagedrt.attention.decode` launches the decode
kernel (``cuda_src/decode.cu``), and :mod:`~pagedrt.attention.reference` holds the
float64 references the tests compare with and the host backend runs.
"""

from . import reference
from .decode import ContiguousDecodePlan, DecodePlan, contiguous_decode, paged_decode
from .planner import SplitPlan, plan_splits, workspace_bytes

__all__ = ["ContiguousDecodePlan", "DecodePlan", "SplitPlan", "contiguous_decode", "paged_decode", "plan_splits",
           "reference", "workspace_bytes"]
