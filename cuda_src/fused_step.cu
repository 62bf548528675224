// A whole decode step of a Llama-family model in one launch, for batches of at most ROWS sequences with one
// new token each (pagedrt/engine/fused.py launches it). At such batches every GEMM is a matrix-vector product
// and every other op is tiny: a launch per op leaves the GPU idle between launches, and one persistent
// kernel, its phases separated by grid-wide barriers, streams the weights back to back.
//
// The grid is cooperative (every block resident), one block an SM. Phases, each spread over the grid:
//   embed     residual[b] = embedding[ids[b]]
//   per layer:
//   qkv       x = rmsnorm(residual[b]) * attn_norm (every block normalises the rows itself, into shared memory);
//             W_qkv . x on tensor cores (Gemv below), each output rounded to T as the layered path's GEMM
//             output is; a pair of rows (2i, 2i+1) of a q or k head rotated by pos * inv_freq[i] (pos =
//             seq_lens[b] - 1, GGUF's adjacent pairs); q out, k and v straight into the layer's planes at slots[b]
//   attention work items (row b, KV head h, split s): split s of the row's tokens, for the h's G query heads,
//             an online softmax over tiles of TILE tokens in the log2 domain; partial o, m, l to `partial`,
//             and the last split of (b, h) to arrive merges them into attn[b] (counters[b * kv_heads + h])
//   o         residual[b] += round_T(W_o . attn[b])
//   gate_up   x = rmsnorm(residual[b]) * ffn_norm; mlp[b, j] = silu(round_T(gate_j . x)) * round_T(up_j . x)
//   down      residual[b] += round_T(W_down . mlp[b])
//   logits    x = rmsnorm(residual[b]) * output_norm; logits[b] = W_out . x (float32)
// Weights are [out, in] (one output's weights a contiguous row). Before each barrier a block loads its first
// chunk of the next phase's weights into registers (and prefetches the rest into L2), so the weights stream
// while the grid waits. NORM_PER: values of a row each thread holds while it normalises it (hidden <=
// NORM_PER * THREADS); ROWS: the batch rows shared memory holds.
//
// Memory that a phase writes and a later phase reads (residual, q, attn, mlp, partial) is read through L2
// (__ldcg): another SM wrote it inside this launch. The barrier counter and the merge counters
// (`counters`: [1 + rows * kv_heads] uint32) are zero at launch (the launcher clears them); a merge resets
// its counter for the next layer.
#include "common.cuh"

namespace pagedrt {
namespace fused {

constexpr int THREADS = 256, WARPS = THREADS / 32, TILE = 64;
constexpr int MAX_GROUP_DIMS = 2048;  // query heads a KV head x head_dim, at most
constexpr int MAX_SPLITS = 16;        // attention splits of a (row, KV head), at most
enum Weight { ATTN_NORM, QKV, O, FFN_NORM, GATE_UP, DOWN, K_PLANE, V_PLANE, PER_LAYER };

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

template <typename T> __device__ __forceinline__ float round_to(float x) { return to_float(from_float<T>(x)); }

// N (2 or 4) adjacent values of T at p (N * sizeof(T)-aligned), as floats, read through L2.
template <typename T, int N> __device__ __forceinline__ void load_values(const T* p, float (&out)[N]) {
    T v[N];
    if (N == 2) {
        *reinterpret_cast<unsigned*>(v) = __ldcg(reinterpret_cast<const unsigned*>(p));
    } else {
        *reinterpret_cast<uint2*>(v) = __ldcg(reinterpret_cast<const uint2*>(p));
    }
#pragma unroll
    for (int e = 0; e < N; ++e) out[e] = to_float(v[e]);
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Every block waits until every block of the grid arrived; what each wrote before is visible after.
__device__ __forceinline__ void grid_sync(unsigned* bar, unsigned& target) {
    __syncthreads();
    target += gridDim.x;
    if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(bar) : "memory");
        unsigned seen;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(bar) : "memory");
        } while ((int)(seen - target) < 0);
    }
    __syncthreads();
}

