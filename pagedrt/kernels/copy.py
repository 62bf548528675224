"""Copy whole blocks (copy-on-write, compaction) in every plane with one launch, and its NumPy reference."""

import numpy as np

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
    check(len(planes) > 0, "planes is empty: pass at least one plane")
    names = [f"planes[{i}]" for i in range(len(planes))]
    xp = array_module(**dict(zip(names, planes)))
    layouts = [plane(n, p) for n, p in zip(names, planes)]
    block_bytes = layouts[0].block_elems * planes[0].itemsize
    for n, p, lay in zip(names, planes, layouts):
        check(p.strides[0] == planes[0].strides[0] and lay.block_elems * p.itemsize == block_bytes,
              lambda: f"{n} has block stride {p.strides[0]} and block size {lay.block_elems * p.itemsize} bytes but "
                      f"planes[0] has {planes[0].strides[0]} and {block_bytes}: all planes must share both")
    pairs = _host_pairs(pairs, min(lay.num_blocks for lay in layouts))
    spans = Spans(planes, planes[0].strides[0], block_bytes)
    if spans.spans and len(pairs):
        bad = np.flatnonzero(spans.unusable(pairs).any(axis=1))
        if bad.size:
            i = int(bad[0])
            block = next(int(b) for b in pairs[i] if spans.unusable(np.array([b]))[0])
            raise BlockTableError(f"pairs[{i}] = {tuple(pairs[i].tolist())} names block {block}, "
                                  f"{spans.why(block)}; fix the pair")
    if xp is np:
        copy_blocks_reference(planes, pairs)
        return
    for n, p in zip(names, planes):
        aligned(n, p)
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


def _host_pairs(pairs, num_blocks):
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
