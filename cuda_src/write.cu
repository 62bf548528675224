// Write K/V of new tokens into their cache slots (prompt or decode step alike).
//
// k, v:      [num_tokens, num_kv_heads, HEAD_DIM], contiguous
// k_cache, v_cache: planes; slot = block*BLOCK_SIZE + slot_in_block goes to
//            block*block_stride + (h*BLOCK_SIZE + slot_in_block)*HEAD_DIM
// slots:     [num_tokens] int64; a negative slot is padding and is skipped.
// One thread per 16-byte vector of a (token, head) row, grid-stride.
//
// Launched programmatically (PDL), a write lets the next kernel (the layer's attention) start its
// thread blocks at once, and waits for the kernel before it to finish before it reads k, v or the
// slots and writes the planes: that kernel may have produced k and v, or read the planes.
//
// write_kv_fp8: the same into float8 e4m3 planes, each value divided by its KV head's scale
// (k_scales, v_scales: float32 [num_kv_heads]) and rounded as float2_to_e4m3x2 says; one
// thread per 16-byte vector of the planes (16 values, two 16-byte vectors of k and of v).
#include "common.cuh"

namespace pagedrt {

template <typename T, int HEAD_DIM, int BLOCK_SIZE>
__global__ void write_kv(const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ k_cache,
                         T* __restrict__ v_cache, long long block_stride, const long long* __restrict__ slots,
                         long long num_tokens, int num_kv_heads) {
    constexpr int V = Vec16<T>::kElems, NV = HEAD_DIM / V;
    static_assert(HEAD_DIM % V == 0, "head_dim must be a whole number of 16-byte vectors");
    launch_dependents();
    grid_dependency_wait();
    const long long total = num_tokens * num_kv_heads * NV;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long row = i / NV;  // token * num_kv_heads + head
        const int vec = (int)(i % NV);
        const long long slot = slots[row / num_kv_heads];
        if (slot < 0) continue;
        const int head = (int)(row % num_kv_heads);
        const long long dst = slot_offset(slot, head, block_stride, BLOCK_SIZE, HEAD_DIM) + vec * V;
        const long long src = row * HEAD_DIM + vec * V;
        *reinterpret_cast<uint4*>(k_cache + dst) = *reinterpret_cast<const uint4*>(k + src);
        *reinterpret_cast<uint4*>(v_cache + dst) = *reinterpret_cast<const uint4*>(v + src);
    }
}

// 16 values of T (two 16-byte vectors, lo's first) divided by scale, as 16 e4m3 bytes.
template <typename T>
__device__ __forceinline__ uint4 quantise16(const uint4& lo16, const uint4& hi16, float scale) {
    float x[16];
    unpack<T>(lo16, x);
    unpack<T>(hi16, x + 8);
    unsigned w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned lo = float2_to_e4m3x2(__fdiv_rn(x[4 * i], scale), __fdiv_rn(x[4 * i + 1], scale));
        const unsigned hi = float2_to_e4m3x2(__fdiv_rn(x[4 * i + 2], scale), __fdiv_rn(x[4 * i + 3], scale));
        w[i] = lo | (hi << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

template <typename T, int HEAD_DIM, int BLOCK_SIZE>
__global__ void write_kv_fp8(const T* __restrict__ k, const T* __restrict__ v, e4m3* __restrict__ k_cache,
                             e4m3* __restrict__ v_cache, long long block_stride, const long long* __restrict__ slots,
                             long long num_tokens, int num_kv_heads, const float* __restrict__ k_scales,
                             const float* __restrict__ v_scales) {
    constexpr int NV = HEAD_DIM / 16;
    static_assert(HEAD_DIM % 16 == 0 && sizeof(T) == 2, "16 values of a 16-bit type make one stored vector");
    launch_dependents();
    grid_dependency_wait();
    const long long total = num_tokens * num_kv_heads * NV;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long row = i / NV;  // token * num_kv_heads + head
        const int vec = (int)(i % NV);
        const long long slot = slots[row / num_kv_heads];
        if (slot < 0) continue;
        const int head = (int)(row % num_kv_heads);
        const long long dst = slot_offset(slot, head, block_stride, BLOCK_SIZE, HEAD_DIM) + vec * 16;
        const long long src = row * HEAD_DIM + vec * 16;
        const uint4* k16 = reinterpret_cast<const uint4*>(k + src);
        const uint4* v16 = reinterpret_cast<const uint4*>(v + src);
        *reinterpret_cast<uint4*>(k_cache + dst) = quantise16<T>(k16[0], k16[1], __ldg(k_scales + head));
        *reinterpret_cast<uint4*>(v_cache + dst) = quantise16<T>(v16[0], v16[1], __ldg(v_scales + head));
    }
}

}  // namespace pagedrt
