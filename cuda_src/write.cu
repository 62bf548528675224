// Write K/V of new tokens into their cache slots (prompt or decode step alike).
//
// k, v:      [num_tokens, num_kv_heads, HEAD_DIM], contiguous
// k_cache, v_cache: planes; slot = block*BLOCK_SIZE + slot_in_block goes to
//            block*block_stride + (h*BLOCK_SIZE + slot_in_block)*HEAD_DIM
// slots:     [num_tokens] int64; a negative slot is padding and is skipped.
// One thread per 16-byte vector of a (token, head) row, grid-stride.
#include "common.cuh"

namespace pagedrt {

template <typename T, int HEAD_DIM, int BLOCK_SIZE>
__global__ void write_kv(const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ k_cache,
                         T* __restrict__ v_cache, long long block_stride, const long long* __restrict__ slots,
                         long long num_tokens, int num_kv_heads) {
    constexpr int V = Vec16<T>::kElems, NV = HEAD_DIM / V;
    static_assert(HEAD_DIM % V == 0, "head_dim must be a whole number of 16-byte vectors");
    const long long total = num_tokens * num_kv_heads * NV;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long row = i / NV;  // token * num_kv_heads + head
        const int vec = (int)(i % NV);
        const long long slot = slots[row / num_kv_heads];
        if (slot < 0) continue;
        const int head = (int)(row % num_kv_heads);
        const long long dst = (slot / BLOCK_SIZE) * block_stride +
                              ((long long)head * BLOCK_SIZE + slot % BLOCK_SIZE) * HEAD_DIM + vec * V;
        const long long src = row * HEAD_DIM + vec * V;
        *reinterpret_cast<uint4*>(k_cache + dst) = *reinterpret_cast<const uint4*>(k + src);
        *reinterpret_cast<uint4*>(v_cache + dst) = *reinterpret_cast<const uint4*>(v + src);
    }
}

}  // namespace pagedrt
