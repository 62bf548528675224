"""Write the K/V of new tokens into their cache slots (any number of tokens), and its NumPy reference."""

import numpy as np

from .. import source
from .args import (array_module, c_contiguous, check, device_pointers, int_array, multiprocessors, plane, ptr,
                   same_layout)
from .configs import config, sweep
from .validate import Spans, check_slots

FILE = "write.cu"
THREADS = 256


def kernel_name(cfg):
    return f"pagedrt::write_kv<{cfg.cuda_type}, {cfg.head_dim}, {cfg.block_size}>"


def instances(configs=None):
    """{file: name expressions} for ``configs`` (default: the representative sweep)."""
    return {FILE: tuple(dict.fromkeys(kernel_name(c) for c in (configs or sweep())))}


class WritePlan:
    """One step's K/V writes, prepared once and run for every layer (as :class:`~pagedrt.attention.DecodePlan`).

    ``WritePlan(k, k_cache, slot_mapping)`` checks the shapes and the slots (with
    ``validate``, on the device, once) and sizes the launch; :meth:`run` stores one
    layer's k and v, which must have the shape and dtype of the plan's k, into planes
    with the layout of the plan's K plane. Arguments are those of :func:`write_kv`.

    When the K plane lies in a pool (a cache's planes do), validation also refuses
    slots in blocks whose memory is not mapped, checked against the plan's K plane:
    a cache maps and releases a block in every plane at once, so that covers every
    layer a run writes. A run refuses planes whose pool was closed since
    (``PoolClosedError``).
    """

    def __init__(self, k, k_cache, slot_mapping, *, validate=True, _v_cache=None):
        # _v_cache: write_kv's V plane, checked with the K plane (a plan over many layers is given only K)
        xp = array_module(k=k, k_cache=k_cache, slot_mapping=slot_mapping)
        pk = plane("k_cache", k_cache)
        c_contiguous("k", k, 3)
        check(k.dtype == k_cache.dtype and k.shape[1:] == (pk.num_kv_heads, pk.head_dim),
              lambda: f"k must be {k_cache.dtype} [num_tokens, {pk.num_kv_heads}, {pk.head_dim}] to match the "
                      f"cache, got {k.dtype} {k.shape}")
        cfg = config(k_cache.dtype, pk.head_dim, pk.block_size, 1)
        int_array("slot_mapping", slot_mapping, np.int64, 1)
        num_tokens = int(k.shape[0])
        check(slot_mapping.shape[0] == num_tokens and slot_mapping.flags.c_contiguous,
              lambda: f"slot_mapping must be contiguous with one slot per token ({num_tokens}), got "
                      f"{slot_mapping.shape}")
        planes = (k_cache, _v_cache) if type(_v_cache) is type(k_cache) else (k_cache,)
        spans = Spans(planes, k_cache.strides[0], pk.block_elems * k.itemsize)
        if xp is np or validate:
            check_slots(slot_mapping, pk.block_size, pk.num_blocks, spans)
        self._spans = spans
        self._type, self._k, self._plane = type(k), (k.shape, k.dtype), (k_cache.shape, k_cache.strides, k_cache.dtype)
        self._slots, self._launch = slot_mapping, None
        if xp is not np:
            import cupy
            self._device = k.device.id
            total = num_tokens * pk.num_kv_heads * pk.head_dim * k.itemsize // 16
            if total:
                blocks = min(-(-total // THREADS), 32 * multiprocessors(cupy.cuda.Device().id))
                self._launch = (source.function(FILE, kernel_name(cfg)), (blocks,), (THREADS,),
                                (np.int64(pk.block_stride), ptr(slot_mapping), np.int64(num_tokens),
                                 np.int32(pk.num_kv_heads)))

    def run(self, k, v, k_cache, v_cache):
        """Store ``k`` and ``v`` into one layer's planes at the plan's slots."""
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
        same_layout("k_cache", k_cache, self._plane, "K plane")
        same_layout("v_cache", v_cache, self._plane, "K plane")
        if self._spans.pools:
            self._spans.check_open()
        if array_type is np.ndarray:
            write_kv_reference(k, v, k_cache, v_cache, self._slots)
            return
        pk, pv, pkc, pvc = device_pointers(self._device, ("k", "v", "k_cache", "v_cache"), (k, v, k_cache, v_cache))
        if self._launch is not None:
            kernel, grid, threads, (stride, slots, num_tokens, heads) = self._launch
            kernel(grid, threads, (pk, pv, pkc, pvc, stride, slots, num_tokens, heads))


def write_kv(k, v, k_cache, v_cache, slot_mapping, *, validate=True):
    """Store k, v [num_tokens, kv_heads, head_dim] into the planes at ``slot_mapping``.

    slot_mapping: int64 [num_tokens], slot = block_id * block_size + slot_in_block;
    a negative slot is padding and is skipped. ``validate`` refuses, on the device
    first (one small launch and a 16-byte device-to-host read), slots past the cache,
    slots in blocks whose memory is not mapped (planes in a pool) and a slot given to
    two tokens (``BlockTableError``); NumPy inputs are always checked. Planes in a
    closed pool raise ``PoolClosedError``. For many layers over the same slots, make
    one :class:`WritePlan` and run it per layer.
    """
    WritePlan(k, k_cache, slot_mapping, validate=validate, _v_cache=v_cache).run(k, v, k_cache, v_cache)


def write_kv_reference(k, v, k_cache, v_cache, slot_mapping):
    """NumPy reference of :func:`write_kv` (no checks): scatter the non-padding tokens into their slots."""
    keep = slot_mapping >= 0
    blocks, offsets = np.divmod(slot_mapping[keep], k_cache.shape[2])
    k_cache[blocks, :, offsets, :] = k[keep]
    v_cache[blocks, :, offsets, :] = v[keep]
