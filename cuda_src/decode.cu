// Decode attention over a paged KV cache: one query token per sequence.
//
// One thread block handles one (sequence, KV head, split segment) and all GROUP
// query heads that share the KV head, so every K/V byte is read from HBM once.
//
// Data path: a STAGES-deep cp.async pipeline stages TILE tokens of K and V per
// stage into shared memory (16-byte copies, coalesced: a (block, head) chunk is
// contiguous in the HND layout). The block ids a tile needs are read from the
// table one tile ahead and turned into source addresses then, so a copy never
// waits for the table. Only a segment's last tile checks for missing tokens. The
// copies carry an evict-first L2 policy: K and V are read once, and what is read
// again (the table, q, the split partials, out) then stays in L2.
//
// Math: a token's head_dim is spread over LANES lanes (LANES chosen by the
// launcher from the group size: fewer lanes, fewer shuffles, more registers);
// the lanes' partial dot products are summed with xor shuffles. q is held in
// registers pre-scaled by scale*log2(e), so scores are in the log2 domain
// (exp2f). Each lane group keeps a running max m, sum l and fp32 output per
// query head; the output is rescaled only when m grows by more than 2^8 (one
// warp vote per STEP tokens), which after the first tokens is rare. At the end
// the lane groups are merged through shared memory.
//
// MMA (fp16/bf16, LANES = 32: a lane group is a warp): consume_mma does the math
// of a tile on tensor cores instead of dot_scores/accumulate, over a shared-memory
// layout whose 16-byte chunks are XOR-swizzled by row; the rest is shared. A tile
// is 16 tokens per warp: 64 with THREADS = 128, 32 with the short geometry's 64 (FP8
// up to 16 heads: twice that, so each warp has two chunks in flight).
// The group's query heads are the rows of m16 tiles: up to 16 heads fill one (8 or
// fewer leave its upper half zero, and the kernel skips that half's softmax); wider
// groups take M_TILES = 2 or 4 of them (padded with zero rows), each held by
// warps / M_TILES warps, and a warp then consumes M_TILES chunks of 16 tokens a tile
// (WARP_CHUNKS in all, two at a time), so every K/V byte is still read from HBM once,
// for all the group's heads.
//
// GROUP_CHUNKS (CUDA cores, groups wider than their registers take): the group is cut
// into chunks of GROUP heads, one thread block each (blockIdx.x = KV head x chunk); the
// chunks of a KV head read the same K/V, one after another from L2.
//
// decode_fp8: the MMA path over float8 e4m3 K/V (half the bytes of fp16) with float32 scales
// per KV head: consume_mma_fp8 converts K and V to f16 in registers (cvt.rn.f16x2.e4m3x2, exact)
// and runs the same f16 mma; the K scale is folded into q's pre-scale and the V scale into the
// output at the end, so the loop never multiplies by a scale. Stages hold HEAD_DIM bytes a token:
// twice the tokens a tile up to 16 heads, twice the stages past them (the planner's FP8_FACTOR).
//
// PAGED=false is the contiguous baseline: block id = seq * max_blocks + logical
// block, no table read; the rest of the code is shared.
//
// INDEXED: item i is the decode row rows[i] = (table row, query token) of a batch that
// also holds prompt rows (a mixed step, attention/prefill.py): one more load at the start;
// the split workspace stays indexed by item.
//
// Block ids: IDS_WINDOW table entries at a time are staged in shared memory
// after the pipeline's stages, read by the whole thread block with coalesced loads.
//
// Programmatic dependent launch (PDL, pagedrt/kernels/launch.py): a block lets the next kernel launch
// at once (launch_dependents), and itself streams what the kernel before it on the stream cannot be
// writing (the table, the lengths, q, and every token but each sequence's newest) before it waits for
// that kernel (grid_dependency_wait): the wait comes before the tile holding the sequence's newest
// token (the layer's K/V write stores it) and before the block writes anything (out, and the split
// workspace, which the previous layer's attention may still be merging from). So a layer's attention
// streams its K/V while the previous layer's tail and merge finish. The write kernel waits for the
// attention before it, so a kernel's wait covers every earlier one. Launched normally, both are no-ops.
//
// Split-K: with a partial-output workspace (part_o != nullptr) a block writes
// its unnormalised output, m and l for its segment and counts itself in; the
// last segment of a (sequence, KV head) to arrive merges them all (no second
// kernel, so no launch gap and no second ramp). Segments past a sequence's end
// exit at once: they are neither written nor counted.
#include "common.cuh"

namespace pagedrt {

constexpr int pow2_floor(int x) { int p = 1; while (2 * p <= x) p *= 2; return p; }
constexpr int min_int(int a, int b) { return a < b ? a : b; }

// Work decomposition of one thread block. THREADS, LANES, TILE, STAGES and IDS_WINDOW come from
// the planner (pagedrt/attention/planner.py: geometry), which also sizes shared memory.
template <typename T, int HEAD_DIM, int GROUP, int THREADS, int LANES, int TILE, int STAGES, int IDS_WINDOW>
struct DecodeShape {
    static constexpr int kThreads = THREADS;
    static constexpr int kVec = Vec16<T>::kElems;                  // elements per 16-byte vector
    static constexpr int kRowVecs = HEAD_DIM / kVec;               // vectors in one token's K (or V) row
    static constexpr int kLaneVecs = (kRowVecs + LANES - 1) / LANES;  // vectors per lane
    static constexpr int kLaneGroups = kThreads / LANES;           // tokens in progress at once
    static constexpr int kTokensPerGroup = TILE / kLaneGroups;     // per lane group per tile
    // tokens per online-softmax step: keeps the score registers (STEP x GROUP) near 8
    static constexpr int kStep = min_int(kTokensPerGroup, pow2_floor(8 / GROUP > 0 ? 8 / GROUP : 1));
    static constexpr int kCopies = (TILE * kRowVecs + kThreads - 1) / kThreads;  // per thread per tile
    static constexpr bool kEvenCopies = (TILE * kRowVecs) % kThreads == 0;
    static constexpr int kTileElems = TILE * HEAD_DIM;
    static constexpr int kSmemBytes = STAGES * 2 * kTileElems * (int)sizeof(T);

    static_assert(HEAD_DIM % kVec == 0, "head_dim must be a whole number of 16-byte vectors");
    static_assert(LANES >= 1 && LANES <= 32 && (LANES & (LANES - 1)) == 0, "LANES: a power of two <= 32");
    static_assert(kLaneVecs <= 4 && LANES * kLaneVecs >= kRowVecs, "at most four vectors per lane");
    static_assert(TILE % kLaneGroups == 0, "TILE must be a multiple of the lane groups");
    static_assert(kTokensPerGroup % kStep == 0, "STEP must divide the tokens per lane group");
    static_assert(STAGES >= 2, "the pipeline needs at least two stages");
    static_assert(IDS_WINDOW >= (STAGES + 1) * (TILE / 8 + 1), "the staged ids cover the prologue's tiles");
    static_assert(IDS_WINDOW % kThreads == 0, "each thread stages the same number of ids");
};

// Rescale the running output only when the running max grows by more than this
// (log2 units): exp2(score - m) then stays <= 2^8, and most steps skip the rescale.
constexpr float kRescaleLog2 = 8.f;

// One token row (K or V) as floats: lane's vectors j = 0..LV-1 are lane + j*LANES;
// vectors past the row (head_dim not a power-of-two number of vectors) are zeros.
template <typename T, int NV, int LANES, int LV>
__device__ __forceinline__ void load_row(const T* row, int lane, float (&out)[LV][Vec16<T>::kElems]) {
    constexpr int V = Vec16<T>::kElems;
#pragma unroll
    for (int j = 0; j < LV; ++j) {
        const int vec = lane + j * LANES;
        if (LANES * (j + 1) <= NV || vec < NV) {
            unpack<T>(*reinterpret_cast<const uint4*>(row + vec * V), out[j]);
        } else {
#pragma unroll
            for (int e = 0; e < V; ++e) out[j][e] = 0.f;
        }
    }
}

// Scores (log2 domain) of STEP tokens for every query head of the group, summed over the lanes.
template <typename T, int HEAD_DIM, int GROUP, int NV, int LANES, int LV, int STEP, int LG>
__device__ __forceinline__ void dot_scores(const T* tile, int first, int lane,
                                           const float (&q)[GROUP][LV][Vec16<T>::kElems],
                                           float (&s)[STEP][GROUP]) {
    constexpr int V = Vec16<T>::kElems;
#pragma unroll
    for (int u = 0; u < STEP; ++u) {
        float kf[LV][V];
        load_row<T, NV, LANES, LV>(tile + (first + u * LG) * HEAD_DIM, lane, kf);
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            float dot = 0.f;
#pragma unroll
            for (int j = 0; j < LV; ++j)
#pragma unroll
                for (int e = 0; e < V; ++e) dot = fmaf(q[g][j][e], kf[j][e], dot);
            s[u][g] = dot;
        }
    }
#pragma unroll
    for (int offset = LANES / 2; offset > 0; offset /= 2)
#pragma unroll
        for (int u = 0; u < STEP; ++u)
#pragma unroll
            for (int g = 0; g < GROUP; ++g) s[u][g] += __shfl_xor_sync(0xffffffffu, s[u][g], offset);
}

