"""A whole decode step in one launch for small batches: ``cuda_src/fused_step.cu``'s ``decode_step``.

At a batch of a few sequences every GEMM of a decode step is a matrix-vector product and every other op is
tiny, so the layered step (about ten launches a layer) is bound by launches, not by memory. The fused step
runs the same arithmetic (each rounding where the layered path rounds) as one cooperative launch whose phases
are separated by grid-wide barriers; docs/ENGINE.md ("One launch a step") has the design and the figures.

:class:`FusedDecode` is made once per model (when :func:`unsupported` says nothing against it) and owns the
workspace every batch size shares; :meth:`FusedDecode.run` launches one step of ``batch <= MAX_ROWS`` rows.
"""

import functools
import math
from typing import Any, Optional

import numpy as np

from .. import source
from ..attention.plan_base import LOG2E
from ..errors import UnsupportedConfigError
from ..kernels.args import ptr
from ..kernels.configs import CUDA_TYPES
from ..kernels.launch import launch_ex
from ..spec import dtype_name

FILE = "fused_step.cu"
THREADS, WARPS, TILE, MAX_GROUP_DIMS, MAX_SPLITS, STAGED = 256, 8, 64, 2048, 16, 2  # as cuda_src/fused_step.cu's
PAD = 8  # elements between the GEMV's shared-memory rows
NORM_PER = (2, 3, 4, 6)  # the kernel's NORM_PER: values of a row a thread holds while it normalises the row
MAX_HIDDEN = NORM_PER[-1] * THREADS
ROWS = (1, 2, 4, 8)  # the kernel's instances: a batch runs on the smallest that holds it
MAX_ROWS = ROWS[-1]
HEAD_DIMS = (64, 128)
SMEM_LIMIT = 99 << 10  # dynamic shared memory every device of compute capability 8.0 or later lets a block opt in to
MIN_CAPABILITY = 80
PER_LAYER = ("attn_norm", "qkv", "o", "ffn_norm", "gate_up", "down")  # then the K and V planes


def instances(dtypes=("float16", "bfloat16"), per=(3,)):
    """{file: name expressions} of the fused step's instances (``per``: the NORM_PER of SmolLM2's hidden size)."""
    return {FILE: tuple(_name(d, h, r, v) for d in dtypes for h in HEAD_DIMS for r in ROWS for v in per)}


def _name(dtype: str, head_dim: int, rows: int, per: int) -> str:
    return f"pagedrt::decode_step<{CUDA_TYPES[dtype]}, {head_dim}, {rows}, {per}>"


def norm_per(hidden: int) -> int:
    """The kernel's NORM_PER for a hidden size (at most MAX_HIDDEN): values of a row each thread normalises."""
    return next(v for v in NORM_PER if v * THREADS >= hidden)


def smem_bytes(config, rows: int) -> int:
    """Dynamic shared memory of the instance for ``rows``: the normalised or gathered rows of a GEMV phase, or
    the attention's STAGED buffers of a K and V tile (or its warps' outputs, whichever is larger) and its float
    state, whichever is larger."""
    c = config
    widest = max(c.hidden, c.ffn, c.q_heads * c.head_dim)
    gemv = WARPS * rows * 4 + (WARPS + 1) * 128 * 4 + rows * (widest + PAD) * 2
    group = c.q_heads // c.kv_heads
    front = max(STAGED * 2 * TILE * c.head_dim * 2, WARPS * group * c.head_dim * 4)
    attention = front + group * (c.head_dim + TILE + 3) * 4
    return max(gemv, attention)


def unsupported(config, spec, capability: int) -> Optional[str]:
    """Why the fused step cannot run a model of ``config`` over a cache of ``spec`` on a device of compute
    capability ``capability`` (e.g. 90), or None when it can."""
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
               (smem_bytes(c, MAX_ROWS) > SMEM_LIMIT, "its rows do not fit in shared memory")]
    return next((why for bad, why in reasons if bad), None)


@functools.lru_cache(maxsize=None)
def _kernel(dtype: str, head_dim: int, rows: int, per: int) -> Any:
    fn = source.function(FILE, _name(dtype, head_dim, rows, per))
    fn.max_dynamic_shared_size_bytes = SMEM_LIMIT
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
                np.int32(self.max_splits(batch)), np.float32(c.rms_eps), np.float32(LOG2E / math.sqrt(c.head_dim)))
        kernel = _kernel(self.dtype, c.head_dim, rows, norm_per(c.hidden))
        launch_ex(kernel, (self.grid,), (THREADS,), args, smem_bytes(c, rows), programmatic_serialization=False,
                  cooperative=True)
        return logits
