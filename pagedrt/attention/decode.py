"""Decode attention over a paged KV cache (one query token per sequence): the device side.

:class:`DecodePlan` does a step's checks and planning once; its :meth:`~DecodePlan.run`
attends for one layer. :func:`paged_decode` is a plan run once. :class:`ContiguousDecodePlan`
and :func:`contiguous_decode` run the same kernel source over K/V stored one sequence
after another: the contiguous baseline, which shows what paging itself costs. Given NumPy arrays they
run the float64 references (:mod:`pagedrt.attention.reference`).

K/V planes of FP8 (float8 e4m3 bits, held as uint8: :mod:`pagedrt.fp8`) take their scales at each run
(``k_scale``, ``v_scale``: float32 [kv_heads], one layer's); q and the output stay float16 or bfloat16.

Long sequences in small batches are split (split-K): each thread block handles one
segment of a sequence and writes a partial state (m, l, unnormalised o) into the
plan's workspace; the last segment of each sequence and KV head to finish combines
them exactly. :func:`~pagedrt.attention.planner.plan_splits` picks the split count
and the geometry.

Groups of more than 16 query heads a KV head run, on compute capability 9.0, on the sm_90a prefill kernel
(:mod:`pagedrt.attention.prefill_sm90`): a sequence's heads are the rows of one warpgroup tile, split the same
way into the same workspace layout.
"""

import functools
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from .. import source
from ..kernels.args import (NULL, Plane, array_module, c_contiguous, check, int_array, multiprocessors, plane,
                            positive_int, ptr, RunArrays)
from ..errors import UnsupportedConfigError
from ..kernels.configs import Config, config, fp8_sweep, sweep
from ..kernels.launch import launch
from ..kernels.validate import Spans, check_block_tables
from ..spec import Array, plane_kv_dtype
from . import reference
from . import prefill_sm90
from .plan_base import (LOG2E, Plan, Workspace, check_block_mask, check_workspace, default_scale, table_args,
                        table_width)
from .planner import (GEOMETRIES, WGMMA, SplitPlan, check_geometry, geometry, kernel_group, plan_splits,
                      prefill_sm90_geometry, split_residency, wide_kernel, wide_split, workspace_layout)

FILE = "decode.cu"
MAX_GRID_YZ = 65535  # batch and splits are grid dimensions y and z


def kernel_name(cfg: Config, paged: bool, geometry_name: str, indexed: bool = False) -> str:
    """The decode kernel's name expression for configuration ``cfg`` in geometry ``geometry_name``; ``indexed``:
    the variant that reads each item's table row and query token from a rows array (a mixed step's decode rows).
    Its GROUP is the heads one thread block takes (:func:`~pagedrt.attention.planner.kernel_group`)."""
    geo = geometry(cfg, geometry_name)
    heads = kernel_group(cfg)[0]
    flag = lambda b: "true" if b else "false"  # noqa: E731
    if cfg.fp8:
        return (f"pagedrt::decode_fp8<{cfg.cuda_type}, {cfg.head_dim}, {cfg.block_size}, {heads}, {geo.threads}, "
                f"{geo.tile}, {geo.stages}, {geo.ids_window}, {flag(indexed)}>")
    return (f"pagedrt::decode<{cfg.cuda_type}, {cfg.head_dim}, {cfg.block_size}, {heads}, {flag(paged)}, "
            f"{geo.threads}, {geo.lanes}, {geo.tile}, {geo.stages}, {flag(geo.mma)}, {geo.ids_window}, "
            f"{flag(indexed)}>")


def instances(configs: Optional[Sequence[Config]] = None, paged: Sequence[bool] = (True, False),
              indexed: Sequence[bool] = (False,)) -> Dict[str, Tuple[str, ...]]:
    """{file: name expressions} for ``configs`` (default: the representative sweeps, FP8's too), in every geometry;
    ``indexed=(False, True)`` adds the paged kernels' row-indexed variants (a mixed step's decode rows). FP8
    configurations have paged kernels only."""
    names = [kernel_name(c, p, name, i) for c in (configs or sweep() + fp8_sweep()) for p in paged for i in indexed
             if (p or not i) and (not c.fp8 or p) for name in GEOMETRIES]
    return {FILE: tuple(dict.fromkeys(names))}