// A GEMV phase: out[row][b] = dot(W row, xs row b) for `rows` weight rows of k elements (k a multiple of 32),
// on tensor cores: a tile is 16 rows by the batch's 8 columns (rows past the batch are computed and ignored),
// mma.m16n8k16 over the k dimension. Block u % grid takes tile u; its warp w takes the k-steps (32 elements)
// w, w + 8, ...: lane (g = lane / 4, t = lane % 4) loads 16 bytes of rows g and g + 8 at k0 + 8t and the same
// 16 bytes of xs row g, which are the A and B fragments of two mmas once k is renumbered inside the step (the
// sum does not depend on the order). The warps' partial tiles are summed in shared memory in warp order.
// A warp holds STEPS k-steps a chunk and loads its next chunk while it computes this one; the first chunk is
// loaded before the barrier that opens the phase, so its weights arrive while the grid waits.
// Gate/up tiles (`split` = ffn) are 8 gate rows j.. and the 8 up rows ffn + j.., so one tile holds both.
struct Gemv {
    const void* w;
    int k, rows, split;
    __device__ int tiles() const { return split ? (split + 7) / 8 : (rows + 15) / 16; }
    // The weight row of tile u's row r (0..15), or -1 past the end.
    __device__ int row(int u, int r) const {
        if (split) {
            const int j = u * 8 + (r & 7);
            return j < split ? j + (r < 8 ? 0 : split) : -1;
        }
        const int i = u * 16 + r;
        return i < rows ? i : -1;
    }
};

constexpr int STEPS = 3, PAD = 8;

template <typename T>
struct Chunk {
    uint4 a[STEPS][2];

    // Chunk c of tile u: this warp's k-steps warp + 8 (c * STEPS + i) (zeros past k or the rows).
    __device__ __forceinline__ void load(const Gemv& g, int u, int c) {
        const T* base = reinterpret_cast<const T*>(g.w);
        const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, steps = g.k / 32;
        const int r0 = g.row(u, lane / 4), r1 = g.row(u, lane / 4 + 8);
#pragma unroll
        for (int i = 0; i < STEPS; ++i) {
            const int step = warp + WARPS * (c * STEPS + i), col = step * 32 + 8 * (lane % 4);
            const bool in = step < steps;
            a[i][0] = in && r0 >= 0 ? __ldg(reinterpret_cast<const uint4*>(base + (long long)r0 * g.k + col))
                                    : make_uint4(0u, 0u, 0u, 0u);
            a[i][1] = in && r1 >= 0 ? __ldg(reinterpret_cast<const uint4*>(base + (long long)r1 * g.k + col))
                                    : make_uint4(0u, 0u, 0u, 0u);
        }
    }

    // c += this chunk's part of the tile; xs: rows of `stride` elements, `batch` of them.
    __device__ __forceinline__ void mma(const T* xs, int stride, int k, int c, int batch, float (&acc)[4]) const {
        const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, steps = k / 32, n = lane / 4;
#pragma unroll
        for (int i = 0; i < STEPS; ++i) {
            const int step = warp + WARPS * (c * STEPS + i);
            if (step >= steps) break;
            const uint4 x = n < batch ? *reinterpret_cast<const uint4*>(xs + n * stride + step * 32 + 8 * (lane % 4))
                                      : make_uint4(0u, 0u, 0u, 0u);
            mma_16816<T>(acc, a[i][0].x, a[i][1].x, a[i][0].y, a[i][1].y, x.x, x.y);
            mma_16816<T>(acc, a[i][0].z, a[i][1].z, a[i][0].w, a[i][1].w, x.z, x.w);
        }
    }
};

// Load this block's first chunk of phase g (before the barrier that opens it).
template <typename T>
__device__ __forceinline__ void first_chunk(const Gemv& g, Chunk<T>& first) {
    if ((int)blockIdx.x < g.tiles()) first.load(g, blockIdx.x, 0);
}

// Prefetch into L2 the rows this block computes in phase g, from its (skip + 1)-th tile on.
template <typename T>
__device__ __forceinline__ void prefetch_tiles(const Gemv& g, int skip) {
    const int lines = (g.k * (int)sizeof(T) + 127) / 128;
    const T* base = reinterpret_cast<const T*>(g.w);
    for (int u = blockIdx.x + skip * gridDim.x; u < g.tiles(); u += gridDim.x)
        for (int i = threadIdx.x; i < 16 * lines; i += THREADS) {
            const int r = g.row(u, i / lines);
            if (r >= 0) prefetch_l2(reinterpret_cast<const char*>(base + (long long)r * g.k) + (i % lines) * 128);
        }
}

