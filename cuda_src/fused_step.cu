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
//             an online softmax over tiles of TILE tokens in the log2 domain; partial o, m, l to `partial`
//   o         attn[b] = the splits merged (by each block that computes o rows, as it loads them);
//             residual[b] += round_T(W_o . attn[b])
//   gate_up   x = rmsnorm(residual[b]) * ffn_norm; mlp[b, j] = silu(round_T(gate_j . x)) * round_T(up_j . x)
//   down      residual[b] += round_T(W_down . mlp[b])
//   logits    x = rmsnorm(residual[b]) * output_norm; logits[b] = W_out . x (float32)
// Weights are [out, in] (one output's weights a contiguous row). On compute capability 9.0 a GEMV phase whose
// tiles fit is staged: its weights sit in shared memory, copied there by bulk copies a layer ahead, issued in a
// phase the block has no work in where it can, so that no grid barrier waits for them (Staged, below; for that
// the o and down phases' tiles go to the blocks after the attention items, the qkv phase's to the blocks after
// those). Otherwise, between arriving at a barrier and waiting at it, a block loads its first chunk of the next
// phase's weights into registers (and prefetches the rest into L2), so the weights stream while the grid gathers.
// The same time goes to the loads that wait for nothing else: the next norm's weights into registers, a block's
// first attention tiles (all but the newest token's K/V rows, which the qkv phase writes) into shared memory.
// Each row's rotations and new K/V row are worked out once, at the launch's start. NORM_PER: values of a row each
// thread holds while it normalises it (hidden <= NORM_PER * THREADS); ROWS: the batch rows shared memory holds.
//
// Memory that a phase writes and a later phase reads (residual, q, the newest K/V rows, mlp, partial) is read
// through L2 (__ldcg, cp.async.cg): another SM wrote it inside this launch. The barrier counter is zero at
// launch (the launcher clears it).
#include "common.cuh"

namespace pagedrt {
namespace fused {

constexpr int THREADS = 256, WARPS = THREADS / 32, TILE = 64;
constexpr int MAX_GROUP_DIMS = 2048;  // query heads a KV head x head_dim, at most
constexpr int MAX_SPLITS = 16;        // attention splits of a (row, KV head), at most
constexpr int STAGED = 2;             // tiles of K/V a block copies at the barrier that opens attention
// floats of a (query head, split)'s partial: its unnormalised output, then m and l (16-byte aligned rows)
constexpr __host__ __device__ int partial_stride(int head_dim) { return head_dim + 4; }
// Bytes of shared memory before the staged weights: the step's constants (each row's rotations and new K/V row)
// and the staged phases' four mbarriers.
constexpr __host__ __device__ int constants_bytes(int rows, int head_dim) {
    return (rows * (head_dim / 2 * 8 + 8) + 4 * 8 + 15) / 16 * 16;
}
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

__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// A grid-wide barrier in two halves: every block arrives (what it wrote before is visible to a block that waited),
// then waits until every block arrived. Between the two a block issues the loads that do not depend on the other
// blocks (the next phase's first weights): the arrival's release does not wait for them, and they travel while
// the grid gathers.
__device__ __forceinline__ void grid_arrive(unsigned* bar, unsigned& target) {
    __syncthreads();
    target += gridDim.x;
    if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(bar) : "memory");
    }
}

__device__ __forceinline__ void grid_wait(const unsigned* bar, unsigned target) {
    if (threadIdx.x == 0) {
        unsigned seen;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(bar) : "memory");
        } while ((int)(seen - target) < 0);
    }
    __syncthreads();
}