@dataclass(frozen=True)
class _Kernel:
    function: object
    geometry: object       # planner.Geometry
    resident_blocks: int   # thread blocks of this kernel the whole device holds at once


@functools.lru_cache(maxsize=None)
def _kernel(cfg, paged, geometry_name, device_id, indexed=False):
    """The compiled kernel of a configuration and geometry, and its occupancy, per device."""
    from cupy_backends.cuda.api import driver
    fn = source.function(FILE, kernel_name(cfg, paged, geometry_name, indexed))
    geo = geometry(cfg, geometry_name)
    fn.max_dynamic_shared_size_bytes = geo.smem_bytes
    per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, geo.threads, geo.smem_bytes)
    return _Kernel(fn, geo, max(1, per_sm) * multiprocessors(device_id))


def _device_split(cfg, batch, q_heads, max_seq_len, num_splits, mean_seq_len, geometry_name):
    """The split plan on the current device, from the standard paged kernel's occupancy (so the contiguous
    baseline runs the same plan as the paged kernel)."""
    import cupy
    standard = _kernel(cfg, True, "standard", cupy.cuda.Device().id)
    units = q_heads // kernel_group(cfg)[0]  # thread blocks an item takes
    resident = split_residency(standard.resident_blocks, multiprocessors(cupy.cuda.Device().id),
                               standard.geometry.pipeline_bytes)
    return plan_splits(batch, units, max_seq_len, standard.geometry.tile, 2 * cfg.head_dim * cfg.kv_itemsize,
                       resident, num_splits=num_splits, mean_seq_len=mean_seq_len, geometry=geometry_name,
                       wave_blocks=standard.resident_blocks)


@dataclass(frozen=True)
class _Launch:
    """A decode launch but for its per-layer pointers: q, the K and V planes, out."""
    function: object
    grid: tuple
    threads: tuple
    smem: int
    middle: tuple  # the arguments between v and out: block stride ... group_chunks
    tail: tuple    # the split partials in the workspace (part_o, part_ml, arrivals) or nulls, then the rows or null

    def __call__(self, q: np.uint64, k: np.uint64, v: np.uint64, out: np.uint64, scales: tuple = ()) -> None:
        """Launch over one layer's pointers; ``scales``: FP8's (k_scale, v_scale) pointers, else nothing."""
        launch(self.function, self.grid, self.threads, (q, k, v, *self.middle, out, *self.tail, *scales), self.smem)


@dataclass(frozen=True)
class _Bound:
    """A prepared decode launch and what it runs over: its split workspace (the plan's or the caller's), the
    stream a split launch belongs to, the plan's claim on a caller's workspace, and the device arrays its
    pointers name besides the per-layer ones (a mixed step's rows)."""
    launch: _Launch
    workspace: Optional[Array]
    stream: Optional[int]  # the stream's pointer when split, else None (any stream)
    claim: Optional[Tuple[Workspace, int]]  # (Workspace, the plan's claim) on a caller's split workspace, else None
    keep: Optional[Array] = None

    def check(self) -> None:
        """Raise LaunchArgumentError unless the launch may run now: on the plan's stream when split, over a
        caller's workspace still laid out for this plan."""
        import cupy
        check(self.stream is None or self.stream == cupy.cuda.get_current_stream().ptr,
              lambda: "the plan splits sequences, and its split workspace belongs to the stream it was made on: "
                      "run it on that stream, or make a plan per stream")
        check(self.claim is None or self.claim[0].holds(self.claim[1]),
              "a later plan was made on this plan's workspace and laid it out for itself: a workspace holds one "
              "plan at a time; run the latest plan, or give each live plan its own workspace")


