"""The layered decode step's GEMMs with the ops between them fused in: ``cuda_src/layer_gemm.cu``, and NumPy
references.

A layer of the layered step was nine launches, most of them bound by launch latency rather than bytes. With
these it is five: norm + qkv + the rotary embeddings + K/V write (:func:`norm_gemm_rope_write`), attention, o +
residual add (:func:`gemm_add`), norm + gate/up + SwiGLU (:func:`norm_gemm_silu`), down + residual add
(:func:`gemm_add`). Each rounds where the unfused ops round (``ops.add_rms_norm``, ``ops.gemm``,
``ops.silu_mul``, ``RopeWritePlan``): A to the weights' dtype after the norm, the GEMM's output to it before
SwiGLU, the residual add or the rotation.

Given CuPy arrays a function launches the kernel (through ``cuLaunchKernelEx``, with programmatic stream
serialization on compute capability 9.0 and later: it requests its first weight tiles before it waits for the
kernel before it); given NumPy arrays it runs its reference, in float64 with those roundings. A launch's
configuration (tile rows and columns, weight stages, k-split over warps) is :data:`TABLE`'s first entry for its
variant that covers its rows and depth and fits in shared memory: the fastest of those measured on an H200 at
SmolLM2-135M's shapes (docs/ENGINE.md, "Speed").
"""

import functools
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from .. import source
from ..kernels.args import NULL, check, ptr
from ..kernels.configs import CUDA_TYPES
from ..kernels.launch import launch_ex
from ..spec import Array, dtype_name
from .rope_write import RopeWritePlan

FILE = "layer_gemm.cu"
THREADS, BK = 256, 64  # as cuda_src/layer_gemm.cu's
NORM, PLAIN = 0, 1  # prologues
STORE, SILU_UP, ADD, ROPE_WRITE = 0, 1, 2, 3  # epilogues
Config = Tuple[int, int, int, int]  # (BM, BN, STAGES, WARPS_K)
# (prologue, epilogue) -> ((most rows, deepest k, config), ...): the first that covers a launch and fits is its.
TABLE = {(NORM, STORE): ((32, 4096, (16, 32, 10, 4)), (128, 4096, (16, 64, 10, 2)), (256, 4096, (32, 64, 10, 2))),
         (NORM, ROPE_WRITE): ((32, 4096, (16, 32, 10, 4)), (128, 4096, (16, 64, 10, 2)),  # NORM, STORE's
                              (256, 4096, (32, 64, 10, 2))),
         (NORM, SILU_UP): ((32, 4096, (16, 64, 10, 2)), (64, 4096, (32, 64, 10, 2)), (128, 4096, (32, 128, 8, 2)),
                           (256, 4096, (32, 192, 6, 2))),
         (PLAIN, ADD): ((128, 768, (16, 32, 10, 4)), (256, 768, (16, 64, 10, 2)), (64, 4096, (16, 32, 24, 4)),
                        (128, 4096, (32, 32, 24, 4)), (256, 4096, (32, 64, 12, 2)))}
FALLBACK: Config = (16, 32, 2, 4)  # the least shared memory: when no entry fits
VARIANTS = tuple(TABLE)
MIN_ROWS, MAX_ROWS = 9, 64  # the decode steps the layered path runs with these (fewer rows: the fused step)
DTYPES = ("float16", "bfloat16")
MIN_CAPABILITY, PDL_CAPABILITY = 80, 90  # mma.m16n8k16 for bfloat16; griddepcontrol


def configs(variant: Tuple[int, int]) -> Tuple[Config, ...]:
    """Every configuration a variant may launch with: its table's and the fallback."""
    return tuple(dict.fromkeys([c for _, _, c in TABLE[variant]] + [FALLBACK]))


def kernel_name(dtype: str, prologue: int, epilogue: int, config: Config) -> str:
    """The name expression of one instance."""
    return f"pagedrt::layer_gemm<{CUDA_TYPES[dtype]}, {prologue}, {epilogue}, {', '.join(map(str, config))}>"