// acc[g] += p[u][g] * V row of token u, for STEP tokens.
template <typename T, int HEAD_DIM, int GROUP, int NV, int LANES, int LV, int STEP, int LG>
__device__ __forceinline__ void accumulate(const T* tile, int first, int lane, const float (&p)[STEP][GROUP],
                                           float (&acc)[GROUP][LV][Vec16<T>::kElems]) {
    constexpr int V = Vec16<T>::kElems;
#pragma unroll
    for (int u = 0; u < STEP; ++u) {
        float vf[LV][V];
        load_row<T, NV, LANES, LV>(tile + (first + u * LG) * HEAD_DIM, lane, vf);
#pragma unroll
        for (int g = 0; g < GROUP; ++g)
#pragma unroll
            for (int j = 0; j < LV; ++j)
#pragma unroll
                for (int e = 0; e < V; ++e) acc[g][j][e] = fmaf(p[u][g], vf[j][e], acc[g][j][e]);
    }
}

// The online softmax of one warp's scores, NT n-tiles of 8 tokens (sc: S's C fragments; tokens
// first + 8j + 2*quad_col + e), on the quad of lanes that holds a row: running max m_row (rescaling o
// and l_row when it grows by more than 2^kRescaleLog2) and sum l_row; sc becomes the weights P.
// A lane holds row quad_row (C elements 0, 1) and, with UPPER, row quad_row + 8 (elements 2, 3): state
// [0] and [1]. Without UPPER the upper rows are padding, and neither their state nor their P is kept.
template <int HEAD_DIM, bool MASK, bool UPPER, int NT>
__device__ __forceinline__ void softmax_mma(float (&sc)[NT][4], int live, int first, int quad_col,
                                            float (&o)[HEAD_DIM / 8][4], float (&m_row)[2], float (&l_row)[2]) {
    constexpr int CHUNKS = HEAD_DIM / 8, HALVES = UPPER ? 2 : 1;
    float top[2] = {neg_inf(), neg_inf()};
    bool grow = false;
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                if (MASK && first + 8 * j + 2 * quad_col + e >= live) sc[j][2 * h + e] = neg_inf();
                top[h] = fmaxf(top[h], sc[j][2 * h + e]);
            }
        top[h] = fmaxf(top[h], __shfl_xor_sync(0xffffffffu, top[h], 1));
        top[h] = fmaxf(top[h], __shfl_xor_sync(0xffffffffu, top[h], 2));
        grow |= top[h] > m_row[h] + kRescaleLog2;
    }
    if (__any_sync(0xffffffffu, grow)) {  // rare after the first tokens
#pragma unroll
        for (int h = 0; h < HALVES; ++h) {
            const bool up = top[h] > m_row[h] + kRescaleLog2;
            const float alpha = up ? exp2f(m_row[h] - top[h]) : 1.f;  // m = -inf: 0
            m_row[h] = up ? top[h] : m_row[h];
            l_row[h] *= alpha;
#pragma unroll
            for (int j = 0; j < CHUNKS; ++j) {
                o[j][2 * h] *= alpha;
                o[j][2 * h + 1] *= alpha;
            }
        }
    }
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
        const float shift = m_row[h] == neg_inf() ? 0.f : m_row[h];
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                sc[j][2 * h + e] = exp2f(sc[j][2 * h + e] - shift);
                l_row[h] += sc[j][2 * h + e];
            }
    }
}

// P of 16 tokens (n-tiles p0, p1) as the A operand of o += P V: a0, a1, a2, a3 (rows r, r + 8 of tokens
// 0-7, then of tokens 8-15), from S's C layout; without UPPER the upper rows are zero.
template <typename T, bool UPPER>
__device__ __forceinline__ void pack_p(const float (&p0)[4], const float (&p1)[4], unsigned (&pa)[4]) {
    pa[0] = pack2<T>(p0[0], p0[1]);
    pa[1] = UPPER ? pack2<T>(p0[2], p0[3]) : 0u;
    pa[2] = pack2<T>(p1[0], p1[1]);
    pa[3] = UPPER ? pack2<T>(p1[2], p1[3]) : 0u;
}

// CH chunks of 16 tokens of a staged tile on tensor cores, tokens [first, first + 16 CH), for the warp's
// m16 tile of query heads. S = q K^T by m16n8k16 (rows: query heads; n-tiles of 8 tokens), all chunks
// first, so their mma chains overlap; one online-softmax step over them on the quad of lanes that holds a
// row (query head lane/4, and lane/4 + 8 with UPPER; tokens 2*(lane%4) + {0, 1} of each n-tile); then
// o += P V with P taken from S's registers (the C layout of two n-tiles is the A layout of one k-step).
// Rows are HEAD_DIM elements; 16-byte chunk x of row r is stored at x ^ (r % 8). sk, sv: shared-space
// addresses of the tile's K and V; live: tokens that exist; qa[kk]: q's A fragment (a0..a3) of k-step kk.
template <typename T, int HEAD_DIM, bool MASK, bool UPPER, int CH>
__device__ __forceinline__ void consume_mma(unsigned sk, unsigned sv, int live, int first, int lane,
                                            const unsigned (&qa)[HEAD_DIM / 16][4], float (&o)[HEAD_DIM / 8][4],
                                            float (&m_row)[2], float (&l_row)[2]) {
    constexpr int CHUNKS = HEAD_DIM / 8;
    constexpr unsigned ROW_BYTES = HEAD_DIM * sizeof(T);
    float sc[2 * CH][4];
#pragma unroll
    for (int j = 0; j < 2 * CH; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
    {
        // ldmatrix.x4: lanes 8i..8i+7 address the rows of matrix i: tokens +8 for i >= 2, dims +8 for odd i
        const int row = (lane & 7) + ((lane >> 4) << 3), upper = (lane >> 3) & 1;
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
#pragma unroll
            for (int c = 0; c < CH; ++c) {
                const int tok = first + 16 * c + row;
                unsigned b[4];
                ldmatrix_x4(b, sk + tok * ROW_BYTES + (((2 * kk + upper) ^ (tok % 8)) << 4));
                mma_16816<T>(sc[2 * c], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b[0], b[1]);
                mma_16816<T>(sc[2 * c + 1], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b[2], b[3]);
            }
        }
    }
    softmax_mma<HEAD_DIM, MASK, UPPER, 2 * CH>(sc, live, first, lane % 4, o, m_row, l_row);
    // ldmatrix.x4.trans: matrix i covers tokens +8 for odd i, the next chunk of dims for i >= 2
    const int row = (lane & 7) + (((lane >> 3) & 1) << 3), next = lane >> 4;
#pragma unroll
    for (int c = 0; c < CH; ++c) {
        unsigned pa[4];
        pack_p<T, UPPER>(sc[2 * c], sc[2 * c + 1], pa);
        const int tok = first + 16 * c + row;
#pragma unroll
        for (int x = 0; x < CHUNKS; x += 2) {
            unsigned b[4];
            ldmatrix_x4_trans(b, sv + tok * ROW_BYTES + (((x + next) ^ (tok % 8)) << 4));
            mma_16816<T>(o[x], pa[0], pa[1], pa[2], pa[3], b[0], b[1]);
            mma_16816<T>(o[x + 1], pa[0], pa[1], pa[2], pa[3], b[2], b[3]);
        }
    }
}

