// A whole decode step of a Llama-family model in one launch, for batches of at most ROWS sequences with one
// new token each (pagedrt/engine/fused.py launches it). At such batches every GEMM is a matrix-vector product
// and every other op is tiny: a launch per op leaves the GPU idle between launches, and one persistent
// kernel, its phases separated by grid-wide barriers, streams the weights back to back.
//
// The grid is cooperative (every block resident). Phases, each spread over all warps of the grid:
//   embed     residual[b] = embedding[ids[b]]
//   per layer:
//   qkv       x = rmsnorm(residual[b]) * attn_norm (every block normalises the rows itself, into shared memory);
//             a warp computes a pair of adjacent output rows (2i, 2i+1) of W_qkv . x, rounds them to T as the
//             layered path's GEMM output is, rotates q and k heads by pos * inv_freq[i] (pos = seq_lens[b] - 1,
//             GGUF's adjacent pairs), writes q, and k and v straight into the layer's planes at slots[b]
//   attention work items (row b, KV head h, split s): split s of the row's tokens, for the h's G query heads,
//             an online softmax over tiles of TILE tokens in the log2 domain; partial o, m, l to `partial`,
//             and the last split of (b, h) to arrive merges them into attn[b] (counters[b * kv_heads + h])
//   o         residual[b] += round_T(W_o . attn[b])
//   gate_up   x = rmsnorm(residual[b]) * ffn_norm; mlp[b, j] = silu(round_T(gate_j . x)) * round_T(up_j . x)
//   down      residual[b] += round_T(W_down . mlp[b])
//   logits    x = rmsnorm(residual[b]) * output_norm; logits[b] = W_out . x (float32)
// Weights are [out, in] (one output's weights a contiguous row of 16-byte vectors); before each barrier a
// warp prefetches into L2 the rows it computes after it, so the weights stream while the grid waits.
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
constexpr int VPL = 6;  // a GEMV chunk's 16-byte vectors a lane where a phase's width is not the hidden size
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

// A GEMV phase: `count` units of NR weight rows each, unit u's rows at w + (u * unit_rows + r * step) * k
// (k elements of T, a multiple of 8). Warp g of the grid takes units g, g + warps, ...; a unit's row is read
// in chunks of CHUNK elements, VPL 16-byte vectors a lane, and the warp loads its next chunk while it
// computes this one: the first chunk is loaded before the barrier that opens the phase (`first`), so its
// weights arrive while the grid waits.
struct Gemv {
    const void* w;
    long long unit_rows, step;
    int k, count;
};

template <typename T, int NR, int V>
struct Chunk {
    static constexpr int CHUNK = V * 32 * 8;  // elements of a row a chunk
    uint4 w[NR][V];

    // Chunk c of unit u (zeros past the row's end).
    __device__ __forceinline__ void load(const Gemv& g, int u, int c) {
        const T* base = reinterpret_cast<const T*>(g.w);
        const int lane = threadIdx.x % 32, vectors = g.k / 8;
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            const uint4* row = reinterpret_cast<const uint4*>(base + (u * g.unit_rows + r * g.step) * g.k);
#pragma unroll
            for (int v = 0; v < V; ++v) {
                const int i = c * (CHUNK / 8) + v * 32 + lane;
                w[r][v] = i < vectors ? __ldg(row + i) : make_uint4(0u, 0u, 0u, 0u);
            }
        }
    }

    // acc[r][b] += this chunk's part of dot(row r, xs row b).
    template <int ROWS>
    __device__ __forceinline__ void dot(const T* xs, int k, int c, int batch, float (&acc)[NR][ROWS]) const {
        const int lane = threadIdx.x % 32, vectors = k / 8;
#pragma unroll
        for (int v = 0; v < V; ++v) {
            const int i = c * (CHUNK / 8) + v * 32 + lane;
            if (i >= vectors) break;
            float wf[NR][8];
#pragma unroll
            for (int r = 0; r < NR; ++r) unpack<T>(w[r][v], wf[r]);
#pragma unroll
            for (int b = 0; b < ROWS; ++b) {
                if (b >= batch) break;
                float xf[8];
                unpack<T>(reinterpret_cast<const uint4*>(xs + b * k)[i], xf);
#pragma unroll
                for (int r = 0; r < NR; ++r)
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[r][b] = fmaf(wf[r][e], xf[e], acc[r][b]);
            }
        }
    }
};

