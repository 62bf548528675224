"""Copy whole blocks in every plane: with one kernel launch (copy-on-write), with the copy engines (swap), or from
one cache's planes to another's, on the same GPU or another (transfer).

:func:`copy_blocks` runs ``cuda_src/copy.cu`` on the SMs: order-free pairs, one launch.
:func:`swap_blocks` moves blocks between the tiers (device and pinned host memory, one
range) with ``cuMemcpyAsync`` on a stream: the DMA engines copy while the SMs compute,
pairs run in the order given, and consecutive pairs become one copy per run of blocks.
:class:`BlockTransfer` copies blocks of one set of planes into another set (two caches,
two GPUs): ``cuMemcpyPeerAsync`` per run of blocks, or the same kernel as ``copy_blocks``
on the destination GPU, reading the source through a peer mapping (``Pool.grant_access``);
the planes are checked once, when it is made, the pairs on every run.
:func:`transfer_blocks` is one such transfer, planned and run at once.
Each has a NumPy reference, which the host backend runs.
"""

import contextlib
import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import driver as drv
from .. import source
from .args import aligned, array_kind, array_module, check, multiprocessors, plane
from .validate import Spans, address
from ..errors import BlockTableError, PeerAccessError
from ..memory import find_pool
from ..spec import Array
from ..staging import PinnedStaging

FILE = "copy.cu"
NAME = "pagedrt::copy_blocks"
THREADS = 256


def instances() -> Dict[str, Tuple[str, ...]]:
    """{file: name expressions} of the copy kernel."""
    return {FILE: (NAME,)}


def copy_blocks(planes: Sequence[Array], pairs: Any) -> None:
    """Copy block src to block dst in every plane, for every (src, dst) row of ``pairs``, in one launch on the
    current stream (the NumPy reference for NumPy planes).

    Parameters
    ----------
    planes : sequence of array [num_blocks, kv_heads, block_size, head_dim]
        Sharing the block stride and block byte size (e.g. a cache's ``planes``: every layer's K and V).
    pairs : ints [n, 2]
        (src, dst) block ids: a list, NumPy or CuPy. Destinations distinct and no block both a source and a
        destination, so the copies are order-free.

    Raises
    ------
    BlockTableError
        An id outside the planes, or a block whose memory is not mapped now in some plane (planes in a pool);
        checked on the host before anything is copied.
    LaunchArgumentError
        Planes that do not share their layout, malformed pairs, or pairs that are not order-free.
    PoolClosedError
        Planes in a closed pool.
    """
    planes = list(planes)
    xp, pairs, block_bytes = _checked(planes, pairs, order_free=True)
    if xp is np:
        copy_blocks_reference(planes, pairs)
        return
    if not len(pairs):
        return
    _launch(_device_bases(planes), pairs, planes[0].strides[0], block_bytes)


def _device_bases(planes: Sequence[Array]) -> Array:
    """The planes' first bytes as a uint64 array on the current device: the copy kernel's bases."""
    import cupy
    return cupy.asarray(np.array([p.data.ptr for p in planes], dtype=np.uint64))


