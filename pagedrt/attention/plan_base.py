"""What every attention plan shares: the checks of its step's arguments, its run, and the caller's workspace.

:class:`Plan` is the base of :class:`~pagedrt.attention.DecodePlan`,
:class:`~pagedrt.attention.ContiguousDecodePlan` and :class:`~pagedrt.attention.PrefillPlan`: a plan
records once what its runs accept (:meth:`Plan._keep`), and :meth:`Plan.run` checks one layer's arrays
and scales against that, runs the float64 reference on NumPy arrays, and otherwise hands the layer's
pointers to the subclass's launches (:meth:`Plan._launch`).

A caller's split workspace holds one plan's partials at a time: a split plan lays it out anew (its
arrival counts fall where another plan's partials were). Callers pass the array; :meth:`Workspace.of`
gives the one :class:`Workspace` of that memory while any plan holds it, which knows the plan that laid
it out last, so an earlier plan refuses to run over it (as FlashInfer's wrappers own their workspace,
here the workspace owns the record of its plan).
"""

import itertools
import math
import weakref
from typing import Optional

import numpy as np

from ..kernels.args import (aligned, check, check_scales, device_pointers, int_array, ptr, scale_keywords,
                            scale_pointers, store)
from ..spec import Array

LOG2E = 1.4426950408889634  # kernels take the scale times log2(e): their softmax runs on exp2


def default_scale(scale: Optional[float], head_dim: int) -> float:
    """The attention scale: ``scale``, or 1 / sqrt(head_dim) when None; LaunchArgumentError unless finite."""
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    check(math.isfinite(scale), lambda: f"scale must be finite, got {scale}")
    return scale


def table_width(block_tables: Array) -> int:
    """The width of a block table, checked: int32 [rows, width], contiguous columns, rows at least a row apart
    (the row stride, ``strides[0] // 4`` entries, is a kernel argument)."""
    int_array("block_tables", block_tables, np.int32, 2)
    width = int(block_tables.shape[1])
    check(width >= 1 and block_tables.strides[1] == 4 and block_tables.strides[0] >= 4 * width,
          lambda: f"block_tables (shape {block_tables.shape}, strides {block_tables.strides}) must have "
                  "contiguous columns and rows at least a row apart")
    return width


def table_args(block_tables: Array) -> tuple:
    """A block table as kernels take it: its pointer and its row stride in entries."""
    return ptr(block_tables), np.int64(block_tables.strides[0] // 4)


def check_block_mask(block_mask: Optional[Array], num_blocks: int) -> None:
    """LaunchArgumentError unless ``block_mask`` is None or a contiguous bool/uint8 [num_blocks]."""
    if block_mask is None:
        return
    check(block_mask.ndim == 1 and block_mask.shape[0] == num_blocks and block_mask.itemsize == 1
          and block_mask.flags.c_contiguous and block_mask.dtype.kind in "bu",
          lambda: f"block_mask must be a contiguous bool/uint8 array of {num_blocks} entries (one per "
                  f"block), got {block_mask.dtype} {block_mask.shape}")


def check_workspace(workspace: Optional[Array]) -> None:
    """A caller's workspace: None, or a contiguous 1-D uint8 array (device arrays also 16-byte aligned)."""
    if workspace is None:
        return
    check(workspace.dtype == np.uint8 and workspace.ndim == 1 and workspace.flags.c_contiguous,
          lambda: f"workspace must be a contiguous 1-D uint8 array, got {workspace.dtype} {workspace.shape}")
    if not isinstance(workspace, np.ndarray):
        aligned("workspace", workspace)


class Workspace:
    """The record of a caller's split workspace (a device uint8 array): the plan that laid it out last.

    Plans reach it through :meth:`of`, by the array's address, so every plan made on the same memory shares one
    record; it lives while a plan holds it.
    """

    # address -> the Workspace of that memory, while a plan holds it
    _live: "weakref.WeakValueDictionary[int, Workspace]" = weakref.WeakValueDictionary()

    def __init__(self) -> None:
        self._claims = itertools.count()
        self._holder: Optional[int] = None  # the claim of the plan that laid the memory out last

    @classmethod
    def of(cls, array: Array) -> "Workspace":
        """The one Workspace of ``array``'s memory (by its address): the one live plans hold, else a new one."""
        found = cls._live.get(array.data.ptr)
        if found is None:
            found = cls._live[array.data.ptr] = cls()
        return found

    def lay_out(self) -> int:
        """Record that a new plan lays the memory out for itself; returns that plan's claim."""
        self._holder = next(self._claims)
        return self._holder

    def holds(self, claim: int) -> bool:
        """Whether the plan of ``claim`` laid the memory out last (so its partials are where it put them)."""
        return self._holder == claim


class Plan:
    """The run every plan shares. A subclass's constructor checks its step and calls :meth:`_keep`; it
    implements :meth:`_check_launch` and :meth:`_launch` for device arrays."""

    def _keep(self, arrays, kv_heads: Optional[int], reference_run, device: Optional[int]) -> None:
        """Record what runs accept: ``arrays`` (a :class:`~pagedrt.kernels.args.RunArrays`), ``kv_heads`` (FP8
        planes: the length of the scales a run takes; else None), the host run ``reference_run(q, k, v,
        **scales)`` and the plan's device (None on the host)."""
        self._arrays, self._kv_heads, self._reference, self._device = arrays, kv_heads, reference_run, device

    def _check_launch(self) -> None:
        """Raise LaunchArgumentError unless the plan's launches may run now (stream, workspace)."""

    def _launch(self, pointers: list, scales: tuple) -> None:
        """Launch over one layer's pointers (q, k_cache, v_cache, out) and FP8 scale pointers (else none)."""
        raise NotImplementedError

    def run(self, q: Array, k_cache: Array, v_cache: Array, out: Optional[Array] = None, *,
            k_scale: Optional[Array] = None, v_scale: Optional[Array] = None) -> Array:
        """Attention of ``q`` over one layer's K and V; returns ``out``.

        Parameters
        ----------
        q : array
            Of the plan's q shape and dtype, C-contiguous.
        k_cache, v_cache : array
            One layer's planes, of the plan's K plane layout (shape, strides, dtype).
        out : array, optional
            Of q's shape and dtype, C-contiguous; allocated when None.
        k_scale, v_scale : array, optional
            FP8 planes: that layer's float32 [kv_heads] scales; other planes take none.
        """
        k, v = k_cache, v_cache
        self._arrays.check(q, k, v, out)
        check_scales(self._kv_heads, self._arrays.array_type, k_scale, v_scale)
        if self._arrays.array_type is np.ndarray:
            return store(self._reference(q, k, v, **scale_keywords(self._kv_heads, k_scale, v_scale)), out)
        import cupy
        self._check_launch()
        out = cupy.empty_like(q) if out is None else out
        pointers = device_pointers(self._device, ("q", "k_cache", "v_cache", "out"), (q, k, v, out))
        self._launch(pointers, scale_pointers(self._device, self._kv_heads, k_scale, v_scale))
        return out