def instances(dtypes: Sequence[str] = DTYPES) -> Dict[str, Tuple[str, ...]]:
    """{file: name expressions} of every variant and configuration for the activation dtypes ``dtypes``."""
    return {FILE: tuple(kernel_name(d, p, e, c) for d in dtypes for p, e in VARIANTS for c in configs((p, e)))}


def smem_bytes(prologue: int, config: Config, k: int) -> int:
    """Dynamic shared memory of a launch: its BM rows of A over the whole K (float32 for the norm, normalised in
    place, and the norm's K weights), STAGES buffers of W; or the warps' partial sums if more."""
    bm, bn, stages, warps_k = config
    a_bytes = bm * k * 4 + k * 4 if prologue == NORM else bm * k * 2
    return max(a_bytes + stages * bn * BK * 2, (warps_k - 1) * bm * bn * 4)


def choose(prologue: int, epilogue: int, m: int, k: int, smem_limit: int) -> Config:
    """The configuration of a launch of ``m`` rows of depth ``k`` on a device of ``smem_limit`` bytes of shared
    memory a block: TABLE's first entry that covers it and fits, else FALLBACK (:func:`unsupported` says whether
    that fits)."""
    for rows, depth, config in TABLE[(prologue, epilogue)]:
        if m <= rows and k <= depth and smem_bytes(prologue, config, k) <= smem_limit:
            return config
    return FALLBACK


def unsupported(config: Any, spec: Any, capability: int, smem_limit: int) -> Optional[str]:
    """Why these kernels cannot run a model of ``config`` over a cache of ``spec`` on a device of compute
    capability ``capability`` (e.g. 90) with ``smem_limit`` bytes of shared memory a block, or None."""
    c = config
    width = (c.q_heads + 2 * c.kv_heads) * c.head_dim
    reasons = [(capability < MIN_CAPABILITY, f"compute capability {capability} has no mma.m16n8k16 for bfloat16"),
               (spec.dtype.name not in DTYPES, f"activations are {spec.dtype.name}"),
               (any(x % BK for x in (c.hidden, c.ffn, c.q_heads * c.head_dim)),
                f"hidden, ffn or the attention's width is not a multiple of {BK}"),
               (width % 8, f"the QKV width {width} is not a multiple of 8"),
               (smem_bytes(NORM, FALLBACK, c.hidden) > smem_limit
                or smem_bytes(PLAIN, FALLBACK, max(c.ffn, c.q_heads * c.head_dim)) > smem_limit,
                "a tile's rows do not fit in shared memory")]
    return next((why for bad, why in reasons if bad), None)


def _host(*arrays):
    return all(isinstance(a, np.ndarray) for a in arrays)


def _normed(x: np.ndarray, norm_weight: np.ndarray, eps: float, dtype: Any) -> np.ndarray:
    """``ops.add_rms_norm``'s output (without the add) in float64, rounded to ``dtype``."""
    x = x.astype(np.float64)
    return (x / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps) * norm_weight).astype(dtype).astype(np.float64)


def _check(a: Array, w: Array, out: Array, rows: int, cols: int, a_dtype: Any) -> None:
    """LaunchArgumentError unless A [m, k] of ``a_dtype``, W [rows, k] and ``out`` [m, cols] fit."""
    m, k = a.shape if a.ndim == 2 else (-1, -1)
    check(a.dtype == a_dtype and w.ndim == 2 and w.shape == (rows, k) and out.shape[:1] == (m,),
          lambda: f"A must be {np.dtype(a_dtype).name} [m, k] and W [{rows}, k], out [m, ...]; got A {a.dtype} "
                  f"{a.shape}, W {w.dtype} {w.shape}, out {out.shape}")
    check(all(x.flags.c_contiguous for x in (a, w, out)), "A, W and out must be C-contiguous")
    check(k % BK == 0 and cols % 8 == 0, lambda: f"k ({k}) must be a multiple of {BK} and the output's columns "
                                                 f"({cols}) of 8")


