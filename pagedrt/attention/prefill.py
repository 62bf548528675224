"""Prefill attention over a paged KV cache (many query tokens per sequence): the device side.

:class:`PrefillPlan` does a step's checks and planning once; its :meth:`~PrefillPlan.run` attends for one
layer. :func:`paged_prefill` is a plan run once. One batch may mix prompts, chunks of prompts after cached
tokens and single decode tokens. Compute capability 9.0 runs ``cuda_src/prefill_sm90.cu`` for a positive
scale (over FP8 planes too), other devices ``cuda_src/prefill.cu``; a mixed step's decode rows
run where a :class:`~pagedrt.attention.DecodePlan` runs them, on a side stream of the plan's own. Given NumPy
arrays the plan runs the float64 reference (:func:`pagedrt.attention.reference.prefill`). docs/KERNELS.md
("Prefill", "Mixed steps") has the rest.
"""

import functools
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from .. import source
from ..errors import BlockTableError
from ..kernels.args import array_module, c_contiguous, check, int_array, multiprocessors, plane, ptr, RunArrays
from ..kernels.configs import Config, config, fp8_sweep, sweep
from ..kernels.validate import Spans, check_block_tables
from ..spec import Array, plane_kv_dtype
from ..supported import PREFILL_HEAD_DIMS, check as check_supported
from . import decode, prefill_sm90, reference
from .plan_base import (LOG2E, Plan, check_block_mask, check_workspace, default_scale, table_args,
                        table_width)
from .planner import (PREFILL_DTYPES, decode_rows, mixed_prompt_blocks, prefill_geometry, prefill_items,
                      prefill_sm90_geometry)
from .prefill_sm90 import Launch

FILE = "prefill.cu"
MAX_GRID_Y = 65535  # KV heads are grid dimension y


def supported(cfg: Config) -> Config:
    """Raise UnsupportedConfigError unless the prefill kernel runs configuration ``cfg``."""
    check_supported("dtype (prefill runs on tensor cores)", cfg.dtype, PREFILL_DTYPES)
    check_supported("head_dim (prefill)", cfg.head_dim, PREFILL_HEAD_DIMS)
    return cfg


def kernel_name(cfg: Config) -> str:
    """The prefill kernel's name expression for configuration ``cfg`` (the group is a kernel argument): the
    mma.sync kernel, or its FP8 twin for FP8 K/V."""
    geo = prefill_geometry(cfg)
    return (f"pagedrt::prefill{'_fp8' if cfg.fp8 else ''}<{cfg.cuda_type}, {cfg.head_dim}, {cfg.block_size}, "
            f"{geo.threads}, {geo.tile_m}, {geo.tile_n}, {geo.stages}>")


def instances(configs: Optional[Sequence[Config]] = None,
              capability: Optional[str] = None) -> Dict[str, Tuple[str, ...]]:
    """{file: name expressions} for the prefill-capable ``configs`` (default: those of the representative sweeps,
    FP8's too): of both kernels, or, given a device's ``capability`` (CuPy's compute_capability), of the one it
    runs for a positive scale."""
    capable = [c for c in (configs or sweep() + fp8_sweep())
               if c.dtype in PREFILL_DTYPES and c.head_dim in PREFILL_HEAD_DIMS]
    sm90 = prefill_sm90.FILE
    out = {FILE: tuple(dict.fromkeys(kernel_name(c) for c in capable)),
           sm90: tuple(dict.fromkeys(prefill_sm90.kernel_name(c) for c in capable))}
    return out if capability is None else {k: out[k] for k in ((sm90,) if capability == prefill_sm90.SM90
                                                               else (FILE,)) if out[k]}


@functools.lru_cache(maxsize=None)
def _kernel(cfg, device_id):
    """The compiled mma.sync kernel of a configuration, allowed its dynamic shared memory on the device."""
    fn = source.function(FILE, kernel_name(cfg))
    fn.max_dynamic_shared_size_bytes = prefill_geometry(cfg).smem_bytes
    return fn


def _prefill_launch(cfg, pk, block_tables, kv_lens, items, causal, scale, device, sm90, blocks=None):
    """The prefill kernel's :class:`~pagedrt.attention.prefill_sm90.Launch` over the work ``items`` (a device
    int32 [n, 4], n > 0): the sm_90a kernel's when ``sm90`` (on at most ``blocks`` SMs), else the mma.sync
    kernel's (a thread block per (item, KV head))."""
    if sm90:
        return prefill_sm90.launch(cfg, pk, block_tables, kv_lens, items, causal, scale, device, blocks=blocks)
    geo = prefill_geometry(cfg)
    middle = (np.int64(pk.block_stride), *table_args(block_tables), np.int32(block_tables.shape[1]), ptr(kv_lens),
              ptr(items), np.int32(cfg.group), np.int32(bool(causal)), np.float32(scale * LOG2E))
    return Launch(_kernel(cfg, device), (items.shape[0], pk.num_kv_heads), (geo.threads,), geo.smem_bytes, middle)


