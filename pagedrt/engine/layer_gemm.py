"""The layered decode step's GEMMs with the ops between them fused in: ``cuda_src/layer_gemm.cu``, and NumPy
references.

A layer of the layered step was nine launches, most of them bound by launch latency rather than bytes. With
these it is six: norm + qkv (:func:`norm_gemm`), the rotary embeddings + K/V write, attention, o + residual add
(:func:`gemm_add`), norm + gate/up + SwiGLU (:func:`norm_gemm_silu`), down + residual add (:func:`gemm_add`).
Each rounds where the unfused ops round (``ops.add_rms_norm``, ``ops.gemm``, ``ops.silu_mul``): A to the
weights' dtype after the norm, the GEMM's output to it before SwiGLU or the residual add.

Given CuPy arrays a function launches the kernel (through ``cuLaunchKernelEx``, with programmatic stream
serialization on compute capability 9.0 and later: it streams its first weight tiles before it waits for the
kernel before it); given NumPy arrays it runs its reference, in float64 with those roundings. A launch's tile
(:func:`tile`) is the one that moves the fewest bytes into the busiest SM: CTAs re-read A (float32 after the
norm) once per column tile and W once per row tile, and these small GEMMs are bound by those reads.
"""

import functools
from typing import Any, Optional, Tuple

import numpy as np

from .. import source
from ..kernels.args import NULL, check, multiprocessors, ptr
from ..kernels.configs import CUDA_TYPES
from ..kernels.launch import launch_ex
from ..spec import Array, dtype_name

FILE = "layer_gemm.cu"
THREADS, BK, STAGES = 128, 64, 4  # as cuda_src/layer_gemm.cu's
NORM, PLAIN = 0, 1  # prologues
STORE, SILU_UP, ADD = 0, 1, 2  # epilogues
VARIANTS = ((NORM, STORE), (NORM, SILU_UP), (PLAIN, ADD))
TILES = ((16, 64), (16, 128), (32, 64), (32, 96), (32, 128), (64, 64), (64, 96), (64, 128))  # (BM, BN)
MIN_ROWS, MAX_ROWS = 9, 256  # the decode steps the layered path runs with these (smaller ones: the fused step)
DTYPES = ("float16", "bfloat16")
MIN_CAPABILITY, PDL_CAPABILITY = 80, 90  # mma.m16n8k16 for bfloat16; griddepcontrol


def kernel_name(dtype: str, prologue: int, epilogue: int, bm: int, bn: int) -> str:
    """The name expression of one instance."""
    return f"pagedrt::layer_gemm<{CUDA_TYPES[dtype]}, {prologue}, {epilogue}, {bm}, {bn}>"


def instances(dtypes=DTYPES):
    """{file: name expressions} of every variant and tile for the activation dtypes ``dtypes``."""
    return {FILE: tuple(kernel_name(d, p, e, bm, bn) for d in dtypes for p, e in VARIANTS for bm, bn in TILES)}


def smem_bytes(bm: int, bn: int, k: int) -> int:
    """Dynamic shared memory of a tile: its BM rows of A over the whole K, and STAGES buffers of W."""
    return bm * k * 2 + STAGES * bn * BK * 2


def tile(m: int, n: int, k: int, prologue: int, epilogue: int, sms: int, smem_limit: int) -> Tuple[int, int]:
    """The (BM, BN) of TILES for an ``m x k`` A and ``n`` output columns on a device of ``sms`` SMs and
    ``smem_limit`` bytes of shared memory a block: the fewest bytes read by the busiest SM (A's rows, 4 bytes a
    value after the norm, 2 without; W's rows, 2 bytes a value; times the waves of CTAs), then the fewest CTAs,
    then the smallest BM. ValueError when no tile fits (:func:`unsupported` says so first)."""
    a_bytes = 4 if prologue == NORM else 2
    best = None
    for bm, bn in TILES:
        if smem_bytes(bm, bn, k) > smem_limit:
            continue
        cols = bn // 2 if epilogue == SILU_UP else bn
        ctas = -(-n // cols) * -(-m // bm)
        key = (-(-ctas // sms) * (min(bm, m) * a_bytes + bn * 2) * k, ctas, bm)
        best = min(best or (key, (bm, bn)), (key, (bm, bn)))
    if best is None:
        raise ValueError(f"no tile fits {smem_limit} bytes of shared memory at K = {k}")
    return best[1]


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
               (smem_bytes(*TILES[0], max(c.hidden, c.ffn, c.q_heads * c.head_dim)) > smem_limit,
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
def _device(device_id: int) -> Tuple[int, int, int]:
    """(SMs, shared memory a block may opt into, compute capability) of a device."""
    import cupy
    attributes = cupy.cuda.Device(device_id).attributes
    capability = int(cupy.cuda.Device(device_id).compute_capability)
    return multiprocessors(device_id), attributes["MaxSharedMemoryPerBlockOptin"], capability


@functools.lru_cache(maxsize=None)
def _plan(dtype: str, prologue: int, epilogue: int, m: int, n: int, k: int, device_id: int) -> Tuple[Any, tuple, int,
                                                                                                      bool]:
    """(kernel, grid, shared memory, programmatic) of one launch shape on one device."""
    sms, smem_limit, capability = _device(device_id)
    bm, bn = tile(m, n, k, prologue, epilogue, sms, smem_limit)
    fn = source.function(FILE, kernel_name(dtype, prologue, epilogue, bm, bn))
    fn.max_dynamic_shared_size_bytes = smem_limit
    cols = bn // 2 if epilogue == SILU_UP else bn
    return fn, (-(-n // cols), -(-m // bm)), smem_bytes(bm, bn, k), capability >= PDL_CAPABILITY


def _launch(prologue, epilogue, x, norm_weight, a, w, out, residual, n, eps):
    import cupy
    lhs = a if prologue == PLAIN else x
    m, k = lhs.shape
    dtype = dtype_name(w.dtype)
    check(dtype in DTYPES, lambda: f"the kernels take float16 or bfloat16 weights, got {dtype}")
    if m:
        fn, grid, smem, programmatic = _plan(dtype, prologue, epilogue, m, n, k, cupy.cuda.Device().id)
        args = tuple(v if isinstance(v, np.uint64) else ptr(v) for v in (x, norm_weight, a, w, out, residual))
        launch_ex(fn, grid, (THREADS,), args + (np.int32(m), np.int32(n), np.int32(k), np.float32(eps)), smem,
                  programmatic_serialization=programmatic)
    return residual if epilogue == ADD else out


def step_rows_fit(rows: int) -> bool:
    """Whether a decode step of ``rows`` rows runs these kernels (beside cuBLAS, they win from MIN_ROWS to
    MAX_ROWS: docs/ENGINE.md, "Speed")."""
    return MIN_ROWS <= rows <= MAX_ROWS

