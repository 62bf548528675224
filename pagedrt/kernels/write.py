"""Write the K/V of new tokens into their cache slots (any number of tokens), and its NumPy reference.

Into FP8 planes (uint8, float8 e4m3 bits) the values are quantised on the way, each divided by its KV
head's scale (:mod:`pagedrt.fp8` defines the rounding, the saturation and what a NaN becomes).
"""

from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from .. import fp8, source
from ..spec import Array, plane_kv_dtype
from ..supported import FP8_DTYPES
from .args import (array_module, c_contiguous, check, check_scales, device_pointers, int_array, multiprocessors,
                   plane, ptr, same_layout, scale_pointers)
from .configs import Config, config, fp8_sweep, sweep
from .launch import launch
from .validate import Spans, check_slots

FILE = "write.cu"
THREADS = 256


def kernel_name(cfg: Config) -> str:
    """The name expression of ``cfg``'s write kernel."""
    kernel = "write_kv_fp8" if cfg.fp8 else "write_kv"
    return f"pagedrt::{kernel}<{cfg.cuda_type}, {cfg.head_dim}, {cfg.block_size}>"


def instances(configs: Optional[Sequence[Config]] = None) -> Dict[str, Tuple[str, ...]]:
    """{file: name expressions} for ``configs`` (default: the representative sweeps, FP8's too)."""
    return {FILE: tuple(dict.fromkeys(kernel_name(c) for c in (configs or sweep() + fp8_sweep())))}


def check_planes(plan: Any, k_cache: Array, v_cache: Array, k_scale: Optional[Array], v_scale: Optional[Array]) -> None:
    """A write plan's run-time checks of the planes it stores into: the plan's layout (``plan._plane``), the
    scales FP8 planes need (``plan._kv_heads``, ``plan._type``), and pools still open (``plan._spans``);
    WritePlan's and RopeWritePlan's."""
    same_layout("k_cache", k_cache, plan._plane, "K plane")
    same_layout("v_cache", v_cache, plan._plane, "K plane")
    check_scales(plan._kv_heads, plan._type, k_scale, v_scale)
    if plan._spans.pools:
        plan._spans.check_open()


