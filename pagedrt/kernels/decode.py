"""Decode attention over a paged KV cache (one query token per sequence), and its twins.

:func:`paged_decode` reads K/V through the block table; :func:`contiguous_decode`
runs the same kernel source over K/V stored one sequence after another (the
baseline that shows what paging itself costs). Given NumPy arrays they run the
float64 twins :func:`paged_decode_reference` / :func:`contiguous_decode_reference`.

Long sequences in small batches are split (split-K): each thread block handles
one segment of a sequence and writes a partial state (m, l, unnormalised o);
the last segment of each sequence and KV head to finish combines them exactly.
:func:`plan_splits` picks the split count.
"""

import functools
import math
from dataclasses import dataclass

import numpy as np

from .. import source
from .args import (NULL, aligned, array_module, c_contiguous, check, device_pointers, int_array, multiprocessors,
                   plane, positive_int, ptr, same_layout)
from .configs import config, sweep
from .validate import check_block_tables

FILE = "decode.cu"
THREADS = 128                   # threads per block (but MMA_SHORT_THREADS in the short tensor-core geometry)
STAGES = 4                      # cp.async pipeline depth
TILE_BYTES = 8192               # bytes of K (and again of V) per pipeline stage
LANE_FLOATS = 64                # floats of q and of the output a lane holds, over the group (see geometry)
SHORT_TILES = 32                # segments of at most this many tiles run the short-segment geometry,
SHORT_WAVES = 1                 # when there are more thread blocks than this many waves of the standard one
SHORT_STAGES = 3                # its pipeline depth
SHORT_LANE_FLOATS = 32          # its lane budget: half the registers, so more thread blocks per SM
MMA_HEAD_DIMS = (64, 128)       # fp16/bf16 head dims run on tensor cores (a row is 8 or 16 16-byte chunks)
MMA_STAGES = 3                  # tensor cores: 16 tokens per warp per tile
MMA_SHORT_THREADS, MMA_SHORT_STAGES = 64, 3  # two warps, a 32-token tile: 4 blocks share an SM
IDS_WINDOW = 256                # block ids staged in shared memory (kIdsWindow in decode.cu)
MIN_SEGMENT_BYTES = 256 << 10   # K+V bytes that make a split segment worth a thread block
UNEVEN = 1.5                    # longest / mean length above which a full batch is split anyway
MAX_GRID_YZ = 65535             # batch and splits are grid dimensions y and z
LOG2E = 1.4426950408889634


# --- configurations -------------------------------------------------------------

@dataclass(frozen=True)
class Geometry:
    lanes: int       # lanes sharing one token's dot product (each holds head_dim/lanes dims of q)
    tile: int        # tokens per pipeline stage
    stages: int
    smem_bytes: int  # dynamic shared memory per thread block: the pipeline's stages, then the staged ids
    mma: bool = False  # scores and weighted sums on tensor cores (mma.m16n8k16), a warp per 16 tokens
    threads: int = THREADS


def _pow2_floor(x):
    return 1 << (max(1, x).bit_length() - 1)