// Run phase g over xs (rows of `stride` elements): epilogue(u, out) once per tile, by the whole block, with
// out[r * 8 + b] the dot product of the tile's row r and xs row b (shared memory). `sums`: 8 x 128 floats of
// shared memory for the warps' tiles, then the tile's 128.
template <typename T, typename Epilogue>
__device__ __forceinline__ void gemv(const Gemv& g, Chunk<T>& cur, const T* xs, int stride, int batch, float* sums,
                                     Epilogue epilogue) {
    const int chunks = (g.k / 32 + WARPS * STEPS - 1) / (WARPS * STEPS), tiles = g.tiles();
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float* out = sums + WARPS * 128;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int u = blockIdx.x, c = 0; u < tiles;) {
        int next_u = u, next_c = c + 1;
        if (next_c == chunks) next_c = 0, next_u += gridDim.x;
        Chunk<T> next;
        if (next_u < tiles) next.load(g, next_u, next_c);
        cur.mma(xs, stride, g.k, c, batch, acc);
        if (c == chunks - 1) {
            // acc: rows lane / 4 and lane / 4 + 8, columns 2 (lane % 4) and + 1
            float* mine = sums + warp * 128;
            const int r = lane / 4, col = 2 * (lane % 4);
            mine[r * 8 + col] = acc[0], mine[r * 8 + col + 1] = acc[1];
            mine[(r + 8) * 8 + col] = acc[2], mine[(r + 8) * 8 + col + 1] = acc[3];
            __syncthreads();
            if (threadIdx.x < 128) {
                float total = 0.0f;
#pragma unroll
                for (int w = 0; w < WARPS; ++w) total += sums[w * 128 + threadIdx.x];
                out[threadIdx.x] = total;
            }
            __syncthreads();
            epilogue(u, out);
            acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;
        }
        cur = next;
        u = next_u, c = next_c;
    }
}

// xs[b] = residual[b] / sqrt(mean(residual[b]^2) + eps) * weight, as T, for every row b < batch (xs rows
// hidden + PAD apart: the padding spreads a GEMV's reads of 8 rows over the banks).
// PER: values a thread holds of a row (hidden <= PER * THREADS).
template <typename T, int ROWS, int PER>
__device__ void load_normed(const float* residual, const float* __restrict__ weight, T* xs, float* reduce,
                            int batch, int hidden, float eps) {
    float x[ROWS][PER], sum[ROWS];
#pragma unroll
    for (int b = 0; b < ROWS; ++b)
#pragma unroll
        for (int v = 0; v < PER; ++v) {
            const int j = threadIdx.x + v * THREADS;
            x[b][v] = b < batch && j < hidden ? __ldcg(residual + b * hidden + j) : 0.0f;
        }
#pragma unroll
    for (int b = 0; b < ROWS; ++b) {
        sum[b] = 0.0f;
#pragma unroll
        for (int v = 0; v < PER; ++v) sum[b] = fmaf(x[b][v], x[b][v], sum[b]);
        sum[b] = warp_sum(sum[b]);
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0)
#pragma unroll
        for (int b = 0; b < ROWS; ++b) reduce[warp * ROWS + b] = sum[b];
    __syncthreads();
#pragma unroll
    for (int b = 0; b < ROWS; ++b) {
        if (b >= batch) break;
        float total = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) total += reduce[w * ROWS + b];
        const float scale = rsqrtf(total / hidden + eps);
#pragma unroll
        for (int v = 0; v < PER; ++v) {
            const int j = threadIdx.x + v * THREADS;
            if (j < hidden) xs[b * (hidden + PAD) + j] = from_float<T>(x[b][v] * scale * weight[j]);
        }
    }
    __syncthreads();
}

// xs[b] = src[b] (k values of T a row, xs rows k + PAD apart) for every row b < batch.
template <typename T>
__device__ void load_rows(const T* src, T* xs, int batch, int k) {
    const int per_row = k / 8;
    for (int i = threadIdx.x; i < batch * per_row; i += THREADS)
        *reinterpret_cast<uint4*>(xs + (i / per_row) * (k + PAD) + (i % per_row) * 8) =
            __ldcg(reinterpret_cast<const uint4*>(src) + i);
    __syncthreads();
}

