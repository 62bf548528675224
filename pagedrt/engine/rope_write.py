"""Rotary embeddings fused with the K/V write (``cuda_src/rope_write.cu``), and its NumPy reference.

One launch a layer takes qkv as the QKV GEMM leaves it, writes q rotated for attention and stores k rotated and
v into the layer's planes at the step's slots (FP8 planes: quantised as :func:`pagedrt.kernels.write_kv` does),
so no k and v buffers are written and read back.
"""

from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from .. import source
from ..kernels.args import (NULL, array_module, c_contiguous, check, device_pointers, int_array, plane, ptr,
                            scale_pointers)
from ..kernels.configs import Config, config, fp8_sweep, sweep
from ..kernels.launch import launch
from ..kernels.validate import Spans, check_slots
from ..kernels.write import check_planes, write_kv_reference
from ..spec import Array, plane_kv_dtype

FILE = "rope_write.cu"
THREADS = 128  # at least head_dim / 2: a block's threads compute its token's angles


def kernel_name(cfg: Config) -> str:
    """The name expression of ``cfg``'s kernel."""
    plane_type = "pagedrt::e4m3" if cfg.fp8 else cfg.cuda_type
    return f"pagedrt::rope_write<{cfg.cuda_type}, {plane_type}, {cfg.head_dim}, {cfg.block_size}, {THREADS}>"


def instances(configs: Optional[Sequence[Config]] = None) -> Dict[str, Tuple[str, ...]]:
    """{file: name expressions} for ``configs`` (default: the representative sweeps, FP8's too)."""
    return {FILE: tuple(dict.fromkeys(kernel_name(c) for c in (configs or sweep() + fp8_sweep())))}


def positions(qo_indptr: np.ndarray, seq_lens: np.ndarray, num_tokens: int) -> np.ndarray:
    """Each new token's position in its sequence (NumPy, int64): seq_lens[b] - (qo_indptr[b + 1] - t)."""
    qo = np.asarray(qo_indptr, np.int64)
    t = np.arange(num_tokens)
    b = np.searchsorted(qo, t, side="right") - 1
    return np.asarray(seq_lens, np.int64)[b] - (qo[b + 1] - t)