// consume_mma over float8 e4m3 K/V (rows of HEAD_DIM bytes): the products of common.cuh's qk_e4m3 and
// pv_e4m3 (K and V converted to f16 in registers; q's A fragments permuted as qk_e4m3 reads K; output
// column n of n-tile j is dim n*HEAD_DIM/8 + j, an order the final merge undoes). The scales are outside
// (q and the output carry them). Chunks, tokens, rows and UPPER as for consume_mma.
template <int HEAD_DIM, bool MASK, bool UPPER, int CH>
__device__ __forceinline__ void consume_mma_fp8(unsigned sk, unsigned sv, int live, int first, int lane,
                                                const unsigned (&qa)[HEAD_DIM / 16][4], float (&o)[HEAD_DIM / 8][4],
                                                float (&m_row)[2], float (&l_row)[2]) {
    constexpr int ROW_CHUNKS = HEAD_DIM / 16;
    float sc[2 * CH][4];
#pragma unroll
    for (int j = 0; j < 2 * CH; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
    // ldmatrix.x4: lanes 8i..8i+7 address the rows of matrix i: tokens +8 for i >= 2, the next chunk
    // (k-step) for odd i
    const int row = (lane & 7) + ((lane >> 4) << 3), upper = (lane >> 3) & 1;
#pragma unroll
    for (int kk = 0; kk < ROW_CHUNKS; kk += 2)
#pragma unroll
        for (int c = 0; c < CH; ++c) {
            const int tok = first + 16 * c + row;
            qk_e4m3(sk + tok * HEAD_DIM + (swizzle<ROW_CHUNKS>(kk + upper, tok) << 4), qa[kk], qa[kk + 1],
                    sc[2 * c], sc[2 * c + 1]);
        }
    softmax_mma<HEAD_DIM, MASK, UPPER, 2 * CH>(sc, live, first, lane % 4, o, m_row, l_row);
#pragma unroll
    for (int c = 0; c < CH; ++c) {
        unsigned pa[4];
        pack_p<__half, UPPER>(sc[2 * c], sc[2 * c + 1], pa);
        pv_e4m3<HEAD_DIM>(sv, first + 16 * c, lane, pa, o);
    }
}

// An 8x8 16-bit matrix held as an mma fragment (lane l: row l/4, columns 2(l%4), 2(l%4) + 1), transposed in
// registers: the lane gets the same positions of the transpose.
__device__ __forceinline__ unsigned movmatrix_trans(unsigned x) {
    unsigned r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
    return r;
}

// o^T += V^T P^T for keys [key0, key0 + 16) of an e4m3 V tile, a narrow group's product (consume_mma_fp8_narrow):
// the A operand is V^T (rows: dims, k: keys), the B operand P^T (p0, p1: keys 2c, 2c+1 and 2c+8, 2c+9 of head
// r, c = lane%4, r = lane/4). Lane (r, c) reads keys 2c, 2c+1, 2c+8, 2c+9, bytes [r*HEAD_DIM/8, (r+1)*HEAD_DIM/8)
// of each with one shared load (as pv_e4m3), and pairs each dim's two keys with a byte permute: row r of m-tile t
// is dim r*HEAD_DIM/8 + 2t and row r + 8 the dim after it.
template <int HEAD_DIM>
__device__ __forceinline__ void pv_e4m3_narrow(unsigned sv, int key0, int lane, unsigned p0, unsigned p1,
                                               float (&o)[HEAD_DIM / 16][4]) {
    constexpr int WORDS = HEAD_DIM / 32;
    unsigned w[4][WORDS];
    load_v_keys<HEAD_DIM>(sv, key0, lane, w);
#pragma unroll
    for (int i = 0; i < WORDS; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // the lane's bytes 4i + 2h (rows r) and + 1 (rows r + 8): m-tile 2i + h
            const unsigned select = h ? 0x7362u : 0x5140u;  // (k0, k1) of byte 2h, then of byte 2h + 1
            const unsigned lo = __byte_perm(w[0][i], w[1][i], select), hi = __byte_perm(w[2][i], w[3][i], select);
            mma_16816<__half>(o[2 * i + h], e4m3x2_to_half2(lo & 0xffffu), e4m3x2_to_half2(lo >> 16),
                              e4m3x2_to_half2(hi & 0xffffu), e4m3x2_to_half2(hi >> 16), p0, p1);
        }
}

// consume_mma_fp8 for a narrow group (at most 8 heads), transposed: the keys are the rows of the m16 tiles and
// the heads their 8 columns, S^T = K q^T and o^T += V^T P^T. Heads as rows would leave half of every m16 tile
// padding; as columns the products take half the mma and o^T half the registers (which lets more thread blocks
// share an SM: the FP8 kernel is bound by its warps' latencies, not by its bytes). Lane (r, c) = (lane/4,
// lane%4) holds heads 2c, 2c+1 (its state [0], [1]: m_row, shared by the 8 lanes of one c, and its part of
// l_row) of keys r and r + 8 of each chunk; o[t] holds dims r*HEAD_DIM/8 + 2t (elements 0, 1: the two heads)
// and the dim after it (2, 3), an order the final merge undoes. qb[x]: q's B fragment of k-step x, dims
// 16x + 4c, +1 and 16x + 4c + 2, +3 of head r (the order in which the K bytes come). S^T's C fragment of 16
// keys is two 8x8 (keys x heads) matrices; transposed in registers (movmatrix) they are P^T's B fragment.
template <int HEAD_DIM, bool MASK, int CH>
__device__ __forceinline__ void consume_mma_fp8_narrow(unsigned sk, unsigned sv, int live, int first, int lane,
                                                       const unsigned (&qb)[HEAD_DIM / 16][2],
                                                       float (&o)[HEAD_DIM / 16][4], float (&m_row)[2],
                                                       float (&l_row)[2]) {
    constexpr int ROW_CHUNKS = HEAD_DIM / 16;
    float sc[CH][4];
#pragma unroll
    for (int c = 0; c < CH; ++c) sc[c][0] = sc[c][1] = sc[c][2] = sc[c][3] = 0.f;
    // ldmatrix.x4: lanes 8i..8i+7 address the rows of matrix i: keys +8 for odd i, the next chunk for i >= 2
    const int row = (lane & 7) + (((lane >> 3) & 1) << 3), next = lane >> 4;
#pragma unroll
    for (int x = 0; x < ROW_CHUNKS; x += 2)
#pragma unroll
        for (int c = 0; c < CH; ++c) {
            const int key = first + 16 * c + row;
            unsigned b[4];
            ldmatrix_x4(b, sk + key * HEAD_DIM + (swizzle<ROW_CHUNKS>(x + next, key) << 4));
#pragma unroll
            for (int h = 0; h < 2; ++h)  // k-step x + h: matrices 2h (keys 0-7, rows r) and 2h + 1 (keys 8-15)
                mma_16816<__half>(sc[c], e4m3x2_to_half2(b[2 * h] & 0xffffu), e4m3x2_to_half2(b[2 * h + 1] & 0xffffu),
                                  e4m3x2_to_half2(b[2 * h] >> 16), e4m3x2_to_half2(b[2 * h + 1] >> 16),
                                  qb[x + h][0], qb[x + h][1]);
        }
    // Online softmax: a lane's own maximum decides whether any head's running max must grow (rare after the
    // first keys); only then are the maxima of the 8 lanes holding a head combined (shuffles over lane/4).
    const int r = lane / 4;
    float top[2] = {neg_inf(), neg_inf()};
#pragma unroll
    for (int c = 0; c < CH; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            if (MASK && first + 16 * c + r + 8 * (e >> 1) >= live) sc[c][e] = neg_inf();
            top[e & 1] = fmaxf(top[e & 1], sc[c][e]);
        }
    if (__any_sync(0xffffffffu, top[0] > m_row[0] + kRescaleLog2 || top[1] > m_row[1] + kRescaleLog2)) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float t = top[h];
            t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, 4));
            t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, 8));
            t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, 16));
            const bool up = t > m_row[h] + kRescaleLog2;
            const float alpha = up ? exp2f(m_row[h] - t) : 1.f;  // m = -inf: 0
            m_row[h] = up ? t : m_row[h];
            l_row[h] *= alpha;