class _Fork:
    """A mixed step's two launches side by side: the prompt rows on the current stream first, so that their
    blocks hold their SMs, then the decode rows on this object's own side stream, which fill the others; an
    event each way (so a CUDA graph captures both)."""

    def __init__(self) -> None:
        import cupy
        self._fork, self._join = cupy.cuda.Event(disable_timing=True), cupy.cuda.Event(disable_timing=True)
        self._side = cupy.cuda.Stream(non_blocking=True)

    def __call__(self, side_launch: Callable[[], None], main_launch: Callable[[], None]) -> None:
        """Run ``main_launch()`` on the current stream, then ``side_launch()`` on the side stream (which waits
        only for what came before ``main_launch``); the current stream goes on once both are done."""
        import cupy
        main = cupy.cuda.get_current_stream()
        self._fork.record(main)
        main_launch()
        self._side.wait_event(self._fork)
        with self._side:
            side_launch()
        self._join.record(self._side)
        main.wait_event(self._join)


def _check_step(q, k_cache, block_tables, kv_lens, qo_indptr, block_mask, scale, workspace):
    """The checks of a prefill step's arguments, before anything is read back; returns (config, K plane, table
    width, scale)."""
    c_contiguous("q", q, 3)
    pk = plane("k_cache", k_cache)
    q_heads, head_dim = int(q.shape[1]), int(q.shape[2])
    kv_dtype = plane_kv_dtype(k_cache.dtype)  # FP8, or None: the planes hold q's dtype
    check(kv_dtype is not None or q.dtype == k_cache.dtype,
          lambda: f"q is {q.dtype} but the K/V cache is {k_cache.dtype}: they must match")
    check(head_dim == pk.head_dim, lambda: f"q has head_dim {head_dim} but the K/V cache has {pk.head_dim}")
    check(q_heads % pk.num_kv_heads == 0,
          lambda: f"q has {q_heads} heads, not a multiple of the {pk.num_kv_heads} KV heads")
    check(pk.num_kv_heads <= MAX_GRID_Y, lambda: f"{pk.num_kv_heads} KV heads exceed {MAX_GRID_Y}")
    cfg = supported(config(q.dtype, pk.head_dim, pk.block_size, q_heads // pk.num_kv_heads, kv_dtype=kv_dtype))
    width = table_width(block_tables)
    batch = int(block_tables.shape[0])
    int_array("kv_lens", kv_lens, np.int32, 1)
    check(kv_lens.shape[0] == batch and kv_lens.flags.c_contiguous,
          lambda: f"kv_lens must be contiguous with one length per block-table row ({batch}), got shape "
                  f"{kv_lens.shape}")
    int_array("qo_indptr", qo_indptr, np.int32, 1)
    check(qo_indptr.shape[0] == batch + 1 and qo_indptr.flags.c_contiguous,
          lambda: f"qo_indptr must be contiguous with {batch + 1} offsets (one per block-table row, then the "
                  f"end), got shape {qo_indptr.shape}")
    check_block_mask(block_mask, pk.num_blocks)
    scale = default_scale(scale, head_dim)
    check_workspace(workspace)
    return cfg, pk, width, scale


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


class PrefillPlan(Plan):
    """One prefill step's attention, planned once and run for every layer (a plan/run split).

    The constructor does the per-step work: it checks the shapes and offsets, the lengths and the table (with
    ``validate``), cuts the work items on the host and uploads them. :meth:`run` then only checks one layer's
    arrays against the plan and launches (no allocation and no host sync when ``out`` is given, so a CUDA graph
    can capture it). A plan reads ``block_tables`` and ``kv_lens`` when each run executes: it belongs to the
    step whose table and lengths it checked. Decode rows (:attr:`decode_rows`) run where a
    :class:`~pagedrt.attention.DecodePlan` would run them, split by their longest and mean length when
    ``validate`` read the lengths, else by the table's width. On NumPy arrays every row runs the reference.
    Over FP8 planes (q and out float16 or bfloat16, head_dim 64 or 128) :meth:`run` takes the layer's
    ``k_scale`` and ``v_scale``.

    Parameters
    ----------
    q : array [num_tokens, q_heads, head_dim]
        C-contiguous. Query head h uses KV head ``h // (q_heads // kv_heads)``.
    k_cache : array [num_blocks, kv_heads, block_size, head_dim]
        A plane (any block stride): every run's K and V have its layout.
    block_tables : array, int32 [batch, width]
        Row stride may exceed width.
    kv_lens : array, int32 [batch]
        Each sequence's keys after the step (cached and new), in ``[max(1, its query count), width * block_size]``.
    qo_indptr : array, int32 [batch + 1]
        Starting at 0, never decreasing, ending at num_tokens.
    query_lens : numpy.ndarray of int, optional
        Each row's query count on the host (a :class:`~pagedrt.step.Step`'s ``query_lens``), agreeing with
        ``qo_indptr`` (``validate`` checks it on the device); the work items are cut from it. None: the plan
        reads ``qo_indptr`` back from the device (a sync).
    causal : bool
        Query i of a sequence's n sees keys ``0 .. kv_len - n + i`` (aligned bottom-right, as chunked prefill
        needs); else every key.
    scale : float, optional
        Default 1 / sqrt(head_dim).
    block_mask : array, bool or uint8 [num_blocks], optional
        Blocks a table may name.
    validate : bool
        Read ``kv_lens`` back and check every length on the host, then every used table entry on the device as
        :class:`~pagedrt.attention.DecodePlan` does (two device-to-host reads). False trusts them: the kernels
        still never read past a table row's width or write outside q's rows. NumPy inputs are always checked.
    workspace : cupy.ndarray, uint8, optional
        For the decode rows' split partials: at least :func:`~pagedrt.attention.workspace_bytes`
        ``(len(decode_rows), q_heads, head_dim, splits)`` bytes, with DecodePlan's rules; None: the plan
        allocates one when it splits.

    Attributes
    ----------
    kernel : str or None
        The name expression of the prefill kernel a device plan launches for the rows that are not decode rows
        (the sm_90a kernel on compute capability 9.0 when ``scale`` is positive); None when there are none, and
        for NumPy inputs.

    Raises
    ------
    BlockTableError
        A bad length (with ``.row`` and ``.length``) or used table entry.
    LaunchArgumentError
        Shapes, dtypes, strides, offsets or a workspace that do not fit.
    UnsupportedConfigError
        A configuration the prefill kernels do not run (float16 or bfloat16 at head_dim 64, 128 or 256 only).
    PoolClosedError
        Planes in a closed pool.
    """

    def __init__(self, q: Array, k_cache: Array, block_tables: Array, kv_lens: Array, qo_indptr: Array, *,
                 query_lens: Optional[np.ndarray] = None, causal: bool = True, scale: Optional[float] = None,
                 block_mask: Optional[Array] = None, validate: bool = True, workspace: Optional[Array] = None,
                 _v_cache: Optional[Array] = None):
        # _v_cache: paged_prefill's V plane, checked with the K plane (a plan over many layers is given only K)
        xp = array_module(q=q, k_cache=k_cache, block_tables=block_tables, kv_lens=kv_lens, qo_indptr=qo_indptr,
                          block_mask=block_mask, workspace=workspace)
        cfg, pk, width, scale = _check_step(q, k_cache, block_tables, kv_lens, qo_indptr, block_mask, scale,
                                            workspace)
        validate = validate or xp is np
        offsets = _host_offsets(qo_indptr, query_lens, block_tables.shape[0], q.shape[0], validate)
        counts = np.diff(offsets)
        planes = (k_cache, _v_cache) if type(_v_cache) is type(k_cache) else (k_cache,)
        spans = Spans(planes, k_cache.strides[0], pk.block_elems * k_cache.itemsize)
        lens = None
        if validate:
            lens = np.asarray(kv_lens if xp is np else kv_lens.get(), np.int64)
            _check_lengths(lens, counts, width, pk.block_size)
            check_block_tables(block_tables, kv_lens, pk.block_size, pk.num_blocks, block_mask, spans=spans)
        self._decode_rows = decode_rows(counts)
        self._keep(RunArrays(type(q), q.shape, q.dtype, (k_cache.shape, k_cache.strides, k_cache.dtype), "K plane",
                             spans),
                   pk.num_kv_heads if cfg.fp8 else None,
                   functools.partial(reference.prefill, block_tables=block_tables, kv_lens=kv_lens, qo_indptr=offsets,
                                     scale=scale, causal=causal),
                   None if xp is np else q.device.id)
        self._prefill = self._decode = self._fork = self.kernel = None
        if xp is np:
            return
        if self._decode_rows.size:
            self._decode = self._split_decode_rows(cfg, q.shape[1], pk, block_tables, kv_lens, offsets, lens, scale,
                                                   workspace)
        self._choose_prefill(cfg, pk, block_tables, kv_lens, counts, causal, scale)
        if self._prefill is not None and self._decode is not None:
            self._fork = _Fork()

    def _split_decode_rows(self, cfg, q_heads, pk, block_tables, kv_lens, offsets, lens, scale, workspace):
        """The decode rows' launch (:func:`pagedrt.attention.decode.rows_launch`), split by the rows' longest and
        mean length when they were read (``lens``), else by the table's width."""
        rows = self._decode_rows
        longest, mean = int(block_tables.shape[1]) * pk.block_size, None
        if lens is not None:
            longest, mean = int(lens[rows].max()), float(lens[rows].mean())
        return decode.rows_launch(cfg, q_heads, pk, block_tables, kv_lens, rows, offsets[rows], scale, longest, mean,
                                  workspace)

    def _choose_prefill(self, cfg, pk, block_tables, kv_lens, counts, causal, scale):
        """The prefill kernel and its work items for the rows that are not decode rows: the sm_90a kernel on
        compute capability 9.0 for a positive scale (its FP8 twin over FP8 planes), else the mma.sync kernel. Beside
        decode rows the sm_90a kernel takes the SMs :func:`~pagedrt.attention.planner.mixed_prompt_blocks`
        gives it."""
        import cupy
        sm90 = prefill_sm90.runs_on(self._device) and scale > 0
        tile_m = (prefill_sm90_geometry if sm90 else prefill_geometry)(cfg).tile_m
        self._items = cupy.asarray(prefill_items(counts, cfg.group, tile_m, skip=self._decode_rows))
        blocks = mixed_prompt_blocks(multiprocessors(self._device)) if sm90 and self._decode_rows.size else None
        if self._items.shape[0]:
            self._prefill = _prefill_launch(cfg, pk, block_tables, kv_lens, self._items, causal, scale, self._device,
                                            sm90, blocks)
            self.kernel = (prefill_sm90.kernel_name if sm90 else kernel_name)(cfg)

    @property
    def decode_rows(self) -> np.ndarray:
        """The batch rows the decode kernel attends for (host int64, ascending); the prefill kernel takes the
        others (:func:`~pagedrt.attention.planner.decode_rows`)."""
        return self._decode_rows

    def _check_launch(self):
        if self._decode is not None:
            self._decode.check()

    def _launch(self, pointers, scales):
        if self._fork is not None:  # the decode rows on the side stream, beside the prompt rows
            self._fork(lambda: self._decode.launch(*pointers, scales), lambda: self._prefill(*pointers, scales))
        elif self._prefill is not None:
            self._prefill(*pointers, scales)
        elif self._decode is not None:
            self._decode.launch(*pointers, scales)


def paged_prefill(q: Array, k_cache: Array, v_cache: Array, block_tables: Array, kv_lens: Array, qo_indptr: Array,
                  *, out: Optional[Array] = None, query_lens: Optional[np.ndarray] = None, causal: bool = True,
                  scale: Optional[float] = None, block_mask: Optional[Array] = None, validate: bool = True,
                  workspace: Optional[Array] = None, k_scale: Optional[Array] = None,
                  v_scale: Optional[Array] = None) -> Array:
    """Attention of each sequence's query rows over its paged K/V; returns ``out``.

    Makes a :class:`PrefillPlan` and runs it once; ``validate`` checks the V plane too. For many layers over the
    same step, make one :class:`PrefillPlan` and run it per layer.

    Parameters
    ----------
    q : array [num_tokens, q_heads, head_dim]
        C-contiguous; float16 or bfloat16 over FP8 planes, else the planes' dtype.
    k_cache, v_cache : array [num_blocks, kv_heads, block_size, head_dim]
        One layer's planes (any block stride); uint8 planes hold float8 e4m3 bits
        (:func:`pagedrt.spec.plane_kv_dtype`).
    block_tables : array, int32 [batch, width]
    kv_lens : array, int32 [batch]
        Each sequence's keys after the step (cached and new).
    qo_indptr : array, int32 [batch + 1]
        Sequence b's queries are rows ``qo_indptr[b]:qo_indptr[b + 1]`` of q.
    out : array [num_tokens, q_heads, head_dim], optional
        Allocated when None.
    query_lens, causal, scale, block_mask, validate, workspace
        As for :class:`PrefillPlan`.
    k_scale, v_scale : array, float32 [kv_heads], optional
        FP8 planes only, and needed there: the layer's scales, as for :func:`~pagedrt.attention.paged_decode`.
    """
    plan = PrefillPlan(q, k_cache, block_tables, kv_lens, qo_indptr, query_lens=query_lens, causal=causal,
                       scale=scale, block_mask=block_mask, validate=validate, workspace=workspace,
                       _v_cache=v_cache)
    return plan.run(q, k_cache, v_cache, out, k_scale=k_scale, v_scale=v_scale)
