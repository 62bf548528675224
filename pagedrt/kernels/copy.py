"""Copy whole blocks in every plane: with one kernel launch (copy-on-write), or with the copy engines (swap).

:func:`copy_blocks` runs ``cuda_src/copy.cu`` on the SMs: order-free pairs, one launch.
:func:`swap_blocks` moves blocks between the tiers (device and pinned host memory, one
range) with ``cuMemcpyAsync`` on a stream: the DMA engines copy while the SMs compute,
pairs run in the order given, and consecutive pairs become one copy per run of blocks.
Each has a NumPy reference, which the host backend runs.
"""

import functools

import numpy as np

from .. import driver as drv
from .. import source
from .args import aligned, array_module, check, multiprocessors, plane
from .validate import Spans
from ..errors import BlockTableError

FILE = "copy.cu"
NAME = "pagedrt::copy_blocks"
THREADS = 256


def instances():
    return {FILE: (NAME,)}


def copy_blocks(planes, pairs):
    """Copy block src to block dst in every plane, for every (src, dst) row of ``pairs``.

    planes: plane arrays [num_blocks, kv_heads, block_size, head_dim] that share the
    block stride and block byte size (e.g. every layer's K and V); pairs: ints
    [n, 2] (a list, NumPy or CuPy). No block may be both a source and a
    destination, and destinations must be distinct, so the copies are order-free.
    Every pair is checked on the host first (``BlockTableError``): ids inside the
    planes and, for planes that lie in a pool, blocks whose memory is mapped now in
    every plane; planes in a closed pool raise ``PoolClosedError``.
    """
    planes = list(planes)
    xp, pairs, block_bytes = _checked(planes, pairs, order_free=True)
    if xp is np:
        copy_blocks_reference(planes, pairs)
        return
    if not len(pairs):
        return
    import cupy
    bases = cupy.asarray(np.array([p.data.ptr for p in planes], dtype=np.uint64))
    device_pairs = cupy.asarray(pairs)
    block_vecs = block_bytes // 16
    total = len(pairs) * len(planes) * block_vecs
    blocks = min(-(-total // THREADS), 32 * multiprocessors(cupy.cuda.Device().id))
    source.function(FILE, NAME)(
        (blocks,), (THREADS,),
        (bases, np.int32(len(planes)), device_pairs, np.int32(len(pairs)), np.int64(planes[0].strides[0]),
         np.int32(block_vecs)))


def swap_blocks(planes, pairs, stream=None):
    """Copy block src to block dst in every plane, pair after pair in the order given, with the copy engines.

    For moves between the tiers (``cache.swap_out``, ``swap_in`` and ``step.swaps``): a
    later pair may write a block an earlier one read, and each copy is made before the
    next. Consecutive pairs (src and dst both one block on) become one ``cuMemcpyAsync``
    per plane, or one for all planes where they tile the block stride (block-major),
    queued on ``stream`` (a CuPy stream; the current one if None): the SMs stay free, and
    work on another stream overlaps the copies; record an event after this call and make
    whatever reads or writes the blocks wait on it. planes and pairs are checked as for
    :func:`copy_blocks`, but for the order rule.
    """
    planes = list(planes)
    xp, pairs, block_bytes = _checked(planes, pairs, order_free=False)
    if xp is np:
        swap_blocks_reference(planes, pairs)
        return
    if not len(pairs):
        return
    import cupy
    stride = planes[0].strides[0]
    handle = (stream if stream is not None else cupy.cuda.get_current_stream()).ptr
    d = _driver()
    for src, dst, count in _runs(pairs).tolist():
        for base, width in _spans([p.data.ptr for p in planes], stride, block_bytes):
            if width == stride:  # the run's blocks are one contiguous range
                drv.call(d, "cuMemcpyAsync", base + dst * stride, base + src * stride, count * stride, handle)
                continue
            for k in range(count):
                drv.call(d, "cuMemcpyAsync", base + (dst + k) * stride, base + (src + k) * stride, width, handle)


def swap_blocks_reference(planes, pairs):
    """NumPy reference of :func:`swap_blocks` (no checks): run after run, in order."""
    for src, dst, count in _runs(np.asarray(pairs, np.int64).reshape(-1, 2)).tolist():
        for p in planes:
            p[dst:dst + count] = p[src:src + count]


_driver = functools.cache(drv.load)


def _runs(pairs):
    """(src, dst, count) int64 rows: the runs of consecutive pairs whose src and dst both step by one block, in
    order; a run whose source and destination ranges would overlap is split into single pairs."""
    n = len(pairs)
    if not n:
        return np.zeros((0, 3), np.int64)
    src, dst = pairs[:, 0], pairs[:, 1]
    starts = np.ones(n, bool)
    starts[1:] = (np.diff(src) != 1) | (np.diff(dst) != 1)
    first = np.flatnonzero(starts)
    counts = np.diff(np.append(first, n))
    overlapping = (counts > 1) & (np.abs(dst[first] - src[first]) < counts)
    if overlapping.any():
        starts |= np.repeat(overlapping, counts)
        first = np.flatnonzero(starts)
        counts = np.diff(np.append(first, n))
    return np.stack([src[first], dst[first], counts], axis=1)


def _spans(bases, stride, block_bytes):
    """(first byte, width) of each stretch of planes whose blocks lie side by side inside one block stride."""
    spans = []
    for base in sorted(set(bases)):
        if spans and spans[-1][0] + spans[-1][1] == base and spans[-1][1] + block_bytes <= stride:
            spans[-1][1] += block_bytes
        else:
            spans.append([base, block_bytes])
    return spans


def _checked(planes, pairs, order_free):
    """(array module, pairs as checked int64 [n, 2], block bytes) of a block copy's arguments: planes sharing the
    block stride and size, pairs inside every plane and mapped; with ``order_free``, distinct destinations and no
    block both a source and a destination."""
    check(len(planes) > 0, "planes is empty: pass at least one plane")
    names = [f"planes[{i}]" for i in range(len(planes))]
    xp = array_module(**dict(zip(names, planes)))
    layouts = [plane(n, p) for n, p in zip(names, planes)]
    block_bytes = layouts[0].block_elems * planes[0].itemsize
    for n, p, lay in zip(names, planes, layouts):
        check(p.strides[0] == planes[0].strides[0] and lay.block_elems * p.itemsize == block_bytes,
              lambda: f"{n} has block stride {p.strides[0]} and block size {lay.block_elems * p.itemsize} bytes but "
                      f"planes[0] has {planes[0].strides[0]} and {block_bytes}: all planes must share both")
    pairs = _host_pairs(pairs, min(lay.num_blocks for lay in layouts), order_free)
    spans = Spans(planes, planes[0].strides[0], block_bytes)
    if spans.spans and len(pairs):
        bad = np.flatnonzero(spans.unusable(pairs).any(axis=1))
        if bad.size:
            i = int(bad[0])
            block = next(int(b) for b in pairs[i] if spans.unusable(np.array([b]))[0])
            raise BlockTableError(f"pairs[{i}] = {tuple(pairs[i].tolist())} names block {block}, "
                                  f"{spans.why(block)}; fix the pair")
    if xp is not np:
        for n, p in zip(names, planes):
            aligned(n, p)
    return xp, pairs, block_bytes


def _host_pairs(pairs, num_blocks, order_free):
    """``pairs`` as a checked int64 [n, 2] NumPy array."""
    host = pairs.get() if type(pairs).__module__.split(".")[0] == "cupy" else np.asarray(pairs)
    if host.size == 0:
        return np.zeros((0, 2), np.int64)
    check(host.ndim == 2 and host.shape[1] == 2 and host.dtype.kind in "iu",
          lambda: f"pairs must be integers [n, 2] (src, dst), got {host.dtype} {host.shape}")
    host = host.astype(np.int64)
    bad = np.flatnonzero(((host < 0) | (host >= num_blocks)).any(axis=1))
    if bad.size:
        i = int(bad[0])
        raise BlockTableError(f"pairs[{i}] = {tuple(host[i].tolist())} names a block outside the planes' "
                              f"blocks 0..{num_blocks - 1}: fix the pair")
    if not order_free:
        return host
    src, dst = host[:, 0], host[:, 1]
    _, counts = np.unique(dst, return_counts=True)
    check(counts.max() == 1, "pairs copy into the same destination twice: each destination once")
    both = np.intersect1d(src, dst)
    check(both.size == 0, lambda: f"block {int(both[0])} is both a source and a destination: "
                                  "split the copy into two calls so its order is defined")
    return host


def copy_blocks_reference(planes, pairs):
    """NumPy reference of :func:`copy_blocks` (no checks)."""
    pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    for p in planes:
        p[pairs[:, 1]] = p[pairs[:, 0]]