// A GEMV phase: out[row][b] = dot(W row, xs row b) for `rows` weight rows of k elements (k a multiple of 32),
// on tensor cores: a tile is 16 rows by the batch's 8 columns (rows past the batch are computed and ignored),
// mma.m16n8k16 over the k dimension. Block (u + offset) % grid takes tile u; its warp w takes the k-steps (32
// elements) w, w + 8, ...: lane (g = lane / 4, t = lane % 4) loads 16 bytes of rows g and g + 8 at k0 + 8t and
// the same 16 bytes of xs row g, which are the A and B fragments of two mmas once k is renumbered inside the step
// (the sum does not depend on the order). The warps' partial tiles are summed in shared memory in warp order.
// The weights come one of two ways. Staged (compute capability 9.0, where a layer's tiles fit): a block's tiles of
// the phase sit in shared memory, copied there by bulk copies a layer ahead (Staged, below). Streamed: a warp holds
// STEPS k-steps a chunk in registers and loads its next chunk while it computes this one; the first chunk is
// loaded while the barrier that opens the phase gathers the grid, so its weights arrive meanwhile. Either way a
// warp's mmas run in the same order: the same sums.
// Gate/up tiles (`split` = ffn) are 8 gate rows j.. and the 8 up rows ffn + j.., so one tile holds both.
struct Gemv {
    const void* w;
    int k, rows, split;
    int offset;  // the block that takes tile 0 (0 <= offset < grid)
    __device__ int tiles() const { return split ? (split + 7) / 8 : (rows + 15) / 16; }
    // This block's first tile: it takes tiles slot(), slot() + grid, ... (a remainder: written as a compare and an
    // add instead, decode_step's head_dim 128 instances spilled registers)
    __device__ int slot() const { return ((int)blockIdx.x - offset + (int)gridDim.x) % (int)gridDim.x; }
    // Tiles of the block whose slot is 0, which has the most.
    __device__ int most_tiles() const { return (tiles() + gridDim.x - 1) / gridDim.x; }
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

// Load this block's first chunk of phase g (between arriving at the barrier that opens it and waiting there).
template <typename T>
__device__ __forceinline__ void first_chunk(const Gemv& g, Chunk<T>& first) {
    const int u = g.slot();
    if (u < g.tiles()) first.load(g, u, 0);
}

// Prefetch into L2 the rows this block computes in phase g, from its (skip + 1)-th tile on.
template <typename T>
__device__ __forceinline__ void prefetch_tiles(const Gemv& g, int skip) {
    const int lines = (g.k * (int)sizeof(T) + 127) / 128;
    const T* base = reinterpret_cast<const T*>(g.w);
    for (int u = g.slot() + skip * gridDim.x; u < g.tiles(); u += gridDim.x)
        for (int i = threadIdx.x; i < 16 * lines; i += THREADS) {
            const int r = g.row(u, i / lines);
            if (r >= 0) prefetch_l2(reinterpret_cast<const char*>(base + (long long)r * g.k) + (i % lines) * 128);
        }
}

// The end of tile u: the warps' partial tiles (acc: rows lane / 4 and lane / 4 + 8, columns 2 (lane % 4) and + 1)
// summed in warp order, then epilogue(u, out) by the whole block, with out[r * 8 + b] the dot product of the tile's
// row r and xs row b (shared memory). `sums`: 8 x 128 floats of shared memory for the warps' tiles, then the
// tile's 128. Every warp's reads of the tile's weights are done once it returns.
template <typename Epilogue>
__device__ __forceinline__ void finish_tile(int u, float (&acc)[4], float* sums, Epilogue& epilogue) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float* out = sums + WARPS * 128;
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

// Run phase g over xs (rows of `stride` elements), its weights streamed: epilogue(u, out) once per tile
// (finish_tile).
template <typename T, typename Epilogue>
__device__ __forceinline__ void gemv(const Gemv& g, Chunk<T>& cur, const T* xs, int stride, int batch, float* sums,
                                     Epilogue epilogue) {
    const int chunks = (g.k / 32 + WARPS * STEPS - 1) / (WARPS * STEPS), tiles = g.tiles();
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int u = g.slot(), c = 0; u < tiles;) {
        int next_u = u, next_c = c + 1;
        if (next_c == chunks) next_c = 0, next_u += gridDim.x;
        Chunk<T> next;
        if (next_u < tiles) next.load(g, next_u, next_c);
        cur.mma(xs, stride, g.k, c, batch, acc);
        if (c == chunks - 1) finish_tile(u, acc, sums, epilogue);
        cur = next;
        u = next_u, c = next_c;
    }
}

// Shared-memory rows of a staged tile: k elements and a pad that puts row r + 1 64 bytes after row r in the banks,
// so that a quarter warp's two rows (lanes 0-3 and 4-7) read disjoint banks.
constexpr __host__ __device__ int staged_stride(int k) { return k % 64 ? k : k + 32; }

// Run phase g over xs with its weights staged: this block's tiles [16][staged_stride(k)] one after another in `w`
// (shared memory, landed). The same mmas in the same order as gemv's.
template <typename T, typename Epilogue>
__device__ __forceinline__ void gemv_staged(const Gemv& g, const T* w, const T* xs, int stride, int batch,
                                            float* sums, Epilogue epilogue) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, steps = g.k / 32, n = lane / 4;
    const int ws = staged_stride(g.k), col = 8 * (lane % 4);
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int u = g.slot(); u < g.tiles(); u += gridDim.x, w += 16 * ws) {
        const bool in0 = g.row(u, n) >= 0, in1 = g.row(u, n + 8) >= 0;
        const T* a0 = w + n * ws + col;
        const T* a1 = a0 + 8 * ws;
        const T* x = xs + n * stride + col;
#pragma unroll 3
        for (int step = warp; step < steps; step += WARPS) {
            const uint4 p = in0 ? *reinterpret_cast<const uint4*>(a0 + step * 32) : zero;
            const uint4 q = in1 ? *reinterpret_cast<const uint4*>(a1 + step * 32) : zero;
            const uint4 b = n < batch ? *reinterpret_cast<const uint4*>(x + step * 32) : zero;
            mma_16816<T>(acc, p.x, q.x, p.y, q.y, b.x, b.y);
            mma_16816<T>(acc, p.z, q.z, p.w, q.w, b.z, b.w);
        }
        finish_tile(u, acc, sums, epilogue);
    }
}

// Weights staged a layer ahead. Phase p of `staged` (bit p: qkv, o, gate_up, down) has a buffer of most_tiles()
// tiles in shared memory and an mbarrier; its fill for layer l is the barrier's phase l (parity l & 1). Warp 1
// fills, a bulk copy a weight row (rows are padded in shared memory, not in global memory): for layer 0 at the
// launch's start, later once the block's phase of the layer before is done with the buffer. Issuing a fill stalls
// warp 1 until the copy engine has taken its copies (about 60 cycles a row), and the block waits for warp 1 at its
// next __syncthreads; a fill between arriving at a grid barrier and waiting there makes the barrier that much
// slower. So a block fills, where it can, at the start of a phase it has no work in (decode_step places the
// o, down and qkv tiles on the blocks after the attention items to leave such blocks). The fill for layer l + 1 of
//   qkv:     a block without an attention item: at the start of layer l's attention; else at the barrier that
//            ends layer l's qkv
//   down:    a block without an attention item: at the start of layer l + 1's attention; else at the barrier
//            that ends layer l's down
//   gate_up: a block without down tiles: at the start of layer l's down; else one without qkv tiles: at the start
//            of layer l + 1's qkv; else at the barrier that ends layer l's gate_up
//   o:       a block without an attention item: at the start of layer l + 1's attention (first: o comes next);
//            else at the barrier that ends layer l's o
// Each is after the block's phase of layer l is done with the buffer and before its phase of layer l + 1. Warp 2
// prefetches each fill's tiles into L2 at a barrier before it (stage_prefetch), and the copies come from L2.
enum Staged { STAGE_QKV, STAGE_O, STAGE_GATE_UP, STAGE_DOWN, STAGES_ };