struct Step {
    const unsigned long long* layers;
    const long long* ids;
    const int* tables;
    long long table_stride;
    const int* seq_lens;
    const long long* slots;
    long long block_stride;
    int block_size, batch, hidden, ffn, q_heads, kv_heads, splits;
};

// The K/V rows of attention item `item` (row, KV head, split) into L2: issued before the barrier that opens
// the attention phase (the newest token's row is being written then; it is the one row read cold).
template <typename T, int HEAD_DIM>
__device__ void prefetch_item(const Step& s, const T* k_plane, const T* v_plane, int item) {
    const int split = item % s.splits, h = (item / s.splits) % s.kv_heads, b = item / (s.splits * s.kv_heads);
    const int len = s.seq_lens[b], chunk = (len + s.splits - 1) / s.splits;
    const int start = split * chunk, end = min(len, start + chunk);
    const int* table = s.tables + b * s.table_stride;
    for (int t = start + threadIdx.x; t < end; t += THREADS) {
        const long long row = (long long)table[t / s.block_size] * s.block_stride +
                              ((long long)h * s.block_size + t % s.block_size) * HEAD_DIM;
        for (int line = 0; line < HEAD_DIM * (int)sizeof(T); line += 128) {
            prefetch_l2(reinterpret_cast<const char*>(k_plane + row) + line);
            prefetch_l2(reinterpret_cast<const char*>(v_plane + row) + line);
        }
    }
}