#pragma unroll
            for (int j = 0; j < HEAD_DIM / 16; ++j) {
                o[j][h] *= alpha;
                o[j][h + 2] *= alpha;
            }
        }
    }
    const float shift[2] = {m_row[0] == neg_inf() ? 0.f : m_row[0], m_row[1] == neg_inf() ? 0.f : m_row[1]};
#pragma unroll
    for (int c = 0; c < CH; ++c) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            sc[c][e] = exp2f(sc[c][e] - shift[e & 1]);
            l_row[e & 1] += sc[c][e];
        }
        const unsigned p0 = movmatrix_trans(pack2<__half>(sc[c][0], sc[c][1]));  // keys 0-7 x heads, transposed
        const unsigned p1 = movmatrix_trans(pack2<__half>(sc[c][2], sc[c][3]));  // keys 8-15
        pv_e4m3_narrow<HEAD_DIM>(sv, first + 16 * c, lane, p0, p1, o);
    }
}

// Add to a device-wide count with acquire-release semantics: writes before it (this
// thread's, and those a barrier made it observe) are visible to whoever reads the count
// after it, and that reader sees theirs. On sm_90 it is one MEMBAR.ALL.GPU, the atomic
// and an L1 invalidate, where __threadfence() + atomicAdd take a MEMBAR.SC.GPU on each side.
__device__ __forceinline__ int add_acq_rel(int* count, int value) {
    int old;
    asm volatile("atom.add.acq_rel.gpu.global.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(count), "r"(value) : "memory");
    return old;
}

// Split-K, after a block has written its segment's (o, m, l) for query heads
// head_row .. head_row + GROUP - 1: count the segment in; the last of the item's LIVE
// segments (the first LIVE of the NUM_SPLITS: those holding tokens, at least 2) to
// arrive combines them exactly: m = max m_i, l = sum l_i 2^(m_i - m),
// out = sum o_i 2^(m_i - m) / l, into output rows out_shift further on (0 but for an
// INDEXED item). Each thread merges 4 dims of one query head, loading 8 segments at a
// time so that their loads are in flight together. `last` is one int of the block's
// dynamic shared memory, free at this point.
template <typename T, int GROUP, int HEAD_DIM, int NT>
__device__ __forceinline__ void arrive_and_merge(const float* part_o, const float2* part_ml, int* arrivals,
                                                 long long head_row, long long out_shift, int live, int num_splits,
                                                 T* out, int* last) {
    __syncthreads();  // the block's partials are written
    const long long item = head_row / GROUP;
    if (threadIdx.x == 0) {
        *last = add_acq_rel(arrivals + item, 1) == live - 1;
        if (*last) arrivals[item] = 0;  // ready for the next launch
    }
    __syncthreads();  // the merging block's threads read after thread 0's acquire
    if (!*last) return;
    constexpr int QUADS = HEAD_DIM / 4, BATCH = 8;
    static_assert(HEAD_DIM % 4 == 0, "the merge moves 4 dims at a time");
    for (int c = threadIdx.x; c < GROUP * QUADS; c += NT) {
        const long long row = head_row + c / QUADS;
        const float2* const ml = part_ml + row * num_splits;
        const float4* const o = reinterpret_cast<const float4*>(part_o + row * num_splits * HEAD_DIM) + c % QUADS;
        float m_run = neg_inf(), l_run = 0.f;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int s0 = 0; s0 < live; s0 += BATCH) {
            float2 seg[BATCH];
            float4 part[BATCH];
#pragma unroll
            for (int j = 0; j < BATCH; ++j) {  // past the end: the last segment again, weighed 0 below
                const int s = min(s0 + j, live - 1);
                seg[j] = __ldcg(ml + s);  // L2: written by other SMs during this launch
                part[j] = __ldcg(o + s * QUADS);
            }
            float top = m_run;
#pragma unroll
            for (int j = 0; j < BATCH; ++j) top = s0 + j < live ? fmaxf(top, seg[j].x) : top;
            const float alpha = exp2f(m_run - top);  // m_run = -inf: 0 (a segment with tokens has m finite)
            l_run *= alpha;
            acc.x *= alpha, acc.y *= alpha, acc.z *= alpha, acc.w *= alpha;
#pragma unroll
            for (int j = 0; j < BATCH; ++j) {
                const bool used = s0 + j < live;
                const float w = used ? exp2f(seg[j].x - top) : 0.f;
                const float4 p = used ? part[j] : make_float4(0.f, 0.f, 0.f, 0.f);
                l_run = fmaf(w, used ? seg[j].y : 0.f, l_run);
                acc.x = fmaf(w, p.x, acc.x), acc.y = fmaf(w, p.y, acc.y);
                acc.z = fmaf(w, p.z, acc.z), acc.w = fmaf(w, p.w, acc.w);
            }
            m_run = top;
        }
        const float inv = l_run > 0.f ? 1.f / l_run : 0.f;
        T* const dst = out + (row + out_shift) * HEAD_DIM + 4 * (c % QUADS);
        dst[0] = from_float<T>(acc.x * inv), dst[1] = from_float<T>(acc.y * inv);
        dst[2] = from_float<T>(acc.z * inv), dst[3] = from_float<T>(acc.w * inv);
    }
}

// q, out:       [batch, q_heads, HEAD_DIM], contiguous ([tokens, ...] when INDEXED); q_heads is
//               num_kv_heads * GROUP * group_chunks
// k, v:         planes; element (block b, kv head h, slot s, dim d) at b*block_stride + (h*BLOCK_SIZE + s)*HEAD_DIM + d
// block_tables: [batch, >= max_blocks] int32 with row stride table_stride (unused when !PAGED)
// seq_lens:     [batch] int32, clamped to [0, max_blocks*BLOCK_SIZE]
// grid:         (num_kv_heads * group_chunks, batch, num_splits); blockIdx.x = KV head x
//               group_chunks + chunk, query heads [blockIdx.x * GROUP, + GROUP); segment `split`
//               covers tokens [split*segment_tokens, (split+1)*segment_tokens), the last one up to
//               the end; segment_tokens is a multiple of TILE
// part_o, part_ml, arrivals: nullptr (write out) or the split workspace
//               [batch*q_heads, num_splits, HEAD_DIM] floats, [batch*q_heads, num_splits] (m, l)
//               and [batch*gridDim.x] int32 arrival counts, zero before the launch (and after it:
//               the merging block resets its count)
// rows:         INDEXED only (a mixed step's decode rows): [batch] of (table row, query token); item
//               blockIdx.y reads block_tables and seq_lens at the first and q and out at the second.
//               Otherwise item i reads row i of each.
// k_scales, v_scales: FP8 only (KV = e4m3): float32 [num_kv_heads], the value of a stored byte b of
//               KV head h is e4m3(b) * scale[h]; the element type of k, v and block_stride is KV.
template <typename T, typename KV, int HEAD_DIM, int BLOCK_SIZE, int GROUP, bool PAGED, int THREADS, int LANES,
          int TILE, int STAGES, bool MMA, int IDS_WINDOW, bool INDEXED>