template <typename T>
__device__ __forceinline__ void stage_fill(const Gemv& g, T* buf, unsigned long long* bar) {
#if __CUDA_ARCH__ >= 900
    const int lane = threadIdx.x - 32, tiles = g.tiles(), first = g.slot();
    if (lane < 0 || lane >= 32 || first >= tiles) return;
    const unsigned b = (unsigned)__cvta_generic_to_shared(bar), row_bytes = g.k * (unsigned)sizeof(T);
    if (lane == 0) {  // every row of the block's tiles but the last tile's past the end
        const int mine = (tiles - 1 - first) / gridDim.x + 1, last = first + (mine - 1) * gridDim.x;
        const int past = g.split ? 2 * max(0, last * 8 + 8 - g.split) : max(0, last * 16 + 16 - g.rows);
        sm90::mbarrier_expect_bytes(b, (mine * 16 - past) * row_bytes);
    }
    __syncwarp();
    const int ws = staged_stride(g.k);
    const T* base = reinterpret_cast<const T*>(g.w);
    for (int i = lane / 16; first + i * (int)gridDim.x < tiles; i += 2) {
        const int r = g.row(first + i * gridDim.x, lane % 16);
        if (r >= 0)
            sm90::bulk_copy((unsigned)__cvta_generic_to_shared(buf + (i * 16 + lane % 16) * ws),
                            base + (long long)r * g.k, row_bytes, b);
    }
#endif
}

// Prefetch into L2 the tiles of phase g this block's next fill copies (warp 2, one bulk prefetch a tile's rows:
// gate/up tiles are two runs of 8 rows).
template <typename T>
__device__ __forceinline__ void stage_prefetch(const Gemv& g) {
#if __CUDA_ARCH__ >= 900
    const int lane = threadIdx.x - 64;
    if (lane < 0 || lane >= 32) return;
    const T* base = reinterpret_cast<const T*>(g.w);
    const unsigned row_bytes = g.k * (unsigned)sizeof(T);
    for (int u = g.slot() + lane * gridDim.x; u < g.tiles(); u += 32 * gridDim.x) {
        if (g.split) {
            const int j = u * 8, n = min(8, g.split - j);
            sm90::bulk_prefetch_l2(base + (long long)j * g.k, n * row_bytes);
            sm90::bulk_prefetch_l2(base + (long long)(j + g.split) * g.k, n * row_bytes);
        } else {
            const int r = u * 16;
            sm90::bulk_prefetch_l2(base + (long long)r * g.k, min(16, g.rows - r) * row_bytes);
        }
    }
#endif
}

// Wait until this block's tiles of a staged phase for `layer` have landed.
__device__ __forceinline__ void stage_wait(const Gemv& g, unsigned long long* bar, int layer) {
#if __CUDA_ARCH__ >= 900
    if (g.slot() < g.tiles()) sm90::mbarrier_wait((unsigned)__cvta_generic_to_shared(bar), layer & 1);
#endif
}

// A norm's weights this thread multiplies by (element threadIdx.x + v * THREADS of each row): loaded between
// arriving at the barrier that opens the phase and waiting there, so the norm does not wait for them.
template <int PER>
__device__ __forceinline__ void load_norm_weight(const float* __restrict__ weight, int hidden, float (&wn)[PER]) {
#pragma unroll
    for (int v = 0; v < PER; ++v) {
        const int j = threadIdx.x + v * THREADS;
        wn[v] = j < hidden ? __ldg(weight + j) : 0.0f;
    }
}

