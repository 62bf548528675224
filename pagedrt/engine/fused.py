"""A whole decode step in one launch for small batches: ``cuda_src/fused_step.cu``'s ``decode_step``.

At a batch of a few sequences every GEMM of a decode step is a matrix-vector product and every other op is
tiny, so the layered step (about ten launches a layer) is bound by launches, not by memory. The fused step
runs the same arithmetic (each rounding where the layered path rounds) as one cooperative launch whose phases
are separated by grid-wide barriers; docs/ENGINE.md ("One launch a step") has the design and the figures.

:class:`FusedDecode` is made once per model (when :func:`unsupported` says nothing against it) and owns the
workspace every batch size shares; :meth:`FusedDecode.run` launches one step of ``batch <= MAX_ROWS`` rows. On
compute capability 9.0 the phases whose weight tiles fit in shared memory (:func:`staging`) have them copied there
a layer ahead; the others stream their weights through registers.
"""

import functools
import math
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from .. import source
from ..attention.plan_base import LOG2E
from ..errors import UnsupportedConfigError
from ..kernels.args import ptr
from ..kernels.configs import CUDA_TYPES
from ..kernels.launch import launch_ex
from ..spec import KVSpec, dtype_name
from .config import ModelConfig

FILE = "fused_step.cu"
THREADS, WARPS, TILE, MAX_GROUP_DIMS, MAX_SPLITS, STAGED = 256, 8, 64, 2048, 16, 2  # as cuda_src/fused_step.cu's
PAD = 8  # elements between the GEMV's shared-memory rows
NORM_PER = (2, 3, 4, 6)  # the kernel's NORM_PER: values of a row a thread holds while it normalises the row
MAX_HIDDEN = NORM_PER[-1] * THREADS
ROWS = (1, 2, 4, 8)  # the kernel's instances: a batch runs on the smallest that holds it
MAX_ROWS = ROWS[-1]
HEAD_DIMS = (64, 128)
MIN_CAPABILITY = 80
STAGING_CAPABILITY = 90  # bulk copies into shared memory that land on an mbarrier
PER_LAYER = ("attn_norm", "qkv", "o", "ffn_norm", "gate_up", "down")  # then the K and V planes
STAGED_PHASES = ("qkv", "o", "gate_up", "down")  # the phases whose weights may be staged: bit p of the kernel's mask


def instances(dtypes: Sequence[str] = ("float16", "bfloat16"),
              per: Sequence[int] = (3,)) -> Dict[str, Tuple[str, ...]]:
    """{file: name expressions} of the fused step's instances (``per``: the NORM_PER of SmolLM2's hidden size)."""
    return {FILE: tuple(_name(d, h, r, v) for d in dtypes for h in HEAD_DIMS for r in ROWS for v in per)}


def _name(dtype: str, head_dim: int, rows: int, per: int) -> str:
    return f"pagedrt::decode_step<{CUDA_TYPES[dtype]}, {head_dim}, {rows}, {per}>"


def norm_per(hidden: int) -> int:
    """The kernel's NORM_PER for a hidden size (at most MAX_HIDDEN): values of a row each thread normalises."""
    return next(v for v in NORM_PER if v * THREADS >= hidden)