class WritePlan:
    """One step's K/V writes, prepared once and run for every layer (as :class:`~pagedrt.attention.DecodePlan`).

    ``WritePlan(k, k_cache, slot_mapping)`` checks the shapes and the slots (with
    ``validate``, on the device, once) and sizes the launch; :meth:`run` stores one
    layer's k and v, which must have the shape and dtype of the plan's k, into planes
    with the layout of the plan's K plane (FP8 planes: with that layer's scales).
    Arguments are those of :func:`write_kv`.

    When the K plane lies in a pool (a cache's planes do), validation also refuses
    slots in blocks whose memory is not mapped, checked against the plan's K plane:
    a cache maps and releases a block in every plane at once, so that covers every
    layer a run writes. A run refuses planes whose pool was closed since
    (``PoolClosedError``).
    """

    def __init__(self, k: Array, k_cache: Array, slot_mapping: Array, *, validate: bool = True,
                 _v_cache: Optional[Array] = None) -> None:
        # _v_cache: write_kv's V plane, checked with the K plane (a plan over many layers is given only K)
        xp = array_module(k=k, k_cache=k_cache, slot_mapping=slot_mapping)
        pk = plane("k_cache", k_cache)
        c_contiguous("k", k, 3)
        kv_dtype = plane_kv_dtype(k_cache.dtype)  # FP8, or None: the planes hold k's dtype
        check((kv_dtype is not None or k.dtype == k_cache.dtype) and k.shape[1:] == (pk.num_kv_heads, pk.head_dim),
              lambda: f"k must be {' or '.join(FP8_DTYPES) if kv_dtype else k_cache.dtype} [num_tokens, "
                      f"{pk.num_kv_heads}, {pk.head_dim}] to match the cache, got {k.dtype} {k.shape}")
        cfg = config(k.dtype, pk.head_dim, pk.block_size, 1, kv_dtype=kv_dtype)
        self._kv_heads = pk.num_kv_heads if cfg.fp8 else None
        int_array("slot_mapping", slot_mapping, np.int64, 1)
        num_tokens = int(k.shape[0])
        check(slot_mapping.shape[0] == num_tokens and slot_mapping.flags.c_contiguous,
              lambda: f"slot_mapping must be contiguous with one slot per token ({num_tokens}), got "
                      f"{slot_mapping.shape}")
        planes = (k_cache, _v_cache) if type(_v_cache) is type(k_cache) else (k_cache,)
        spans = Spans(planes, k_cache.strides[0], pk.block_elems * k_cache.itemsize)
        if xp is np or validate:
            check_slots(slot_mapping, pk.block_size, pk.num_blocks, spans)
        self._spans = spans
        self._type, self._k, self._plane = type(k), (k.shape, k.dtype), (k_cache.shape, k_cache.strides, k_cache.dtype)
        self._slots, self._launch = slot_mapping, None
        if xp is not np:
            import cupy
            self._device = k.device.id
            total = num_tokens * pk.num_kv_heads * pk.head_dim * k_cache.itemsize // 16
            if total:
                blocks = min(-(-total // THREADS), 32 * multiprocessors(cupy.cuda.Device().id))
                self._launch = (source.function(FILE, kernel_name(cfg)), (blocks,), (THREADS,),
                                (np.int64(pk.block_stride), ptr(slot_mapping), np.int64(num_tokens),
                                 np.int32(pk.num_kv_heads)))

    def run(self, k: Array, v: Array, k_cache: Array, v_cache: Array, *, k_scale: Optional[Array] = None,
            v_scale: Optional[Array] = None) -> None:
        """Store ``k`` and ``v`` into one layer's planes at the plan's slots; FP8 planes need that layer's
        ``k_scale`` and ``v_scale`` (float32 [kv_heads])."""
        array_type = self._type
        check(type(k) is array_type and type(v) is array_type and type(k_cache) is array_type
              and type(v_cache) is array_type,
              lambda: f"k, v, k_cache and v_cache must be {array_type.__module__}.{array_type.__name__}s, as the "
                      "plan's: NumPy or CuPy arrays, not a mix")
        shape, dtype = self._k
        for name, a in (("k", k), ("v", v)):
            check(a.shape == shape and a.dtype == dtype and a.flags.c_contiguous,
                  lambda: f"{name} must be C-contiguous {dtype} of the same shape as the plan's k {shape}, "
                          f"got {a.dtype} {a.shape}")
        check_planes(self, k_cache, v_cache, k_scale, v_scale)
        if array_type is np.ndarray:
            write_kv_reference(k, v, k_cache, v_cache, self._slots, k_scale=k_scale, v_scale=v_scale)
            return
        pk, pv, pkc, pvc = device_pointers(self._device, ("k", "v", "k_cache", "v_cache"), (k, v, k_cache, v_cache))
        scales = scale_pointers(self._device, self._kv_heads, k_scale, v_scale)
        if self._launch is not None:
            kernel, grid, threads, (stride, slots, num_tokens, heads) = self._launch
            launch(kernel, grid, threads, (pk, pv, pkc, pvc, stride, slots, num_tokens, heads, *scales))


def write_kv(k: Array, v: Array, k_cache: Array, v_cache: Array, slot_mapping: Array, *, validate: bool = True,
             k_scale: Optional[Array] = None, v_scale: Optional[Array] = None) -> None:
    """Store k, v into the planes at ``slot_mapping``.

    A negative slot is padding and is skipped. ``validate`` refuses, on the device
    first (one small launch and a 16-byte device-to-host read), slots past the cache,
    slots in blocks whose memory is not mapped (planes in a pool) and a slot given to
    two tokens (``BlockTableError``); NumPy inputs are always checked. Planes in a
    closed pool raise ``PoolClosedError``. For many layers over the same slots, make
    one :class:`WritePlan` and run it per layer.

    Parameters
    ----------
    k, v : array [num_tokens, kv_heads, head_dim]
        C-contiguous, of the planes' dtype; over FP8 planes float16 or bfloat16.
    k_cache, v_cache : array [num_blocks, kv_heads, block_size, head_dim]
        One layer's planes (any block stride). uint8 planes hold float8 e4m3 bits
        (:func:`pagedrt.spec.plane_kv_dtype`): each value is stored as e4m3(value / scale) (:mod:`pagedrt.fp8`).
    slot_mapping : array, int64 [num_tokens]
        slot = block_id * block_size + slot_in_block.
    validate : bool
        Check the slots first (above).
    k_scale, v_scale : array, float32 [kv_heads], optional
        FP8 planes only, and needed there: the layer's scales.
    """
    WritePlan(k, k_cache, slot_mapping, validate=validate, _v_cache=v_cache).run(k, v, k_cache, v_cache,
                                                                                  k_scale=k_scale, v_scale=v_scale)


def write_kv_reference(k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, slot_mapping: np.ndarray,
                       *, k_scale: Optional[np.ndarray] = None, v_scale: Optional[np.ndarray] = None) -> None:
    """NumPy reference of :func:`write_kv` (no checks): scatter the non-padding tokens into their slots,
    quantised (:func:`pagedrt.fp8.quantise`) when the scales are given."""
    keep = slot_mapping >= 0
    blocks, offsets = np.divmod(slot_mapping[keep], k_cache.shape[2])
    k_cache[blocks, :, offsets, :] = k[keep] if k_scale is None else fp8.quantise(k[keep], k_scale)
    v_cache[blocks, :, offsets, :] = v[keep] if v_scale is None else fp8.quantise(v[keep], v_scale)
