"""How attention work is cut: the launch geometry of a configuration, the split plan of a decode step, the
work items of a prefill step.

Host code only (no cupy): the device side (:mod:`pagedrt.attention.decode`) asks the
occupancy API how many thread blocks of a geometry fit on the device and hands that
count here. A forced geometry is an argument (``geometry="standard" | "short"``),
never a changed constant.
"""

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from ..kernels.args import check
from ..kernels.configs import Config

GEOMETRIES = ("standard", "short")

THREADS = 128                   # threads per thread block (MMA_SHORT_THREADS in the short tensor-core geometry)
STAGES = 4                      # cp.async pipeline depth on CUDA cores
TILE_BYTES = 8192               # bytes of K (and again of V) per pipeline stage on CUDA cores
LANE_FLOATS = 64                # floats of q and of the output a lane holds, over the group
SHORT_STAGES = 3                # the short geometry's pipeline depth on CUDA cores
SHORT_LANE_FLOATS = 32          # the short geometry's lane budget: half the registers, twice the resident blocks
MMA_HEAD_DIMS = (64, 128)       # fp16/bf16 head dims that run on tensor cores (a row is 8 or 16 16-byte chunks)
CORE_GROUP = 8                  # CUDA cores: query heads one thread block holds (q and the output in registers)
MMA_SHORT_GROUP = 32            # tensor cores: the widest group the short geometry's two warps hold (two m16 tiles)
MMA_STAGES = 3                  # pipeline depth on tensor cores
MMA_SHORT_THREADS = 64          # the short tensor-core geometry: two warps, a 32-token tile
MMA_SHORT_STAGES = 3            # and its pipeline depth
FP8_FACTOR = 2                  # FP8 K/V: tiles of twice the tokens to 16 heads, else twice the stages,
FP8_NARROW_GROUP = 8            # but to this many heads (transposed: keys as m16 rows) fp16's tile and stages
IDS_WINDOW = 256                # block ids a thread block stages in shared memory at a time
SHORT_TILES = 64                # segments of at most this many tiles may run the short geometry,
SHORT_WAVES = 1                 # when the thread blocks outnumber this many waves of the standard geometry
MIN_SEGMENT_BYTES = 256 << 10   # K+V bytes that make a split segment worth a thread block
SPLIT_BLOCKS_PER_SM = 2         # split plans count at most this many resident thread blocks an SM (split_residency),
SPLIT_SM_BYTES = 96 << 10       # or fewer, enough for their pipelines to hold this many K/V bytes
UNEVEN = 1.5                    # longest / mean length above which a batch that fills the device is split anyway
PREFILL_DTYPES = ("float16", "bfloat16")  # prefill runs on tensor cores only
PREFILL_THREADS = 128           # four warps, 16 packed query rows each
PREFILL_TILE_M = 64             # packed query rows (query token x query head of the group) per work item
PREFILL_STAGES = 2              # the key pipeline's depth
SM90_THREADS = 384              # sm_90a prefill: a producer warpgroup and two consumer warpgroups
SM90_TILE_M = 128               # packed query rows per work item: 64 per consumer warpgroup
SM90_SMEM_LIMIT = 227 * 1024    # dynamic shared memory a thread block may have on compute capability 9.0
SM90_MAX_STAGES = 4             # its K+V stages (and FP8's staging slots) at most
SM90_FP8_STAGING = 2            # FP8: staging slots at least (a tile's e4m3 bytes land while the last is converted)
MAX_DECODE_ROWS = 65535         # a mixed step's decode rows are the decode kernel's grid dimension y
WIDE_GROUP = 16                 # decode of wider groups runs on the sm_90a prefill kernel (wide_group),
WIDE_UNSPLIT_GROUP = 32         # but one the decode kernel runs unsplit keeps it to this many heads (wide_kernel)
WGMMA = "wgmma"                 # the SplitPlan geometry of such a decode
WIDE_SEGMENT_BYTES = 512 << 10  # K+V of its shortest segment: 8 key tiles at head_dim 128 (wide_split)
MIXED_PROMPT_SHARE = 2 / 3      # of the SMs, a mixed step's prompt rows take on the sm_90a kernel (mixed_prompt_blocks)