def _workspace_fits(workspace, batch, q_heads, head_dim, split):
    """Check a caller's workspace holds the split's partials; returns the layout (o, ml, arrivals, total)."""
    layout = workspace_layout(batch, q_heads, head_dim, split.num_splits)
    check(workspace is None or workspace.nbytes >= layout[3],
          lambda: f"workspace holds {workspace.nbytes} bytes but {split.num_splits} splits of {batch} x {q_heads} "
                  f"heads of head_dim {head_dim} need {layout[3]}: pass workspace_bytes({batch}, {q_heads}, "
                  f"{head_dim}, {split.num_splits}) bytes or more")
    return layout


def _bind_workspace(workspace, layout, rows):
    """The workspace (the caller's, or one allocated for the plan) and the kernel's pointers into it, with the
    arrival counts zeroed on the current stream. ``rows``: batch * q_heads."""
    import cupy
    if workspace is None:
        workspace = cupy.empty(layout[3], np.uint8)
    base = workspace.data.ptr
    cupy.cuda.runtime.memsetAsync(base + layout[2], 0, rows * 4, cupy.cuda.get_current_stream().ptr)
    return workspace, tuple(np.uint64(base + offset) for offset in layout[:3])


def _split_parts(split, layout, workspace, rows):
    """(workspace, its partials' pointers, stream, claim) of a :class:`_Bound` on the current stream: for a split
    plan the workspace laid out (the caller's, claimed, or one allocated) for ``rows`` (batch * q_heads) rows;
    unsplit, null pointers and no stream."""
    import cupy
    if split.num_splits <= 1:
        return workspace, (NULL, NULL, NULL), None, None
    claim = None
    if workspace is not None:
        held = Workspace.of(workspace)
        claim = (held, held.lay_out())
    workspace, parts = _bind_workspace(workspace, layout, rows)
    return workspace, parts, cupy.cuda.get_current_stream().ptr, claim