// xs[b] = residual[b] / sqrt(mean(residual[b]^2) + eps) * weight, as T, for every row b < batch (xs rows
// hidden + PAD apart: the padding spreads a GEMV's reads of 8 rows over the banks); wn: load_norm_weight's.
// PER: values a thread holds of a row (hidden <= PER * THREADS).
template <typename T, int ROWS, int PER>
__device__ void load_normed(const float* residual, const float (&wn)[PER], T* xs, float* reduce, int batch,
                            int hidden, float eps) {
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
            if (j < hidden) xs[b * (hidden + PAD) + j] = from_float<T>(x[b][v] * scale * wn[v]);
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

// An attention work item: (row b, KV head h, split) and the tokens [start, end) of the split.
struct Item {
    int b, h, split, len, start, end;
    Item() = default;
    __device__ Item(const Step& s, int item) {
        split = item % s.splits, h = (item / s.splits) % s.kv_heads, b = item / (s.splits * s.kv_heads);
        len = s.seq_lens[b];
        const int chunk = (len + s.splits - 1) / s.splits;
        start = split * chunk, end = min(len, start + chunk);
    }
};

// A tile's K and V rows travel to shared memory by cp.async, CHUNKS 16-byte pieces a row; thread tid copies piece
// tid % CHUNKS of the tile's rows tid / CHUNKS + q * (THREADS / CHUNKS), q < ROWS_PER, of both planes.
template <typename T, int HEAD_DIM>
struct TileCopy {
    static constexpr int CHUNKS = HEAD_DIM * (int)sizeof(T) / 16, ROWS_PER = TILE * CHUNKS / THREADS;
    long long row[ROWS_PER];  // the plane offset of each of this thread's rows (-1: past the tile or the item)
    int start;                // the tile's first token

    __device__ int token(int q) const { return start + threadIdx.x / CHUNKS + q * (THREADS / CHUNKS); }

    // This thread's rows of the tile at token `tile` of item `it` (table loads only).
    __device__ void locate(const Step& s, const Item& it, int tile) {
        const int* table = s.tables + it.b * s.table_stride;
        start = tile;
#pragma unroll
        for (int q = 0; q < ROWS_PER; ++q) {
            const int t = token(q);
            row[q] = t < min(it.end, tile + TILE)
                         ? (long long)table[t / s.block_size] * s.block_stride +
                               ((long long)it.h * s.block_size + t % s.block_size) * HEAD_DIM
                         : -1;
        }
    }

    // Copy the rows located into ks, vs ([TILE][HEAD_DIM]): every row but token `skip`, or only token `only`
    // (when only >= 0); commits one group.
    __device__ void copy(const T* k_plane, const T* v_plane, T* ks, T* vs, int skip, int only) const {
        const int piece = (threadIdx.x % CHUNKS) * (16 / (int)sizeof(T));
#pragma unroll
        for (int q = 0; q < ROWS_PER; ++q) {
            const bool wanted = row[q] >= 0 && (only >= 0 ? token(q) == only : token(q) != skip);
            if (!wanted) continue;
            const int j = threadIdx.x / CHUNKS + q * (THREADS / CHUNKS);
            const int at = j * HEAD_DIM + piece;
            cp_async16_shared((unsigned)__cvta_generic_to_shared(ks + at), k_plane + row[q] + piece, 16);
            cp_async16_shared((unsigned)__cvta_generic_to_shared(vs + at), v_plane + row[q] + piece, 16);
        }
        cp_async_commit();
    }
};

// Shared memory of the attention phase: STAGED buffers of a tile's K and V rows (after the last tile, the warps'
// outputs: attend), then the float state. Tile i of an item goes to buffer i % STAGED; a block's first item's
// first STAGED tiles are copied at the barrier.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ int attention_front(int group) {  // bytes before the float state
    return max(STAGED * 2 * TILE * HEAD_DIM * (int)sizeof(T), WARPS * group * HEAD_DIM * (int)sizeof(float));
}
template <typename T, int HEAD_DIM>
__device__ __forceinline__ T* tile_k(void* smem, int i) {
    return reinterpret_cast<T*>(smem) + (i % STAGED) * 2 * TILE * HEAD_DIM;
}
template <typename T, int HEAD_DIM>
__device__ __forceinline__ T* tile_v(void* smem, int i) { return tile_k<T, HEAD_DIM>(smem, i) + TILE * HEAD_DIM; }

