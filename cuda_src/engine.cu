// The engine's small kernels around the GEMMs of a Llama layer (pagedrt/engine/ops.py launches them; the rotary
// embeddings are rope_write.cu's).
//
// T is the activations' type (__half or __nv_bfloat16); the residual stream and the norm weights are
// float. Every kernel computes in float. Row-major, contiguous arrays throughout.
//
// embed:         residual[t, :] = table[ids[t], :]
// add_rms_norm:  out row r reads residual row i = rows ? rows[r + 1] - 1 : r (the last token of batch row r
//                when rows is the step's query offsets); x = residual[i] (+ delta[i], written back);
//                out[r] = x / sqrt(mean(x^2) + eps) * weight
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
__global__ void silu_mul(const T* __restrict__ gate_up, T* __restrict__ out, int ffn) {
    const long long t = blockIdx.x;
    for (int j = threadIdx.x; j < ffn; j += blockDim.x) {
        const float g = to_float(gate_up[t * 2 * ffn + j]), u = to_float(gate_up[t * 2 * ffn + ffn + j]);
        out[t * ffn + j] = from_float<T>(g / (1.0f + __expf(-g)) * u);
    }
}

}  // namespace pagedrt