def _unknown(name: object) -> Callable[[], str]:
    return lambda: (f"geometry={name!r} is not a geometry: use one of {', '.join(map(repr, GEOMETRIES))} "
                    "(or None for the plan's choice)")


def check_geometry(name: Optional[str]) -> None:
    """Raise LaunchArgumentError unless ``name`` is None or one of GEOMETRIES."""
    check(name is None or name in GEOMETRIES, _unknown(name))


@dataclass(frozen=True)
class Geometry:
    """How one thread block cuts the work of a configuration (template arguments of the kernel)."""

    lanes: int       # lanes sharing one token's dot product (each holds head_dim/lanes dims of q)
    tile: int        # tokens per pipeline stage
    stages: int
    smem_bytes: int  # dynamic shared memory per thread block: the pipeline's stages, then the staged ids
    mma: bool = False  # scores and weighted sums on tensor cores (mma.m16n8k16), a warp per 16 tokens
    threads: int = THREADS
    ids_window: int = IDS_WINDOW  # block ids staged in shared memory at a time

    @property
    def pipeline_bytes(self) -> int:
        """K/V bytes the pipeline's stages hold (its shared memory but the staged ids)."""
        return self.smem_bytes - 4 * self.ids_window


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def mma(cfg: Config) -> bool:
    """Whether configuration ``cfg``'s decode runs on tensor cores: fp16/bf16 (and FP8 K/V) at MMA_HEAD_DIMS."""
    return cfg.dtype != "float32" and cfg.head_dim in MMA_HEAD_DIMS


def kernel_group(cfg: Config) -> Tuple[int, int]:
    """(query heads a decode thread block takes, thread blocks a KV head gets): ``(group, 1)`` on tensor cores,
    whose m16 tiles hold up to 64 heads, and for groups of at most CORE_GROUP. A wider group on CUDA cores is
    cut into chunks of its largest divisor up to CORE_GROUP (a prime group into single heads), one thread block
    each: every chunk reads the KV head's K/V again, mostly from L2."""
    if mma(cfg) or cfg.group <= CORE_GROUP:
        return cfg.group, 1
    heads = max(d for d in range(1, CORE_GROUP + 1) if cfg.group % d == 0)
    return heads, cfg.group // heads