// One (row, KV head, split) of the attention phase; the last split of (row, KV head) to finish merges.
// A tile's K and V are requested together at its start. Scores: 4 threads a token (K read once, every query
// head of the group from shared memory). P . V: warp w takes the tile's tokens [w * TILE / WARPS, (w + 1) *
// TILE / WARPS), its lanes a V row's dims, and keeps every head's output for its tokens in registers; the
// warps' sums meet in shared memory in warp order (the same sum every run).
template <typename T, int HEAD_DIM>
__device__ void attend(const Step& s, const T* k_plane, const T* v_plane, const T* q, T* attn, float* partial,
                       unsigned* counters, int item, float scale_log2, float* smem) {
    constexpr int PART = HEAD_DIM / 4, LANE_DIMS = HEAD_DIM / 32, MAX_GROUP = MAX_GROUP_DIMS / HEAD_DIM;
    constexpr int PER_WARP = TILE / WARPS;
    const int group = s.q_heads / s.kv_heads, split = item % s.splits, h = (item / s.splits) % s.kv_heads;
    const int b = item / (s.splits * s.kv_heads), len = s.seq_lens[b];
    const int chunk = (len + s.splits - 1) / s.splits, start = split * chunk, end = min(len, start + chunk);
    float* qs = smem;                                   // [group][HEAD_DIM]
    float* out = qs + group * HEAD_DIM;                 // [group][HEAD_DIM]: the warps' sums
    float* scores = out + group * HEAD_DIM;             // [group][TILE]
    float* m = scores + group * TILE;                   // [group]
    float* l = m + group;                               // [group]
    float* alpha = l + group;                           // [group]
    __shared__ int last;
    const int head0 = b * s.q_heads + h * group, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float o[MAX_GROUP][LANE_DIMS];
#pragma unroll
    for (int g = 0; g < MAX_GROUP; ++g)
#pragma unroll
        for (int e = 0; e < LANE_DIMS; ++e) o[g][e] = 0.0f;
    const int* table = s.tables + b * s.table_stride;
    auto token_row = [&](int t) {
        return (long long)table[t / s.block_size] * s.block_stride +
               ((long long)h * s.block_size + t % s.block_size) * HEAD_DIM;
    };
    for (int tile = start; tile < end; tile += TILE) {
        const int n = min(TILE, end - tile), j = threadIdx.x / 4, part = threadIdx.x % 4;
        const bool valid = j < n;
        uint4 kraw[PART / 8];
        if (valid) {
            const long long row = token_row(tile + j);
#pragma unroll
            for (int v = 0; v < PART / 8; ++v)
                kraw[v] = __ldcg(reinterpret_cast<const uint4*>(k_plane + row + part * PART) + v);
        }
        float v[PER_WARP][LANE_DIMS];
#pragma unroll
        for (int t = 0; t < PER_WARP; ++t) {
            const int jj = warp * PER_WARP + t;
            if (jj < n) {
                load_values<T, LANE_DIMS>(v_plane + token_row(tile + jj) + lane * LANE_DIMS, v[t]);
            } else {
#pragma unroll
                for (int e = 0; e < LANE_DIMS; ++e) v[t][e] = 0.0f;
            }
        }
        if (tile == start) {  // q and the running state, while the first tile's K and V are on their way
            for (int i = threadIdx.x; i < group * HEAD_DIM; i += THREADS) {
                qs[i] = to_float(__ldcg(q + (long long)head0 * HEAD_DIM + i)) * scale_log2;
                out[i] = 0.0f;
            }
            if (threadIdx.x < group) m[threadIdx.x] = neg_inf(), l[threadIdx.x] = 0.0f;
            __syncthreads();
        }
        float kf[PART];
#pragma unroll
        for (int vv = 0; vv < PART / 8; ++vv) unpack<T>(kraw[vv], kf + 8 * vv);
        for (int g = 0; g < group; ++g) {
            float d = 0.0f;
            if (valid)
#pragma unroll
                for (int e = 0; e < PART; ++e) d = fmaf(kf[e], qs[g * HEAD_DIM + part * PART + e], d);
            d += __shfl_xor_sync(0xffffffffu, d, 1);
            d += __shfl_xor_sync(0xffffffffu, d, 2);
            if (part == 0) scores[g * TILE + j] = valid ? d : neg_inf();
        }
        __syncthreads();
        for (int g = warp; g < group; g += WARPS) {
            const float s0 = scores[g * TILE + lane], s1 = scores[g * TILE + lane + 32];
            const float m_old = m[g], m_new = fmaxf(m_old, warp_max(fmaxf(s0, s1)));
            const float p0 = exp2f(s0 - m_new), p1 = exp2f(s1 - m_new);
            scores[g * TILE + lane] = p0;
            scores[g * TILE + lane + 32] = p1;
            const float sum = warp_sum(p0 + p1);
            if (lane == 0) {
                const float a = exp2f(m_old - m_new);
                alpha[g] = a;
                l[g] = l[g] * a + sum;
                m[g] = m_new;
            }
        }
        __syncthreads();
#pragma unroll
        for (int g = 0; g < MAX_GROUP; ++g) {
            if (g >= group) break;
            const float a = alpha[g];
#pragma unroll
            for (int e = 0; e < LANE_DIMS; ++e) {
                float acc = o[g][e] * a;
#pragma unroll
                for (int t = 0; t < PER_WARP; ++t) acc = fmaf(scores[g * TILE + warp * PER_WARP + t], v[t][e], acc);
                o[g][e] = acc;
            }
        }
        __syncthreads();
    }
    if (start >= end) {  // an empty split: its partial is o = 0, m = -inf, l = 0
        for (int i = threadIdx.x; i < group * HEAD_DIM; i += THREADS) out[i] = 0.0f;
        if (threadIdx.x < group) m[threadIdx.x] = neg_inf(), l[threadIdx.x] = 0.0f;
    }
    for (int w = 0; w < WARPS; ++w) {
        if (warp == w && start < end)
#pragma unroll
            for (int g = 0; g < MAX_GROUP; ++g) {
                if (g >= group) break;
#pragma unroll
                for (int e = 0; e < LANE_DIMS; ++e) out[g * HEAD_DIM + lane * LANE_DIMS + e] += o[g][e];
            }
        __syncthreads();
    }
    // This split's unnormalised output, max and sum: partial[(head, split)] = o[HEAD_DIM], m, l.
    const int stride = HEAD_DIM + 2;
    for (int i = threadIdx.x; i < group * HEAD_DIM; i += THREADS)
        partial[((long long)(head0 + i / HEAD_DIM) * s.splits + split) * stride + i % HEAD_DIM] = out[i];
    if (threadIdx.x < group) {
        float* dst = partial + ((long long)(head0 + threadIdx.x) * s.splits + split) * stride;
        dst[HEAD_DIM] = m[threadIdx.x];
        dst[HEAD_DIM + 1] = l[threadIdx.x];
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counters + b * s.kv_heads + h, 1u) == (unsigned)s.splits - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int i = threadIdx.x; i < group * HEAD_DIM; i += THREADS) {
        const float* src = partial + (long long)(head0 + i / HEAD_DIM) * s.splits * stride;
        float ms[MAX_SPLITS], ls[MAX_SPLITS], os[MAX_SPLITS], top = neg_inf();
#pragma unroll
        for (int k = 0; k < MAX_SPLITS; ++k) {
            const bool here = k < s.splits;
            ms[k] = here ? __ldcg(src + k * stride + HEAD_DIM) : neg_inf();
            ls[k] = here ? __ldcg(src + k * stride + HEAD_DIM + 1) : 0.0f;
            os[k] = here ? __ldcg(src + k * stride + i % HEAD_DIM) : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < MAX_SPLITS; ++k) top = fmaxf(top, ms[k]);
        float sum = 0.0f, x = 0.0f;
#pragma unroll
        for (int k = 0; k < MAX_SPLITS; ++k) {
            const float w = exp2f(ms[k] - top);
            sum = fmaf(ls[k], w, sum);
            x = fmaf(os[k], w, x);
        }
        attn[(long long)head0 * HEAD_DIM + i] = from_float<T>(x / sum);
    }
    if (threadIdx.x == 0) counters[b * s.kv_heads + h] = 0;
    __syncthreads();
}

}  // namespace fused

