"""Prefill attention over a paged KV cache (many query tokens per sequence): the device side.

:class:`PrefillPlan` does a step's checks and planning once; its :meth:`~PrefillPlan.run`
attends for one layer. :func:`paged_prefill` is a plan run once. One batch may mix
prompts, chunks of prompts after cached tokens and single decode tokens: sequence b's
queries are rows ``qo_indptr[b]:qo_indptr[b + 1]`` of q and its keys the first
``kv_lens[b]`` tokens of its block-table row (cached and new: the new tokens' K/V are
written first). Causal attention is aligned bottom-right: query i of n sees keys
0..kv_len - n + i. Given NumPy arrays the plan runs the float64 reference
(:func:`pagedrt.attention.reference.prefill`).

The kernels run on tensor cores for float16 and bfloat16 at head_dim 64, 128 and 256;
other configurations raise ``UnsupportedConfigError`` on either backend, so a
configuration is supported by both or neither. A device of compute capability 9.0
(H100, H200) runs ``cuda_src/prefill_sm90.cu`` (warpgroup MMA with warp-specialised
producer and consumers, compiled for sm_90a) for every positive scale; every other GPU,
and a scale of 0 or below, runs ``cuda_src/prefill.cu`` (mma.m16n8k16, sm_80+). The
work items (query tiles of each sequence, :func:`~pagedrt.attention.planner.prefill_items`)
are cut on the host from the query counts, which a :class:`~pagedrt.step.Step` carries on
the host (``query_lens``).

Over FP8 K/V (uint8 planes of float8 e4m3 bits, scales per KV head given at each run) the rows that are not
decode rows run ``prefill_fp8``, the mma.sync kernel converting K and V to f16 in registers
(``cuda_src/prefill.cu``), on every GPU (the sm_90a kernel reads fp16/bf16 planes only); the decode rows run
``decode_fp8``'s indexed variant.

A mixed step's decode rows (one query token each:
:func:`~pagedrt.attention.planner.decode_rows`) go where a :class:`~pagedrt.attention.DecodePlan`
sends them (through :func:`pagedrt.attention.decode.rows_launch`): the decode kernel
(``cuda_src/decode.cu``), which streams their K/V at memory speed, or for a wide group on
compute capability 9.0 the sm_90a kernel, an item a row, split; the prefill kernel takes the other rows. With both,
a run launches the decode rows on a side stream beside the prompt rows on the current
one (an event each way, so a CUDA graph captures both).
"""

import functools
import math

import numpy as np

from .. import source
from ..errors import BlockTableError
from ..kernels.args import (array_module, c_contiguous, check, check_scales, device_pointers, int_array, plane,
                            ptr, RunArrays, scale_keywords, scale_pointers, store)
from ..kernels.configs import config, fp8_sweep, sweep
from ..kernels.validate import Spans, check_block_tables
from ..supported import PREFILL_HEAD_DIMS, check as check_supported
from . import decode, prefill_sm90, reference
from .planner import PREFILL_DTYPES, decode_rows, prefill_geometry, prefill_items, prefill_sm90_geometry
from .prefill_sm90 import Launch

FILE = "prefill.cu"
LOG2E = 1.4426950408889634
MAX_GRID_Y = 65535  # KV heads are grid dimension y


def supported(cfg):
    """Raise UnsupportedConfigError unless the prefill kernel runs configuration ``cfg``."""
    check_supported("dtype (prefill runs on tensor cores)", cfg.dtype, PREFILL_DTYPES)
    check_supported("head_dim (prefill)", cfg.head_dim, PREFILL_HEAD_DIMS)
    return cfg


def kernel_name(cfg):
    """The prefill kernel's name expression for configuration ``cfg`` (the group is a kernel argument): the
    mma.sync kernel, or its FP8 twin for FP8 K/V."""
    geo = prefill_geometry(cfg)
    return (f"pagedrt::prefill{'_fp8' if cfg.fp8 else ''}<{cfg.cuda_type}, {cfg.head_dim}, {cfg.block_size}, "
            f"{geo.threads}, {geo.tile_m}, {geo.tile_n}, {geo.stages}>")