class RopeWritePlan:
    """One step's rotary embeddings and K/V writes, checked once and run for every layer (as
    :class:`~pagedrt.kernels.WritePlan`, whose checks it makes).

    Parameters
    ----------
    qkv : array [n, (q_heads + 2 kv_heads) * head_dim]
        C-contiguous: each token's q heads, k heads, then v heads. On the device of q's dtype; on the host any
        float dtype (the host model's float64).
    q : array [n, q_heads, head_dim]
        C-contiguous, float16, bfloat16 or float32: where the rotated q goes.
    k_cache : array [num_blocks, kv_heads, block_size, head_dim]
        The first layer's K plane: every layer's planes must have its layout. uint8 planes hold float8 e4m3 bits.
    slot_mapping : array, int64 [n]
        ``block_id * block_size + slot_in_block``; negative is padding (no k or v stored; q is).
    qo_indptr : array, int32 [batch + 1]
        The step's query offsets: batch row b's tokens are ``qo_indptr[b]`` to ``qo_indptr[b + 1] - 1``.
    seq_lens : array, int32 [batch]
        Each row's KV length after the step: token t of row b sits at position
        ``seq_lens[b] - (qo_indptr[b + 1] - t)``.
    inv_freq : array, float32 [head_dim / 2]
        Pair i turns by ``position * inv_freq[i]`` (the product in float32).
    validate : bool
        Check the slots on the device (one small launch, a 16-byte read); NumPy inputs are always checked.

    Raises
    ------
    LaunchArgumentError
        A shape, dtype, layout or array module that does not fit.
    UnsupportedConfigError
        A dtype, head_dim or block size the kernels do not cover.
    BlockTableError
        A slot past the cache, in a block whose memory is not mapped, or given to two tokens.
    """

    def __init__(self, qkv: Array, q: Array, k_cache: Array, slot_mapping: Array, qo_indptr: Array,
                 seq_lens: Array, inv_freq: Array, *, validate: bool = True):
        xp = array_module(qkv=qkv, q=q, k_cache=k_cache, slot_mapping=slot_mapping, qo_indptr=qo_indptr,
                          seq_lens=seq_lens, inv_freq=inv_freq)
        pk = plane("k_cache", k_cache)
        c_contiguous("q", q, 3)
        c_contiguous("qkv", qkv, 2)
        n, q_heads, d = (int(x) for x in q.shape)
        kv_heads, kv_dtype = pk.num_kv_heads, plane_kv_dtype(k_cache.dtype)
        check(d == pk.head_dim and (kv_dtype is not None or q.dtype == k_cache.dtype),
              lambda: f"q ({q.dtype} {q.shape}) must have the planes' head_dim {pk.head_dim} and, unless they are "
                      f"FP8, their dtype {k_cache.dtype}")
        width = (q_heads + 2 * kv_heads) * d
        check(qkv.shape == (n, width) and (xp is np or qkv.dtype == q.dtype),
              lambda: f"qkv must be [{n}, {width}] ((q heads {q_heads} + 2 x KV heads {kv_heads}) x {d})"
                      + ("" if xp is np else f" of q's dtype {q.dtype}") + f", got {qkv.dtype} {qkv.shape}")
        cfg = config(q.dtype, d, pk.block_size, 1, kv_dtype=kv_dtype)
        for name, a, dtype in (("slot_mapping", slot_mapping, np.int64), ("qo_indptr", qo_indptr, np.int32),
                               ("seq_lens", seq_lens, np.int32)):
            int_array(name, a, dtype, 1)
            c_contiguous(name, a, 1)
        batch = int(seq_lens.shape[0])
        check(slot_mapping.shape[0] == n and batch >= 1 and qo_indptr.shape[0] == batch + 1,
              lambda: f"slot_mapping must hold one slot per token ({n}) and qo_indptr one offset more than seq_lens "
                      f"({batch}), got {slot_mapping.shape[0]} and {qo_indptr.shape[0]}")
        check(inv_freq.dtype == np.float32 and inv_freq.shape == (d // 2,) and inv_freq.flags.c_contiguous,
              lambda: f"inv_freq must be contiguous float32 [{d // 2}], got {inv_freq.dtype} {inv_freq.shape}")
        spans = Spans((k_cache,), k_cache.strides[0], pk.block_elems * k_cache.itemsize)
        if xp is np or validate:
            check_slots(slot_mapping, pk.block_size, pk.num_blocks, spans)
        self._spans, self._kv_heads = spans, kv_heads if cfg.fp8 else None
        self._type, self._qkv, self._q = type(q), (qkv.shape, qkv.dtype), (q.shape, q.dtype)
        self._plane = (k_cache.shape, k_cache.strides, k_cache.dtype)
        self._steps = (slot_mapping, qo_indptr, seq_lens, inv_freq)
        self._device, self._launch, self._epilogue = None if xp is np else q.device.id, None, None
        if xp is not np and n:
            vectors = (q_heads + 2 * kv_heads) * d // (16 if cfg.fp8 else 16 // q.itemsize)  # a token's, one a thread
            grid = (n, -(-vectors // THREADS))
            self._launch = (source.function(FILE, kernel_name(cfg)), grid, (THREADS,),
                            (np.int64(pk.block_stride), ptr(slot_mapping), ptr(qo_indptr), ptr(seq_lens),
                             np.int32(batch), ptr(inv_freq), np.int32(q_heads), np.int32(kv_heads)))
            if n == batch:  # one token a row: a decode step, whose rotation a GEMM's epilogue can make
                self._epilogue = ((np.int64(pk.block_stride), ptr(slot_mapping), ptr(seq_lens), ptr(inv_freq)),
                                  (np.int32(q_heads), np.int32(kv_heads), np.int32(d), np.int32(pk.block_size)))
        self._decode = n == batch

    def run(self, qkv: Array, q: Array, k_cache: Array, v_cache: Array, *, k_scale: Optional[Array] = None,
            v_scale: Optional[Array] = None) -> None:
        """Rotate one layer's ``qkv`` into ``q`` and store its k and v into ``k_cache`` and ``v_cache`` at the
        plan's slots; arrays of the plan's shapes, dtypes and layout. FP8 planes need that layer's ``k_scale``
        and ``v_scale`` (float32 [kv_heads])."""
        self._check(q, k_cache, v_cache, k_scale, v_scale, qkv=qkv)
        if self._type is np.ndarray:
            rope_write_reference(qkv, q, k_cache, v_cache, *self._steps, k_scale=k_scale, v_scale=v_scale)
            return
        pointers = device_pointers(self._device, ("qkv", "q", "k_cache", "v_cache"), (qkv, q, k_cache, v_cache))
        scales = scale_pointers(self._device, self._kv_heads, k_scale, v_scale) or (NULL, NULL)
        if self._launch is not None:
            kernel, grid, threads, args = self._launch
            launch(kernel, grid, threads, (*pointers, *args, *scales))

    def epilogue_args(self, width: int, q: Array, k_cache: Array, v_cache: Array, *,
                      k_scale: Optional[Array] = None, v_scale: Optional[Array] = None) -> Tuple[np.generic, ...]:
        """The arguments of ``cuda_src/layer_gemm.cu``'s ROPE_WRITE epilogue, which makes this plan's rotation
        and write of one layer inside the QKV GEMM (:func:`pagedrt.engine.layer_gemm.norm_gemm_rope_write`):
        the planes, the step's slots, lengths and frequencies, the scales (FP8 planes) and the heads' shape, after
        :meth:`run`'s checks of ``q`` and the planes. A device plan of a decode step (one token a row) only.

        Parameters
        ----------
        width : int
            The GEMM's output columns: the plan's qkv width, or the epilogue would store past the heads.
        q, k_cache, v_cache, k_scale, v_scale
            As :meth:`run`'s.

        Raises
        ------
        LaunchArgumentError
            As :meth:`run`; another width, a host plan, or a step with a row of more than one token.
        """
        self._check(q, k_cache, v_cache, k_scale, v_scale)
        check(width == self._qkv[0][1], lambda: f"the QKV GEMM has {width} output columns; the plan's qkv has "
                                                f"{self._qkv[0][1]}")
        check(self._type is not np.ndarray and self._decode,
              "the ROPE_WRITE epilogue takes a device plan of a decode step (one token a row)")
        if self._epilogue is None:  # no tokens: nothing is launched
            return ()
        pointers = device_pointers(self._device, ("q", "k_cache", "v_cache"), (q, k_cache, v_cache))
        scales = scale_pointers(self._device, self._kv_heads, k_scale, v_scale) or (NULL, NULL)
        (stride, *steps), heads = self._epilogue
        return (pointers[1], pointers[2], stride, *steps, *scales, *heads)

    def _check(self, q, k_cache, v_cache, k_scale, v_scale, qkv=None) -> None:
        """:meth:`run`'s and :meth:`epilogue_args`' checks: one array type, q's (and qkv's) shape, dtype and
        layout, the planes and scales."""
        array_type = self._type
        shaped = (("q", q, self._q),) + (() if qkv is None else (("qkv", qkv, self._qkv),))
        check(all(type(a) is array_type for a in (k_cache, v_cache) + tuple(a for _, a, _ in shaped)),
              lambda: f"qkv, q, k_cache and v_cache must be {array_type.__module__}.{array_type.__name__}s, as the "
                      "plan's: NumPy or CuPy arrays, not a mix")
        for name, a, (shape, dtype) in shaped:
            check(a.shape == shape and a.dtype == dtype and a.flags.c_contiguous,
                  lambda: f"{name} must be C-contiguous {dtype} of shape {shape}, as the plan's, got {a.dtype} "
                          f"{a.shape}")
        check_planes(self, k_cache, v_cache, k_scale, v_scale)


def rope_write_reference(qkv: np.ndarray, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                         slot_mapping: np.ndarray, qo_indptr: np.ndarray, seq_lens: np.ndarray, inv_freq: np.ndarray,
                         *, k_scale: Optional[np.ndarray] = None, v_scale: Optional[np.ndarray] = None) -> None:
    """NumPy reference of :class:`RopeWritePlan` (no checks; arguments as there): the rotation in float64 of the
    float32 angles, rounded to q's dtype, then :func:`~pagedrt.kernels.write_kv_reference` of k and v."""
    n, q_heads, d = q.shape
    kv_heads = k_cache.shape[1]
    pos = positions(qo_indptr, seq_lens, n).astype(np.float32)
    angle = (pos[:, None] * inv_freq[None, :]).astype(np.float64)  # float32 product, as the kernel's
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    heads = qkv.reshape(n, q_heads + 2 * kv_heads, d // 2, 2).astype(np.float64)
    x0, x1 = heads[:, :q_heads + kv_heads, :, 0], heads[:, :q_heads + kv_heads, :, 1]
    rotated = np.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1).reshape(n, q_heads + kv_heads, d)
    rotated = rotated.astype(q.dtype)
    q[...] = rotated[:, :q_heads]
    v = qkv.reshape(n, q_heads + 2 * kv_heads, d)[:, q_heads + kv_heads:].astype(q.dtype)
    write_kv_reference(rotated[:, q_heads:], v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