// One (row, KV head, split) of the attention phase: this split's unnormalised output, max and sum of every query
// head of the group into `partial` (the o phase merges the splits). The first STAGED tiles' rows are in shared memory
// already when `staged` (copied at the barrier, but for the newest token's, which the qkv phase wrote).
// Scores: 4 threads a token (K read once, every query head of the group from shared memory). P . V: warp w takes
// the tile's tokens [w * TILE / WARPS, (w + 1) * TILE / WARPS), its lanes a V row's dims, and keeps every head's
// output for its tokens in registers. The warps' outputs meet in shared memory (over the K/V tiles, free after the
// last one), each in a slice of its own, and are summed in warp order after one barrier (the same sum every run).
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void attend(const Step& s, const T* k_plane, const T* v_plane, const T* q, float* partial,
                                       const Item& it, const TileCopy<T, HEAD_DIM> (&first)[STAGED], bool staged,
                                       float scale_log2, void* smem) {
    constexpr int PART = HEAD_DIM / 4, LANE_DIMS = HEAD_DIM / 32, MAX_GROUP = MAX_GROUP_DIMS / HEAD_DIM;
    constexpr int PER_WARP = TILE / WARPS;
    const int group = s.q_heads / s.kv_heads;
    float* qs = reinterpret_cast<float*>(static_cast<char*>(smem) + attention_front<T, HEAD_DIM>(group));  // [group][D]
    float* scores = qs + group * HEAD_DIM;                       // [group][TILE]
    float* m = scores + group * TILE;                            // [group]
    float* l = m + group;                                        // [group]
    float* alpha = l + group;                                    // [group]
    const int head0 = it.b * s.q_heads + it.h * group, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (staged)  // the newest token's row
#pragma unroll
        for (int i = 0; i < STAGED; ++i)
            first[i].copy(k_plane, v_plane, tile_k<T, HEAD_DIM>(smem, i), tile_v<T, HEAD_DIM>(smem, i), -1, it.len - 1);
    float o[MAX_GROUP][LANE_DIMS];
#pragma unroll
    for (int g = 0; g < MAX_GROUP; ++g)
#pragma unroll
        for (int e = 0; e < LANE_DIMS; ++e) o[g][e] = 0.0f;
    for (int i = threadIdx.x; i < group * HEAD_DIM; i += THREADS) {
        qs[i] = to_float(__ldcg(q + (long long)head0 * HEAD_DIM + i)) * scale_log2;
    }
    if (threadIdx.x < group) m[threadIdx.x] = neg_inf(), l[threadIdx.x] = 0.0f;
    for (int tile = it.start, i = 0; tile < it.end; tile += TILE, ++i) {
        const int n = min(TILE, it.end - tile), j = threadIdx.x / 4, part = threadIdx.x % 4;
        const bool valid = j < n;
        const T* ks = tile_k<T, HEAD_DIM>(smem, i);
        const T* vs = tile_v<T, HEAD_DIM>(smem, i);
        if (!staged || i >= STAGED) {
            TileCopy<T, HEAD_DIM> rows;
            rows.locate(s, it, tile);
            rows.copy(k_plane, v_plane, tile_k<T, HEAD_DIM>(smem, i), tile_v<T, HEAD_DIM>(smem, i), -1, -1);
        }
        cp_async_wait<0>();
        __syncthreads();
        float kf[PART];
        if (valid)
#pragma unroll
            for (int vv = 0; vv < PART / 8; ++vv)
                unpack<T>(*reinterpret_cast<const uint4*>(ks + j * HEAD_DIM + part * PART + 8 * vv), kf + 8 * vv);
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
            __syncwarp();  // every lane has read m[g] before lane 0 writes it
            if (lane == 0) {
                const float a = exp2f(m_old - m_new);
                alpha[g] = a;
                l[g] = l[g] * a + sum;
                m[g] = m_new;
            }
        }
        __syncthreads();
        float v[PER_WARP][LANE_DIMS];
#pragma unroll
        for (int t = 0; t < PER_WARP; ++t) {
            const int jj = warp * PER_WARP + t;
#pragma unroll
            for (int e = 0; e < LANE_DIMS; ++e)
                v[t][e] = jj < n ? to_float(vs[jj * HEAD_DIM + lane * LANE_DIMS + e]) : 0.0f;
        }
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
    // partial[(head, split)] = o[HEAD_DIM], m, l (an empty split: o = 0, m = -inf, l = 0)
    if (threadIdx.x < group) {
        float* dst = partial + ((long long)(head0 + threadIdx.x) * s.splits + it.split) * partial_stride(HEAD_DIM);
        *reinterpret_cast<float2*>(dst + HEAD_DIM) = make_float2(m[threadIdx.x], l[threadIdx.x]);
    }
    float* slices = reinterpret_cast<float*>(smem);  // [WARPS][group][HEAD_DIM]
    const int dims = group * HEAD_DIM;
#pragma unroll
    for (int g = 0; g < MAX_GROUP; ++g) {
        if (g >= group) break;
#pragma unroll
        for (int e = 0; e < LANE_DIMS; ++e) slices[warp * dims + g * HEAD_DIM + lane * LANE_DIMS + e] = o[g][e];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < dims; i += THREADS) {
        float total = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) total += slices[w * dims + i];
        partial[((long long)(head0 + i / HEAD_DIM) * s.splits + it.split) * partial_stride(HEAD_DIM) + i % HEAD_DIM] =
            total;
    }
    __syncthreads();
}

// xs[b][head * HEAD_DIM + d] = the merged attention output of every row b < batch and query head, as T (xs rows
// width + PAD apart): the splits' outputs weighed by 2^(m - max m), over the weighed sums.
template <typename T, int HEAD_DIM>
__device__ void load_merged(const float* partial, T* xs, int batch, int q_heads, int splits) {
    constexpr int STRIDE = partial_stride(HEAD_DIM), QUADS = HEAD_DIM / 4;
    const int width = q_heads * HEAD_DIM;
    for (int i = threadIdx.x; i < batch * q_heads * QUADS; i += THREADS) {
        const int head = i / QUADS, d = (i % QUADS) * 4;  // head: b * q_heads + the row's head
        const float* src = partial + (long long)head * splits * STRIDE;
        float2 ml[MAX_SPLITS];
        float4 o[MAX_SPLITS];
        float top = neg_inf();
#pragma unroll
        for (int k = 0; k < MAX_SPLITS; ++k) {
            const bool here = k < splits;
            ml[k] = here ? __ldcg(reinterpret_cast<const float2*>(src + k * STRIDE + HEAD_DIM))
                         : make_float2(neg_inf(), 0.0f);
            o[k] = here ? __ldcg(reinterpret_cast<const float4*>(src + k * STRIDE + d))
                        : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            top = fmaxf(top, ml[k].x);
        }
        float sum = 0.0f, x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int k = 0; k < MAX_SPLITS; ++k) {
            const float w = exp2f(ml[k].x - top);
            sum = fmaf(ml[k].y, w, sum);
            x[0] = fmaf(o[k].x, w, x[0]), x[1] = fmaf(o[k].y, w, x[1]);
            x[2] = fmaf(o[k].z, w, x[2]), x[3] = fmaf(o[k].w, w, x[3]);
        }
        T* dst = xs + (head / q_heads) * (width + PAD) + (head % q_heads) * HEAD_DIM + d;
#pragma unroll
        for (int e = 0; e < 4; ++e) dst[e] = from_float<T>(x[e] / sum);
    }
    __syncthreads();
}

}  // namespace fused