def geometry(cfg: Config, geometry_name: str = "standard") -> Geometry:
    """The :class:`Geometry` of configuration ``cfg`` named ``geometry_name`` (docs/KERNELS.md, "Decode").

    CUDA cores: each lane holds at most LANE_FLOATS dims of q and of the output over the thread block's heads
    (:func:`kernel_group`), which sizes the lanes per token; a stage holds TILE_BYTES of K. Tensor cores
    (fp16/bf16 at MMA_HEAD_DIMS): a warp per 16 tokens of a 64-token tile, MMA_STAGES stages. FP8 K/V: fp16's
    tile and stages up to FP8_NARROW_GROUP heads (the transposed kernel), FP8_FACTOR times the tile up to 16
    heads, FP8_FACTOR times the stages past that. ``"short"`` (for many short segments): half the lane budget
    and one stage less on CUDA cores; two warps and a 32-token tile on tensor cores, except past
    MMA_SHORT_GROUP heads, which run the standard geometry under either name.

    Raises
    ------
    LaunchArgumentError
        ``geometry_name`` is not one of GEOMETRIES.
    """
    check(geometry_name in GEOMETRIES, _unknown(geometry_name))
    short = geometry_name == "short"
    row = cfg.head_dim * cfg.kv_itemsize
    if mma(cfg):
        short = short and cfg.group <= MMA_SHORT_GROUP
        threads, stages = (MMA_SHORT_THREADS, MMA_SHORT_STAGES) if short else (THREADS, MMA_STAGES)
        tile = 16 * threads // 32
        if cfg.fp8 and FP8_NARROW_GROUP < cfg.group <= 16:
            tile *= FP8_FACTOR
        elif cfg.fp8 and cfg.group > 16:
            stages *= FP8_FACTOR
        return Geometry(32, tile, stages, stages * 2 * tile * row + 4 * IDS_WINDOW, True, threads)
    vec = 16 // cfg.itemsize
    row_vecs = cfg.head_dim // vec
    budget, stages = (SHORT_LANE_FLOATS, SHORT_STAGES) if short else (LANE_FLOATS, STAGES)
    lane_vecs = min(4, _pow2_floor(budget // (vec * kernel_group(cfg)[0])))
    lanes = min(32, 1 << (-(-row_vecs // lane_vecs) - 1).bit_length())
    tile = max(_pow2_floor(TILE_BYTES // row), THREADS // lanes)
    return Geometry(lanes, tile, stages, stages * 2 * tile * row + 4 * IDS_WINDOW)


@dataclass(frozen=True)
class PrefillGeometry:
    """How one prefill thread block cuts its work item (template arguments of the kernel)."""

    tile_m: int      # packed query rows per work item
    tile_n: int      # keys per pipeline stage
    stages: int
    smem_bytes: int  # dynamic shared memory: the Q tile and the stages of K and of V (and FP8's staging)
    threads: int = PREFILL_THREADS
    staging: int = 0  # the sm_90a kernel over FP8 K/V: slots of a key tile's e4m3 K and V, converted into stages


def prefill_geometry(cfg: Config) -> PrefillGeometry:
    """The :class:`PrefillGeometry` of configuration ``cfg`` (fp16/bf16, head_dim in PREFILL_HEAD_DIMS).

    Four warps of 16 packed rows each, PREFILL_STAGES stages of 64 keys (32 at head_dim
    256, where a thread holds 128 floats of output and 64 more of scores would spill). FP8
    K/V stages hold rows of head_dim bytes; the Q tile stays in q's dtype.
    """
    tile_n = 32 if cfg.head_dim > 128 else 64
    return PrefillGeometry(PREFILL_TILE_M, tile_n, PREFILL_STAGES,
                           PREFILL_STAGES * 2 * tile_n * cfg.head_dim * cfg.kv_itemsize
                           + PREFILL_TILE_M * cfg.head_dim * cfg.itemsize)


def prefill_sm90_geometry(cfg: Config) -> PrefillGeometry:
    """The :class:`PrefillGeometry` of the sm_90a kernel (``cuda_src/prefill_sm90.cu``) for ``cfg``.

    Two consumer warpgroups of 64 packed rows (SM90_TILE_M = 128), key tiles of 128
    (64 at head_dim 256, where a consumer holds 128 floats of output), and as many K+V
    stages as fit beside the Q tile in SM90_SMEM_LIMIT (at most SM90_MAX_STAGES). Shared memory: the
    Q tile, the stages, and 1024 bytes to align the tiles for the 128-byte swizzle. FP8 K/V: the
    stages hold f16 (converted), and after them ``staging`` slots of a key tile's e4m3 K and V:
    as many stages as fit beside SM90_FP8_STAGING slots, then as many slots as fit (at most
    SM90_MAX_STAGES): 2 and 2 at head_dim 128, 4 and 4 at 64.
    """
    row = cfg.head_dim * 2  # bytes of a row of Q or of a stage: fp16/bf16 (FP8's converted to f16)
    tile_n = 64 if cfg.head_dim > 128 else 128
    free = SM90_SMEM_LIMIT - 1024 - SM90_TILE_M * row
    slot = 2 * tile_n * cfg.head_dim if cfg.fp8 else 0  # a staging slot: a tile's e4m3 K and V
    stages = min(SM90_MAX_STAGES, (free - SM90_FP8_STAGING * slot) // (2 * tile_n * row))
    staging = min(SM90_MAX_STAGES, (free - 2 * stages * tile_n * row) // slot) if cfg.fp8 else 0
    return PrefillGeometry(SM90_TILE_M, tile_n, stages,
                           (SM90_TILE_M + 2 * stages * tile_n) * row + staging * slot + 1024, SM90_THREADS, staging)


def wide_group(cfg: Config) -> bool:
    """Whether a decode of ``cfg`` runs on the sm_90a prefill kernel on a device of compute capability 9.0 (with
    a positive scale and the plan's choice of geometry): fp16/bf16 planes, head_dim 64 or 128 (where that kernel
    splits: at 256 its consumers have no registers left for the merge), and more than WIDE_GROUP query heads a
    KV head. The group's heads are then the rows of one warpgroup's m64 tile, whose
    wgmma reads each K/V tile from shared memory once for all of them, where the decode kernel's mma.sync tiles
    (m16) read it once per 16 heads; past 16 heads that made the decode kernel the slower
    (docs/KERNELS.md, "Any group size")."""
    return not cfg.fp8 and cfg.dtype in PREFILL_DTYPES and cfg.head_dim in MMA_HEAD_DIMS and cfg.group > WIDE_GROUP


def wide_kernel(cfg: Config, decode_splits: Callable[[], int]) -> bool:
    """Whether a decode of ``cfg`` that :func:`wide_group` admits runs on the sm_90a kernel: past
    WIDE_UNSPLIT_GROUP heads always; to that many, only when the decode kernel's own split plan
    (``decode_splits()``, asked for only then) cuts its sequences. Unsplit, every sequence a thread block and the
    blocks filling the device, the decode kernel's two m16 tiles streamed faster than the sm_90a kernel at 24 and
    32 heads; split, or past 32 heads (four tiles), the sm_90a kernel was as fast or faster (docs/KERNELS.md,
    "Any group size", has the figures)."""
    return wide_group(cfg) and (cfg.group > WIDE_UNSPLIT_GROUP or decode_splits() > 1)


def wide_split(cfg: Config, batch: int, num_kv_heads: int, max_seq_len: int, multiprocessors: int, *,
               num_splits: Optional[int] = None, mean_seq_len: Optional[float] = None) -> "SplitPlan":
    """The :class:`SplitPlan` of a wide group's decode on the sm_90a kernel (geometry WGMMA): as
    :func:`plan_splits` cuts it for a thread block per SM over the kernel's key tiles, into segments of at least
    WIDE_SEGMENT_BYTES of K+V. A segment's partials are the whole group's output rows, and the last segment
    merges them all: shorter segments cost more in writes and merge than they gain in parallel work
    (docs/KERNELS.md, "Any group size")."""
    split = plan_splits(batch, num_kv_heads, max_seq_len, prefill_sm90_geometry(cfg).tile_n,
                        2 * cfg.head_dim * cfg.itemsize, multiprocessors, num_splits=num_splits,
                        mean_seq_len=mean_seq_len, geometry="standard", min_segment_bytes=WIDE_SEGMENT_BYTES)
    return SplitPlan(split.num_splits, split.segment_tokens, WGMMA)


def prefill_items(query_lens: Sequence[int], group: int, tile_m: int = PREFILL_TILE_M,
                  skip: Sequence[int] = ()) -> np.ndarray:
    """The work items of a prefill: int32 [n, 4] rows (batch row, its first query token, its query count,
    the item's first packed row), from the host's per-row query counts.

    Sequence b's packed rows are its query tokens times the group's query heads
    (``query_lens[b] * group``), cut into items of ``tile_m``; rows without queries
    have none, nor have the rows in ``skip`` (a mixed step's decode rows, which the
    decode kernel takes). The items come a sequence at a time, the sequences with the
    most query tokens first (stable among equals), and within a sequence its later
    items first: under a causal mask they see the most keys. Both kernels take a KV
    head's items in this order before the next head's, so the units in flight share
    one KV head's K/V of a sequence or two in L2, and the long items start early rather
    than run alone at the end (docs/KERNELS.md, "Work items").
    """
    counts = np.asarray(query_lens, np.int64)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1])) if counts.size else counts
    tiles = -(-counts * group // tile_m)
    tiles[np.asarray(skip, np.int64)] = 0
    rows = np.repeat(np.arange(counts.size), tiles)
    index = np.arange(rows.size) - np.repeat(np.cumsum(tiles) - tiles, tiles)  # item's tile in its sequence
    items = np.stack([rows, starts[rows], counts[rows], index * tile_m], axis=1).astype(np.int32)
    rank = np.empty(counts.size, np.int64)
    rank[np.argsort(-counts, kind="stable")] = np.arange(counts.size)  # sequence b's place: most queries first
    return items[np.lexsort((-index, rank[rows]))]


def mixed_prompt_blocks(multiprocessors: int) -> int:
    """The SMs a mixed step's prompt rows take on the sm_90a kernel's persistent grid (a block an SM, launched
    before the decode rows): MIXED_PROMPT_SHARE of ``multiprocessors``. The decode rows' blocks stream their K/V
    on the other SMs at once and take the prompt's as it frees them. Given every SM, the prompt's blocks held
    the device until its units ran out, and the two parts ran one after the other; given less, a prompt
    shorter than the decode rows finishes beside them. Two thirds measured best of the shares tried on the
    H200's mixed shapes (docs/KERNELS.md, "Mixed steps").
    """
    check(multiprocessors > 0, lambda: f"{multiprocessors} SMs")
    return max(1, int(np.ceil(MIXED_PROMPT_SHARE * multiprocessors)))


def decode_rows(query_lens: Sequence[int]) -> np.ndarray:
    """The rows of a prefill batch the decode kernel attends for (int64, ascending): a mixed step's decode rows.

    Those of one query token, the first MAX_DECODE_ROWS of them; the prefill kernel takes the
    others. The decode kernel streams a row's K/V at memory speed, where the prefill kernel gives
    the row a tile of its own (``group`` of its 64 packed rows). A one-token row sees every key of
    its sequence, causal or not, so the two kernels compute the same thing.
    """
    return np.flatnonzero(np.asarray(query_lens) == 1)[:MAX_DECODE_ROWS].astype(np.int64)


@dataclass(frozen=True)
class SplitPlan:
    """How each sequence's tokens are cut into segments, one thread block each, and which geometry runs them."""

    num_splits: int
    segment_tokens: int  # split i covers tokens [i*segment_tokens, (i+1)*segment_tokens); the last, the rest
    geometry: str        # "standard" or "short" (see :func:`geometry`)

    def segments(self, length: int) -> List[Tuple[int, int]]:
        """Token ranges [begin, end) of the splits of a sequence of ``length`` tokens, as the kernel cuts
        them: the last split takes the rest; splits past the end are empty."""
        out = []
        for i in range(self.num_splits):
            begin = i * self.segment_tokens
            end = length if i == self.num_splits - 1 else min(length, begin + self.segment_tokens)
            out.append((begin, max(begin, end)))
        return out


def split_residency(resident_blocks: int, multiprocessors: int, pipeline_bytes: int) -> int:
    """The resident thread blocks a split plan fills: the kernel's (``resident_blocks``), but an SM only as many
    as its K/V pipeline needs to keep SPLIT_SM_BYTES in flight (``pipeline_bytes`` a block), and at most
    SPLIT_BLOCKS_PER_SM. That is one block of fp16 at head_dim 128 and two of FP8's narrow kernel, whose stages
    hold half the bytes; cutting sequences further to fill the rest adds more thread-block starts and merges than
    it gains (docs/KERNELS.md, "Split plan")."""
    per_sm = min(SPLIT_BLOCKS_PER_SM, -(-SPLIT_SM_BYTES // max(1, pipeline_bytes)))
    return min(resident_blocks, per_sm * multiprocessors)


def plan_splits(batch: int, num_kv_heads: int, max_seq_len: int, tile: int, bytes_per_token: int,
                resident_blocks: int, *, num_splits: Optional[int] = None, mean_seq_len: Optional[float] = None,
                geometry: Optional[str] = None, min_segment_bytes: int = MIN_SEGMENT_BYTES,
                wave_blocks: Optional[int] = None) -> "SplitPlan":
    """Cut sequences into segments for split-K, and choose the geometry (docs/KERNELS.md, "Split plan").

    Without a request, ``batch * num_kv_heads`` thread blocks that leave resident blocks unused split each
    sequence to fill them in one wave, in segments of at least ``min_segment_bytes`` of K+V; uneven lengths
    (the longest over UNEVEN times ``mean_seq_len``) are cut in segments of about a quarter of the mean.
    Segments are whole tiles; splits the rounding left empty are dropped, but a requested count is kept.
    Unless forced, ``"short"`` when segments are at most SHORT_TILES tiles, the thread blocks outnumber
    SHORT_WAVES waves of ``wave_blocks`` and the lengths were not cut for unevenness.

    Parameters
    ----------
    batch, num_kv_heads : int
        Sequences, and thread blocks a sequence takes unsplit.
    max_seq_len : int
        The longest sequence's tokens.
    tile : int
        Tokens a pipeline stage of the standard geometry holds (the short geometry's divides it).
    bytes_per_token : int
        K+V bytes of one token of one KV head.
    resident_blocks : int
        Thread blocks of the standard geometry the device holds at once (:func:`split_residency`).
    num_splits : int, optional
        Force the count.
    mean_seq_len : float, optional
        The mean length, where known.
    geometry : str, optional
        Force the geometry.
    min_segment_bytes : int
        The shortest segment, in K+V bytes.
    wave_blocks : int, optional
        Thread blocks of one wave of the standard geometry; default ``resident_blocks``.

    Raises
    ------
    LaunchArgumentError
        An unknown ``geometry``.
    """
    check_geometry(geometry)
    units = batch * num_kv_heads
    min_tokens = max(1, min_segment_bytes // bytes_per_token)
    mean = mean_seq_len or 0.0  # unknown (or 0): not uneven
    uneven = bool(mean) and max_seq_len > UNEVEN * mean
    if num_splits is not None:
        wanted = num_splits
    else:
        wanted = 1
        if 0 < units < resident_blocks:
            wanted = max(1, min(resident_blocks // units, max_seq_len // min_tokens))
        if uneven:
            wanted = max(wanted, -(-max_seq_len // max(min_tokens, int(mean) // 4)))
    segment = -(-max_seq_len // wanted)
    segment = -(-segment // tile) * tile
    if num_splits is None:
        wanted = -(-max_seq_len // segment)
    if geometry is None:
        wave = resident_blocks if wave_blocks is None else wave_blocks
        short = segment <= SHORT_TILES * tile and units * wanted > SHORT_WAVES * wave and not uneven
        geometry = "short" if short else "standard"
    return SplitPlan(wanted, segment, geometry)


def _round16(n: int) -> int:
    return -(-n // 16) * 16


def workspace_layout(batch: int, q_heads: int, head_dim: int, num_splits: int) -> Tuple[int, int, int, int]:
    """Byte offsets of the split partials in a workspace, and its size: (o, ml, arrivals, total).

    o: float32 [batch*q_heads, num_splits, head_dim] (unnormalised outputs); ml:
    float32 [batch*q_heads, num_splits, 2] (running max and sum); arrivals: int32
    [batch*q_heads] counts (one per (sequence, KV head) is used). Each starts on a
    16-byte boundary. An unsplit plan needs none: total 0.
    """
    if num_splits <= 1:
        return 0, 0, 0, 0
    rows = batch * q_heads
    o_bytes = _round16(rows * num_splits * head_dim * 4)
    ml_bytes = _round16(rows * num_splits * 2 * 4)
    return 0, o_bytes, o_bytes + ml_bytes, o_bytes + ml_bytes + _round16(rows * 4)


def workspace_bytes(batch: int, q_heads: int, head_dim: int, num_splits: int) -> int:
    """Bytes of workspace a plan of ``num_splits`` splits needs (0 when unsplit)."""
    return workspace_layout(batch, q_heads, head_dim, num_splits)[3]