def smem_bytes(config: ModelConfig, rows: int) -> int:
    """Dynamic shared memory of the instance for ``rows`` but the staged weights (:func:`staging`): the step's
    constants (each row's rotations and new K/V row, the staged phases' mbarriers), then the normalised or
    gathered rows of a GEMV phase, or the attention's STAGED buffers of a K and V tile (or its warps' outputs,
    whichever is larger) and its float state, whichever is larger."""
    c = config
    constants = -(-(rows * (c.head_dim // 2 * 8 + 8) + 4 * 8) // 16) * 16  # the kernel's constants_bytes
    widest = max(c.hidden, c.ffn, c.q_heads * c.head_dim)
    gemv = WARPS * rows * 4 + (WARPS + 1) * 128 * 4 + rows * (widest + PAD) * 2
    group = c.q_heads // c.kv_heads
    front = max(STAGED * 2 * TILE * c.head_dim * 2, WARPS * group * c.head_dim * 4)
    attention = front + group * (c.head_dim + TILE + 3) * 4
    return constants + max(gemv, attention)


def staged_stride(k: int) -> int:
    """Elements between a staged weight tile's rows in shared memory (the kernel's ``staged_stride``)."""
    return k if k % 64 else k + 32


def staging(config: ModelConfig, itemsize: int, grid: int, capability: int, smem_limit: int) -> Tuple[int, int]:
    """Which phases' weights the kernel stages in shared memory a layer ahead, and the bytes they take.

    Phase p (:data:`STAGED_PHASES`) is staged, in order, when its buffer (the most tiles a block takes, 16 weight
    rows each) fits in what ``smem_limit`` leaves beside :func:`smem_bytes` at MAX_ROWS and a table of every layer's
    staged weights (four pointers a layer); the others stream their weights through registers. Returns (the
    kernel's mask, bytes, the table's included).
    """
    c = config
    if capability < STAGING_CAPABILITY:
        return 0, 0
    table = 4 * 8 * c.num_layers
    budget = smem_limit - smem_bytes(c, MAX_ROWS) - table
    width = c.q_heads * c.head_dim
    phases = ((c.hidden, -(-(width + 2 * c.kv_heads * c.head_dim) // 16)), (width, -(-c.hidden // 16)),
              (c.hidden, -(-c.ffn // 8)), (c.ffn, -(-c.hidden // 16)))  # (k, tiles) of each phase
    mask = used = 0
    for p, (k, tiles) in enumerate(phases):
        size = -(-tiles // grid) * 16 * staged_stride(k) * itemsize
        if used + size <= budget:
            mask, used = mask | 1 << p, used + size
    return (mask, used + table) if mask else (0, 0)


def unsupported(config: ModelConfig, spec: KVSpec, capability: int, smem_limit: int) -> Optional[str]:
    """Why the fused step cannot run a model of ``config`` over a cache of ``spec`` on a device of compute
    capability ``capability`` (e.g. 90) whose blocks may opt in to ``smem_limit`` bytes of shared memory
    (``layer_gemm.device_limits``), or None when it can."""
    c = config
    group = c.q_heads // c.kv_heads
    reasons = [(capability < MIN_CAPABILITY, f"compute capability {capability} has no mma.m16n8k16 for bfloat16"),
               (spec.is_fp8, "the cache is FP8"),
               (spec.dtype.name not in ("float16", "bfloat16"), f"activations are {spec.dtype.name}"),
               (c.head_dim not in HEAD_DIMS, f"head_dim {c.head_dim} is not one of {HEAD_DIMS}"),
               (any(x % 32 for x in (c.hidden, c.ffn, c.q_heads * c.head_dim)),
                "hidden, ffn or the attention's width is not a multiple of 32"),
               (c.hidden > MAX_HIDDEN, f"hidden {c.hidden} is over {MAX_HIDDEN}"),
               (group * c.head_dim > MAX_GROUP_DIMS, f"a group of {group} query heads of {c.head_dim}"),
               (smem_bytes(c, MAX_ROWS) > smem_limit, "its rows do not fit in shared memory")]
    return next((why for bad, why in reasons if bad), None)


@functools.lru_cache(maxsize=None)
def _kernel(dtype: str, head_dim: int, rows: int, per: int, smem_limit: int) -> Any:
    fn = source.function(FILE, _name(dtype, head_dim, rows, per))
    fn.max_dynamic_shared_size_bytes = smem_limit
    return fn


class FusedDecode:
    """The fused decode step of one :class:`~pagedrt.engine.model.LlamaModel` over its cache.

    Parameters
    ----------
    model : LlamaModel
        Its weights (``[out, in]``, the cache's dtype), config and cache; :func:`unsupported` must be None.

    Raises
    ------
    UnsupportedConfigError
        From :meth:`run`: a step of more than MAX_ROWS rows, or of rows with more than one new token.
    """

    def __init__(self, model: Any) -> None:
        import cupy
        c, cache = model.config, model.cache
        self.config, self.dtype = c, dtype_name(model.act_dtype)
        pointers = []
        for layer, w in enumerate(model.layers):
            pointers += [w[name].data.ptr for name in PER_LAYER]
            pointers += [cache.k(layer).data.ptr, cache.v(layer).data.ptr]
        self.layers = cupy.asarray(np.array(pointers, np.uint64))
        k0 = cache.k(0)
        self.block_stride = k0.strides[0] // k0.itemsize
        # the arrays run() reads, not the model (which holds this object: no reference cycle)
        self.embedding, self.output_norm, self.output = model.embedding, model.output_norm, model.output
        self.inv_freq, self.block_size = model.inv_freq, cache.block_size
        device = cupy.cuda.Device()
        self.grid = device.attributes["MultiProcessorCount"]
        self.smem_limit = device.attributes["MaxSharedMemoryPerBlockOptin"]
        self.staged, self.staged_bytes = staging(c, np.dtype(model.act_dtype).itemsize, self.grid,
                                                 int(device.compute_capability), self.smem_limit)
        act = model.act_dtype
        self.residual = cupy.empty((MAX_ROWS, c.hidden), np.float32)
        self.q = cupy.empty((MAX_ROWS, c.q_heads * c.head_dim), act)
        self.mlp = cupy.empty((MAX_ROWS, c.ffn), act)
        self.partial = cupy.empty(MAX_ROWS * c.q_heads * MAX_SPLITS * (c.head_dim + 4), np.float32)
        self.barrier = cupy.zeros(1, np.uint32)

    def max_splits(self, batch: int) -> int:
        """The most attention splits of each (row, KV head) at ``batch`` rows: about one work item a block (the
        kernel takes the fewest that leave each split one tile of keys, up to this)."""
        return max(1, min(MAX_SPLITS, self.grid // (batch * self.config.kv_heads)))

    def run(self, step: Any, ids: Any, logits: Any) -> Any:
        """One decode step of ``len(step.seqs) <= MAX_ROWS`` rows, one new token each: K/V written at the step's
        slots, ``logits`` (float32 [batch, vocab]) of the new tokens.

        Parameters
        ----------
        step : Step
            From ``cache.step()``: its block tables, KV lengths (the new token counted) and slot mapping.
        ids : cupy.ndarray
            int64 [batch], the new tokens.
        logits : cupy.ndarray
            float32 [batch, vocab], written.
        """
        import cupy
        c = self.config
        batch = len(step.seqs)
        if not 1 <= batch <= MAX_ROWS or step.num_tokens != batch:
            raise UnsupportedConfigError(f"the fused step takes 1 to {MAX_ROWS} rows of one new token each; this "
                                         f"step has {step.num_tokens} tokens in {batch} rows")
        rows = next(r for r in ROWS if r >= batch)
        tables = step.block_tables
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memsetAsync(self.barrier.data.ptr, 0, self.barrier.nbytes, stream.ptr)
        args = (ptr(self.layers), np.int32(c.num_layers), ptr(self.embedding), ptr(self.output_norm),
                ptr(self.output), np.int32(c.vocab_size), ptr(self.inv_freq), ptr(ids), ptr(tables),
                np.int64(tables.strides[0] // 4), ptr(step.seq_lens), ptr(step.slot_mapping),
                np.int64(self.block_stride), np.int32(self.block_size), ptr(self.residual), ptr(self.q),
                ptr(self.mlp), ptr(self.partial), ptr(self.barrier), ptr(logits), np.int32(batch),
                np.int32(c.hidden), np.int32(c.ffn), np.int32(c.q_heads), np.int32(c.kv_heads),
                np.int32(self.max_splits(batch)), np.float32(c.rms_eps), np.float32(LOG2E / math.sqrt(c.head_dim)),
                np.int32(self.staged))
        kernel = _kernel(self.dtype, c.head_dim, rows, norm_per(c.hidden), self.smem_limit)
        launch_ex(kernel, (self.grid,), (THREADS,), args, smem_bytes(c, rows) + self.staged_bytes,
                  programmatic_serialization=False, cooperative=True)
        return logits