template <typename T, int HEAD_DIM, int ROWS, int NORM_PER>
__global__ void __launch_bounds__(fused::THREADS, 1) decode_step(
    const unsigned long long* __restrict__ layers, int num_layers, const T* __restrict__ embedding,
    const float* __restrict__ output_norm, const T* __restrict__ output, int vocab, const float* __restrict__ inv_freq,
    const long long* __restrict__ ids, const int* __restrict__ tables, long long table_stride,
    const int* __restrict__ seq_lens, const long long* __restrict__ slots, long long block_stride, int block_size,
    float* residual, T* q, T* mlp, float* partial, unsigned* barrier, float* logits, int batch, int hidden,
    int ffn, int q_heads, int kv_heads, int max_splits, float eps, float scale_log2, int staged_phases) {
    using namespace fused;
#if __CUDA_ARCH__ < 900
    staged_phases = 0;  // as the launcher passes here; as a constant it drops the staged code and its registers
#endif
    extern __shared__ uint4 smem_front[];
    // The step's constants, for the whole launch: each row's rotation (cos, sin) of every pair of a head, and
    // the offset of its new token's K/V row in a layer's plane (-1: a padding row); the staged phases' mbarriers
    // and buffers; then what phases share.
    float2* rotation = reinterpret_cast<float2*>(smem_front);                       // [ROWS][HEAD_DIM / 2]
    long long* kv_row = reinterpret_cast<long long*>(rotation + ROWS * HEAD_DIM / 2);  // [ROWS]
    unsigned long long* stage_bar = reinterpret_cast<unsigned long long*>(kv_row + ROWS);  // [STAGES_]
    const int qkv_rows = (q_heads + 2 * kv_heads) * HEAD_DIM, attn_width = q_heads * HEAD_DIM;
    int splits = 1;  // attention splits: the fewest that leave each item one tile, at most max_splits
    for (int b = 0; b < batch; ++b) splits = max(splits, (seq_lens[b] + TILE - 1) / TILE);
    splits = min(splits, max_splits);
    const int items = batch * kv_heads * splits;  // attention's work items, item i on block i
    // Where each phase's tiles start (Gemv::offset), the same in every layer: gate_up's at block 0, o's and down's
    // (as many tiles) at the block after the attention items, qkv's after those ((hidden + 15) / 16 tiles), so that
    // a block idle in attention, down or qkv refills there (Staged).
    const int after_items = items % (int)gridDim.x, qkv_at = (items + (hidden + 15) / 16) % (int)gridDim.x;
    // phase p's GEMV in a layer whose weight pointers are w
    auto phase = [&](const unsigned long long* w, int p) {
        return p == STAGE_QKV ? Gemv{(const void*)w[QKV], hidden, qkv_rows, 0, qkv_at}
               : p == STAGE_O ? Gemv{(const void*)w[O], attn_width, hidden, 0, after_items}
               : p == STAGE_GATE_UP ? Gemv{(const void*)w[GATE_UP], hidden, 2 * ffn, ffn, 0}
                                    : Gemv{(const void*)w[DOWN], ffn, hidden, 0, after_items};
    };
    T* stage_buf[STAGES_];
    T* at = reinterpret_cast<T*>(smem_front + constants_bytes(ROWS, HEAD_DIM) / 16);
#pragma unroll
    for (int p = 0; p < STAGES_; ++p) {
        const Gemv g = phase(layers, p);
        stage_buf[p] = staged_phases >> p & 1 ? at : nullptr;
        if (staged_phases >> p & 1) at += g.most_tiles() * 16 * staged_stride(g.k);
    }
    // every layer's staged weights, [num_layers][STAGES_] (a refill reads its pointer here, not from global memory)
    unsigned long long* staged_weights = reinterpret_cast<unsigned long long*>(at);
    if (staged_phases) at = reinterpret_cast<T*>(staged_weights + num_layers * STAGES_);
    uint4* smem_raw = reinterpret_cast<uint4*>(at);
    const int tid = threadIdx.x;
#if __CUDA_ARCH__ >= 900
    if (staged_phases) {
        for (int i = tid; i < num_layers * STAGES_; i += THREADS)
            staged_weights[i] = (unsigned long long)phase(layers + i / STAGES_ * PER_LAYER, i % STAGES_).w;
        if (tid < STAGES_) sm90::mbarrier_init((unsigned)__cvta_generic_to_shared(stage_bar + tid), 1);
        sm90::mbarrier_init_fence();
        __syncthreads();
#pragma unroll
        for (int p = 0; p < STAGES_; ++p)
            if (staged_phases >> p & 1) stage_fill(phase(layers, p), stage_buf[p], stage_bar + p);
    }
#endif
    float* reduce = reinterpret_cast<float*>(smem_raw);  // load_normed's partial sums
    float* sums = reduce + WARPS * ROWS;                 // the GEMV's warp tiles and the block's tile
    T* xs = reinterpret_cast<T*>(sums + (WARPS + 1) * 128);
    const Step s{layers, ids, tables, table_stride, seq_lens, slots, block_stride, block_size, batch, hidden, ffn,
                 q_heads, kv_heads, splits};
    unsigned target = 0;
    Chunk<T> cur;
    // Whether this block has work in attention, qkv and down (where it refills when it has none: Staged).
    const Gemv qkv0 = phase(layers, STAGE_QKV), down0 = phase(layers, STAGE_DOWN);
    const bool busy_attn = (int)blockIdx.x < items, busy_qkv = qkv0.slot() < qkv0.tiles();
    const bool busy_down = down0.slot() < down0.tiles();
    // This block's first attention item and its first tiles' rows: the same plane offsets in every layer.
    TileCopy<T, HEAD_DIM> staged[STAGED];
    Item first;
    if (busy_attn) {
        first = Item(s, blockIdx.x);
#pragma unroll
        for (int i = 0; i < STAGED; ++i) staged[i].locate(s, first, first.start + i * TILE);
    }

    for (int i = tid; i < batch * HEAD_DIM / 2; i += THREADS) {
        const int b = i / (HEAD_DIM / 2);
        float sn, cs;
        sincosf((float)(seq_lens[b] - 1) * inv_freq[i % (HEAD_DIM / 2)], &sn, &cs);
        rotation[i] = make_float2(cs, sn);
    }
    if (tid < batch) {
        const long long slot = slots[tid];
        kv_row[tid] = slot < 0 ? -1 : slot_offset(slot, 0, block_stride, block_size, HEAD_DIM);
    }
    for (int i = blockIdx.x * THREADS + tid; i < batch * hidden; i += gridDim.x * THREADS)
        residual[i] = to_float(embedding[ids[i / hidden] * hidden + i % hidden]);
    float norm_weight[NORM_PER];
    grid_arrive(barrier, target);  // (its __syncthreads makes the constants visible to the block)
    if ((staged_phases >> STAGE_QKV & 1) && num_layers > 1) stage_prefetch<T>(phase(layers + PER_LAYER, STAGE_QKV));
    if (!(staged_phases >> STAGE_QKV & 1)) first_chunk(phase(layers, STAGE_QKV), cur);
    load_norm_weight(reinterpret_cast<const float*>(layers[ATTN_NORM]), hidden, norm_weight);
    grid_wait(barrier, target);

    for (int layer = 0; layer < num_layers; ++layer) {
        const unsigned long long* w = layers + layer * PER_LAYER;
        T* k_plane = reinterpret_cast<T*>(w[K_PLANE]);
        T* v_plane = reinterpret_cast<T*>(w[V_PLANE]);
        const Gemv qkv_phase = phase(w, STAGE_QKV), o_phase = phase(w, STAGE_O);
        const Gemv gate_up_phase = phase(w, STAGE_GATE_UP), down_phase = phase(w, STAGE_DOWN);
        // warp 1 fills a staged phase's buffer for a later layer (where: Staged); warp 2 prefetches a fill's tiles
        // into L2 at a barrier before it (phase p of layer `at`)
        auto refill = [&](int p, int at) {
            if (at < num_layers && tid / 32 == 1 && (staged_phases >> p & 1)) {
                Gemv g = phase(w, p);
                g.w = (const void*)staged_weights[at * STAGES_ + p];
                stage_fill(g, stage_buf[p], stage_bar + p);
            }
        };
        auto prefetch = [&](int p, int at) {
            if (at < num_layers && (staged_phases >> p & 1)) {
                Gemv g = phase(w, p);
                g.w = (const void*)staged_weights[at * STAGES_ + p];
                stage_prefetch<T>(g);
            }
        };
        // phase p's GEMV over xs, its weights staged or streamed
        auto run_gemv = [&](int p, const Gemv& g, int stride, auto epilogue) {
            if (staged_phases >> p & 1) {
                stage_wait(g, stage_bar + p, layer);
                gemv_staged(g, stage_buf[p], xs, stride, batch, sums, epilogue);
            } else {
                gemv(g, cur, xs, stride, batch, sums, epilogue);
            }
        };
        auto streams = [&](int p) { return !(staged_phases >> p & 1); };

        // qkv: norm; a thread a (pair of rows, batch row): rotary embeddings, q out and k, v into the planes. The
        // block's first attention tiles are copied at the barrier, all but the newest token's row (written here).
        // A block without qkv tiles that had down tiles refills gate_up meanwhile.
        if (layer > 0 && busy_down && !busy_qkv) refill(STAGE_GATE_UP, layer);
        // a block without qkv tiles needs no norm (the test read from the phase: busy_qkv held across the loop
        // spills registers on sm_80; the same below for down's rows)
        if (qkv_phase.slot() < qkv_phase.tiles())
            load_normed<T, ROWS, NORM_PER>(residual, norm_weight, xs, reduce, batch, hidden, eps);
        run_gemv(STAGE_QKV, qkv_phase, hidden + PAD, [&](int u, const float* out) {
            const int pair = tid / 8, b = tid % 8, col = u * 16 + 2 * pair;
            if (tid >= 64 || b >= batch || col >= qkv_rows) return;
            const int head = col / HEAD_DIM, i = (col % HEAD_DIM) / 2;
            float x0 = round_to<T>(out[2 * pair * 8 + b]), x1 = round_to<T>(out[(2 * pair + 1) * 8 + b]);
            if (head < q_heads + kv_heads) {
                const float2 r = rotation[b * (HEAD_DIM / 2) + i];
                rotate_pair(x0, x1, r.x, r.y);
            }
            T* dst;
            if (head < q_heads) {
                dst = q + ((long long)b * q_heads + head) * HEAD_DIM;
            } else {
                if (kv_row[b] < 0) return;
                const bool is_k = head < q_heads + kv_heads;
                const int kh = head - q_heads - (is_k ? 0 : kv_heads);
                dst = (is_k ? k_plane : v_plane) + kv_row[b] + (long long)kh * block_size * HEAD_DIM;
            }
            dst[2 * i] = from_float<T>(x0);
            dst[2 * i + 1] = from_float<T>(x1);
        });
        grid_arrive(barrier, target);  // (its __syncthreads frees the GEMV's shared memory for the tile)
        if (busy_attn) {
#pragma unroll
            for (int i = 0; i < STAGED; ++i)
                staged[i].copy(k_plane, v_plane, tile_k<T, HEAD_DIM>(smem_raw, i), tile_v<T, HEAD_DIM>(smem_raw, i),
                               first.len - 1, -1);
            refill(STAGE_QKV, layer + 1);
        }
        grid_wait(barrier, target);

        // attention: each split's partial (the o phase merges them); a block without an item refills meanwhile
        if (!busy_attn) {
            if (layer > 0) refill(STAGE_O, layer);  // (layer 0's is the launch's; o's is needed first)
            refill(STAGE_QKV, layer + 1);
            if (layer > 0) refill(STAGE_DOWN, layer);
        }
        for (int item = blockIdx.x; item < items; item += gridDim.x)
            attend<T, HEAD_DIM>(s, k_plane, v_plane, q, partial, item == (int)blockIdx.x ? first : Item(s, item),
                                staged, item == (int)blockIdx.x, scale_log2, smem_raw);
        grid_arrive(barrier, target);
        prefetch(STAGE_O, layer + 1);
        if (streams(STAGE_O)) first_chunk(o_phase, cur);
        grid_wait(barrier, target);

        // o: residual += W_o . merged attention (one add to each element in the phase: the same sum every run)
        auto add_to_residual = [&](int u, const float* out) {
            const int r = tid / 8, b = tid % 8, col = u * 16 + r;
            if (tid < 128 && b < batch && col < hidden)
                atomicAdd(residual + (long long)b * hidden + col, round_to<T>(out[r * 8 + b]));
        };
        if (o_phase.slot() < o_phase.tiles()) load_merged<T, HEAD_DIM>(partial, xs, batch, q_heads, splits);
        run_gemv(STAGE_O, o_phase, attn_width + PAD, add_to_residual);
        grid_arrive(barrier, target);
        if (streams(STAGE_GATE_UP)) first_chunk(gate_up_phase, cur);
        load_norm_weight(reinterpret_cast<const float*>(w[FFN_NORM]), hidden, norm_weight);
        if (busy_attn) refill(STAGE_O, layer + 1);
        prefetch(STAGE_GATE_UP, layer + 1);
        if (streams(STAGE_GATE_UP)) prefetch_tiles<T>(gate_up_phase, 1);
        grid_wait(barrier, target);

        // gate_up: norm, SiLU(gate) * up
        load_normed<T, ROWS, NORM_PER>(residual, norm_weight, xs, reduce, batch, hidden, eps);
        run_gemv(STAGE_GATE_UP, gate_up_phase, hidden + PAD, [&](int u, const float* out) {
            const int j = tid / 8, b = tid % 8, col = u * 8 + j;
            if (tid >= 64 || b >= batch || col >= ffn) return;
            const float g = round_to<T>(out[j * 8 + b]), up = round_to<T>(out[(j + 8) * 8 + b]);
            mlp[(long long)b * ffn + col] = from_float<T>(g / (1.0f + __expf(-g)) * up);
        });
        grid_arrive(barrier, target);
        if (streams(STAGE_DOWN)) {
            first_chunk(down_phase, cur);
            prefetch_tiles<T>(down_phase, 0);  // the first tile's later chunks too
        }
        if (busy_down && busy_qkv) refill(STAGE_GATE_UP, layer + 1);
        prefetch(STAGE_DOWN, layer + 1);
        grid_wait(barrier, target);

        // down: residual += W_down . mlp; a block without down tiles refills gate_up meanwhile
        if (!busy_down) refill(STAGE_GATE_UP, layer + 1);
        if (down_phase.slot() < down_phase.tiles()) load_rows<T>(mlp, xs, batch, ffn);
        run_gemv(STAGE_DOWN, down_phase, ffn + PAD, add_to_residual);
        const Gemv logits_phase{(const void*)output, hidden, vocab, 0, 0};
        grid_arrive(barrier, target);
        if (busy_attn) refill(STAGE_DOWN, layer + 1);
        prefetch(STAGE_QKV, layer + 2);
        if (layer + 1 < num_layers) {
            if (streams(STAGE_QKV)) first_chunk(phase(w + PER_LAYER, STAGE_QKV), cur);
            load_norm_weight(reinterpret_cast<const float*>(w[PER_LAYER + ATTN_NORM]), hidden, norm_weight);
        } else {
            first_chunk(logits_phase, cur);
            load_norm_weight(output_norm, hidden, norm_weight);
            prefetch_tiles<T>(logits_phase, 1);
        }
        grid_wait(barrier, target);
    }

    // logits = W_out . norm(residual), float32
    load_normed<T, ROWS, NORM_PER>(residual, norm_weight, xs, reduce, batch, hidden, eps);
    gemv(Gemv{(const void*)output, hidden, vocab, 0, 0}, cur, xs, hidden + PAD, batch, sums,
         [&](int u, const float* out) {
             const int r = tid / 8, b = tid % 8, row = u * 16 + r;
             if (tid < 128 && b < batch && row < vocab) logits[(long long)b * vocab + row] = out[r * 8 + b];
         });
}

}  // namespace pagedrt