__device__ __forceinline__ void
decode_body(const T* __restrict__ q, const KV* __restrict__ k, const KV* __restrict__ v, long long block_stride,
            const int* __restrict__ block_tables, long long table_stride, int max_blocks,
            const int* __restrict__ seq_lens, float scale_log2, int segment_tokens, int group_chunks,
            T* __restrict__ out, float* __restrict__ part_o, float2* __restrict__ part_ml, int* __restrict__ arrivals,
            const int2* __restrict__ rows, const float* __restrict__ k_scales, const float* __restrict__ v_scales) {
    using S = DecodeShape<KV, HEAD_DIM, GROUP, THREADS, LANES, TILE, STAGES, IDS_WINDOW>;
    constexpr int V = S::kVec, NV = S::kRowVecs, LV = S::kLaneVecs, COPIES = S::kCopies;
    constexpr int LG = S::kLaneGroups, NT = S::kThreads, STEP = S::kStep;
    constexpr bool FP8 = !same_type<KV, T>::value;
    static_assert(!FP8 || (MMA && same_type<KV, e4m3>::value), "FP8 K/V runs on tensor cores only");
    // Built at two stages, the FP8 kernel stopped with an illegal instruction at its first cp.async under the
    // evict-first L2 hint (compute-sanitizer; the same instance without the hint ran right): refused here, so
    // such a geometry fails to compile rather than leaving the CUDA context unusable (docs/KERNELS.md).
    static_assert(!FP8 || STAGES >= 3, "FP8 K/V: at least three pipeline stages");
    // MMA: m16 tiles of query heads, the upper half of a tile in use, and the warps sharing a tile
    // (each holds a part of the tile's tokens: PARTS states a head to merge at the end).
    constexpr int WARPS = THREADS / 32, M_TILES = !MMA || GROUP <= 16 ? 1 : GROUP <= 32 ? 2 : 4;
    constexpr bool UPPER = MMA && GROUP > 8;
    // FP8 with at most 8 heads: the narrow, transposed form (consume_mma_fp8_narrow), heads as n8 columns
    constexpr bool NARROW = FP8 && GROUP <= 8;
    constexpr int O_TILES = NARROW ? HEAD_DIM / 16 : HEAD_DIM / 8;  // C fragments of the output
    constexpr int PARTS = MMA ? WARPS / M_TILES : LG;
    static_assert(!MMA || (GROUP <= 64 && WARPS % M_TILES == 0), "MMA: whole warps per m16 tile of heads");
    // MMA: chunks of 16 tokens a warp consumes a tile (M_TILES when a tile has 16 tokens a warp; FP8's tiles
    // have twice as many, so that a warp has two chunks' chains in flight)
    constexpr int WARP_CHUNKS = MMA ? TILE / (16 * PARTS) : 1;
    static_assert(!MMA || TILE % (16 * PARTS) == 0, "MMA: whole chunks of 16 tokens a warp");
    static_assert(MMA || GROUP <= 8, "CUDA cores: at most 8 heads a thread block (wider groups come in chunks)");
    static_assert(PARTS * GROUP * (HEAD_DIM + 2) * 4 <= S::kSmemBytes,
                  "the final merge reuses the pipeline's shared memory");
    launch_dependents();  // PDL (above): the next kernel may launch now

    // 128-byte aligned: stages 16 bytes off a 128-byte boundary (what a static __shared__
    // variable placed before them does) made every case markedly slower (docs/KERNELS.md).
    extern __shared__ __align__(128) unsigned char smem_raw[];
    KV* const smem_k = reinterpret_cast<KV*>(smem_raw);
    KV* const smem_v = smem_k + STAGES * S::kTileElems;

    const int kv_head = MMA ? blockIdx.x : blockIdx.x / group_chunks;  // MMA: group_chunks is 1
    const int item = blockIdx.y, split = blockIdx.z, num_splits = gridDim.z;
    const int tid = threadIdx.x, lane = tid % LANES, lane_group = tid / LANES;
    const int2 pick = INDEXED ? __ldg(rows + item) : make_int2(item, item);  // (table row, query token)
    const int seq = pick.x;
    const long long head_row = ((long long)item * gridDim.x + blockIdx.x) * GROUP;  // query head g=0's split row
    const long long q_row = INDEXED ? ((long long)pick.y * gridDim.x + blockIdx.x) * GROUP : head_row;  // of q, out

    // Every load the start needs is issued before any of them is used (the length, the
    // first window of block ids, q), so their latencies overlap instead of adding up at
    // every thread block's start; a segment past the sequence's end wastes them.
    const int raw_len = seq_lens[seq];
    const int begin = split * segment_tokens;
    const int* const table_row = block_tables + (PAGED ? seq * table_stride : 0);
    // A segment that is not its sequence's last reads only its own ids, not a whole window (fewer
    // table bytes when many short segments start at once); the last may run on to the sequence's
    // end and takes a whole window.
    const int id_limit = split == num_splits - 1
        ? max_blocks : min(max_blocks, (begin + segment_tokens + BLOCK_SIZE - 1) / BLOCK_SIZE);
    int first_ids[IDS_WINDOW / NT];
#pragma unroll
    for (int i = 0; i < IDS_WINDOW / NT; ++i) {
        const int logical = begin / BLOCK_SIZE + i * NT + tid;
        first_ids[i] = PAGED && logical < id_limit ? __ldg(table_row + logical) : 0;
    }

    constexpr int CORE = MMA ? 1 : GROUP;  // CUDA cores: heads held in registers (the MMA path holds none)
    float qf[CORE][LV][V];
    // MMA: q as the A operand of m16n8k16, rows = the query heads of the warp's m16 tile (padded
    // with zeros past the group), pre-scaled; qa[kk] = a0..a3 of k-step kk (a1, a3: rows + 8).
    // NARROW: q as the B operand, qa[kk] = b0, b1 of k-step kk: head quad_row (zeros past the group).
    const int warp = tid / 32, quad_row = (tid % 32) / 4, quad_col = tid % 4;
    const int m_tile = warp / PARTS, part = warp % PARTS;  // MMA: the warp's heads and share of the tile
    unsigned qa[MMA ? HEAD_DIM / 16 : 1][NARROW ? 2 : 4];
    if constexpr (MMA) {
        if constexpr (FP8) scale_log2 *= __ldg(k_scales + kv_head);  // the K scale joins q's pre-scale
    }
    if constexpr (NARROW) {
        const T* const row = q + (q_row + quad_row) * HEAD_DIM;
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // dims 16kk + 4c + 2h, + 1, as consume_mma_fp8_narrow reads K
                const int d = 16 * kk + 4 * quad_col + 2 * h;
                qa[kk][h] = quad_row < GROUP ? pack2<__half>(to_float(row[d]) * scale_log2,
                                                             to_float(row[d + 1]) * scale_log2) : 0u;
            }
    } else if constexpr (MMA) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {  // rows quad_row and quad_row + 8 of the m16 tile
            const int head = 16 * m_tile + quad_row + 8 * r;
            const T* const row = q + (q_row + head) * HEAD_DIM;
#pragma unroll
            for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {  // FP8: dims permuted as consume_mma_fp8 reads K
                    const int d = FP8 ? 16 * kk + 4 * quad_col + 2 * h : 16 * kk + 8 * h + 2 * quad_col;
                    unsigned a = 0u;
                    if ((UPPER || r == 0) && head < GROUP) {
                        const float x0 = to_float(row[d]) * scale_log2, x1 = to_float(row[d + 1]) * scale_log2;
                        a = FP8 ? pack2<__half>(x0, x1) : pack2<T>(x0, x1);
                    }
                    qa[kk][2 * h + r] = a;
                }
            }
        }
    } else {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            load_row<T, NV, LANES, LV>(q + (q_row + g) * HEAD_DIM, lane, qf[g]);
#pragma unroll
            for (int j = 0; j < LV; ++j)
#pragma unroll
                for (int e = 0; e < V; ++e) qf[g][j][e] *= scale_log2;
        }
    }

    const int len = min(max(raw_len, 0), max_blocks * BLOCK_SIZE);
    const int end = split == num_splits - 1 ? len : min(len, begin + segment_tokens);
    // Segments holding tokens (split 0 stands for an empty sequence); the others take no
    // part. With one, it is the whole sequence and writes out itself.
    const int live = max(1, min(num_splits, (len + segment_tokens - 1) / segment_tokens));
    if (split >= live) return;
    const bool merged = part_o != nullptr && live > 1;
    if (begin >= end) {  // an empty sequence: its output is zero
        grid_dependency_wait();  // PDL: before any write
        for (int i = tid; i < GROUP * HEAD_DIM; i += NT) out[q_row * HEAD_DIM + i] = from_float<T>(0.f);
        return;
    }

    // Copy c of a tile moves vector i = c*NT + tid: token row i / NV, vector i % NV.
    // A (block, head) chunk is BLOCK_SIZE*NV contiguous vectors, so the block a copy
    // falls in, relative to the tile's first block, is fixed per thread (and known at
    // compile time when a chunk is a whole number of copy rounds); so is its offset
    // inside the block, except that a tile shorter than a block adds its slot offset.
    constexpr int CHUNK = BLOCK_SIZE * NV;
    const char* const k_bytes = reinterpret_cast<const char*>(k);
    const long long stride_bytes = block_stride * (long long)sizeof(KV);
    const long long v_minus_k = reinterpret_cast<const char*>(v) - k_bytes;  // same offset in the V plane
    const unsigned smem_k_addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_k));
    constexpr unsigned V_SMEM = STAGES * S::kTileElems * sizeof(KV);  // smem_v - smem_k, bytes
    const unsigned long long read_once = evict_first_policy();  // the L2 policy of the K/V stream
    int row_of[COPIES], block_of[COPIES], src_off[COPIES];