def _launch(device_bases: Array, pairs: Array, stride: int, block_bytes: int) -> None:
    """One launch of the copy kernel on the current device and stream: for every pair (int64 [n, 2], NumPy or on the
    device) and plane base (a device array, :func:`_device_bases`), the block at ``base + src * stride`` to
    ``base + dst * stride``."""
    import cupy
    device_pairs = cupy.asarray(pairs)
    block_vecs = block_bytes // 16
    total = len(pairs) * len(device_bases) * block_vecs
    blocks = min(-(-total // THREADS), 32 * multiprocessors(cupy.cuda.Device().id))
    source.function(FILE, NAME)(
        (blocks,), (THREADS,),
        (device_bases, np.int32(len(device_bases)), device_pairs, np.int32(len(pairs)), np.int64(stride),
         np.int32(block_vecs)))


def swap_blocks(planes: Sequence[Array], pairs: Any, stream: Optional[Any] = None) -> None:
    """Copy block src to block dst in every plane, pair after pair in the order given, with the copy engines.

    For moves between the tiers (``cache.swap_out``, ``swap_in`` and ``step.swaps``): a later pair may write a
    block an earlier one read. Consecutive pairs (src and dst both one block on) become one ``cuMemcpyAsync``
    per plane, or one for all planes where they tile the block stride (block-major). The SMs stay free: record
    an event after this call and make whatever reads or writes the blocks wait on it.

    Parameters
    ----------
    planes, pairs
        As :func:`copy_blocks`, but pairs may repeat blocks: they run in order.
    stream : cupy.cuda.Stream, optional
        Where the copies are queued; the current stream when None.

    Raises
    ------
    BlockTableError, LaunchArgumentError, PoolClosedError
        As :func:`copy_blocks` (but for the order rule).
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


def swap_blocks_reference(planes: Sequence[np.ndarray], pairs: Any) -> None:
    """NumPy reference of :func:`swap_blocks` (no checks): run after run, in order."""
    for src, dst, count in _runs(np.asarray(pairs, np.int64).reshape(-1, 2)).tolist():
        for p in planes:
            p[dst:dst + count] = p[src:src + count]


class BlockTransfer:
    """Block src of every source plane copied to block dst of the matching destination plane, for every (src, dst)
    row of the pairs of each :meth:`run`: K/V moved from one cache to another, on the same GPU or another. The
    planes are checked once, here; the pairs on every run (:func:`transfer_blocks` checks both on every call).

    By default the copy engines make it: one ``cuMemcpyPeerAsync`` per plane and run of consecutive pairs, or per
    block where a side's blocks do not lie side by side (block-major planes); no peer mapping is needed. With
    ``mapped=True``, one launch of the copy kernel on the destination's device, reading the source over the peer
    mapping. NumPy planes (the host backend) run :func:`transfer_blocks_reference` either way.

    Parameters
    ----------
    src_planes, dst_planes : sequence of array [num_blocks, kv_heads, block_size, head_dim]
        As many planes each (e.g. two caches' ``planes``; plane i to plane i), all of one block byte size; the
        planes of one side share their block stride and lie on one device; the two sides share no memory.
    mapped : bool
        Copy with the kernel over the peer mapping: every source plane must lie in a pool that granted the
        destination device access (``Pool.grant_access``), and the destination planes at one distance from the
        source planes, a multiple of a block stride both share (two caches of one layout).

    Raises
    ------
    LaunchArgumentError
        Planes that do not match as above (with ``mapped``, planes not at one distance).
    PeerAccessError
        ``mapped`` over a source pool the destination device may not access.
    PoolClosedError
        Planes in a closed pool.
    """

    def __init__(self, src_planes: Sequence[Array], dst_planes: Sequence[Array], *, mapped: bool = False) -> None:
        self.src_planes, self.dst_planes, self.mapped = tuple(src_planes), tuple(dst_planes), bool(mapped)
        xp, self.block_bytes, self._limits, (self.src_device, self.dst_device) = _transfer_planes(
            list(self.src_planes), list(self.dst_planes))
        self._spans = tuple(Spans(planes, planes[0].strides[0], self.block_bytes)
                            for planes in (self.src_planes, self.dst_planes))
        self._host = xp is np
        if self._host:
            return
        if self.mapped:
            import cupy
            shift = _mapped_shift(self.src_planes, self.dst_planes, self.src_device, self.dst_device)
            self._shift = np.array([0, shift], np.int64)  # the destination ids as the kernel counts from the source
            with cupy.cuda.Device(self.dst_device):
                self._bases = _device_bases(self.src_planes)
            self._staging = PinnedStaging(cupy)  # the pairs' upload does not wait for the stream
            return
        self._contexts = drv.primary_context(self.src_device), drv.primary_context(self.dst_device)
        self._pointers = [(s.data.ptr, t.data.ptr) for s, t in zip(self.src_planes, self.dst_planes)]

    def run(self, pairs: Any, stream: Optional[Any] = None) -> None:
        """Copy the blocks of ``pairs``; checked on the host first, nothing copied on refusal.

        Parameters
        ----------
        pairs : ints [n, 2]
            (src, dst) block ids, a list, NumPy or CuPy; each destination once.
        stream : cupy.cuda.Stream, optional
            Where the copies are queued (with ``mapped``, a stream of the destination's device); the current
            stream when None.

        Raises
        ------
        BlockTableError
            An id outside its side's planes, or a block whose memory is not mapped now.
        LaunchArgumentError
            Malformed pairs, or a destination named twice.
        PoolClosedError
            Planes in a pool closed since.
        """
        for spans in self._spans:
            spans.check_open()
        pairs = _host_pairs(pairs, *self._limits, "the source planes'", "the destination planes'")
        _distinct_destinations(pairs)
        _refuse_unmapped(self._spans[0], pairs, pairs[:, :1], "source block")
        _refuse_unmapped(self._spans[1], pairs, pairs[:, 1:], "destination block")
        if self._host:
            transfer_blocks_reference(self.src_planes, self.dst_planes, pairs)
            return
        if not len(pairs):
            return
        import cupy
        if self.mapped:
            with cupy.cuda.Device(self.dst_device), (stream if stream is not None else contextlib.nullcontext()):
                moved = pairs + self._shift
                device_pairs = self._staging.send(moved, out=cupy.empty(moved.shape, np.int64))
                _launch(self._bases, device_pairs, self.src_planes[0].strides[0], self.block_bytes)
            return
        handle = (stream if stream is not None else cupy.cuda.get_current_stream()).ptr
        d = _driver()
        src_ctx, dst_ctx = self._contexts
        size = self.block_bytes
        src_stride, dst_stride = self.src_planes[0].strides[0], self.dst_planes[0].strides[0]
        whole = src_stride == size and dst_stride == size  # a run of blocks is one contiguous range
        for src, dst, count in _runs(pairs, same_planes=False).tolist():
            for s, t in self._pointers:
                if whole:
                    drv.call(d, "cuMemcpyPeerAsync", t + dst * size, dst_ctx, s + src * size, src_ctx,
                             count * size, handle)
                    continue
                for k in range(count):
                    drv.call(d, "cuMemcpyPeerAsync", t + (dst + k) * dst_stride, dst_ctx, s + (src + k) * src_stride,
                             src_ctx, size, handle)


def transfer_blocks(src_planes: Sequence[Array], dst_planes: Sequence[Array], pairs: Any, stream: Optional[Any] = None,
                    *, mapped: bool = False) -> None:
    """One block transfer between two caches' planes: ``BlockTransfer(src_planes, dst_planes,
    mapped=mapped).run(pairs, stream)``, every check made first (see :class:`BlockTransfer`). To move blocks between
    the same planes again and again, make the :class:`BlockTransfer` once."""
    BlockTransfer(src_planes, dst_planes, mapped=mapped).run(pairs, stream)


def transfer_blocks_reference(src_planes: Sequence[np.ndarray], dst_planes: Sequence[np.ndarray], pairs: Any) -> None:
    """NumPy reference of :func:`transfer_blocks` (no checks)."""
    pairs = np.asarray(pairs, np.int64).reshape(-1, 2)
    for s, t in zip(src_planes, dst_planes):
        t[pairs[:, 1]] = s[pairs[:, 0]]


_driver = functools.cache(drv.load)


def _runs(pairs: np.ndarray, same_planes: bool = True) -> np.ndarray:
    """(src, dst, count) int64 rows: the runs of consecutive pairs whose src and dst both step by one block, in
    order. Where source and destination are the same planes, a run whose source and destination ranges would
    overlap is split into single pairs."""
    n = len(pairs)
    if not n:
        return np.zeros((0, 3), np.int64)
    src, dst = pairs[:, 0], pairs[:, 1]
    starts = np.ones(n, bool)
    starts[1:] = (np.diff(src) != 1) | (np.diff(dst) != 1)
    first = np.flatnonzero(starts)
    counts = np.diff(np.append(first, n))
    overlapping = same_planes & (counts > 1) & (np.abs(dst[first] - src[first]) < counts)
    if overlapping.any():
        starts |= np.repeat(overlapping, counts)
        first = np.flatnonzero(starts)
        counts = np.diff(np.append(first, n))
    return np.stack([src[first], dst[first], counts], axis=1)


def _spans(bases: Sequence[int], stride: int, block_bytes: int) -> List[List[int]]:
    """(first byte, width) of each stretch of planes whose blocks lie side by side inside one block stride."""
    spans: List[List[int]] = []
    for base in sorted(set(bases)):
        if spans and spans[-1][0] + spans[-1][1] == base and spans[-1][1] + block_bytes <= stride:
            spans[-1][1] += block_bytes
        else:
            spans.append([base, block_bytes])
    return spans


def _checked(planes: List[Array], pairs: Any, order_free: bool) -> Tuple[Any, np.ndarray, int]:
    """(array module, pairs as checked int64 [n, 2], block bytes) of a block copy's arguments: planes sharing the
    block stride and size, pairs inside every plane and mapped; with ``order_free``, distinct destinations and no
    block both a source and a destination."""
    check(len(planes) > 0, "planes is empty: pass at least one plane")
    names = [f"planes[{i}]" for i in range(len(planes))]
    xp = array_module(**dict(zip(names, planes)))
    block_bytes, num_blocks = _side(names, planes)
    pairs = _host_pairs(pairs, num_blocks, num_blocks, "the planes'", "the planes'")
    if order_free and len(pairs):
        _distinct_destinations(pairs)
        both = np.intersect1d(pairs[:, 0], pairs[:, 1])
        check(both.size == 0, lambda: f"block {int(both[0])} is both a source and a destination: "
                                      "split the copy into two calls so its order is defined")
    _refuse_unmapped(Spans(planes, planes[0].strides[0], block_bytes), pairs, pairs, "block")
    if xp is not np:
        for n, p in zip(names, planes):
            aligned(n, p)
    return xp, pairs, block_bytes


def _transfer_planes(src_planes: List[Array], dst_planes: List[Array]) -> Tuple[Any, int, Tuple[int, int], tuple]:
    """(array module, block bytes, (blocks of the source planes, of the destination planes), (source device,
    destination device)) of a transfer's planes, checked; the devices are None for NumPy planes."""
    check(len(src_planes) > 0, "src_planes is empty: pass at least one plane")
    check(len(src_planes) == len(dst_planes),
          lambda: f"{len(src_planes)} source planes but {len(dst_planes)} destination planes: plane i is copied to "
                  "plane i, so pass as many of each")
    src_names = [f"src_planes[{i}]" for i in range(len(src_planes))]
    dst_names = [f"dst_planes[{i}]" for i in range(len(dst_planes))]
    xp = array_kind(**dict(zip(src_names + dst_names, src_planes + dst_planes)))
    src_bytes, src_blocks = _side(src_names, src_planes)
    dst_bytes, dst_blocks = _side(dst_names, dst_planes)
    check(src_bytes == dst_bytes, lambda: f"source blocks are {src_bytes} bytes but destination blocks {dst_bytes}: "
                                          "copy between planes of one block shape and dtype")
    devices: tuple = (None, None)
    if xp is not np:
        devices = tuple(_one_device(names, planes) for names, planes in ((src_names, src_planes),
                                                                         (dst_names, dst_planes)))
        for n, p in zip(src_names + dst_names, src_planes + dst_planes):
            aligned(n, p)
    _apart(src_planes, dst_planes, src_bytes)
    return xp, src_bytes, (src_blocks, dst_blocks), devices


def _side(names: List[str], planes: Sequence[Array]) -> Tuple[int, int]:
    """(block bytes, blocks in the smallest plane) of planes that share their block stride and block size."""
    layouts = [plane(n, p) for n, p in zip(names, planes)]
    block_bytes = layouts[0].block_elems * planes[0].itemsize
    for n, p, lay in zip(names, planes, layouts):
        check(p.strides[0] == planes[0].strides[0] and lay.block_elems * p.itemsize == block_bytes,
              lambda: f"{n} has block stride {p.strides[0]} and block size {lay.block_elems * p.itemsize} bytes but "
                      f"{names[0]} has {planes[0].strides[0]} and {block_bytes}: all planes must share both")
    return block_bytes, min(lay.num_blocks for lay in layouts)


def _one_device(names: List[str], planes: Sequence[Array]) -> int:
    """The device every one of ``planes`` (CuPy arrays) lies on."""
    device = planes[0].device.id
    for n, p in zip(names, planes):
        check(p.device.id == device, lambda: f"{n} is on device {p.device.id} but {names[0]} on device {device}: the "
                                             "planes of one side must lie on one device")
    return device


def _apart(src_planes: Sequence[Array], dst_planes: Sequence[Array], block_bytes: int) -> None:
    """Check that no source plane's bytes overlap a destination plane's."""
    def extents(planes):
        lo = np.array([address(p) for p in planes], np.int64)
        return lo, lo + np.array([(p.shape[0] - 1) * p.strides[0] for p in planes], np.int64) + block_bytes
    (src_lo, src_hi), (dst_lo, dst_hi) = extents(src_planes), extents(dst_planes)
    overlap = (src_lo[:, None] < dst_hi[None, :]) & (dst_lo[None, :] < src_hi[:, None])
    check(not overlap.any(), lambda: "src_planes[{}] and dst_planes[{}] share memory: a transfer copies between two "
                                     "sets of planes; within one, use copy_blocks or swap_blocks"
                                     .format(*np.argwhere(overlap)[0]))


def _mapped_shift(src_planes: Sequence[Array], dst_planes: Sequence[Array], src_device: int, dst_device: int) -> int:
    """How many source block strides lie between every source plane and its destination plane, for the copy kernel
    on the destination device to reach both through the source bases; checks the peer mapping it reads over."""
    stride = src_planes[0].strides[0]
    offsets = {t.data.ptr - s.data.ptr for s, t in zip(src_planes, dst_planes)}
    offset = offsets.pop()
    check(dst_planes[0].strides[0] == stride and not offsets and offset % stride == 0,
          lambda: "mapped=True needs the destination planes at one distance from the source planes, a multiple of a "
                  "block stride both share (two caches of one layout): these are not; use mapped=False")
    if src_device != dst_device:
        for i, p in enumerate(src_planes):
            pool = find_pool(p.data.ptr)
            if pool is None or dst_device not in pool.access_devices:
                where = "lies in no pool" if pool is None else f"lies in a pool that device {dst_device} may not access"
                raise PeerAccessError(
                    f"src_planes[{i}] (device {src_device}) {where}: the copy kernel on device {dst_device} cannot "
                    f"read it over a peer mapping; call pool.grant_access({dst_device}) on the source cache's pool "
                    "first, or use mapped=False")
    return offset // stride


def _host_pairs(pairs: Any, src_blocks: int, dst_blocks: int, src_what: str, dst_what: str) -> np.ndarray:
    """``pairs`` as a checked int64 [n, 2] NumPy array: sources in ``[0, src_blocks)``, destinations in
    ``[0, dst_blocks)``."""
    host = pairs.get() if type(pairs).__module__.split(".")[0] == "cupy" else np.asarray(pairs)
    if host.size == 0:
        return np.zeros((0, 2), np.int64)
    check(host.ndim == 2 and host.shape[1] == 2 and host.dtype.kind in "iu",
          lambda: f"pairs must be integers [n, 2] (src, dst), got {host.dtype} {host.shape}")
    host = host.astype(np.int64)
    for column, limit, what in ((0, src_blocks, src_what), (1, dst_blocks, dst_what)):
        bad = np.flatnonzero((host[:, column] < 0) | (host[:, column] >= limit))
        if bad.size:
            i = int(bad[0])
            raise BlockTableError(f"pairs[{i}] = {tuple(host[i].tolist())} names a block outside {what} "
                                  f"blocks 0..{limit - 1}: fix the pair")
    return host


def _distinct_destinations(pairs: np.ndarray) -> None:
    """LaunchArgumentError unless every destination of ``pairs`` is named once."""
    if len(pairs) < 2:
        return
    _, counts = np.unique(pairs[:, 1], return_counts=True)
    check(counts.max() == 1, "pairs copy into the same destination twice: each destination once")


def _refuse_unmapped(spans: Spans, pairs: np.ndarray, ids: np.ndarray, what: str) -> None:
    """Raise BlockTableError for the first pair whose ``ids`` (its columns of ``pairs`` to check) name a block whose
    memory is not mapped now in some plane of ``spans`` (a :class:`~pagedrt.kernels.validate.Spans`)."""
    if not spans.spans or not len(pairs):
        return
    bad = np.flatnonzero(spans.unusable(ids).any(axis=1))
    if bad.size:
        i = int(bad[0])
        block = next(int(b) for b in ids[i] if spans.unusable(np.array([b]))[0])
        raise BlockTableError(f"pairs[{i}] = {tuple(pairs[i].tolist())} names {what} {block}, "
                              f"{spans.why(block)}; fix the pair")


def copy_blocks_reference(planes: Sequence[np.ndarray], pairs: Any) -> None:
    """NumPy reference of :func:`copy_blocks` (no checks)."""
    pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    for p in planes:
        p[pairs[:, 1]] = p[pairs[:, 0]]
