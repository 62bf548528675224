"""The sm_90a prefill kernel's launcher (``cuda_src/prefill_sm90.cu``: warpgroup MMA, warp-specialised).

Devices of compute capability 9.0 (H100, H200) run it for :class:`~pagedrt.attention.PrefillPlan` (a positive
scale; fp16/bf16 planes, or FP8 ones on its twin ``prefill_sm90_fp8``) and for a
:class:`~pagedrt.attention.DecodePlan` of a wide group (:func:`~pagedrt.attention.planner.wide_kernel`; fp16/bf16
planes only): there a sequence's one query token times the group's heads
are the rows of its tile, and long sequences are cut into segments (split-K) merged in the kernel, over the
decode plan's workspace. The grid is persistent: a thread block per SM, over the (work item, KV head,
segment) units, which a block claims from the launch's queue as it frees up (two int32 counters the launch
owns; the kernel resets them, so replays need no memset, but launches over one queue must not overlap).
"""

import functools
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np

from .. import source
from ..kernels.args import NULL, Plane, check, multiprocessors, ptr
from ..kernels.configs import Config
from ..spec import Array
from .plan_base import LOG2E
from .planner import prefill_sm90_geometry

FILE = "prefill_sm90.cu"  # source.ARCHES compiles it for sm_90a
SM90 = "90"  # CuPy's compute_capability of the devices that run it
ALL_TILES = np.iinfo(np.int32).max  # an unsplit launch's segment: every key tile
# (item, KV head, segment) units the kernel counts in int, with room for each block's claim past the last
MAX_UNITS = np.iinfo(np.int32).max - (1 << 16)


def kernel_name(cfg: Config) -> str:
    """The kernel's name expression for ``cfg`` (the block size and the group are kernel arguments): over FP8 K/V
    its twin, which takes the staging slots too."""
    geo = prefill_sm90_geometry(cfg)
    if cfg.fp8:
        return f"pagedrt::prefill_sm90_fp8<{cfg.cuda_type}, {cfg.head_dim}, {geo.tile_n}, {geo.stages}, {geo.staging}>"
    return f"pagedrt::prefill_sm90<{cfg.cuda_type}, {cfg.head_dim}, {geo.tile_n}, {geo.stages}>"


def runs_on(device_id: int) -> bool:
    """Whether the device runs this kernel (compute capability 9.0)."""
    import cupy
    return cupy.cuda.Device(device_id).compute_capability == SM90


@functools.lru_cache(maxsize=None)
def _kernel(cfg, device_id):
    """The compiled kernel of ``cfg``, allowed its dynamic shared memory on the device."""
    fn = source.function(FILE, kernel_name(cfg))
    fn.max_dynamic_shared_size_bytes = prefill_sm90_geometry(cfg).smem_bytes
    return fn


@dataclass(frozen=True)
class Launch:
    """A prefill launch (of this kernel or of ``prefill.cu``'s) but for its per-layer pointers: q, the K and V
    planes, out."""
    function: Any  # cupy.RawKernel
    grid: tuple
    threads: tuple
    smem: int
    middle: tuple  # the arguments between v and out
    owns: tuple = ()  # device arrays the arguments point into (the sm_90a kernel's queue)

    def __call__(self, q: np.uint64, k: np.uint64, v: np.uint64, out: np.uint64, scales: tuple = ()) -> None:
        """Launch over one layer's pointers; ``scales``: FP8's (k_scale, v_scale) pointers, else nothing."""
        self.function(self.grid, self.threads, (q, k, v, *self.middle, out, *scales), shared_mem=self.smem)


def launch(cfg: Config, pk: Plane, block_tables: Array, kv_lens: Array, items: Array, causal: bool, scale: float,
           device: int, num_splits: int = 1, split_tiles: int = ALL_TILES,
           parts: Tuple[np.uint64, np.uint64, np.uint64] = (NULL,) * 3, blocks: Optional[int] = None) -> Launch:
    """The :class:`Launch` over the work ``items`` (a device int32 [n, 4], n > 0) of planes ``pk``
    (:class:`~pagedrt.kernels.args.Plane`): unsplit, or cut into ``num_splits`` segments of ``split_tiles`` key
    tiles, whose partials go to ``parts``, the workspace's (part_o, part_ml, arrivals) pointers; a block an SM,
    on at most ``blocks`` SMs (None: every SM). The launch allocates its unit queue (zeroed once)."""
    geo = prefill_sm90_geometry(cfg)
    units = items.shape[0] * pk.num_kv_heads * num_splits
    check(units <= MAX_UNITS, lambda: f"{items.shape[0]} work items x {pk.num_kv_heads} KV heads x {num_splits} "
                                      f"segments are {units} units, over the kernel's {MAX_UNITS}: fewer splits")
    import cupy
    queue = cupy.zeros(2, np.int32)
    middle = (np.int64(pk.block_stride), ptr(block_tables), np.int64(block_tables.strides[0] // 4),
              np.int32(block_tables.shape[1]), ptr(kv_lens), ptr(items), np.int32(cfg.group), np.int32(bool(causal)),
              np.float32(scale * LOG2E), np.int32(pk.block_size.bit_length() - 1), np.int32(items.shape[0]),
              np.int32(pk.num_kv_heads), np.int32(num_splits), np.int32(split_tiles), *parts, ptr(queue))
    grid = min(units, multiprocessors(device), blocks or units)
    return Launch(_kernel(cfg, device), (grid,), (geo.threads,), geo.smem_bytes, middle, (queue,))