#pragma unroll
    for (int c = 0; c < COPIES; ++c) {
        const int i = c * NT + tid, t = i / NV;
        row_of[c] = t;
        block_of[c] = TILE <= BLOCK_SIZE ? 0 : CHUNK % NT == 0 ? c * NT / CHUNK : i / CHUNK;
        src_off[c] = ((kv_head * BLOCK_SIZE + t % BLOCK_SIZE) * HEAD_DIM + (i % NV) * V) * (int)sizeof(KV);
    }
    auto copy_exists = [&](int c) { return S::kEvenCopies || c * NT + tid < TILE * NV; };

    // The table entries of the next IDS_WINDOW logical blocks, loaded by the whole thread
    // block with coalesced reads into shared memory (after the pipeline's bytes), so a
    // tile's ids cost shared-memory reads rather than global loads on every tile.
    int* const smem_ids = reinterpret_cast<int*>(smem_raw + S::kSmemBytes);
    int window = 0;  // logical block held in smem_ids[0]
    auto load_window = [&](int first_block) {
#pragma unroll
        for (int i = 0; i < IDS_WINDOW / NT; ++i) {
            const int logical = first_block + i * NT + tid;
            smem_ids[i * NT + tid] = logical < max_blocks ? __ldg(table_row + logical) : 0;
        }
        window = first_block;
    };

    // Block id of each copy of a tile (-1 past the end), read one tile before the copies
    // are issued. FULL: the whole tile exists (every tile but the last).
    long long ids[COPIES];
    auto fetch = [&](int tile, auto full) {
        constexpr bool FULL = decltype(full)::value;
        const int first = begin + tile * TILE;
#pragma unroll
        for (int c = 0; c < COPIES; ++c) {
            ids[c] = -1;
            if (copy_exists(c) && (FULL || first + row_of[c] < end)) {
                const int logical = first / BLOCK_SIZE + block_of[c];
                ids[c] = PAGED ? (long long)smem_ids[logical - window] : (long long)seq * max_blocks + logical;
            }
        }
    };
    auto issue = [&](int tile, auto full) {
        constexpr bool FULL = decltype(full)::value;
        const int first = begin + tile * TILE;
        const unsigned stage = smem_k_addr + (tile % STAGES) * S::kTileElems * (unsigned)sizeof(KV);
        // a tile inside one block starts at slot first % BLOCK_SIZE of it
        const int slot_bytes = TILE < BLOCK_SIZE ? (first % BLOCK_SIZE) * HEAD_DIM * (int)sizeof(KV) : 0;
#pragma unroll
        for (int c = 0; c < COPIES; ++c) {
            if (copy_exists(c)) {
                // MMA: 16-byte chunk x of row r is stored swizzled, so ldmatrix's 8 rows hit 8 banks
                const int vec = (c * NT + tid) % NV, chunk = MMA ? swizzle<NV>(vec, row_of[c]) : vec;
                const unsigned dst = stage + (row_of[c] * HEAD_DIM + chunk * V) * sizeof(KV);
                const bool live = FULL || ids[c] >= 0;  // else zero-fill, reading nothing
                const char* const from = live ? k_bytes + ids[c] * stride_bytes + src_off[c] + slot_bytes
                                              : reinterpret_cast<const char*>(q);
                cp_async16_shared(dst, from, live ? 16 : 0, read_once);
                cp_async16_shared(dst + V_SMEM, live ? from + v_minus_k : from, live ? 16 : 0, read_once);
            }
        }
    };
    // The whole tile exists: every tile but a segment's last.
    auto is_full = [&](int tile) { return begin + (tile + 1) * TILE <= end; };
    auto fetch_tile = [&](int tile) {
        if (is_full(tile)) fetch(tile, integral_constant<bool, true>());
        else fetch(tile, integral_constant<bool, false>());
    };
    auto issue_tile = [&](int tile) {
        // PDL: the tile holding the sequence's newest token waits for the kernel before (its K/V write)
        if (end == len && begin + (tile + 1) * TILE >= len) grid_dependency_wait();
        if (is_full(tile)) issue(tile, integral_constant<bool, true>());
        else issue(tile, integral_constant<bool, false>());
    };

    float m[CORE], l[CORE], acc[CORE][LV][V];