def geometry(cfg, short=False):
    """How a thread block cuts the work of a configuration.

    Lanes per token: the fewer, the fewer shuffles and the less softmax work repeated
    across lanes, but each lane then holds more dims of q and of the output for every
    query head: LANE_FLOATS of them (q and output together, about 2 * LANE_FLOATS
    registers). A stage holds TILE_BYTES of K (a power-of-two token count, at least
    one per lane group). ``short``: the geometry for short segments, where each
    thread block's start and end weigh most; half the lane budget and one stage less
    let twice as many thread blocks share an SM and hide each other's start (on the
    H200, b256 81.0% -> 85.4% of the stream ceiling; long sequences lose, b32 89.7%
    -> 84.8%: benchmarks/results/h200-bench_decode-lanes16.txt). The split plan
    chooses it (:func:`plan_splits`).

    fp16/bf16 at head_dim 64 or 128 run on tensor cores instead: a warp per 16 tokens
    of a 64-token tile, 3 stages, 2 blocks per SM. Their short geometry has two warps
    (a 32-token tile) and 3 stages of half the bytes, so 4 blocks share an SM with
    the same bytes in flight, and each block's start is hidden by three others (on the
    H200, b64, b128 and b256 0.2-2.3% faster; three 128-thread blocks of 2 stages
    measured slower, one-warp blocks no faster: benchmarks/NOTES.md, v7 and v10).
    """
    row = cfg.head_dim * cfg.itemsize
    if cfg.dtype != "float32" and cfg.head_dim in MMA_HEAD_DIMS:
        threads, stages = (MMA_SHORT_THREADS, MMA_SHORT_STAGES) if short else (THREADS, MMA_STAGES)
        tile = 16 * threads // 32
        return Geometry(32, tile, stages, stages * 2 * tile * row + 4 * IDS_WINDOW, True, threads)
    vec = 16 // cfg.itemsize
    row_vecs = cfg.head_dim // vec
    budget, stages = (SHORT_LANE_FLOATS, SHORT_STAGES) if short else (LANE_FLOATS, STAGES)
    lane_vecs = min(4, _pow2_floor(budget // (vec * cfg.group)))
    lanes = min(32, 1 << (-(-row_vecs // lane_vecs) - 1).bit_length())
    tile = max(_pow2_floor(TILE_BYTES // row), THREADS // lanes)
    return Geometry(lanes, tile, stages, stages * 2 * tile * row + 4 * IDS_WINDOW)


def kernel_name(cfg, paged, short=False):
    """The decode kernel's name expression for a configuration (in the short-segment geometry if ``short``)."""
    geo = geometry(cfg, short)
    return (f"pagedrt::decode<{cfg.cuda_type}, {cfg.head_dim}, {cfg.block_size}, {cfg.group}, "
            f"{'true' if paged else 'false'}, {geo.threads}, {geo.lanes}, {geo.tile}, {geo.stages}, "
            f"{'true' if geo.mma else 'false'}>")


def instances(configs=None, paged=(True, False)):
    """{file: name expressions} for ``configs`` (default: the representative sweep)."""
    names = [kernel_name(c, p, short) for c in (configs or sweep()) for p in paged for short in (False, True)]
    return {FILE: tuple(dict.fromkeys(names))}


# --- the split plan ---------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    num_splits: int
    segment_tokens: int  # split i covers tokens [i*segment_tokens, (i+1)*segment_tokens); the last, the rest
    short: bool = False  # run the short-segment geometry (geometry(cfg, short=True))


def plan_splits(batch, num_kv_heads, max_seq_len, tile, bytes_per_token, slots, num_splits=None,
                mean_seq_len=None):
    """Cut sequences into segments for split-K; ``num_splits`` overrides the choice.

    Without a request: ``batch * num_kv_heads`` thread blocks. If they leave some of
    the device's resident slots (SMs x blocks per SM) empty, split each sequence
    into as many segments as fill the slots in one wave, but never into segments
    of fewer than MIN_SEGMENT_BYTES of K+V (per thread block overheads: pipeline
    fill, final merge). If they fill the slots but lengths are uneven (the longest
    over UNEVEN times the mean, when ``mean_seq_len`` is known), cut segments of
    about a quarter of the mean length, so that short and long sequences become
    work units of similar size and no long sequence runs alone at the end (on the
    H200, the ``var`` case ran 21% faster at 8 splits than unsplit, while equal
    lengths ran fastest unsplit: benchmarks/results/h200-bench_decode_splits-v2.txt).
    Segments are whole tiles; splits the rounding left empty are dropped. A
    requested count is kept even if some segments are then empty. ``slots`` and
    ``tile`` are the standard geometry's; the plan then picks the short-segment
    geometry when segments are at most SHORT_TILES tiles, the thread blocks
    outnumber SHORT_WAVES waves and the lengths were not cut for unevenness: many
    short blocks, whose starts the extra resident blocks hide (one wave of short
    segments, as long-1 split 32 ways, runs faster in the standard geometry, and so
    does the ``var`` case on tensor cores, by 0.7-1.1%: benchmarks/NOTES.md, v10).
    """
    units = batch * num_kv_heads
    min_tokens = max(1, MIN_SEGMENT_BYTES // bytes_per_token)
    uneven = bool(mean_seq_len) and max_seq_len > UNEVEN * mean_seq_len
    if num_splits is not None:
        wanted = num_splits
    elif units < slots:
        wanted = max(1, min(slots // units, max_seq_len // min_tokens))
    elif uneven:
        wanted = -(-max_seq_len // max(min_tokens, int(mean_seq_len) // 4))
    else:
        wanted = 1
    segment = -(-max_seq_len // wanted)
    segment = -(-segment // tile) * tile
    if num_splits is None:
        wanted = -(-max_seq_len // segment)
    short = segment <= SHORT_TILES * tile and units * wanted > SHORT_WAVES * slots and not uneven
    return Plan(wanted, segment, short)


# --- device launch ------------------------------------------------------------------

@dataclass(frozen=True)
class _Kernels:
    decode: object
    geometry: Geometry
    slots: int  # thread blocks resident at once on the whole device


@functools.lru_cache(maxsize=None)
def _kernels(cfg, paged, short, device_id):
    from cupy_backends.cuda.api import driver
    fn = source.function(FILE, kernel_name(cfg, paged, short))
    geo = geometry(cfg, short)
    fn.max_dynamic_shared_size_bytes = geo.smem_bytes
    per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, geo.threads, geo.smem_bytes)
    return _Kernels(fn, geo, max(1, per_sm) * multiprocessors(device_id))


@functools.lru_cache(maxsize=8)
def _workspace(device_id, stream_ptr, rows, num_splits, head_dim):
    """Split partials, kept per shape and stream: o [rows, splits, head_dim], (m, l) [rows, splits, 2],
    and arrival counts, one per (sequence, KV head) item, the first rows / group of them used (zero
    between launches: the merging block resets its item's count)."""
    import cupy
    return (cupy.empty((rows, num_splits, head_dim), np.float32),
            cupy.empty((rows, num_splits, 2), np.float32),
            cupy.zeros(rows, np.int32))


def _plan(cfg, batch, kv_heads, max_seq_len, num_splits, device, mean_seq_len=None):
    """The split plan, from the standard paged kernel's occupancy (so the contiguous twin runs the same plan)."""
    kern = _kernels(cfg, True, False, device)
    return plan_splits(batch, kv_heads, max_seq_len, kern.geometry.tile, 2 * cfg.head_dim * cfg.itemsize,
                       kern.slots, num_splits, mean_seq_len)


@dataclass(frozen=True)
class _Launch:
    """A decode launch but for its per-layer pointers: q, the K and V planes (or twins), out."""
    kernel: object
    grid: tuple
    threads: tuple
    smem: int
    middle: tuple  # the arguments between v and out: block stride ... segment_tokens
    tail: tuple    # pointers to the split workspace (part_o, part_ml, arrivals), or nulls
    stream: object  # the stream (pointer) whose workspace ``tail`` holds; None when unsplit (any stream will do)
    workspace: tuple  # the workspace's arrays: held, so that _workspace's cache cannot free them under a plan

    def __call__(self, q, k, v, out):
        self.kernel(self.grid, self.threads, (q, k, v, *self.middle, out, *self.tail), shared_mem=self.smem)


def _prepare(batch, q_heads, cfg, paged, block_stride, table_args, max_blocks, seq_lens, scale, max_seq_len,
             num_splits, mean_seq_len):
    """The split plan, the kernel and the workspace of a launch (on the current device and stream)."""
    import cupy
    kv_heads = q_heads // cfg.group
    device = cupy.cuda.Device().id
    plan = _plan(cfg, batch, kv_heads, max_seq_len, num_splits, device, mean_seq_len)
    kern = _kernels(cfg, paged, plan.short, device)
    check(plan.num_splits <= MAX_GRID_YZ, lambda: f"num_splits={plan.num_splits} exceeds {MAX_GRID_YZ}")
    stream, workspace, tail = None, (), (NULL, NULL, NULL)
    if plan.num_splits > 1:
        stream = cupy.cuda.get_current_stream().ptr
        workspace = _workspace(device, stream, batch * q_heads, plan.num_splits, cfg.head_dim)
        tail = tuple(ptr(a) for a in workspace)
    middle = (np.int64(block_stride), *table_args, np.int32(max_blocks), ptr(seq_lens),
              np.float32(scale * LOG2E), np.int32(plan.segment_tokens))
    return _Launch(kern.decode, (kv_heads, batch, plan.num_splits), (kern.geometry.threads,),
                   kern.geometry.smem_bytes, middle, tail, stream, workspace)


# --- public launchers -----------------------------------------------------------------

def _common(q, dtype, head_dim, kv_heads, block_size, out, scale, num_splits, capacity, max_seq_len):
    """Checks shared by both launchers (q already checked 3-D contiguous); returns (config, scale, max_seq_len)."""
    batch, q_heads, q_dim = (int(x) for x in q.shape)
    check(q.dtype == dtype, lambda: f"q is {q.dtype} but the K/V cache is {dtype}: they must match")
    check(q_dim == head_dim, lambda: f"q has head_dim {q_dim} but the K/V cache has {head_dim}")
    check(q_heads % kv_heads == 0, lambda: f"q has {q_heads} heads, not a multiple of the {kv_heads} KV heads")
    cfg = config(dtype, head_dim, block_size, q_heads // kv_heads)
    check(batch <= MAX_GRID_YZ, lambda: f"batch {batch} exceeds {MAX_GRID_YZ}: split the batch")
    if out is not None:
        c_contiguous("out", out, 3)
        check(out.shape == q.shape and out.dtype == q.dtype,
              lambda: f"out must be {q.dtype} of q's shape {q.shape}, got {out.dtype} {out.shape}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    check(math.isfinite(scale), lambda: f"scale must be finite, got {scale}")
    positive_int("num_splits", num_splits, MAX_GRID_YZ)
    max_seq_len = positive_int("max_seq_len", max_seq_len, capacity) or capacity
    return cfg, scale, max_seq_len


def _lens(seq_lens, batch):
    int_array("seq_lens", seq_lens, np.int32, 1)
    check(seq_lens.shape[0] == batch and seq_lens.flags.c_contiguous,
          lambda: f"seq_lens must be contiguous with one length per query row ({batch}), got shape "
                  f"{seq_lens.shape}")


class DecodePlan:
    """One decode step's attention launch, prepared once and run for every layer (a plan/run split).

    ``DecodePlan(q, k_cache, block_tables, seq_lens, ...)`` does the per-step work:
    it checks the shapes, the table and the lengths (with ``validate``, on the device,
    once), picks the split plan and the kernel, and binds the split workspace of the
    current stream. :meth:`run` then attends for one layer: its q, K and V planes
    and out must have the shape, dtype and plane layout of the q and K plane the
    plan was made with. ``run`` costs about a third of the host time of
    :func:`paged_decode`, which is a plan and one run (on the H200 machines 21 us
    against 60-79, or 29-33 against 92-97: benchmarks/NOTES.md, "The other
    overheads"). A plan reads ``block_tables`` and ``seq_lens`` when each run
    executes: it belongs to the step whose tables and lengths it checked; make a new
    one when they change. Arguments are those of :func:`paged_decode`.
    """

    def __init__(self, q, k_cache, block_tables, seq_lens, scale=None, *, num_splits=None, max_seq_len=None,
                 mean_seq_len=None, block_mask=None, validate=True):
        xp = array_module(q=q, k_cache=k_cache, block_tables=block_tables, seq_lens=seq_lens,
                          block_mask=block_mask)
        c_contiguous("q", q, 3)
        pk = plane("k_cache", k_cache)
        int_array("block_tables", block_tables, np.int32, 2)
        width = int(block_tables.shape[1])
        check(block_tables.shape[0] == q.shape[0],
              lambda: f"block_tables has {block_tables.shape[0]} rows but q has {q.shape[0]} sequences")
        check(width >= 1 and block_tables.strides[1] == 4 and block_tables.strides[0] >= 4 * width,
              lambda: f"block_tables (shape {block_tables.shape}, strides {block_tables.strides}) must have "
                      "contiguous columns and rows at least a row apart")
        cfg, self._scale, self._max_seq_len = _common(q, k_cache.dtype, pk.head_dim, pk.num_kv_heads,
                                                      pk.block_size, None, scale, num_splits, width * pk.block_size,
                                                      max_seq_len)
        _lens(seq_lens, q.shape[0])
        if block_mask is not None:
            check(block_mask.ndim == 1 and block_mask.shape[0] == pk.num_blocks and block_mask.itemsize == 1
                  and block_mask.flags.c_contiguous and block_mask.dtype.kind in "bu",
                  lambda: f"block_mask must be a contiguous bool/uint8 array of {pk.num_blocks} entries (one per "
                          f"block), got {block_mask.dtype} {block_mask.shape}")
        if xp is np or validate:
            check_block_tables(block_tables, seq_lens, pk.block_size, pk.num_blocks, block_mask)
        self._type, self._q, self._plane = type(q), (q.shape, q.dtype), (k_cache.shape, k_cache.strides, k_cache.dtype)
        self._tables, self._lens, self._num_splits = block_tables, seq_lens, num_splits
        self._launch = None
        if xp is not np:
            self._device = q.device.id
            if q.shape[0]:
                self._launch = _prepare(q.shape[0], q.shape[1], cfg, True, pk.block_stride,
                                        (ptr(block_tables), np.int64(block_tables.strides[0] // 4)), width,
                                        seq_lens, self._scale, self._max_seq_len, num_splits, mean_seq_len)

    def run(self, q, k_cache, v_cache, out=None):
        """Attention of ``q`` over one layer's planes, through the plan's tables; returns ``out``."""
        kind = self._type
        check(type(q) is kind and type(k_cache) is kind and type(v_cache) is kind
              and (out is None or type(out) is kind),
              lambda: f"q, k_cache, v_cache and out must be {kind.__module__}.{kind.__name__}s, as the plan's: "
                      "NumPy or CuPy arrays, not a mix")
        shape, dtype = self._q
        check(q.shape == shape and q.dtype == dtype and q.flags.c_contiguous,
              lambda: f"q must be C-contiguous {dtype} of shape {shape}, as the plan's, got {q.dtype} {q.shape}")
        same_layout("k_cache", k_cache, self._plane, "K plane")
        same_layout("v_cache", v_cache, self._plane, "K plane")
        if out is not None:
            check(out.shape == shape and out.dtype == dtype and out.flags.c_contiguous,
                  lambda: f"out must be C-contiguous {dtype} of q's shape {shape}, got {out.dtype} {out.shape}")
        if kind is np.ndarray:
            result = paged_decode_reference(q, k_cache, v_cache, self._tables, self._lens, self._scale,
                                            num_splits=self._num_splits or 1, max_seq_len=self._max_seq_len)
            return _store(result, out)
        import cupy
        launch = self._launch
        check(launch is None or launch.stream is None or launch.stream == cupy.cuda.get_current_stream().ptr,
              lambda: "the plan splits sequences, and its split workspace belongs to the stream it was made on: "
                      "run it on that stream, or make a plan per stream")
        out = cupy.empty_like(q) if out is None else out
        pointers = device_pointers(self._device, ("q", "k_cache", "v_cache", "out"), (q, k_cache, v_cache, out))
        if launch is not None:
            launch(*pointers)
        return out


def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale=None, *, out=None, num_splits=None,
                 max_seq_len=None, mean_seq_len=None, block_mask=None, validate=True):
    """Attention of one query token per sequence over its paged K/V; returns ``out``.

    q: [batch, q_heads, head_dim]; k_cache, v_cache: planes [num_blocks, kv_heads,
    block_size, head_dim] (any block stride); block_tables: int32 [batch, width]
    (row stride may exceed width); seq_lens: int32 [batch]. Query head h uses KV head
    h // (q_heads // kv_heads). ``max_seq_len`` (default width * block_size) and
    ``mean_seq_len`` (host-side figures of the lengths, if the caller has them, as
    the cache does) size the split plan (and so the geometry) only.
    ``validate`` checks lengths and every used block id (against ``block_mask`` too,
    when given) on the device first, at the cost of one small device-to-host read;
    NumPy inputs are always checked. For many layers over the same tables, make one
    :class:`DecodePlan` and run it per layer.
    """
    plan = DecodePlan(q, k_cache, block_tables, seq_lens, scale, num_splits=num_splits, max_seq_len=max_seq_len,
                      mean_seq_len=mean_seq_len, block_mask=block_mask, validate=validate)
    return plan.run(q, k_cache, v_cache, out)


def contiguous_decode(q, k, v, seq_lens, scale=None, *, out=None, num_splits=None, max_seq_len=None,
                      mean_seq_len=None, validate=True):
    """The same attention over contiguous K/V: k, v [batch, max_blocks, kv_heads, block_size, head_dim].

    Sequence i's token t is k[i, t // block_size, :, t % block_size]: the paged
    kernel with block id i*max_blocks + t // block_size instead of a table read.
    ``validate`` checks the lengths on the device first.
    """
    xp = array_module(q=q, k=k, v=v, seq_lens=seq_lens, out=out)
    c_contiguous("q", q, 3)
    for name, a in (("k", k), ("v", v)):
        c_contiguous(name, a, 5)
    check(k.shape == v.shape and k.dtype == v.dtype,
          lambda: f"k {k.dtype} {k.shape} and v {v.dtype} {v.shape} must have the same shape and dtype")
    batch, max_blocks, kv_heads, block_size, head_dim = (int(x) for x in k.shape)
    check(q.shape[0] == batch, lambda: f"k holds {batch} sequences but q has {q.shape[0]}")
    cfg, scale, max_seq_len = _common(q, k.dtype, head_dim, kv_heads, block_size, out, scale, num_splits,
                                      max_blocks * block_size, max_seq_len)
    _lens(seq_lens, batch)
    if xp is np:
        check_block_tables(None, seq_lens, block_size, 0, width=max_blocks)
        return _store(contiguous_decode_reference(q, k, v, seq_lens, scale), out)
    for name, a in (("q", q), ("k", k), ("v", v), ("out", out)):
        if a is not None:
            aligned(name, a)
    if validate:
        check_block_tables(None, seq_lens, block_size, 0, width=max_blocks)
    out = xp.empty_like(q) if out is None else out
    if batch:
        _prepare(batch, q.shape[1], cfg, False, kv_heads * block_size * head_dim, (NULL, np.int64(0)), max_blocks,
                 seq_lens, scale, max_seq_len, num_splits, mean_seq_len)(ptr(q), ptr(k), ptr(v), ptr(out))
    return out


def split_plan(q, k_cache, block_tables, *, num_splits=None, max_seq_len=None, mean_seq_len=None):
    """The :class:`Plan` :func:`paged_decode` uses for device arrays of these shapes (compiles the kernel)."""
    import cupy
    pk = plane("k_cache", k_cache)
    cfg = config(k_cache.dtype, pk.head_dim, pk.block_size, q.shape[1] // pk.num_kv_heads)
    capacity = block_tables.shape[1] * pk.block_size
    return _plan(cfg, q.shape[0], pk.num_kv_heads, max_seq_len or capacity, num_splits, cupy.cuda.Device().id,
                 mean_seq_len)


def _store(result, out):
    if out is None:
        return result
    out[...] = result
    return out


# --- float64 twins -------------------------------------------------------------------------

def _partial(q, k, v, scale):
    """Unnormalised attention state of query heads q [kv, group, d] over k, v [kv, n, d] (float64).

    Returns (m [kv, group], l [kv, group], o [kv, group, d]): max score, sum of
    exp(score - m), sum of exp(score - m) * v. n = 0 gives m = -inf, l = 0, o = 0.
    """
    if k.shape[1] == 0:
        shape = q.shape[:2]
        return np.full(shape, -np.inf), np.zeros(shape), np.zeros(q.shape)
    scores = np.einsum("hgd,hnd->hgn", q, k) * scale
    m = scores.max(axis=2)
    p = np.exp(scores - m[..., None])
    return m, p.sum(axis=2), np.einsum("hgn,hnd->hgd", p, v)


def merge_partials_reference(m, l, o):
    """Combine split states along axis 0: m, l [splits, ...], o [splits, ..., d] -> normalised output.

    m* = max m_i; l* = sum l_i exp(m_i - m*); out = sum o_i exp(m_i - m*) / l*.
    Empty splits (m_i = -inf) get weight 0.
    """
    top = m.max(axis=0)
    with np.errstate(invalid="ignore"):
        w = np.where(np.isneginf(m), 0.0, np.exp(m - top))
    total = (w * l).sum(axis=0)
    return (w[..., None] * o).sum(axis=0) / total[..., None]


def _segments(length, num_splits, segment_tokens):
    """Token ranges of the splits of one sequence, as the kernel cuts them (the last takes the rest)."""
    out = []
    for i in range(num_splits):
        begin = i * segment_tokens
        end = length if i == num_splits - 1 else min(length, begin + segment_tokens)
        out.append((begin, max(begin, end)))
    return out


def _attend(q, rows, scale, num_splits, max_seq_len, block_size):
    """Float64 attention of q [batch, q_heads, d] over per-sequence K/V given by ``rows(i)``."""
    batch, q_heads, d = q.shape
    out = np.empty(q.shape, np.float64)
    plan = plan_splits(batch, 1, max_seq_len, block_size, 1, 1, num_splits)
    for i in range(batch):
        k, v = rows(i)  # [kv, len, d] float64
        qi = q[i].astype(np.float64).reshape(k.shape[0], -1, d)
        parts = [_partial(qi, k[:, a:b], v[:, a:b], scale)
                 for a, b in _segments(k.shape[1], plan.num_splits, plan.segment_tokens)]
        m, l, o = (np.stack(x) for x in zip(*parts))
        out[i] = merge_partials_reference(m, l, o).reshape(q_heads, d)
    return out.astype(q.dtype)


def paged_decode_reference(q, k_cache, v_cache, block_tables, seq_lens, scale=None, *, num_splits=1,
                           max_seq_len=None):
    """Float64 twin of :func:`paged_decode` (no checks): gather through the table, softmax, weighted sum.

    With ``num_splits`` > 1 it cuts each sequence by the kernel's rule (here into
    whole blocks rather than tiles), computes each segment's state and merges
    them: the twin of split-K, empty segments included.
    """
    block_size = k_cache.shape[2]
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    max_seq_len = max_seq_len or block_tables.shape[1] * block_size

    def rows(i):
        n = int(seq_lens[i])
        blocks = block_tables[i, :-(-n // block_size)]
        return tuple(_tokens(c[blocks], n) for c in (k_cache, v_cache))

    return _attend(q, rows, scale, num_splits, max_seq_len, block_size)


def contiguous_decode_reference(q, k, v, seq_lens, scale=None):
    """Float64 twin of :func:`contiguous_decode`."""
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    return _attend(q, lambda i: (_tokens(k[i], int(seq_lens[i])), _tokens(v[i], int(seq_lens[i]))),
                   scale, 1, k.shape[1] * k.shape[3], k.shape[3])


def _tokens(blocks, n):
    """[nb, kv, bs, d] blocks -> [kv, n, d] float64, the first n tokens in order."""
    nb, kv, bs, d = blocks.shape
    return blocks.astype(np.float64).transpose(1, 0, 2, 3).reshape(kv, nb * bs, d)[:, :n]