def instances(configs=None, capability=None):
    """{file: name expressions} for the prefill-capable ``configs`` (default: those of the representative sweeps,
    FP8's too): of both kernels, or, given a device's ``capability`` (CuPy's compute_capability), of the one it
    runs (FP8 configurations: the mma.sync kernel's FP8 twin, on every device)."""
    capable = [c for c in (configs or sweep() + fp8_sweep())
               if c.dtype in PREFILL_DTYPES and c.head_dim in PREFILL_HEAD_DIMS]
    sm90 = prefill_sm90.FILE
    out = {FILE: tuple(dict.fromkeys(kernel_name(c) for c in capable)),
           sm90: tuple(dict.fromkeys(prefill_sm90.kernel_name(c) for c in capable if not c.fp8))}
    if capability == prefill_sm90.SM90:
        out[FILE] = tuple(kernel_name(c) for c in capable if c.fp8)
    return out if capability is None else {k: out[k] for k in ((sm90, FILE) if capability == prefill_sm90.SM90
                                                               else (FILE,)) if out[k]}


@functools.lru_cache(maxsize=None)
def _kernel(cfg, device_id):
    """The compiled mma.sync kernel of a configuration, allowed its dynamic shared memory on the device."""
    fn = source.function(FILE, kernel_name(cfg))
    fn.max_dynamic_shared_size_bytes = prefill_geometry(cfg).smem_bytes
    return fn