def norm_gemm(x: Array, norm_weight: Array, w: Array, out: Array, eps: float) -> Array:
    """``out = round(rmsnorm(x) * norm_weight) @ w.T``: the norm before the QKV GEMM.

    Parameters
    ----------
    x : array, float32 [m, k]
        The residual stream.
    norm_weight : array, float32 [k]
    w : array [n, k]
        A weight (``[out, in]``), float16 or bfloat16 on the device.
    out : array [m, n]
        w's dtype; written.
    eps : float
    """
    n = w.shape[0]
    _check(x, w, out, n, n, np.float32)
    check(out.dtype == w.dtype and norm_weight.shape == (x.shape[1],), "out must have w's dtype, norm_weight k values")
    if _host(x, norm_weight, w, out):
        out[...] = _normed(x, norm_weight, eps, w.dtype) @ w.astype(np.float64).T
        return out
    return _launch(NORM, STORE, x, norm_weight, NULL, w, out, NULL, n, eps)


def norm_gemm_silu(x: Array, norm_weight: Array, w: Array, out: Array, eps: float) -> Array:
    """``g, u = round(rmsnorm(x) * norm_weight) @ w.T`` (each rounded to w's dtype), ``out = silu(g) * u``: the
    norm, the gate/up GEMM and SwiGLU.

    Parameters
    ----------
    x : array, float32 [m, k]
        The residual stream.
    norm_weight : array, float32 [k]
    w : array [2 f, k]
        The gate rows, then the up rows; float16 or bfloat16 on the device.
    out : array [m, f]
        w's dtype; written.
    eps : float
    """
    f = out.shape[1] if out.ndim == 2 else -1
    _check(x, w, out, 2 * f, f, np.float32)
    check(out.dtype == w.dtype and norm_weight.shape == (x.shape[1],), "out must have w's dtype, norm_weight k values")
    if _host(x, norm_weight, w, out):
        gu = (_normed(x, norm_weight, eps, w.dtype) @ w.astype(np.float64).T).astype(w.dtype).astype(np.float64)
        g, u = gu[:, :f], gu[:, f:]
        out[...] = g / (1.0 + np.exp(-g)) * u
        return out
    return _launch(NORM, SILU_UP, x, norm_weight, NULL, w, out, NULL, f, eps)


def norm_gemm_rope_write(x: Array, norm_weight: Array, w: Array, writer: RopeWritePlan, q: Array, k_cache: Array,
                         v_cache: Array, eps: float, *, k_scale: Optional[Array] = None,
                         v_scale: Optional[Array] = None) -> Array:
    """``qkv = round(rmsnorm(x) * norm_weight) @ w.T`` (rounded to w's dtype), then ``writer.run(qkv, q, k_cache,
    v_cache)``: the norm, the QKV GEMM, the rotary embeddings and the K/V write of a decode step's layer in one
    launch, with no qkv buffer (bit for bit :func:`norm_gemm` then :meth:`RopeWritePlan.run`).

    Parameters
    ----------
    x : array, float32 [m, k]
        The residual stream, a row a sequence of the decode step.
    norm_weight : array, float32 [k]
    w : array [(q_heads + 2 kv_heads) * head_dim, k]
        The QKV weight; float16 or bfloat16 on the device.
    writer : RopeWritePlan
        The step's rotation and write, made over ``m`` rows of one token each.
    q : array [m, q_heads, head_dim]
        w's dtype; written, rotated.
    k_cache, v_cache : array [num_blocks, kv_heads, block_size, head_dim]
        The layer's planes (the writer's layout); k rotated and v stored at the writer's slots.
    eps : float
    k_scale, v_scale : array, float32 [kv_heads], optional
        The layer's scales, for FP8 planes.

    Returns
    -------
    array
        ``q``.
    """
    n = w.shape[0] if w.ndim == 2 else -1
    if _host(x, norm_weight, w, q):
        qkv = norm_gemm(x, norm_weight, w, np.empty((x.shape[0] if x.ndim == 2 else 0, max(n, 0)), w.dtype), eps)
        writer.run(qkv, q, k_cache, v_cache, k_scale=k_scale, v_scale=v_scale)
        return q
    rope = writer.epilogue_args(n, q, k_cache, v_cache, k_scale=k_scale, v_scale=v_scale)  # q, the planes, n
    _check(x, w, q.reshape(q.shape[0], q.shape[1] * q.shape[2]), n, n, np.float32)
    check(norm_weight.dtype == np.float32 and norm_weight.shape == (x.shape[1],) and q.dtype == w.dtype,
          "norm_weight must be float32 [k] and q have w's dtype")
    return _launch(NORM, ROPE_WRITE, x, norm_weight, NULL, w, q, NULL, n, eps, rope) if rope else q


