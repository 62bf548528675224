"""A cache's options beyond its spec, checked before anything is allocated: sizes the bookkeeping can describe
and the host can hold, growth's keywords, and an FP8 cache's scales."""

import os
from typing import Any, Dict, Optional, Tuple, Union

import numpy as np

from .errors import UnsupportedConfigError
from .layout import Layout
from .spec import KVSpec
from .blocks.util import ceil_div
from .supported import MAX_BLOCKS, MAX_POOL_BYTES, MAX_TABLE_ENTRIES, check_positive


def capacity_blocks(spec: KVSpec, max_tokens: Optional[int], max_bytes: Optional[int], host_tokens: Optional[int],
                    host_bytes: Optional[int]) -> Tuple[int, int]:
    """(device blocks, host-tier blocks) of the capacities given: exactly one of ``max_tokens`` (rounded up to
    whole blocks) or ``max_bytes`` (rounded down, at least one block), at most one of the host tier's likewise.
    UnsupportedConfigError otherwise, or past what int32 block ids name."""
    if (max_tokens is None) == (max_bytes is None):
        raise UnsupportedConfigError("give the capacity as exactly one of max_tokens or max_bytes")
    block_bytes = spec.bytes_per_token * spec.block_size
    if max_bytes is None:
        max_blocks = ceil_div(check_positive("max_tokens", max_tokens), spec.block_size)
    else:
        max_blocks = max(check_positive("max_bytes", max_bytes) // block_bytes, 1)
    if host_tokens is not None and host_bytes is not None:
        raise UnsupportedConfigError("give the host tier's capacity as at most one of host_tokens or host_bytes")
    host_blocks = (0 if host_tokens is None and host_bytes is None else
                   ceil_div(check_positive("host_tokens", host_tokens), spec.block_size) if host_bytes is None
                   else max(check_positive("host_bytes", host_bytes) // block_bytes, 1))
    if max_blocks + host_blocks > MAX_BLOCKS:
        raise UnsupportedConfigError(
            f"a capacity of {max_blocks + host_blocks} blocks is more than block ids (int32) can name: at most "
            f"{MAX_BLOCKS}")
    return max_blocks, host_blocks


def check_sizes(layout: Layout, max_seqs: int, max_blocks_per_seq: int) -> None:
    """Refuse, before anything is allocated, a cache the bookkeeping cannot describe or the host not hold."""
    if layout.max_blocks > MAX_BLOCKS:
        raise UnsupportedConfigError(
            f"the cache would hold {layout.max_blocks} blocks but block ids are int32: at most {MAX_BLOCKS}")
    if layout.pool_bytes > MAX_POOL_BYTES:
        raise UnsupportedConfigError(
            f"the cache would reserve {layout.pool_bytes} bytes of address space; one reservation takes at most "
            f"{MAX_POOL_BYTES}")
    entries = max_seqs * max_blocks_per_seq
    if entries > MAX_TABLE_ENTRIES:
        raise UnsupportedConfigError(
            f"a block table of {max_seqs} sequences x {max_blocks_per_seq} blocks has {entries} entries; at most "
            f"{MAX_TABLE_ENTRIES}: lower max_seqs or max_seq_len")
    block_size = layout.block_size
    host = 4 * entries + (48 + 4 * block_size) * max_seqs + 15 * layout.max_blocks  # tables, per row, per block
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return
    if host > memory // 2:
        raise UnsupportedConfigError(
            f"the cache's host bookkeeping would take {host} bytes, more than half of this host's {memory}: "
            f"lower max_seqs, max_seq_len or the capacity")


def growth_keywords(growth: Union[None, bool, Dict[str, Any]], blocks_per_chunk: int) -> Optional[Dict[str, Any]]:
    """``growth=`` as the keywords of :class:`~pagedrt.growth.Growth`, defaults filled in; None for no growth."""
    if growth is None or growth is False:
        return None
    defaults = {"low_blocks": blocks_per_chunk, "high_blocks": 2 * blocks_per_chunk, "release_after": 64,
                "background": True}
    if growth is True:
        return defaults
    if not isinstance(growth, dict):
        raise UnsupportedConfigError(f"growth={growth!r:.80} must be None, False, True or a dict of Growth keywords")
    unknown = sorted(map(str, growth.keys() - defaults.keys()))
    if unknown:
        raise UnsupportedConfigError(f"growth has unknown keys {unknown}: it takes {sorted(defaults)}")
    return defaults | growth


def kv_scales_of(spec: KVSpec, kv_scales: Any) -> Optional[np.ndarray]:
    """The checked float32 scales of an FP8 cache (all 1 by default), None for other caches; raises
    UnsupportedConfigError for scales where there is no FP8, scales of the wrong shape and values that are not
    positive, normal and finite."""
    shape = spec.scales_shape
    if shape is None:
        if kv_scales is not None:
            raise UnsupportedConfigError(f"kv_scales are for FP8 K/V only: this cache stores {spec.kv_dtype}")
        return None
    if kv_scales is None:
        return np.ones(shape, np.float32)
    try:
        scales = np.array(kv_scales, dtype=np.float32)
    except (TypeError, ValueError):
        raise UnsupportedConfigError(f"kv_scales must be float32 numbers [{', '.join(map(str, shape))}]") from None
    if scales.shape != shape:
        raise UnsupportedConfigError(f"kv_scales must have shape {shape} (layers, K then V, KV heads), got "
                                     f"{scales.shape}")
    if not (np.isfinite(scales).all() and (scales >= np.finfo(np.float32).tiny).all()):
        raise UnsupportedConfigError("kv_scales must be positive, normal and finite: stored bytes mean value / scale")
    return scales