def _prefill_launch(cfg, pk, block_tables, kv_lens, items, causal, scale, device, sm90):
    """The prefill kernel's :class:`~pagedrt.attention.prefill_sm90.Launch` over the work ``items`` (a device
    int32 [n, 4], n > 0): the sm_90a kernel's when ``sm90``, else the mma.sync kernel's (a thread block per
    (item, KV head))."""
    if sm90:
        return prefill_sm90.launch(cfg, pk, block_tables, kv_lens, items, causal, scale, device)
    geo = prefill_geometry(cfg)
    middle = (np.int64(pk.block_stride), ptr(block_tables), np.int64(block_tables.strides[0] // 4),
              np.int32(block_tables.shape[1]), ptr(kv_lens), ptr(items), np.int32(cfg.group), np.int32(bool(causal)),
              np.float32(scale * LOG2E))
    return Launch(_kernel(cfg, device), (items.shape[0], pk.num_kv_heads), (geo.threads,), geo.smem_bytes, middle)


_side_streams = {}  # device id -> the stream a mixed step's decode rows run on beside its prompt rows


def _side_stream(device):
    import cupy
    if device not in _side_streams:
        _side_streams[device] = cupy.cuda.Stream(non_blocking=True)
    return _side_streams[device]


def _host_offsets(qo_indptr, query_lens, batch, num_tokens, validate):
    """The query offsets [batch + 1] on the host (int64), checked: from ``query_lens`` when given (compared with
    a device ``qo_indptr`` when ``validate``), else from ``qo_indptr`` (read back from the device)."""
    if query_lens is not None:
        check(isinstance(query_lens, np.ndarray) and query_lens.ndim == 1 and query_lens.shape[0] == batch
              and query_lens.dtype.kind in "iu",
              lambda: f"query_lens must be a 1-D NumPy integer array of {batch} counts (one per batch row), got "
                      f"{type(query_lens).__name__} {getattr(query_lens, 'dtype', '')} "
                      f"{getattr(query_lens, 'shape', '')}")
        check((query_lens >= 0).all(), lambda: f"query_lens[{int(np.argmax(query_lens < 0))}] is negative")
        offsets = np.concatenate(([0], np.cumsum(query_lens, dtype=np.int64)))
    else:
        offsets = np.asarray(qo_indptr if isinstance(qo_indptr, np.ndarray) else qo_indptr.get(), np.int64)
    check(offsets[0] == 0, lambda: f"qo_indptr[0] = {offsets[0]}: the first sequence's queries start at row 0")
    steps = np.diff(offsets)
    check((steps >= 0).all(), lambda: f"qo_indptr decreases at {int(np.argmax(steps < 0)) + 1} "
                                      f"({offsets[int(np.argmax(steps < 0))]} -> "
                                      f"{offsets[int(np.argmax(steps < 0)) + 1]}): offsets must not decrease")
    check(offsets[-1] == num_tokens, lambda: f"qo_indptr[{batch}] = {offsets[-1]} but q has {num_tokens} rows: the "
                                             "last offset is the number of query tokens")
    if query_lens is not None and validate:
        given = qo_indptr if isinstance(qo_indptr, np.ndarray) else qo_indptr.get()
        differ = np.flatnonzero(np.asarray(given, np.int64) != offsets)
        check(differ.size == 0, lambda: f"qo_indptr[{differ[0]}] = {given[differ[0]]} but query_lens sum to "
                                        f"{offsets[differ[0]]} there: they must describe the same rows")
    return offsets


def _check_lengths(kv_lens, query_counts, width, block_size):
    """Raise BlockTableError for the first length outside [1, width * block_size] or below its row's queries."""
    lens = np.asarray(kv_lens, np.int64)
    bad = (lens < 1) | (lens > width * block_size)
    if bad.any():
        row = int(np.argmax(bad))
        err = BlockTableError(f"kv_lens[{row}] = {lens[row]} is outside [1, {width * block_size}]: a block-table "
                              f"row holds {width} blocks of {block_size} tokens; fix the length or widen the table")
        err.row, err.length = row, int(lens[row])
        raise err
    short = lens < query_counts
    if short.any():
        row = int(np.argmax(short))
        err = BlockTableError(f"kv_lens[{row}] = {lens[row]} is less than the row's {query_counts[row]} query "
                              "tokens: the KV length counts the cached tokens and the new ones (write the new "
                              "tokens' K/V first)")
        err.row, err.length = row, int(lens[row])
        raise err


class PrefillPlan:
    """One prefill step's attention, planned once and run for every layer (a plan/run split).

    ``PrefillPlan(q, k_cache, block_tables, kv_lens, qo_indptr, ...)`` does the per-step
    work: it checks the shapes and offsets, the lengths and the table (with
    ``validate``), cuts the work items on the host and uploads them. :meth:`run`
    ``(q, k_cache, v_cache, out=None)`` then attends for one layer: its q, planes and
    out must have the shape, dtype and plane layout of the q and K plane the plan was
    made with, and it only checks that and launches (no allocation and no host sync
    when ``out`` is given, so a CUDA graph can capture it). A plan reads
    ``block_tables`` and ``kv_lens`` when each run executes: it belongs to the step
    whose table and lengths it checked.

    q: [num_tokens, q_heads, head_dim], C-contiguous; k_cache: a plane [num_blocks,
    kv_heads, block_size, head_dim] (any block stride); block_tables: int32 [batch,
    width] (row stride may exceed width); kv_lens: int32 [batch], each sequence's keys
    after the step (cached and new), in [max(1, its query count), width * block_size];
    qo_indptr: int32 [batch + 1], starting at 0, never decreasing, ending at
    num_tokens. Query head h uses KV head h // (q_heads // kv_heads). ``scale``
    defaults to 1 / sqrt(head_dim). ``causal``: query i of a sequence's n sees keys
    0..kv_len - n + i (the mask aligned bottom-right, as chunked prefill needs); else
    every key.

    ``query_lens``: each row's query count as a host NumPy integer array (a
    :class:`~pagedrt.step.Step`'s ``query_lens``). The work items are cut from it; it
    must agree with ``qo_indptr``, which ``validate`` checks on the device. Without it
    the plan reads ``qo_indptr`` back from the device (a sync) to cut them.

    ``kernel``: the name expression of the prefill kernel a device plan launches for the
    rows that are not decode rows (the sm_90a kernel on compute capability 9.0 when
    ``scale`` is positive); None when there are none, and for NumPy inputs.

    ``validate`` (the default) reads ``kv_lens`` back and checks every length on the
    host (in range, and not below its row's query count: ``BlockTableError`` with
    ``.row``, ``.length``), then checks every used table entry on the device as
    :class:`~pagedrt.attention.DecodePlan` does (against ``block_mask`` when given, and,
    for planes in a pool, that the block is mapped): two device-to-host reads.
    ``validate=False`` trusts the lengths and the table: the kernels still never read
    past a table row's width or write outside q's rows. NumPy inputs are always checked.

    Decode rows (:attr:`decode_rows`) run on the decode kernel, split as a
    :class:`~pagedrt.attention.DecodePlan` would split them (by their longest and mean
    length when ``validate`` read the lengths, else by the table's width); a split
    plan keeps their partials in ``workspace``, a caller-owned CuPy uint8 array of at
    least :func:`~pagedrt.attention.workspace_bytes` ``(len(decode_rows), q_heads,
    head_dim, splits)`` bytes, with DecodePlan's rules (one plan at a time, runs on the
    stream the plan was made on), or in one the plan allocates and holds when none is
    given. On NumPy arrays every row runs the reference.

    FP8 planes (uint8 float8 e4m3 bits; q and out float16 or bfloat16; head_dim 64 or 128) run the prompt rows
    on the mma.sync kernel's FP8 twin and the decode rows on decode_fp8's indexed variant, and :meth:`run` takes
    the layer's ``k_scale`` and ``v_scale``.
    """

    def __init__(self, q, k_cache, block_tables, kv_lens, qo_indptr, *, query_lens=None, causal=True, scale=None,
                 block_mask=None, validate=True, workspace=None, _v_cache=None):
        # _v_cache: paged_prefill's V plane, checked with the K plane (a plan over many layers is given only K)
        xp = array_module(q=q, k_cache=k_cache, block_tables=block_tables, kv_lens=kv_lens, qo_indptr=qo_indptr,
                          block_mask=block_mask, workspace=workspace)
        c_contiguous("q", q, 3)
        pk = plane("k_cache", k_cache)
        num_tokens, q_heads, head_dim = (int(x) for x in q.shape)
        fp8 = k_cache.dtype == np.uint8  # FP8 planes: float8 e4m3 bits
        check(fp8 or q.dtype == k_cache.dtype,
              lambda: f"q is {q.dtype} but the K/V cache is {k_cache.dtype}: they must match")
        check(head_dim == pk.head_dim, lambda: f"q has head_dim {head_dim} but the K/V cache has {pk.head_dim}")
        check(q_heads % pk.num_kv_heads == 0,
              lambda: f"q has {q_heads} heads, not a multiple of the {pk.num_kv_heads} KV heads")
        check(pk.num_kv_heads <= MAX_GRID_Y, lambda: f"{pk.num_kv_heads} KV heads exceed {MAX_GRID_Y}")
        cfg = supported(config(q.dtype, pk.head_dim, pk.block_size, q_heads // pk.num_kv_heads,
                               kv_dtype=k_cache.dtype if fp8 else None))
        int_array("block_tables", block_tables, np.int32, 2)
        batch, width = (int(x) for x in block_tables.shape)
        check(width >= 1 and block_tables.strides[1] == 4 and block_tables.strides[0] >= 4 * width,
              lambda: f"block_tables (shape {block_tables.shape}, strides {block_tables.strides}) must have "
                      "contiguous columns and rows at least a row apart")
        int_array("kv_lens", kv_lens, np.int32, 1)
        check(kv_lens.shape[0] == batch and kv_lens.flags.c_contiguous,
              lambda: f"kv_lens must be contiguous with one length per block-table row ({batch}), got shape "
                      f"{kv_lens.shape}")
        int_array("qo_indptr", qo_indptr, np.int32, 1)
        check(qo_indptr.shape[0] == batch + 1 and qo_indptr.flags.c_contiguous,
              lambda: f"qo_indptr must be contiguous with {batch + 1} offsets (one per block-table row, then the "
                      f"end), got shape {qo_indptr.shape}")
        if block_mask is not None:
            check(block_mask.ndim == 1 and block_mask.shape[0] == pk.num_blocks and block_mask.itemsize == 1
                  and block_mask.flags.c_contiguous and block_mask.dtype.kind in "bu",
                  lambda: f"block_mask must be a contiguous bool/uint8 array of {pk.num_blocks} entries (one per "
                          f"block), got {block_mask.dtype} {block_mask.shape}")
        scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        check(math.isfinite(scale), lambda: f"scale must be finite, got {scale}")
        decode.check_workspace(workspace)
        validate = validate or xp is np
        offsets = _host_offsets(qo_indptr, query_lens, batch, num_tokens, validate)
        counts = np.diff(offsets)
        planes = (k_cache, _v_cache) if type(_v_cache) is type(k_cache) else (k_cache,)
        spans = Spans(planes, k_cache.strides[0], pk.block_elems * k_cache.itemsize)
        lens = None
        if validate:
            lens = np.asarray(kv_lens if xp is np else kv_lens.get(), np.int64)
            _check_lengths(lens, counts, width, pk.block_size)
            check_block_tables(block_tables, kv_lens, pk.block_size, pk.num_blocks, block_mask, spans=spans)
        self._decode_rows = decode_rows(counts)
        self._kv_heads = pk.num_kv_heads if fp8 else None  # FP8: the length of the scales a run takes
        self._arrays = RunArrays(type(q), q.shape, q.dtype, (k_cache.shape, k_cache.strides, k_cache.dtype),
                                 "K plane", spans)
        self._reference = functools.partial(reference.prefill, block_tables=block_tables, kv_lens=kv_lens,
                                            qo_indptr=offsets, scale=scale, causal=causal)
        self._prefill = self._decode = self._forked = self.kernel = None
        if xp is np:
            return
        import cupy
        self._device = q.device.id
        rows = self._decode_rows
        if rows.size:  # the split plan sized by the rows' lengths when they were read, else by the table's width
            longest, mean = width * pk.block_size, None
            if validate:
                longest, mean = int(lens[rows].max()), float(lens[rows].mean())
            self._decode = decode.rows_launch(cfg, q_heads, pk, block_tables, kv_lens, rows,
                                              offsets[rows], scale, longest, mean, workspace)
        sm90 = prefill_sm90.runs_on(self._device) and scale > 0 and not fp8  # a positive scale, fp16/bf16 planes
        tile_m = (prefill_sm90_geometry if sm90 else prefill_geometry)(cfg).tile_m
        self._items = cupy.asarray(prefill_items(counts, cfg.group, tile_m, skip=rows))
        if self._items.shape[0]:
            self._prefill = _prefill_launch(cfg, pk, block_tables, kv_lens, self._items, causal, scale, self._device,
                                            sm90)
            self.kernel = (prefill_sm90.kernel_name if sm90 else kernel_name)(cfg)
        if self._prefill is not None and self._decode is not None:
            self._forked = (cupy.cuda.Event(disable_timing=True), cupy.cuda.Event(disable_timing=True),
                            _side_stream(self._device))

    @property
    def decode_rows(self):
        """The batch rows the decode kernel attends for (host int64, ascending); the prefill kernel takes the
        others (:func:`~pagedrt.attention.planner.decode_rows`)."""
        return self._decode_rows

    def run(self, q, k_cache, v_cache, out=None, *, k_scale=None, v_scale=None):
        """Prefill attention of ``q`` over one layer's K and V; returns ``out``. FP8 planes need that layer's
        ``k_scale`` and ``v_scale`` (float32 [kv_heads]); other planes take none."""
        k, v = k_cache, v_cache
        self._arrays.check(q, k, v, out)
        check_scales(self._kv_heads, self._arrays.array_type, k_scale, v_scale)
        if self._arrays.array_type is np.ndarray:
            return store(self._reference(q, k, v, **scale_keywords(self._kv_heads, k_scale, v_scale)), out)
        import cupy
        if self._decode is not None:
            self._decode.check()
        out = cupy.empty_like(q) if out is None else out
        pointers = device_pointers(self._device, ("q", "k_cache", "v_cache", "out"), (q, k, v, out))
        scales = scale_pointers(self._device, self._kv_heads, k_scale, v_scale)
        if self._forked is not None:  # the decode rows on the side stream, beside the prompt rows
            fork, join, side = self._forked
            main = cupy.cuda.get_current_stream()
            fork.record(main)
            side.wait_event(fork)
            with side:
                self._decode.launch(*pointers, scales)
            join.record(side)
            self._prefill(*pointers, scales)
            main.wait_event(join)
        elif self._prefill is not None:
            self._prefill(*pointers, scales)
        elif self._decode is not None:
            self._decode.launch(*pointers, scales)
        return out


def paged_prefill(q, k_cache, v_cache, block_tables, kv_lens, qo_indptr, *, out=None, query_lens=None, causal=True,
                  scale=None, block_mask=None, validate=True, workspace=None, k_scale=None, v_scale=None):
    """Attention of each sequence's query rows over its paged K/V; returns ``out``.

    Arguments as for :class:`PrefillPlan`, which this makes and runs once; ``validate``
    checks the V plane too. For many layers over the same step, make one
    :class:`PrefillPlan` and run it per layer. FP8 planes (uint8, float8 e4m3 bits) need ``k_scale`` and
    ``v_scale``, float32 [kv_heads], as :func:`~pagedrt.attention.paged_decode` does.
    """
    plan = PrefillPlan(q, k_cache, block_tables, kv_lens, qo_indptr, query_lens=query_lens, causal=causal,
                       scale=scale, block_mask=block_mask, validate=validate, workspace=workspace,
                       _v_cache=v_cache)
    return plan.run(q, k_cache, v_cache, out, k_scale=k_scale, v_scale=v_scale)