template <typename T, int HEAD_DIM, int ROWS, int NORM_PER>
__global__ void __launch_bounds__(fused::THREADS, 1) decode_step(
    const unsigned long long* __restrict__ layers, int num_layers, const T* __restrict__ embedding,
    const float* __restrict__ output_norm, const T* __restrict__ output, int vocab, const float* __restrict__ inv_freq,
    const long long* __restrict__ ids, const int* __restrict__ tables, long long table_stride,
    const int* __restrict__ seq_lens, const long long* __restrict__ slots, long long block_stride, int block_size,
    float* residual, T* q, T* attn, T* mlp, float* partial, unsigned* counters, float* logits, int batch, int hidden,
    int ffn, int q_heads, int kv_heads, int splits, float eps, float scale_log2) {
    using namespace fused;
    extern __shared__ uint4 smem_raw[];
    float* reduce = reinterpret_cast<float*>(smem_raw);  // load_normed's partial sums
    float* sums = reduce + WARPS * ROWS;                 // the GEMV's warp tiles and the block's tile
    T* xs = reinterpret_cast<T*>(sums + (WARPS + 1) * 128);
    const Step s{layers, ids, tables, table_stride, seq_lens, slots, block_stride, block_size, batch, hidden, ffn,
                 q_heads, kv_heads, splits};
    unsigned* bar = counters;
    unsigned* merges = counters + 1;
    unsigned target = 0;
    const int qkv_rows = (q_heads + 2 * kv_heads) * HEAD_DIM, attn_width = q_heads * HEAD_DIM;
    const int tid = threadIdx.x;
    auto qkv_phase = [&](int layer) { return Gemv{(const void*)layers[layer * PER_LAYER + QKV], hidden, qkv_rows, 0}; };
    Chunk<T> cur;

    for (int i = blockIdx.x * THREADS + tid; i < batch * hidden; i += gridDim.x * THREADS)
        residual[i] = to_float(embedding[ids[i / hidden] * hidden + i % hidden]);
    first_chunk(qkv_phase(0), cur);
    grid_sync(bar, target);

    for (int layer = 0; layer < num_layers; ++layer) {
        const unsigned long long* w = layers + layer * PER_LAYER;
        T* k_plane = reinterpret_cast<T*>(w[K_PLANE]);
        T* v_plane = reinterpret_cast<T*>(w[V_PLANE]);
        const Gemv o_phase{(const void*)w[O], attn_width, hidden, 0};
        const Gemv gate_up_phase{(const void*)w[GATE_UP], hidden, 2 * ffn, ffn};
        const Gemv down_phase{(const void*)w[DOWN], ffn, hidden, 0};

        // qkv: norm; a thread a (pair of rows, batch row): rotary embeddings, q out and k, v into the planes.
        load_normed<T, ROWS, NORM_PER>(residual, reinterpret_cast<const float*>(w[ATTN_NORM]), xs, reduce, batch,
                                       hidden, eps);
        gemv(qkv_phase(layer), cur, xs, hidden + PAD, batch, sums, [&](int u, const float* out) {
            const int pair = tid / 8, b = tid % 8, col = u * 16 + 2 * pair;
            if (tid >= 64 || b >= batch || col >= qkv_rows) return;
            const int head = col / HEAD_DIM, i = (col % HEAD_DIM) / 2;
            float x0 = round_to<T>(out[2 * pair * 8 + b]), x1 = round_to<T>(out[(2 * pair + 1) * 8 + b]);
            if (head < q_heads + kv_heads) {
                float sn, cs;
                sincosf((float)(seq_lens[b] - 1) * inv_freq[i], &sn, &cs);
                const float y0 = x0 * cs - x1 * sn, y1 = x0 * sn + x1 * cs;
                x0 = y0, x1 = y1;
            }
            T* dst;
            if (head < q_heads) {
                dst = q + ((long long)b * q_heads + head) * HEAD_DIM;
            } else {
                const long long slot = slots[b];
                if (slot < 0) return;
                const bool is_k = head < q_heads + kv_heads;
                const int kh = head - q_heads - (is_k ? 0 : kv_heads);
                dst = (is_k ? k_plane : v_plane) + (slot / block_size) * block_stride +
                      ((long long)kh * block_size + slot % block_size) * HEAD_DIM;
            }
            dst[2 * i] = from_float<T>(x0);
            dst[2 * i + 1] = from_float<T>(x1);
        });
        for (int item = blockIdx.x; item < batch * kv_heads * splits; item += gridDim.x)
            prefetch_item<T, HEAD_DIM>(s, k_plane, v_plane, item);
        grid_sync(bar, target);

        // attention
        for (int item = blockIdx.x; item < batch * kv_heads * splits; item += gridDim.x)
            attend<T, HEAD_DIM>(s, k_plane, v_plane, q, attn, partial, merges, item, scale_log2,
                                reinterpret_cast<float*>(smem_raw));
        first_chunk(o_phase, cur);
        grid_sync(bar, target);

        // o: residual += W_o . attn (one add to each element in the phase: the same sum every run)
        auto add_to_residual = [&](int u, const float* out) {
            const int r = tid / 8, b = tid % 8, col = u * 16 + r;
            if (tid < 128 && b < batch && col < hidden)
                atomicAdd(residual + (long long)b * hidden + col, round_to<T>(out[r * 8 + b]));
        };
        load_rows<T>(attn, xs, batch, attn_width);
        gemv(o_phase, cur, xs, attn_width + PAD, batch, sums, add_to_residual);
        first_chunk(gate_up_phase, cur);
        prefetch_tiles<T>(gate_up_phase, 1);
        grid_sync(bar, target);

        // gate_up: norm, SiLU(gate) * up
        load_normed<T, ROWS, NORM_PER>(residual, reinterpret_cast<const float*>(w[FFN_NORM]), xs, reduce, batch,
                                       hidden, eps);
        gemv(gate_up_phase, cur, xs, hidden + PAD, batch, sums, [&](int u, const float* out) {
            const int j = tid / 8, b = tid % 8, col = u * 8 + j;
            if (tid >= 64 || b >= batch || col >= ffn) return;
            const float g = round_to<T>(out[j * 8 + b]), up = round_to<T>(out[(j + 8) * 8 + b]);
            mlp[(long long)b * ffn + col] = from_float<T>(g / (1.0f + __expf(-g)) * up);
        });
        first_chunk(down_phase, cur);
        grid_sync(bar, target);

        // down: residual += W_down . mlp
        load_rows<T>(mlp, xs, batch, ffn);
        gemv(down_phase, cur, xs, ffn + PAD, batch, sums, add_to_residual);
        const Gemv logits_phase{(const void*)output, hidden, vocab, 0};
        if (layer + 1 < num_layers) {
            first_chunk(qkv_phase(layer + 1), cur);
        } else {
            first_chunk(logits_phase, cur);
            prefetch_tiles<T>(logits_phase, 1);
        }
        grid_sync(bar, target);
    }

    // logits = W_out . norm(residual), float32
    load_normed<T, ROWS, NORM_PER>(residual, output_norm, xs, reduce, batch, hidden, eps);
    gemv(Gemv{(const void*)output, hidden, vocab, 0}, cur, xs, hidden + PAD, batch, sums,
         [&](int u, const float* out) {
             const int r = tid / 8, b = tid % 8, row = u * 16 + r;
             if (tid < 128 && b < batch && row < vocab) logits[(long long)b * vocab + row] = out[r * 8 + b];
         });
}

}  // namespace pagedrt