#pragma unroll
    for (int g = 0; g < CORE; ++g) {
        m[g] = neg_inf();
        l[g] = 0.f;
#pragma unroll
        for (int j = 0; j < LV; ++j)
#pragma unroll
            for (int e = 0; e < V; ++e) acc[g][j][e] = 0.f;
    }

    // STEP tokens of a staged tile: scores, online softmax, weighted V. MASK: the tile
    // runs past the end (only the last one), so scores of missing tokens become -inf.
    auto consume = [&](const KV* sk, const KV* sv, int first, int live, auto mask) {
        constexpr bool MASK = decltype(mask)::value;
        float s[STEP][CORE];
        dot_scores<KV, HEAD_DIM, CORE, NV, LANES, LV, STEP, LG>(sk, first, lane, qf, s);
        float top[CORE];
        bool grow = false;
#pragma unroll
        for (int g = 0; g < CORE; ++g) {
            top[g] = neg_inf();
#pragma unroll
            for (int u = 0; u < STEP; ++u) {
                if (MASK && first + u * LG >= live) s[u][g] = neg_inf();
                top[g] = fmaxf(top[g], s[u][g]);
            }
            grow |= top[g] > m[g] + kRescaleLog2;
        }
        if (__any_sync(0xffffffffu, grow)) {  // warp-uniform, rare after the first tokens
#pragma unroll
            for (int g = 0; g < CORE; ++g) {
                const bool up = top[g] > m[g] + kRescaleLog2;
                const float alpha = up ? exp2f(m[g] - top[g]) : 1.f;  // m = -inf: 0
                m[g] = up ? top[g] : m[g];
                l[g] *= alpha;
#pragma unroll
                for (int j = 0; j < LV; ++j)
#pragma unroll
                    for (int e = 0; e < V; ++e) acc[g][j][e] *= alpha;
            }
        }
#pragma unroll
        for (int g = 0; g < CORE; ++g) {
            const float shift = m[g] == neg_inf() ? 0.f : m[g];  // m = -inf only while every score is -inf
#pragma unroll
            for (int u = 0; u < STEP; ++u) {
                s[u][g] = exp2f(s[u][g] - shift);
                l[g] += s[u][g];
            }
        }
        accumulate<KV, HEAD_DIM, CORE, NV, LANES, LV, STEP, LG>(sv, first, lane, s, acc);
    };

    // MMA: the state of rows quad_row and quad_row + 8 of the warp's m16 tile (their quad of lanes):
    // output o (C fragments, 8 dims per n-tile), running max and this lane's part of the sum, [0] and
    // [1] (see consume_mma).
    // NARROW: heads 2 quad_col and + 1, and o^T (see consume_mma_fp8_narrow).
    float o[MMA ? O_TILES : 1][4], m_row[2] = {neg_inf(), neg_inf()}, l_row[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < (MMA ? O_TILES : 1); ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;

    const int num_tiles = (end - begin + TILE - 1) / TILE;
    if (PAGED) {
#pragma unroll
        for (int i = 0; i < IDS_WINDOW / NT; ++i) smem_ids[i * NT + tid] = first_ids[i];
        window = begin / BLOCK_SIZE;
        __syncthreads();
    }
    fetch_tile(0);
#pragma unroll
    for (int p = 0; p < STAGES - 1; ++p) {
        if (p < num_tiles) issue_tile(p);
        cp_async_commit();
        if (p + 1 < num_tiles) fetch_tile(p + 1);
    }
    for (int tile = 0; tile < num_tiles; ++tile) {
        cp_async_wait<STAGES - 2>();  // this thread's copies of `tile` have landed
        __syncthreads();              // everyone's have, and everyone is done with tile-1's stage
        const int ahead = tile + STAGES - 1;
        if (ahead < num_tiles) issue_tile(ahead);
        cp_async_commit();
        // Past the staged ids: every thread is beyond this tile's barrier, so none reads
        // the old window any more (the ids of tiles in flight are in registers).
        if (PAGED && ahead + 1 < num_tiles && (begin + (ahead + 2) * TILE - 1) / BLOCK_SIZE >= window + IDS_WINDOW) {
            load_window((begin + (ahead + 1) * TILE) / BLOCK_SIZE);
            __syncthreads();
        }
        if (ahead + 1 < num_tiles) fetch_tile(ahead + 1);

        const int live = end - (begin + tile * TILE);  // tokens of this tile that exist
        if constexpr (MMA) {
            const unsigned sk = smem_k_addr + (tile % STAGES) * S::kTileElems * (unsigned)sizeof(KV);
            const int wl = tid % 32;
            const unsigned sv = sk + V_SMEM;
            // The warp's part of the tile: WARP_CHUNKS chunks of 16 tokens, consumed CH at a time (four
            // chunks' scores at once spill at head_dim 128).
            constexpr int CH = WARP_CHUNKS > 2 ? 2 : WARP_CHUNKS;
            const bool full = is_full(tile);
#pragma unroll
            for (int i = 0; i < WARP_CHUNKS / CH; ++i) {
                const int first = 16 * (WARP_CHUNKS * part + CH * i);
                if constexpr (NARROW) {
                    if (full) consume_mma_fp8_narrow<HEAD_DIM, false, CH>(sk, sv, live, first, wl, qa, o, m_row, l_row);
                    else consume_mma_fp8_narrow<HEAD_DIM, true, CH>(sk, sv, live, first, wl, qa, o, m_row, l_row);
                } else if constexpr (FP8) {
                    if (full) consume_mma_fp8<HEAD_DIM, false, UPPER, CH>(sk, sv, live, first, wl, qa, o, m_row, l_row);
                    else consume_mma_fp8<HEAD_DIM, true, UPPER, CH>(sk, sv, live, first, wl, qa, o, m_row, l_row);
                } else {
                    if (full) consume_mma<T, HEAD_DIM, false, UPPER, CH>(sk, sv, live, first, wl, qa, o, m_row, l_row);
                    else consume_mma<T, HEAD_DIM, true, UPPER, CH>(sk, sv, live, first, wl, qa, o, m_row, l_row);
                }
            }
        } else {
            const KV* const sk = smem_k + (tile % STAGES) * S::kTileElems;
            const KV* const sv = smem_v + (tile % STAGES) * S::kTileElems;
            if (is_full(tile)) {
#pragma unroll
                for (int u0 = 0; u0 < S::kTokensPerGroup; u0 += STEP)
                    consume(sk, sv, lane_group + u0 * LG, live, integral_constant<bool, false>());
            } else {
#pragma unroll
                for (int u0 = 0; u0 < S::kTokensPerGroup; u0 += STEP)
                    consume(sk, sv, lane_group + u0 * LG, live, integral_constant<bool, true>());
            }
        }
    }

    // Merge the lane groups' states through shared memory (the pipeline's, now idle).
    cp_async_wait<0>();
    __syncthreads();
    grid_dependency_wait();  // PDL: the kernel before is complete before this block writes (done if it waited)
    float* const red_acc = reinterpret_cast<float*>(smem_raw);  // [PARTS][GROUP][HEAD_DIM]
    float* const red_m = red_acc + PARTS * GROUP * HEAD_DIM;     // [PARTS][GROUP]
    float* const red_l = red_m + PARTS * GROUP;                  // [PARTS][GROUP]
    if constexpr (NARROW) {  // a head's state is on the 8 lanes of its quad_col
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            l_row[h] += __shfl_xor_sync(0xffffffffu, l_row[h], 4);
            l_row[h] += __shfl_xor_sync(0xffffffffu, l_row[h], 8);
            l_row[h] += __shfl_xor_sync(0xffffffffu, l_row[h], 16);
            const int head = 2 * quad_col + h;
            if (quad_row == 0 && head < GROUP) red_m[part * GROUP + head] = m_row[h];
        }
        __syncthreads();
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int head = 2 * quad_col + h;
            if (head < GROUP) {
                float top = neg_inf();
                for (int x = 0; x < PARTS; ++x) top = fmaxf(top, red_m[x * GROUP + head]);
                const float f = exp2f(m_row[h] - (top == neg_inf() ? 0.f : top));
                if (quad_row == 0) red_l[part * GROUP + head] = l_row[h] * f;
                float* const dst = red_acc + (part * GROUP + head) * HEAD_DIM + quad_row * (HEAD_DIM / 8);
#pragma unroll
                for (int t = 0; t < O_TILES; ++t) {  // rows quad_row and + 8 of m-tile t: dims 2t and 2t + 1
                    dst[2 * t] = o[t][h] * f;
                    dst[2 * t + 1] = o[t][h + 2] * f;
                }
            }
        }
    } else if constexpr (MMA) {  // a lane group is a warp; a row's state is on its quad
        static_assert(LG == WARPS, "MMA: the lane groups are the warps (LANES = 32)");
        constexpr int HALVES = UPPER ? 2 : 1;
#pragma unroll
        for (int h = 0; h < HALVES; ++h) {
            const int head = 16 * m_tile + quad_row + 8 * h;
            l_row[h] += __shfl_xor_sync(0xffffffffu, l_row[h], 1);
            l_row[h] += __shfl_xor_sync(0xffffffffu, l_row[h], 2);
            if (quad_col == 0 && head < GROUP) red_m[part * GROUP + head] = m_row[h];
        }
        __syncthreads();
#pragma unroll
        for (int h = 0; h < HALVES; ++h) {
            const int head = 16 * m_tile + quad_row + 8 * h;
            if (head < GROUP) {
                float top = neg_inf();
                for (int x = 0; x < PARTS; ++x) top = fmaxf(top, red_m[x * GROUP + head]);
                const float f = exp2f(m_row[h] - (top == neg_inf() ? 0.f : top));
                if (quad_col == 0) red_l[part * GROUP + head] = l_row[h] * f;
                float* const dst = red_acc + (part * GROUP + head) * HEAD_DIM;
                if constexpr (FP8) {  // column n of n-tile j is dim n * HEAD_DIM / 8 + j (consume_mma_fp8)
#pragma unroll
                    for (int j = 0; j < HEAD_DIM / 8; ++j) {
                        dst[2 * quad_col * (HEAD_DIM / 8) + j] = o[j][2 * h] * f;
                        dst[(2 * quad_col + 1) * (HEAD_DIM / 8) + j] = o[j][2 * h + 1] * f;
                    }
                } else {
#pragma unroll
                    for (int j = 0; j < HEAD_DIM / 8; ++j) {
                        dst[8 * j + 2 * quad_col] = o[j][2 * h] * f;
                        dst[8 * j + 2 * quad_col + 1] = o[j][2 * h + 1] * f;
                    }
                }
            }
        }
    } else {
        if (lane == 0) {
#pragma unroll
            for (int g = 0; g < GROUP; ++g) red_m[lane_group * GROUP + g] = m[g];
        }
        __syncthreads();
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            float top = neg_inf();
            for (int x = 0; x < LG; ++x) top = fmaxf(top, red_m[x * GROUP + g]);
            const float f = exp2f(m[g] - (top == neg_inf() ? 0.f : top));
            if (lane == 0) red_l[lane_group * GROUP + g] = l[g] * f;
            float* const dst = red_acc + (lane_group * GROUP + g) * HEAD_DIM;
#pragma unroll
            for (int j = 0; j < LV; ++j) {
                const int vec = lane + j * LANES;
                if (LANES * (j + 1) <= NV || vec < NV) {
#pragma unroll
                    for (int e = 0; e < V; ++e) dst[vec * V + e] = acc[g][j][e] * f;
                }
            }
        }
    }
    __syncthreads();
    // Each thread finishes one 16-byte vector of the output (OV dims of one query head) and
    // stores it whole: OV times fewer stores than one element a thread. FP8: times the V scale.
    constexpr int OV = Vec16<T>::kElems, ONV = HEAD_DIM / OV;
    float v_scale = 1.f;
    if constexpr (FP8) v_scale = __ldg(v_scales + kv_head);
    for (int c = tid; c < GROUP * ONV; c += NT) {
        const int g = c / ONV, d0 = (c % ONV) * OV;
        float sum[OV], total = 0.f, top = neg_inf();
#pragma unroll
        for (int e = 0; e < OV; ++e) sum[e] = 0.f;
        for (int x = 0; x < PARTS; ++x) {
            const float* const src = red_acc + (x * GROUP + g) * HEAD_DIM + d0;
#pragma unroll
            for (int e = 0; e < OV; ++e) sum[e] += src[e];
            total += red_l[x * GROUP + g];
            top = fmaxf(top, red_m[x * GROUP + g]);
        }
        if constexpr (FP8) {
#pragma unroll
            for (int e = 0; e < OV; ++e) sum[e] *= v_scale;
        }
        const long long row = head_row + g;
        if (merged) {
            float4* const dst = reinterpret_cast<float4*>(part_o + (row * num_splits + split) * HEAD_DIM + d0);
#pragma unroll
            for (int e = 0; e < OV / 4; ++e)
                dst[e] = make_float4(sum[4 * e], sum[4 * e + 1], sum[4 * e + 2], sum[4 * e + 3]);
            if (d0 == 0) part_ml[row * num_splits + split] = make_float2(top, total);
        } else {
            const float inv = total > 0.f ? 1.f / total : 0.f;
#pragma unroll
            for (int e = 0; e < OV; ++e) sum[e] *= inv;
            *reinterpret_cast<uint4*>(out + (q_row + g) * HEAD_DIM + d0) = pack16<T>(sum);
        }
    }
    if (merged)  // the staged ids' space is free now (the merge above used the pipeline's)
        arrive_and_merge<T, GROUP, HEAD_DIM, NT>(part_o, part_ml, arrivals, head_row, q_row - head_row, live,
                                                 num_splits, out, smem_ids);
}

