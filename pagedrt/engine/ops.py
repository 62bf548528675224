"""The operations of a Llama layer around attention: launchers of ``cuda_src/engine.cu``, cuBLAS GEMMs, and
their NumPy references.

Each operation takes its output (``out``) and writes it, so a step allocates nothing
and a CUDA graph can capture it. Given CuPy arrays it launches a kernel (or calls
cuBLAS); given NumPy arrays it runs its reference, which computes in float64 (GEMMs
in float32) and casts to the output's dtype: the host backend's path, and what the
tests compare the kernels with.

- :func:`embed`: the token embedding's rows of ``ids`` into the float32 residual stream.
- :func:`add_rms_norm`: the residual stream plus a layer's output (written back), RMS-normalised and scaled;
  ``rows`` (the step's query offsets) selects each batch row's last token.
- rotary embeddings: :mod:`.rope_write` (fused with the K/V write).
- :func:`silu_mul`: SwiGLU's ``silu(gate) * up``.
- :func:`gemm`: ``a @ w.T`` into ``out``, ``w`` a weight ``[out, in]`` (cuBLAS ``GemmEx``, float32 accumulation;
  the output may be float32).
"""

import functools
import re
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from .. import source
from ..errors import CudaError
from ..kernels.args import NULL, ptr
from ..kernels.configs import CUDA_TYPES
from ..spec import Array, dtype_name

FILE = "engine.cu"
THREADS = 256
KERNELS = ("embed", "add_rms_norm", "silu_mul")
CUDA_R = {"float16": 2, "bfloat16": 14, "float32": 0}  # cudaDataType
CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT, CUBLAS_OP_N, CUBLAS_OP_T = 68, -1, 0, 1
WORKSPACE_BYTES = 32 << 20  # cuBLAS's workspace (Hopper's recommendation)
_ONE, _ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)  # alpha and beta, read by cuBLAS from the host


def instances(dtypes: Sequence[str] = ("float16", "bfloat16")) -> Dict[str, Tuple[str, ...]]:
    """{file: name expressions} of every kernel here for the activation dtypes ``dtypes``."""
    return {FILE: tuple(f"pagedrt::{k}<{CUDA_TYPES[d]}>" for k in KERNELS for d in dtypes)}


@functools.lru_cache(maxsize=None)
def _kernel(name, dtype):
    return source.function(FILE, f"pagedrt::{name}<{CUDA_TYPES[dtype_name(dtype)]}>")


def _host(*arrays):
    return all(isinstance(a, np.ndarray) for a in arrays if a is not None)


def embed(ids: Array, table: Array, out: Array) -> Array:
    """``out[t] = table[ids[t]]``: ids int64 [n], table [vocab, hidden], out float32 [n, hidden]."""
    if _host(ids, table, out):
        out[...] = table[ids]
        return out
    if ids.size:
        _kernel("embed", table.dtype)((ids.size,), (THREADS,), (ptr(ids), ptr(table), ptr(out), np.int32(out.shape[1])))
    return out


def add_rms_norm(residual: Array, delta: Optional[Array], weight: Array, out: Array, eps: float,
                 rows: Optional[Array] = None) -> Array:
    """``residual += delta`` (when given), then ``out[r] = x / sqrt(mean(x**2) + eps) * weight`` of residual row
    ``rows[r + 1] - 1`` (``rows``: the step's query offsets [batch + 1], so each batch row's last token) or of
    row ``r`` (``rows`` None). residual float32 [n, hidden], delta [n, hidden], weight float32 [hidden],
    out [len(rows) - 1 or n, hidden]."""
    if _host(residual, delta, weight, out, rows):
        picked = slice(None) if rows is None else np.asarray(rows[1:], np.int64) - 1
        if delta is not None:
            residual[picked] += delta[picked]
        x = residual[picked].astype(np.float64)
        out[...] = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps) * weight
        return out
    if out.shape[0]:
        _kernel("add_rms_norm", out.dtype)(
            (out.shape[0],), (THREADS,), (ptr(residual), NULL if delta is None else ptr(delta), ptr(weight), ptr(out),
                                          NULL if rows is None else ptr(rows), np.int32(out.shape[1]), np.float32(eps)))
    return out


def silu_mul(gate_up: Array, out: Array) -> Array:
    """``out = silu(gate) * up`` where gate_up [n, 2 ffn] is gate then up; out [n, ffn]."""
    if _host(gate_up, out):
        ffn = out.shape[1]
        g, u = gate_up[:, :ffn].astype(np.float64), gate_up[:, ffn:].astype(np.float64)
        out[...] = g / (1.0 + np.exp(-g)) * u
        return out
    if out.shape[0]:
        _kernel("silu_mul", out.dtype)((out.shape[0],), (THREADS,), (ptr(gate_up), ptr(out), np.int32(out.shape[1])))
    return out


@functools.lru_cache(maxsize=None)
def _cublas(device_id):
    """(cuBLAS, CuPy's handle on this device, a workspace for it). cuBLAS is the library CuPy loaded, called
    through ctypes: CuPy's own wrappers refuse to run while a stream is being captured, which cuBLAS supports
    when the handle has a workspace of its own (so nothing is allocated during the capture)."""
    import ctypes
    import cupy
    handle = cupy.cuda.device.get_cublas_handle()  # loads the library
    with open("/proc/self/maps") as maps:
        path = next((line.split()[-1] for line in maps if re.search(r"/libcublas\.so[.0-9]*$", line.strip())), None)
    if path is None:
        raise CudaError("dlopen", "NOT_FOUND", "libcublas is not loaded in this process")
    lib = ctypes.CDLL(path)
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.cublasSetStream_v2.argtypes = [p, p]
    lib.cublasSetWorkspace_v2.argtypes = [p, p, ctypes.c_size_t]
    lib.cublasGemmEx.argtypes = [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i]
    return lib, handle, cupy.empty(WORKSPACE_BYTES, np.uint8)


def _check(call, status):
    if status:
        raise CudaError(call, f"cublasStatus_t {status}", "see cublas_api.h")


def gemm(a: Array, w: Array, out: Array) -> Array:
    """``out = a @ w.T``: a [m, k], w [n, k] (a weight, ``[out, in]``), out [m, n], all C-contiguous. On the device
    a and w share a dtype and out has it or float32; cuBLAS accumulates in float32. On the host, float32 (or float64
    if out is)."""
    if _host(a, w, out):
        compute = np.float64 if out.dtype == np.float64 else np.float32
        np.matmul(a.astype(compute, copy=False), w.astype(compute, copy=False).T, out=out, casting="unsafe")
        return out
    import cupy
    m, k = a.shape
    n = w.shape[0]
    if m:
        lib, handle, workspace = _cublas(cupy.cuda.Device().id)
        _check("cublasSetStream", lib.cublasSetStream_v2(handle, cupy.cuda.get_current_stream().ptr))
        _check("cublasSetWorkspace", lib.cublasSetWorkspace_v2(handle, workspace.data.ptr, workspace.nbytes))
        # Row-major out = a @ w.T is column-major out^T = w @ a^T, and row-major w [n, k] is column-major w^T:
        # cuBLAS's first matrix is w, transposed.
        _check("cublasGemmEx", lib.cublasGemmEx(
            handle, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, _ONE.ctypes.data, w.data.ptr, CUDA_R[dtype_name(w.dtype)], k,
            a.data.ptr, CUDA_R[dtype_name(a.dtype)], k, _ZERO.ctypes.data, out.data.ptr,
            CUDA_R[dtype_name(out.dtype)], n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT))
    return out
