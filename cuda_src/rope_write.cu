// Rotary embeddings fused with the K/V write: one launch a layer, and no k and v buffers between the two.
//
// qkv:       [num_tokens, (q_heads + 2 kv_heads) * HEAD_DIM], contiguous: q's heads, k's, then v's.
// q:         [num_tokens, q_heads, HEAD_DIM], contiguous: q rotated (what attention reads).
// k_cache, v_cache: planes of P, as write.cu addresses them: slot = block*BLOCK_SIZE + slot_in_block goes to
//            block*block_stride + (h*BLOCK_SIZE + slot_in_block)*HEAD_DIM; k rotated, v as it is.
// slots:     [num_tokens] int64; a negative slot is padding: its k and v are skipped (its q is written).
// Token t of batch row b (qo_indptr[b] <= t < qo_indptr[b + 1]) sits at position seq_lens[b] - (qo_indptr[b + 1]
// - t); q's and k's pairs (x[2i], x[2i+1]) (GGUF's Llama layout) turn by pos * inv_freq[i] in float (sincosf
// of the float32 product), rounded to T. P = e4m3: k, so rounded, and v then go through write_kv_fp8's
// quantise16 (divided by the KV head's scale, k_scales and v_scales float32 [kv_heads]): the planes hold the
// bytes that rotating into a k buffer of T and write_kv_fp8 would store.
//
// Grid (num_tokens, chunks): a thread block takes THREADS of one token's vectors, a thread one 16-byte vector of
// what it stores (FP8: 16 values, so 16 bytes of the planes and two vectors of q); the block's threads first put
// (cos, sin) of the token's HEAD_DIM / 2 angles in shared memory, which every head then reads.
//
// PDL (pagedrt/kernels/launch.py): the kernel waits for the kernel before it before it reads anything, and does
// not let its dependents start early: the attention after it reads q before its own wait.
#include "write.cu"

namespace pagedrt {

// The position of token t in its sequence: its batch row is the last one whose first token is at or before t.
__device__ __forceinline__ int token_position(int t, const int* __restrict__ qo_indptr,
                                              const int* __restrict__ seq_lens, int batch) {
    int lo = 0, hi = batch - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (qo_indptr[mid] <= t) lo = mid; else hi = mid - 1;
    }
    return seq_lens[lo] - (qo_indptr[lo + 1] - t);
}

// Turn the N 16-byte vectors of T in w, pair i by angle[i] = (cos, sin), rounding back to T.
template <typename T, int N>
__device__ __forceinline__ void rotate(uint4 (&w)[N], const float2* angle) {
    constexpr int V = Vec16<T>::kElems;
#pragma unroll
    for (int j = 0; j < N; ++j) {
        float x[V];
        unpack<T>(w[j], x);
#pragma unroll
        for (int i = 0; i < V / 2; ++i) {
            const float2 a = angle[j * V / 2 + i];
            rotate_pair(x[2 * i], x[2 * i + 1], a.x, a.y);
        }
        w[j] = pack16<T>(x);
    }
}

template <typename T, typename P, int HEAD_DIM, int BLOCK_SIZE, int THREADS>
__global__ void __launch_bounds__(THREADS)
rope_write(const T* __restrict__ qkv, T* __restrict__ q, P* __restrict__ k_cache, P* __restrict__ v_cache,
           long long block_stride, const long long* __restrict__ slots, const int* __restrict__ qo_indptr,
           const int* __restrict__ seq_lens, int batch, const float* __restrict__ inv_freq, int q_heads,
           int kv_heads, const float* __restrict__ k_scales, const float* __restrict__ v_scales) {
    constexpr bool FP8 = same_type<P, e4m3>::value;
    constexpr int V = Vec16<T>::kElems, C = FP8 ? 16 : V, N = C / V;  // values a thread stores; vectors of T
    static_assert(HEAD_DIM % C == 0 && HEAD_DIM / 2 <= THREADS, "a thread stores whole vectors of one head");
    static_assert(same_type<P, T>::value || (FP8 && sizeof(T) == 2), "planes of T, or e4m3 under a 16-bit T");
    __shared__ float2 angle[HEAD_DIM / 2];
    grid_dependency_wait();
    const int t = blockIdx.x;
    if (threadIdx.x < HEAD_DIM / 2) {
        const float pos = (float)token_position(t, qo_indptr, seq_lens, batch);
        float s, c;
        sincosf(pos * inv_freq[threadIdx.x], &s, &c);
        angle[threadIdx.x] = make_float2(c, s);
    }
    __syncthreads();
    const int heads = q_heads + 2 * kv_heads, item = blockIdx.y * THREADS + threadIdx.x;
    if (item >= heads * (HEAD_DIM / C)) return;
    const int head = item / (HEAD_DIM / C), col = item % (HEAD_DIM / C) * C;
    const uint4* src = reinterpret_cast<const uint4*>(qkv + ((long long)t * heads + head) * HEAD_DIM + col);
    uint4 w[N];
#pragma unroll
    for (int j = 0; j < N; ++j) w[j] = __ldg(src + j);
    if (head < q_heads + kv_heads) rotate<T>(w, angle + col / 2);
    if (head < q_heads) {
        uint4* dst = reinterpret_cast<uint4*>(q + ((long long)t * q_heads + head) * HEAD_DIM + col);
#pragma unroll
        for (int j = 0; j < N; ++j) dst[j] = w[j];
        return;
    }
    const long long slot = slots[t];
    if (slot < 0) return;
    const bool is_k = head < q_heads + kv_heads;
    const int kv = head - q_heads - (is_k ? 0 : kv_heads);
    const long long dst = slot_offset(slot, kv, block_stride, BLOCK_SIZE, HEAD_DIM) + col;
    P* plane = is_k ? k_cache : v_cache;
    if constexpr (FP8) {
        *reinterpret_cast<uint4*>(plane + dst) =
            quantise16<T>(w[0], w[1], __ldg((is_k ? k_scales : v_scales) + kv));
    } else {
        *reinterpret_cast<uint4*>(plane + dst) = w[0];
    }
}

}  // namespace pagedrt
