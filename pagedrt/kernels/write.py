"""Write the K/V of new tokens into their cache slots (any number of tokens), and the NumPy twin."""

import numpy as np

from .. import source
from .args import aligned, array_module, c_contiguous, check, int_array, multiprocessors, plane, ptr, same_plane
from .configs import config, sweep
from .validate import check_slots

FILE = "write.cu"
THREADS = 256


def kernel_name(cfg):
    return f"pagedrt::write_kv<{cfg.cuda_type}, {cfg.head_dim}, {cfg.block_size}>"


def instances(configs=None):
    """{file: name expressions} for ``configs`` (default: the representative sweep)."""
    return {FILE: tuple(dict.fromkeys(kernel_name(c) for c in (configs or sweep())))}


def write_kv(k, v, k_cache, v_cache, slot_mapping, *, validate=True):
    """Store k, v [num_tokens, kv_heads, head_dim] into the planes at ``slot_mapping``.

    slot_mapping: int64 [num_tokens], slot = block_id * block_size + slot_in_block;
    a negative slot is padding and is skipped. Slots must be distinct. ``validate``
    refuses slots past the cache on the device first (one small device-to-host
    read); NumPy inputs are always checked.
    """
    xp = array_module(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    pk, pv = plane("k_cache", k_cache), plane("v_cache", v_cache)
    same_plane("k_cache", k_cache, pk, "v_cache", v_cache, pv)
    for name, a in (("k", k), ("v", v)):
        c_contiguous(name, a, 3)
        check(a.dtype == k_cache.dtype and a.shape[1:] == (pk.num_kv_heads, pk.head_dim),
              lambda: f"{name} must be {k_cache.dtype} [num_tokens, {pk.num_kv_heads}, {pk.head_dim}] to match the "
                      f"cache, got {a.dtype} {a.shape}")
    check(k.shape == v.shape, lambda: f"k {k.shape} and v {v.shape} must have the same shape")
    cfg = config(k_cache.dtype, pk.head_dim, pk.block_size, 1)
    int_array("slot_mapping", slot_mapping, np.int64, 1)
    num_tokens = int(k.shape[0])
    check(slot_mapping.shape[0] == num_tokens and slot_mapping.flags.c_contiguous,
          lambda: f"slot_mapping must be contiguous with one slot per token ({num_tokens}), got {slot_mapping.shape}")
    capacity = pk.num_blocks * pk.block_size
    if xp is np:
        check_slots(slot_mapping, capacity)
        write_kv_reference(k, v, k_cache, v_cache, slot_mapping)
        return
    for name, a in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        aligned(name, a)
    if validate:
        check_slots(slot_mapping, capacity)
    total = num_tokens * pk.num_kv_heads * pk.head_dim * k.itemsize // 16
    if total == 0:
        return
    import cupy
    blocks = min(-(-total // THREADS), 32 * multiprocessors(cupy.cuda.Device().id))
    source.function(FILE, kernel_name(cfg))(
        (blocks,), (THREADS,),
        (ptr(k), ptr(v), ptr(k_cache), ptr(v_cache), np.int64(pk.block_stride), ptr(slot_mapping),
         np.int64(num_tokens), np.int32(pk.num_kv_heads)))


def write_kv_reference(k, v, k_cache, v_cache, slot_mapping):
    """NumPy twin of :func:`write_kv` (no checks): scatter the non-padding tokens into their slots."""
    keep = slot_mapping >= 0
    blocks, offsets = np.divmod(slot_mapping[keep], k_cache.shape[2])
    k_cache[blocks, :, offsets, :] = k[keep]
    v_cache[blocks, :, offsets, :] = v[keep]
