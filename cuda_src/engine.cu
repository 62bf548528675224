// The engine's small kernels around the GEMMs of a Llama layer (pagedrt/engine/ops.py launches them).
//
// T is the activations' type (__half or __nv_bfloat16); the residual stream and the norm weights are
// float. Every kernel computes in float. Row-major, contiguous arrays throughout.
//
// embed:         residual[t, :] = table[ids[t], :]
// add_rms_norm:  out row r reads residual row i = rows ? rows[r + 1] - 1 : r (the last token of batch row r
//                when rows is the step's query offsets); x = residual[i] (+ delta[i], written back);
//                out[r] = x / sqrt(mean(x^2) + eps) * weight
// rope_split:    token t of batch row b (qo_indptr[b] <= t < qo_indptr[b + 1]) sits at position
//                seq_lens[b] - (qo_indptr[b + 1] - t); its q and k heads in qkv [n, (q_heads + 2 kv_heads) d]
//                are rotated pairwise, (x[2i], x[2i+1]) by pos * inv_freq[i] (GGUF's Llama layout), and
//                written with v to contiguous q [n, q_heads, d], k and v [n, kv_heads, d]
// silu_mul:      out[t, j] = silu(gu[t, j]) * gu[t, ffn + j]
#include "common.cuh"

namespace pagedrt {

template <typename T>
__global__ void embed(const long long* __restrict__ ids, const T* __restrict__ table, float* __restrict__ residual,
                      int hidden) {
    const long long t = blockIdx.x;
    const T* row = table + ids[t] * hidden;
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) residual[t * hidden + j] = to_float(row[j]);
}

// The sum of v over the thread block (blockDim.x a multiple of 32, at most 1024), in every thread.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int warps = blockDim.x / 32;
    v = lane < warps ? partial[lane] : 0.0f;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

template <typename T>
__global__ void add_rms_norm(float* __restrict__ residual, const T* __restrict__ delta,
                             const float* __restrict__ weight, T* __restrict__ out, const int* __restrict__ rows,
                             int hidden, float eps) {
    const int r = blockIdx.x;
    const long long i = rows ? rows[r + 1] - 1 : r;
    float* x = residual + i * hidden;
    float sum = 0.0f;
    for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
        float value = x[j];
        if (delta) {
            value += to_float(delta[i * hidden + j]);
            x[j] = value;
        }
        sum += value * value;
    }
    const float scale = rsqrtf(block_sum(sum) / hidden + eps);
    for (int j = threadIdx.x; j < hidden; j += blockDim.x)
        out[(long long)r * hidden + j] = from_float<T>(x[j] * scale * weight[j]);
}

template <typename T>
__global__ void rope_split(const T* __restrict__ qkv, T* __restrict__ q, T* __restrict__ k, T* __restrict__ v,
                           const int* __restrict__ qo_indptr, const int* __restrict__ seq_lens, int batch,
                           const float* __restrict__ inv_freq, int q_heads, int kv_heads, int head_dim) {
    const int t = blockIdx.x;
    int lo = 0, hi = batch - 1;  // the last row whose first token is at or before t
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (qo_indptr[mid] <= t) lo = mid; else hi = mid - 1;
    }
    const float pos = (float)(seq_lens[lo] - (qo_indptr[lo + 1] - t));
    const int half = head_dim / 2, rotated = (q_heads + kv_heads) * half;
    const long long width = (long long)(q_heads + 2 * kv_heads) * head_dim;
    const T* src = qkv + t * width;
    for (int p = threadIdx.x; p < rotated; p += blockDim.x) {
        const int head = p / half, i = p % half;
        float s, c;
        sincosf(pos * inv_freq[i], &s, &c);
        const float x0 = to_float(src[2 * p]), x1 = to_float(src[2 * p + 1]);
        T* dst = head < q_heads ? q + ((long long)t * q_heads + head) * head_dim
                                : k + ((long long)t * kv_heads + head - q_heads) * head_dim;
        dst[2 * i] = from_float<T>(x0 * c - x1 * s);
        dst[2 * i + 1] = from_float<T>(x0 * s + x1 * c);
    }
    const int values = kv_heads * head_dim;
    for (int j = threadIdx.x; j < values; j += blockDim.x)
        v[(long long)t * values + j] = src[(long long)(q_heads + kv_heads) * head_dim + j];
}

template <typename T>
__global__ void silu_mul(const T* __restrict__ gate_up, T* __restrict__ out, int ffn) {
    const long long t = blockIdx.x;
    for (int j = threadIdx.x; j < ffn; j += blockDim.x) {
        const float g = to_float(gate_up[t * 2 * ffn + j]), u = to_float(gate_up[t * 2 * ffn + ffn + j]);
        out[t * ffn + j] = from_float<T>(g / (1.0f + __expf(-g)) * u);
    }
}

}  // namespace pagedrt