__device__ __forceinline__ int grid_warp() { return blockIdx.x * WARPS + threadIdx.x / 32; }

// Load this warp's first chunk of phase g (before the barrier that opens it).
template <typename T, int NR, int V>
__device__ __forceinline__ void first_chunk(const Gemv& g, Chunk<T, NR, V>& first) {
    if (grid_warp() < g.count) first.load(g, grid_warp(), 0);
}

// Prefetch into L2 the rows this warp takes in phase g, from its (skip + 1)-th unit on.
template <typename T, int NR>
__device__ __forceinline__ void prefetch_units(const Gemv& g, int skip) {
    const int warps = gridDim.x * WARPS, lines = (g.k * (int)sizeof(T) + 127) / 128, lane = threadIdx.x % 32;
    const T* base = reinterpret_cast<const T*>(g.w);
    for (int u = grid_warp() + skip * warps; u < g.count; u += warps)
#pragma unroll
        for (int r = 0; r < NR; ++r)
            for (int line = lane; line < lines; line += 32)
                prefetch_l2(reinterpret_cast<const char*>(base + (u * g.unit_rows + r * g.step) * g.k) + line * 128);
}

// Run phase g over xs (ROWS rows of g.k values of T in shared memory): epilogue(u, acc) once per unit, with
// acc[r][b] the whole dot product of the unit's row r and xs row b in every lane.
template <typename T, int ROWS, int NR, int V, typename Epilogue>
__device__ __forceinline__ void gemv(const Gemv& g, Chunk<T, NR, V>& cur, const T* xs, int batch, Epilogue epilogue) {
    const int warps = gridDim.x * WARPS, chunks = (g.k + Chunk<T, NR, V>::CHUNK - 1) / Chunk<T, NR, V>::CHUNK;
    float acc[NR][ROWS];
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
        for (int b = 0; b < ROWS; ++b) acc[r][b] = 0.0f;
    for (int u = grid_warp(), c = 0; u < g.count;) {
        int next_u = u, next_c = c + 1;
        if (next_c == chunks) next_c = 0, next_u += warps;
        Chunk<T, NR, V> next;
        if (next_u < g.count) next.load(g, next_u, next_c);
        cur.template dot<ROWS>(xs, g.k, c, batch, acc);
        if (c == chunks - 1) {
#pragma unroll
            for (int r = 0; r < NR; ++r)
#pragma unroll
                for (int b = 0; b < ROWS; ++b) acc[r][b] = warp_sum(acc[r][b]);
            epilogue(u, acc);
#pragma unroll
            for (int r = 0; r < NR; ++r)
#pragma unroll
                for (int b = 0; b < ROWS; ++b) acc[r][b] = 0.0f;
        }
        cur = next;
        u = next_u, c = next_c;
    }
}

// xs[b] = residual[b] / sqrt(mean(residual[b]^2) + eps) * weight, as T, for every row b < batch.
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
            if (j < hidden) xs[b * hidden + j] = from_float<T>(x[b][v] * scale * weight[j]);
        }
    }
    __syncthreads();
}