def _prepare(cfg, batch, q_heads, paged, block_stride, table_args, max_blocks, lens, scale, split, layout,
             workspace, rows=None):
    """The :class:`_Bound` launch of a checked decode (on the current device and stream). ``lens``: the lengths'
    pointer; ``rows``: a device int32 [batch, 2] of (table row, query token) for the indexed kernel."""
    import cupy
    kern = _kernel(cfg, paged, split.geometry, cupy.cuda.Device().id, rows is not None)
    workspace, parts, stream, claim = _split_parts(split, layout, workspace, batch * q_heads)
    heads, chunks = kernel_group(cfg)
    middle = (np.int64(block_stride), *table_args, np.int32(max_blocks), lens, np.float32(scale * LOG2E),
              np.int32(split.segment_tokens), np.int32(chunks))
    tail = (*parts, NULL if rows is None else ptr(rows))
    launch = _Launch(kern.function, (q_heads // heads, batch, split.num_splits), (kern.geometry.threads,),
                     kern.geometry.smem_bytes, middle, tail)
    return _Bound(launch, workspace, stream, claim, rows)


def _device_plan(cfg, batch, q_heads, num_kv_heads, scale, max_seq_len, num_splits, mean_seq_len, geometry_name):
    """The split plan on the current device, and its kernel: the sm_90a prefill kernel's plan
    (:func:`~pagedrt.attention.planner.wide_split`, geometry ``"wgmma"``) where
    :func:`~pagedrt.attention.planner.wide_kernel` says (the plan's geometry, a positive scale, compute
    capability 9.0), else the decode kernel's."""
    import cupy
    device = cupy.cuda.Device().id
    decode = functools.cache(functools.partial(_device_split, cfg, batch, q_heads, max_seq_len, num_splits,
                                               mean_seq_len, geometry_name))  # asked for at most once
    if geometry_name is None and scale > 0 and prefill_sm90.runs_on(device) and wide_kernel(
            cfg, lambda: decode().num_splits):
        return wide_split(cfg, batch, num_kv_heads, max_seq_len, multiprocessors(device), num_splits=num_splits,
                          mean_seq_len=mean_seq_len)
    return decode()


def _prepare_wide(cfg, q_heads, pk, block_tables, kv_lens, items, scale, split, layout, workspace):
    """The :class:`_Bound` launch of a checked wide-group decode (:func:`~pagedrt.attention.planner.wide_kernel`)
    on the sm_90a prefill kernel over ``items``, a device int32 [n, 4] of work items of one query token each
    (table row, query token, 1 token, packed row 0: a decode's sequences, or a mixed step's decode rows),
    whose token times the group's heads are the rows of its tile, non-causal (one query token sees every key),
    cut as ``split`` says, partials in the decode layout by item."""
    import cupy
    workspace, parts, stream, claim = _split_parts(split, layout, workspace, int(items.shape[0]) * q_heads)
    tiles = split.segment_tokens // prefill_sm90_geometry(cfg).tile_n
    launch = prefill_sm90.launch(cfg, pk, block_tables, kv_lens, items, False, scale, cupy.cuda.Device().id,
                                 split.num_splits, tiles, parts)
    return _Bound(launch, workspace, stream, claim, items)


def _decode_items_and_prepare(cfg, q_heads, pk, block_tables, seq_lens, scale, split, layout, workspace):
    """:func:`_prepare_wide` over a decode's sequences, an item each: (sequence, its query token, 1, 0), made on
    the device (no upload, so no wait for the stream's earlier work at every step's plan)."""
    import cupy
    seq = cupy.arange(int(seq_lens.shape[0]), dtype=np.int32)
    items = cupy.stack([seq, seq, cupy.ones_like(seq), cupy.zeros_like(seq)], axis=1)
    return _prepare_wide(cfg, q_heads, pk, block_tables, seq_lens, items, scale, split, layout, workspace)


def rows_launch(cfg: Config, q_heads: int, pk: Plane, block_tables: Array, kv_lens: Array, rows: np.ndarray,
                tokens: np.ndarray, scale: float, max_seq_len: int, mean_seq_len: Optional[float],
                workspace: Optional[Array]) -> _Bound:
    """The launch (a :class:`_Bound`: :meth:`~_Bound.check`, then ``.launch(q, k, v, out)``) of a mixed step's
    decode rows, on the current device and stream: batch rows ``rows`` of a prefill batch (host int64, one query
    token each, at most MAX_GRID_YZ), row ``rows[i]`` of ``block_tables`` and ``kv_lens`` with query token
    ``tokens[i]`` of q and out, over planes ``pk`` (:class:`~pagedrt.kernels.args.Plane`). Arguments are checked
    (``workspace`` as for :class:`DecodePlan`, holding ``len(rows)`` rows' partials); ``max_seq_len`` and
    ``mean_seq_len`` size the split plan.

    Every placement of the rows runs the indexed variant of :class:`DecodePlan`'s kernel over the (row, token)
    pairs, uploaded here: it costs one load per thread block more, and rows that follow one another gain
    nothing measurable from the plain kernel over moved pointers (docs/KERNELS.md). A wide group on compute
    capability 9.0 runs where :class:`DecodePlan` runs it: on the sm_90a kernel, an item a row."""
    import cupy
    n = len(rows)
    split = _device_plan(cfg, n, q_heads, pk.num_kv_heads, scale, max_seq_len, None, mean_seq_len, None)
    layout = _workspace_fits(workspace, n, q_heads, cfg.head_dim, split)
    if split.geometry == WGMMA:
        rows = np.asarray(rows, np.int64)
        items = cupy.asarray(np.stack([rows, np.asarray(tokens, np.int64), np.ones_like(rows), np.zeros_like(rows)],
                                      1).astype(np.int32))  # (table row, query token, 1 token, packed row 0)
        return _prepare_wide(cfg, q_heads, pk, block_tables, kv_lens, items, scale, split, layout, workspace)
    pairs = cupy.asarray(np.stack([rows, tokens], axis=1).astype(np.int32))
    return _prepare(cfg, n, q_heads, True, pk.block_stride, table_args(block_tables), int(block_tables.shape[1]),
                    ptr(kv_lens), scale, split, layout, workspace, rows=pairs)


def _common(q, dtype, head_dim, kv_heads, block_size, out, scale, num_splits, capacity, max_seq_len, geometry_name,
            workspace):
    """Checks shared by both launchers (q already checked 3-D contiguous); returns (config, scale, max_seq_len).
    ``dtype``: the planes', read by :func:`pagedrt.spec.plane_kv_dtype` (UnsupportedConfigError where its K/V
    dtype is not supported)."""
    batch, q_heads, q_dim = (int(x) for x in q.shape)
    kv_dtype = plane_kv_dtype(dtype)  # FP8, or None: the planes hold q's dtype
    check(kv_dtype is not None or q.dtype == dtype,
          lambda: f"q is {q.dtype} but the K/V cache is {dtype}: they must match")
    check(q_dim == head_dim, lambda: f"q has head_dim {q_dim} but the K/V cache has {head_dim}")
    check(q_heads % kv_heads == 0, lambda: f"q has {q_heads} heads, not a multiple of the {kv_heads} KV heads")
    cfg = config(q.dtype, head_dim, block_size, q_heads // kv_heads, kv_dtype=kv_dtype)
    check(batch <= MAX_GRID_YZ, lambda: f"batch {batch} exceeds {MAX_GRID_YZ}: split the batch")
    if out is not None:
        c_contiguous("out", out, 3)
        check(out.shape == q.shape and out.dtype == q.dtype,
              lambda: f"out must be {q.dtype} of q's shape {q.shape}, got {out.dtype} {out.shape}")
    scale = default_scale(scale, head_dim)
    positive_int("num_splits", num_splits, MAX_GRID_YZ)
    max_seq_len = positive_int("max_seq_len", max_seq_len, capacity) or capacity
    check_geometry(geometry_name)
    check_workspace(workspace)
    return cfg, scale, max_seq_len


def _lens(seq_lens, batch):
    int_array("seq_lens", seq_lens, np.int32, 1)
    check(seq_lens.shape[0] == batch and seq_lens.flags.c_contiguous,
          lambda: f"seq_lens must be contiguous with one length per query row ({batch}), got shape "
                  f"{seq_lens.shape}")


def _split(xp, cfg, q, max_seq_len, num_splits, mean_seq_len, geometry_name):
    """The split plan: the device's (from the kernel's occupancy), or on the host the reference's cut."""
    if xp is np:
        return reference.split(max_seq_len, cfg.block_size, num_splits or 1, geometry_name or "standard")
    return _device_split(cfg, q.shape[0], q.shape[1], max_seq_len, num_splits, mean_seq_len, geometry_name)


class _Plan(Plan):
    """What a decode plan of either layout does once it is checked: bind the launch, then run per layer."""

    def _bind(self, xp, q, k, cfg, scale, max_seq_len, split, reference_run, paged, spans, prepare):
        """Keep what :meth:`run` checks against, and prepare the launch (device arrays of a batch: ``prepare()``
        returns the :class:`_Bound`)."""
        self._split, self._scale, self._max_seq_len = split, scale, max_seq_len
        arrays = RunArrays(type(q), q.shape, q.dtype, (k.shape, k.strides, k.dtype), "K plane" if paged else "k",
                           spans)
        self._keep(arrays, int(k.shape[-3]) if cfg.fp8 else None, reference_run, None if xp is np else q.device.id)
        self._bound = None
        if xp is not np and q.shape[0]:
            self._bound = prepare()

    @property
    def split(self) -> SplitPlan:
        """The :class:`~pagedrt.attention.planner.SplitPlan` this plan runs."""
        return self._split

    def _check_launch(self):
        if self._bound is not None:
            self._bound.check()

    def _launch(self, pointers, scales):
        if self._bound is not None:
            self._bound.launch(*pointers, scales)


class DecodePlan(_Plan):
    """One decode step's attention, planned once and run for every layer (a plan/run split).

    The constructor does the per-step work: it checks the shapes, the table and the lengths (with
    ``validate``, on the device, once), picks the split plan (:attr:`split`) and the kernel, and carves the
    split partials out of the workspace, zeroing its arrival counts on the current stream. :meth:`run` then
    only checks one layer's arrays against the plan and launches (so a CUDA graph can capture the runs). A plan
    reads ``block_tables`` and ``seq_lens`` when each run executes: it belongs to the step whose tables and
    lengths it checked. With planes in a pool, validation checks the plan's K plane (a cache maps and releases a
    block in every plane at once, so that covers every layer); a run refuses planes whose pool was closed since
    (``PoolClosedError``). A split plan runs on the stream it was made on.

    On compute capability 9.0, the plan's choice for a group of more than 16 query heads a KV head, but for an
    unsplit decode of at most 32 (:func:`~pagedrt.attention.planner.wide_kernel`), is the sm_90a prefill kernel,
    split as :func:`~pagedrt.attention.planner.wide_split` says (:attr:`split`'s geometry ``"wgmma"``). On NumPy arrays
    the plan runs the float64 reference, cut as :func:`reference.split` says (``num_splits`` segments of whole
    blocks, unsplit by default), and :attr:`split` is that cut.

    Parameters
    ----------
    q, k_cache, block_tables, seq_lens, scale, num_splits, max_seq_len, mean_seq_len, block_mask, validate
        As :func:`paged_decode`'s (``k_cache`` fixes the plane layout every run's K and V must have).
    geometry : str, optional
        Force the decode kernel's geometry, ``"standard"`` or ``"short"`` (a wide group then stays on the
        decode kernel); None: the plan's choice.
    workspace : cupy.ndarray, uint8, optional
        Caller-owned, at least :func:`~pagedrt.attention.planner.workspace_bytes` for the plan's split count,
        reusable from step to step (one stream at a time) and fixed for graph capture. It holds one plan at a
        time: an earlier plan made on it then refuses to run (``LaunchArgumentError``), so plans that live side
        by side need a workspace each. None: a split plan allocates its own.
    Raises
    ------
    LaunchArgumentError
        Shapes, dtypes, strides or a workspace that do not fit.
    BlockTableError
        A bad length or used table entry (with ``validate``; NumPy inputs always).
    UnsupportedConfigError
        A configuration the kernels do not support.
    PoolClosedError
        Planes in a closed pool.
    """

    def __init__(self, q: Array, k_cache: Array, block_tables: Array, seq_lens: Array, scale: Optional[float] = None,
                 *, num_splits: Optional[int] = None, max_seq_len: Optional[int] = None,
                 mean_seq_len: Optional[float] = None, block_mask: Optional[Array] = None, validate: bool = True,
                 geometry: Optional[str] = None, workspace: Optional[Array] = None, _v_cache: Optional[Array] = None):
        # _v_cache: paged_decode's V plane, checked with the K plane (a plan over many layers is given only K)
        xp = array_module(q=q, k_cache=k_cache, block_tables=block_tables, seq_lens=seq_lens,
                          block_mask=block_mask, workspace=workspace)
        c_contiguous("q", q, 3)
        pk = plane("k_cache", k_cache)
        planes = (k_cache, _v_cache) if type(_v_cache) is type(k_cache) else (k_cache,)
        spans = Spans(planes, k_cache.strides[0], pk.block_elems * k_cache.itemsize)
        width = table_width(block_tables)
        check(block_tables.shape[0] == q.shape[0],
              lambda: f"block_tables has {block_tables.shape[0]} rows but q has {q.shape[0]} sequences")
        cfg, scale, max_seq_len = _common(q, k_cache.dtype, pk.head_dim, pk.num_kv_heads, pk.block_size, None,
                                          scale, num_splits, width * pk.block_size, max_seq_len, geometry,
                                          workspace)
        _lens(seq_lens, q.shape[0])
        check_block_mask(block_mask, pk.num_blocks)
        if xp is np:
            split = _split(xp, cfg, q, max_seq_len, num_splits, mean_seq_len, geometry)
        else:
            split = _device_plan(cfg, q.shape[0], q.shape[1], pk.num_kv_heads, scale, max_seq_len, num_splits,
                                 mean_seq_len, geometry)
        wide = split.geometry == WGMMA
        layout = _workspace_fits(workspace, q.shape[0], q.shape[1], pk.head_dim, split)
        if xp is np or validate:
            check_block_tables(block_tables, seq_lens, pk.block_size, pk.num_blocks, block_mask, spans=spans)
        reference_run = functools.partial(_paged_reference, block_tables=block_tables, seq_lens=seq_lens,
                                          scale=scale, num_splits=split.num_splits, max_seq_len=max_seq_len)
        prepare: Callable[[], _Bound]
        if wide:
            prepare = functools.partial(_decode_items_and_prepare, cfg, q.shape[1], pk, block_tables, seq_lens,
                                        scale, split, layout, workspace)
        else:
            prepare = lambda: _prepare(cfg, q.shape[0], q.shape[1], True, pk.block_stride,  # noqa: E731
                                       table_args(block_tables), width,
                                       ptr(seq_lens), scale, split, layout, workspace)
        self._bind(xp, q, k_cache, cfg, scale, max_seq_len, split, reference_run, True, spans, prepare)


class ContiguousDecodePlan(_Plan):
    """The contiguous baseline's plan: the same kernel and split plan over K/V stored one sequence after another
    (block id ``i * width + t // block_size`` instead of a table read); :meth:`run` takes K and V of k's shape.
    Comparing it with :class:`DecodePlan` over the same tokens shows what paging itself costs.

    Parameters
    ----------
    q : array [batch, q_heads, head_dim]
        C-contiguous, of k's dtype (float16, bfloat16 or float32: no FP8).
    k : array [batch, width, kv_heads, block_size, head_dim]
        C-contiguous: sequence i's token t is ``k[i, t // block_size, :, t % block_size]``.
    seq_lens : array, int32 [batch]
        Each in ``[1, width * block_size]``.
    validate : bool
        Check the lengths on the device first (NumPy inputs always).
    scale, num_splits, max_seq_len, mean_seq_len, geometry, workspace
        As :class:`DecodePlan`'s.
    """

    def __init__(self, q: Array, k: Array, seq_lens: Array, scale: Optional[float] = None, *,
                 num_splits: Optional[int] = None, max_seq_len: Optional[int] = None,
                 mean_seq_len: Optional[float] = None, validate: bool = True, geometry: Optional[str] = None,
                 workspace: Optional[Array] = None):
        xp = array_module(q=q, k=k, seq_lens=seq_lens, workspace=workspace)
        c_contiguous("q", q, 3)
        c_contiguous("k", k, 5)
        batch, width, kv_heads, block_size, head_dim = (int(x) for x in k.shape)
        spans = Spans((k,), 0, 0)  # only refuses a k in a closed pool: the baseline reads no block table
        check(q.shape[0] == batch, lambda: f"k holds {batch} sequences but q has {q.shape[0]}")
        if plane_kv_dtype(k.dtype) is not None:
            raise UnsupportedConfigError("FP8 (float8_e4m3) K/V runs on the paged kernel only: the contiguous "
                                         "baseline takes float16, bfloat16 or float32")
        cfg, scale, max_seq_len = _common(q, k.dtype, head_dim, kv_heads, block_size, None, scale, num_splits,
                                          width * block_size, max_seq_len, geometry, workspace)
        _lens(seq_lens, batch)
        split = _split(xp, cfg, q, max_seq_len, num_splits, mean_seq_len, geometry)
        layout = _workspace_fits(workspace, batch, q.shape[1], head_dim, split)
        if xp is np or validate:
            check_block_tables(None, seq_lens, block_size, 0, width=width)
        reference_run = functools.partial(_contiguous_reference, seq_lens=seq_lens, scale=scale,
                                          num_splits=split.num_splits, max_seq_len=max_seq_len)
        prepare = lambda: _prepare(cfg, batch, q.shape[1], False, kv_heads * block_size * head_dim,  # noqa: E731
                                   (NULL, np.int64(0)), width, ptr(seq_lens), scale, split, layout, workspace)
        self._bind(xp, q, k, cfg, scale, max_seq_len, split, reference_run, False, spans, prepare)


def _paged_reference(q, k, v, *, block_tables, seq_lens, scale, num_splits, max_seq_len, k_scale=None,
                     v_scale=None):
    return reference.paged_decode(q, k, v, block_tables, seq_lens, scale, num_splits=num_splits,
                                  max_seq_len=max_seq_len, k_scale=k_scale, v_scale=v_scale)


def _contiguous_reference(q, k, v, *, seq_lens, scale, num_splits, max_seq_len):
    return reference.contiguous_decode(q, k, v, seq_lens, scale, num_splits=num_splits, max_seq_len=max_seq_len)


def paged_decode(q: Array, k_cache: Array, v_cache: Array, block_tables: Array, seq_lens: Array,
                 scale: Optional[float] = None, *, out: Optional[Array] = None, num_splits: Optional[int] = None,
                 max_seq_len: Optional[int] = None, mean_seq_len: Optional[float] = None,
                 block_mask: Optional[Array] = None, validate: bool = True, geometry: Optional[str] = None,
                 workspace: Optional[Array] = None, k_scale: Optional[Array] = None,
                 v_scale: Optional[Array] = None) -> Array:
    """Attention of one query token per sequence over its paged K/V; returns ``out``.

    Query head h uses KV head h // (q_heads // kv_heads). Planes in a closed pool raise ``PoolClosedError``,
    whatever ``validate`` says. For many layers over the same tables, make one :class:`DecodePlan` and run it
    per layer.

    Parameters
    ----------
    q : array [batch, q_heads, head_dim]
        C-contiguous; float16 or bfloat16 over FP8 planes, else the planes' dtype.
    k_cache, v_cache : array [num_blocks, kv_heads, block_size, head_dim]
        One layer's planes (any block stride). uint8 planes hold float8 e4m3 bits
        (:func:`pagedrt.spec.plane_kv_dtype`): a stored value b means e4m3(b) * scale.
    block_tables : array, int32 [batch, width]
        Row stride may exceed width.
    seq_lens : array, int32 [batch]
    scale : float, optional
        Default 1 / sqrt(head_dim).
    out : array [batch, q_heads, head_dim], optional
        Allocated when None.
    num_splits : int, optional
        Force the split count (default: the split plan's).
    max_seq_len, mean_seq_len : optional
        Host-side figures of the lengths, if the caller has them (as the cache does): they size the split plan
        (and so the geometry) only. ``max_seq_len`` defaults to width * block_size.
    block_mask : array, bool or uint8 [num_blocks], optional
        Blocks a table may name (checked with ``validate``).
    validate : bool
        Check lengths and every used block id (against ``block_mask`` too, and, for planes that lie in a pool,
        that the block's memory is mapped now) on the device first, at the cost of one small launch and a
        16-byte device-to-host read; NumPy inputs are always checked (``BlockTableError``).
    geometry, workspace : optional
        As for :class:`DecodePlan`.
    k_scale, v_scale : array, float32 [kv_heads], optional
        FP8 planes only, and needed there: the layer's scales.
    """
    plan = DecodePlan(q, k_cache, block_tables, seq_lens, scale, num_splits=num_splits, max_seq_len=max_seq_len,
                      mean_seq_len=mean_seq_len, block_mask=block_mask, validate=validate, geometry=geometry,
                      workspace=workspace, _v_cache=v_cache)
    return plan.run(q, k_cache, v_cache, out, k_scale=k_scale, v_scale=v_scale)


def contiguous_decode(q: Array, k: Array, v: Array, seq_lens: Array, scale: Optional[float] = None, *,
                      out: Optional[Array] = None, num_splits: Optional[int] = None, max_seq_len: Optional[int] = None,
                      mean_seq_len: Optional[float] = None, validate: bool = True, geometry: Optional[str] = None,
                      workspace: Optional[Array] = None) -> Array:
    """The contiguous baseline run once: :class:`ContiguousDecodePlan` ``(q, k, seq_lens, ...).run(q, k, v, out)``;
    returns ``out`` (allocated when None, of q's shape and dtype). ``v`` has k's shape, dtype and layout."""
    plan = ContiguousDecodePlan(q, k, seq_lens, scale, num_splits=num_splits, max_seq_len=max_seq_len,
                                mean_seq_len=mean_seq_len, validate=validate, geometry=geometry, workspace=workspace)
    return plan.run(q, k, v, out)