def gemm_add(a: Array, w: Array, residual: Array) -> Array:
    """``residual += round(a @ w.T)`` (rounded to w's dtype, added in float32): the o and down GEMMs.

    Parameters
    ----------
    a : array [m, k]
        w's dtype (on the host any float dtype: the host model's attention output is the cache's dtype).
    w : array [n, k]
        A weight (``[out, in]``), float16 or bfloat16 on the device.
    residual : array, float32 [m, n]
        The residual stream; updated in place.
    """
    n, host = w.shape[0], _host(a, w, residual)
    _check(a, w, residual, n, n, a.dtype if host else w.dtype)
    check(residual.dtype == np.float32 and residual.shape[1:] == (n,), "residual must be float32 [m, n]")
    if host:
        residual += (a.astype(np.float64) @ w.astype(np.float64).T).astype(w.dtype)
        return residual
    return _launch(PLAIN, ADD, NULL, NULL, a, w, NULL, residual, n, 0.0)


@functools.lru_cache(maxsize=None)
def device_limits(device_id: int) -> Tuple[int, int]:
    """(compute capability, shared memory a block may opt into) of a device: :func:`unsupported`'s last two
    arguments."""
    import cupy
    device = cupy.cuda.Device(device_id)
    return int(device.compute_capability), device.attributes["MaxSharedMemoryPerBlockOptin"]


@functools.lru_cache(maxsize=None)
def _plan(dtype: str, prologue: int, epilogue: int, m: int, n: int, k: int, device_id: int) -> Tuple[Any, tuple, int,
                                                                                                      bool]:
    """(kernel, grid, shared memory, programmatic) of one launch shape on one device."""
    capability, smem_limit = device_limits(device_id)
    config = choose(prologue, epilogue, m, k, smem_limit)
    fn = source.function(FILE, kernel_name(dtype, prologue, epilogue, config))
    fn.max_dynamic_shared_size_bytes = smem_limit  # not this launch's: plans of other depths share the kernel
    cols = config[1] // 2 if epilogue == SILU_UP else config[1]
    return fn, (-(-n // cols), -(-m // config[0])), smem_bytes(prologue, config, k), capability >= PDL_CAPABILITY


NO_ROPE = (NULL, NULL, np.int64(0), NULL, NULL, NULL, NULL, NULL, np.int32(0), np.int32(0), np.int32(0), np.int32(0))


def _launch(prologue, epilogue, x, norm_weight, a, w, out, residual, n, eps, rope=NO_ROPE):
    import cupy
    lhs = a if prologue == PLAIN else x
    m, k = lhs.shape
    dtype = dtype_name(w.dtype)
    check(dtype in DTYPES, lambda: f"the kernels take float16 or bfloat16 weights, got {dtype}")
    if m:
        fn, grid, smem, programmatic = _plan(dtype, prologue, epilogue, m, n, k, cupy.cuda.Device().id)
        args = tuple(v if isinstance(v, np.uint64) else ptr(v) for v in (x, norm_weight, a, w, out, residual))
        launch_ex(fn, grid, (THREADS,), args + (np.int32(m), np.int32(n), np.int32(k), np.float32(eps)) + rope,
                  smem, programmatic_serialization=programmatic)
    return residual if epilogue == ADD else out


def step_rows_fit(rows: int) -> bool:
    """Whether a decode step of ``rows`` rows runs these kernels: from MIN_ROWS to MAX_ROWS, where they beat cuBLAS
    and the unfused ops (at 128 and 256 rows they lose: docs/ENGINE.md, "Speed")."""
    return MIN_ROWS <= rows <= MAX_ROWS