// The kernel over K/V of the input type (arguments: see decode_body).
template <typename T, int HEAD_DIM, int BLOCK_SIZE, int GROUP, bool PAGED, int THREADS, int LANES, int TILE, int STAGES,
          bool MMA, int IDS_WINDOW, bool INDEXED>
__global__ void __launch_bounds__(THREADS)
decode(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, long long block_stride,
       const int* __restrict__ block_tables, long long table_stride, int max_blocks,
       const int* __restrict__ seq_lens, float scale_log2, int segment_tokens, int group_chunks,
       T* __restrict__ out, float* __restrict__ part_o, float2* __restrict__ part_ml, int* __restrict__ arrivals,
       const int2* __restrict__ rows) {
    decode_body<T, T, HEAD_DIM, BLOCK_SIZE, GROUP, PAGED, THREADS, LANES, TILE, STAGES, MMA, IDS_WINDOW, INDEXED>(
        q, k, v, block_stride, block_tables, table_stride, max_blocks, seq_lens, scale_log2, segment_tokens,
        group_chunks, out, part_o, part_ml, arrivals, rows, nullptr, nullptr);
}

// The paged kernel over float8 e4m3 K/V on tensor cores (q and out: __half or __nv_bfloat16); the arguments
// of decode (rows: INDEXED only, else null), then the scales. Registers for at least 2 blocks an SM (left to
// itself ptxas capped some instances at 168 registers and spilled); a narrow group's (at most 8 heads) for
// 512 threads an SM (128 registers), whose stages the planner sizes to match (planner.geometry).
template <typename T, int HEAD_DIM, int BLOCK_SIZE, int GROUP, int THREADS, int TILE, int STAGES, int IDS_WINDOW,
          bool INDEXED>
__global__ void __launch_bounds__(THREADS, GROUP <= 8 ? 512 / THREADS : 2)
decode_fp8(const T* __restrict__ q, const e4m3* __restrict__ k, const e4m3* __restrict__ v, long long block_stride,
           const int* __restrict__ block_tables, long long table_stride, int max_blocks,
           const int* __restrict__ seq_lens, float scale_log2, int segment_tokens, int group_chunks,
           T* __restrict__ out, float* __restrict__ part_o, float2* __restrict__ part_ml, int* __restrict__ arrivals,
           const int2* __restrict__ rows, const float* __restrict__ k_scales, const float* __restrict__ v_scales) {
    decode_body<T, e4m3, HEAD_DIM, BLOCK_SIZE, GROUP, true, THREADS, 32, TILE, STAGES, true, IDS_WINDOW, INDEXED>(
        q, k, v, block_stride, block_tables, table_stride, max_blocks, seq_lens, scale_log2, segment_tokens,
        group_chunks, out, part_o, part_ml, arrivals, rows, k_scales, v_scales);
}

}  // namespace pagedrt