// xs[b] = src[b] (k values of T a row) for every row b < batch.
template <typename T>
__device__ void load_rows(const T* src, T* xs, int batch, int k) {
    const int vectors = batch * k / 8;
    for (int i = threadIdx.x; i < vectors; i += THREADS)
        reinterpret_cast<uint4*>(xs)[i] = __ldcg(reinterpret_cast<const uint4*>(src) + i);
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

template <typename T, int HEAD_DIM, int ROWS, int VH>
__global__ void __launch_bounds__(fused::THREADS, 1) decode_step(
    const unsigned long long* __restrict__ layers, int num_layers, const T* __restrict__ embedding,
    const float* __restrict__ output_norm, const T* __restrict__ output, int vocab, const float* __restrict__ inv_freq,
    const long long* __restrict__ ids, const int* __restrict__ tables, long long table_stride,
    const int* __restrict__ seq_lens, const long long* __restrict__ slots, long long block_stride, int block_size,
    float* residual, T* q, T* attn, T* mlp, float* partial, unsigned* counters, float* logits, int batch, int hidden,
    int ffn, int q_heads, int kv_heads, int splits, float eps, float scale_log2) {
    using namespace fused;
    extern __shared__ uint4 smem_raw[];
    float* reduce = reinterpret_cast<float*>(smem_raw);  // load_normed's partial sums; xs follows
    T* xs = reinterpret_cast<T*>(reduce + WARPS * ROWS);
    const Step s{layers, ids, tables, table_stride, seq_lens, slots, block_stride, block_size, batch, hidden, ffn,
                 q_heads, kv_heads, splits};
    unsigned* bar = counters;
    unsigned* merges = counters + 1;
    unsigned target = 0;
    const int qkv_rows = (q_heads + 2 * kv_heads) * HEAD_DIM, attn_width = q_heads * HEAD_DIM;
    const int lane = threadIdx.x % 32;
    constexpr int LOGIT_ROWS = VH <= 3 ? 4 : 2;
    auto qkv_phase = [&](int layer) { return Gemv{(const void*)layers[layer * PER_LAYER + QKV], 2, 1, hidden, qkv_rows / 2}; };
    Chunk<T, 2, VH> cur_h;  // a phase of rows of the hidden size (qkv, gate_up)
    Chunk<T, 2, VPL> cur;   // o and down

    for (int i = blockIdx.x * THREADS + threadIdx.x; i < batch * hidden; i += gridDim.x * THREADS)
        residual[i] = to_float(embedding[ids[i / hidden] * hidden + i % hidden]);
    first_chunk(qkv_phase(0), cur_h);
    grid_sync(bar, target);

    for (int layer = 0; layer < num_layers; ++layer) {
        const unsigned long long* w = layers + layer * PER_LAYER;
        T* k_plane = reinterpret_cast<T*>(w[K_PLANE]);
        T* v_plane = reinterpret_cast<T*>(w[V_PLANE]);
        const Gemv o_phase{(const void*)w[O], 2, 1, attn_width, hidden / 2};
        const Gemv gate_up_phase{(const void*)w[GATE_UP], 1, ffn, hidden, ffn};
        const Gemv down_phase{(const void*)w[DOWN], 2, 1, ffn, hidden / 2};

        // qkv: norm, a pair of rows a unit, rotary embeddings, q out and k, v into the planes.
        load_normed<T, ROWS, VH>(residual, reinterpret_cast<const float*>(w[ATTN_NORM]), xs, reduce, batch, hidden, eps);
        gemv<T, ROWS, 2>(qkv_phase(layer), cur_h, xs, batch, [&](int u, float (&acc)[2][ROWS]) {
            const int head = 2 * u / HEAD_DIM, i = u % (HEAD_DIM / 2);
#pragma unroll
            for (int b = 0; b < ROWS; ++b) {
                if (lane != b || b >= batch) continue;
                float x0 = round_to<T>(acc[0][b]), x1 = round_to<T>(acc[1][b]);
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
                    if (slot < 0) continue;
                    const bool is_k = head < q_heads + kv_heads;
                    const int kh = head - q_heads - (is_k ? 0 : kv_heads);
                    dst = (is_k ? k_plane : v_plane) + (slot / block_size) * block_stride +
                          ((long long)kh * block_size + slot % block_size) * HEAD_DIM;
                }
                dst[2 * i] = from_float<T>(x0);
                dst[2 * i + 1] = from_float<T>(x1);
            }
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

        // o: residual += W_o . attn
        load_rows<T>(attn, xs, batch, attn_width);
        gemv<T, ROWS, 2>(o_phase, cur, xs, batch, [&](int u, float (&acc)[2][ROWS]) {
#pragma unroll
            for (int b = 0; b < ROWS; ++b)
                if (lane == b && b < batch) {
                    float* r = residual + (long long)b * hidden + 2 * u;
                    atomicAdd(r, round_to<T>(acc[0][b]));
                    atomicAdd(r + 1, round_to<T>(acc[1][b]));
                }
        });
        first_chunk(gate_up_phase, cur_h);
        prefetch_units<T, 2>(gate_up_phase, 1);
        grid_sync(bar, target);

        // gate_up: norm, rows j and ffn + j a unit, SiLU(gate) * up
        load_normed<T, ROWS, VH>(residual, reinterpret_cast<const float*>(w[FFN_NORM]), xs, reduce, batch, hidden, eps);
        gemv<T, ROWS, 2>(gate_up_phase, cur_h, xs, batch, [&](int u, float (&acc)[2][ROWS]) {
#pragma unroll
            for (int b = 0; b < ROWS; ++b)
                if (lane == b && b < batch) {
                    const float g = round_to<T>(acc[0][b]), up = round_to<T>(acc[1][b]);
                    mlp[(long long)b * ffn + u] = from_float<T>(g / (1.0f + __expf(-g)) * up);
                }
        });
        first_chunk(down_phase, cur);
        grid_sync(bar, target);

        // down: residual += W_down . mlp
        load_rows<T>(mlp, xs, batch, ffn);
        gemv<T, ROWS, 2>(down_phase, cur, xs, batch, [&](int u, float (&acc)[2][ROWS]) {
#pragma unroll
            for (int b = 0; b < ROWS; ++b)
                if (lane == b && b < batch) {
                    float* r = residual + (long long)b * hidden + 2 * u;
                    atomicAdd(r, round_to<T>(acc[0][b]));
                    atomicAdd(r + 1, round_to<T>(acc[1][b]));
                }
        });
        if (layer + 1 < num_layers)
            first_chunk(qkv_phase(layer + 1), cur_h);
        else
            prefetch_units<T, LOGIT_ROWS>(Gemv{(const void*)output, LOGIT_ROWS, 1, hidden, vocab / LOGIT_ROWS}, 0);
        grid_sync(bar, target);
    }

    // logits = W_out . norm(residual), float32: LOGIT_ROWS rows a unit, then the vocab % LOGIT_ROWS last rows
    const Gemv logits_phase{(const void*)output, LOGIT_ROWS, 1, hidden, vocab / LOGIT_ROWS};
    Chunk<T, LOGIT_ROWS, VH> rows;
    first_chunk(logits_phase, rows);
    load_normed<T, ROWS, VH>(residual, output_norm, xs, reduce, batch, hidden, eps);
    gemv<T, ROWS, LOGIT_ROWS>(logits_phase, rows, xs, batch, [&](int u, float (&acc)[LOGIT_ROWS][ROWS]) {
#pragma unroll
        for (int b = 0; b < ROWS; ++b)
            if (lane == b && b < batch)
#pragma unroll
                for (int r = 0; r < LOGIT_ROWS; ++r) logits[(long long)b * vocab + LOGIT_ROWS * u + r] = acc[r][b];
    });
    const int tail = vocab % LOGIT_ROWS;
    if (tail) {
        const Gemv tail_phase{(const void*)(output + (long long)(vocab - tail) * hidden), 1, 1, hidden, tail};
        Chunk<T, 1, VH> row;
        first_chunk(tail_phase, row);
        gemv<T, ROWS, 1>(tail_phase, row, xs, batch, [&](int u, float (&acc)[1][ROWS]) {
#pragma unroll
            for (int b = 0; b < ROWS; ++b)
                if (lane == b && b < batch) logits[(long long)b * vocab + vocab - tail + u] = acc[0][b];
        });
    }
}

}  // namespace pagedrt
