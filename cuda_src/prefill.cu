// Prefill attention over a paged KV cache: many query tokens per sequence (a prompt, a chunk
// of one, decode tokens beside them), FlashAttention-2 style on tensor cores (mma.m16n8k16, sm_80+).
//
// Work: one thread block per (work item, KV head). A work item (the planner's, made on the host)
// is TILE_M consecutive packed query rows of one sequence: packed row p is query token p / group,
// query head p % group of the KV head, so the group's heads share every K/V tile (GQA packed into
// the M dimension, as FlashInfer does) and a tile may end inside a token's heads. Warp w owns
// packed rows [16w, 16w + 16) of the tile.
//
// Data path: the Q tile is staged in shared memory once (cp.async) and, for head_dim <= 128,
// read into registers as mma A fragments (head_dim 256 reads them from shared memory at every
// k-step: 64 more registers per thread would spill). K and V are streamed through a STAGES-deep
// cp.async pipeline of TILE_N keys per stage; each 16-byte copy finds its block through the
// block table (read one tile ahead of its copies, as decode.cu does). Keys past the sequence
// are zero-filled (nothing read), so a NaN in a slot the sequence does not own never reaches P V.
// Rows in shared memory are swizzled: 16-byte chunk x of row r sits at x ^ (r % 8), so an
// ldmatrix's 8 rows hit 8 different banks.
//
// Math: S = Q K^T by mma (K through ldmatrix), scaled by scale * log2(e) in fp32; the online
// softmax runs on the quad of lanes that holds a row (running max and sum in fp32, the output
// rescaled at every key tile); O += P V takes P straight from S's accumulator registers (the C
// fragments of two 8-key n-tiles are the A fragment of one 16-key k-step), rounded to T, and V
// through ldmatrix.trans. Causal (aligned bottom-right): query i of a sequence with q_len
// queries and kv_len keys sees keys 0 .. kv_len - q_len + i; the key loop stops at the tile's
// last row's limit, and only key tiles that cross a row's limit (or the sequence's end) mask.
// At the end the output is normalised, staged in Q's shared memory and stored in 16-byte vectors.
//
// prefill_fp8: the same over float8 e4m3 K/V (rows of HEAD_DIM bytes) with float32 scales per KV
// head, as decode_fp8 reads them (decode.cu): K and V are converted to f16 in registers
// (cvt.rn.f16x2.e4m3x2, exact) and both products are f16 mma. Q's A fragments are built once from
// shared memory, converted to f16 with scale * log2(e) * k_scale folded in, their dims permuted as an
// ldmatrix of e4m3 K rows delivers them; P V pairs V's bytes with a byte permute, so output column n of
// dim tile j is dim n * HEAD_DIM / 8 + j, an order the final store undoes (times the V scale).
#include "common.cuh"

namespace pagedrt {

// Work decomposition of one thread block; TILE_M, TILE_N, STAGES and THREADS come from the planner
// (pagedrt/attention/planner.py: prefill_geometry), which also sizes shared memory.
// KV: the stored K/V element (T, or e4m3 for FP8).
template <typename T, typename KV, int HEAD_DIM, int THREADS, int TILE_M, int TILE_N, int STAGES>
struct PrefillShape {
    static constexpr int kVec = Vec16<T>::kElems;             // elements per 16-byte chunk of Q and out
    static constexpr int kRowVecs = HEAD_DIM / kVec;          // chunks in one row of Q or out
    static constexpr int kRowBytes = HEAD_DIM * (int)sizeof(T);
    static constexpr int kRowsPerRound = THREADS / kRowVecs;  // rows one 16-byte copy per thread covers
    static constexpr int kRowCopies = TILE_M / kRowsPerRound; // copies per thread of the Q (and out) tile
    static constexpr int kKVRowBytes = HEAD_DIM * (int)sizeof(KV);  // a K or V row
    static constexpr int kKVRowVecs = kKVRowBytes / 16;
    static constexpr int kKVRowsPerRound = THREADS / kKVRowVecs;
    static constexpr int kCopies = TILE_N / kKVRowsPerRound;  // copies per thread per key tile (K, and again V)
    static constexpr int kTileBytes = TILE_N * kKVRowBytes;   // one stage of K (and again of V)
    static constexpr int kQOffset = STAGES * 2 * kTileBytes;  // the Q tile, after the stages
    static constexpr int kSmemBytes = kQOffset + TILE_M * kRowBytes;
    static constexpr bool kQInRegisters = HEAD_DIM <= 128;

    static_assert(sizeof(T) == 2, "tensor cores: half or bfloat16");
    static_assert(TILE_M == 16 * (THREADS / 32), "a warp per 16 packed rows");
    static_assert(TILE_N % 16 == 0 && HEAD_DIM % 16 == 0, "whole mma k-steps of keys and of head_dim");
    static_assert(kRowVecs % 8 == 0, "Q rows: the swizzle permutes groups of 8 chunks");
    static_assert(THREADS % kRowVecs == 0 && THREADS % kKVRowVecs == 0 && TILE_N % kKVRowsPerRound == 0
                  && TILE_M % kRowsPerRound == 0, "whole copy rounds");
    static_assert(STAGES >= 2, "the pipeline needs at least two stages");
};

// Byte offset of 16-byte chunk x of row r in a staged tile of ROW_BYTES rows (at chunk swizzle(x, r)).
template <int ROW_BYTES>
__device__ __forceinline__ unsigned swizzled(int row, int chunk) {
    return row * ROW_BYTES + (swizzle<ROW_BYTES / 16>(chunk, row) << 4);
}

// q, out:       [num_tokens, num_kv_heads * group, HEAD_DIM], contiguous
// k, v:         planes; element (block b, kv head h, slot s, dim d) at b*block_stride + (h*BLOCK_SIZE + s)*HEAD_DIM + d
// block_tables: [batch, >= max_blocks] int32 with row stride table_stride
// kv_lens:      [batch] int32 (keys after the step: cached and new), clamped to [0, max_blocks*BLOCK_SIZE]
// items:        [gridDim.x] (batch row, its first query token, its query count, the tile's first packed row)
// grid:         (work items, num_kv_heads); causal: nonzero for the bottom-right causal mask
// k_scales, v_scales: FP8 only (KV = e4m3): float32 [num_kv_heads], the value of a stored byte b of KV
//               head h is e4m3(b) * scale[h]; the element type of k, v and block_stride is KV.
template <typename T, typename KV, int HEAD_DIM, int BLOCK_SIZE, int THREADS, int TILE_M, int TILE_N, int STAGES>
__device__ __forceinline__ void
prefill_body(const T* __restrict__ q, const KV* __restrict__ k, const KV* __restrict__ v, long long block_stride,
             const int* __restrict__ block_tables, long long table_stride, int max_blocks,
             const int* __restrict__ kv_lens, const int4* __restrict__ items, int group, int causal,
             float scale_log2, T* __restrict__ out, const float* __restrict__ k_scales,
             const float* __restrict__ v_scales) {
    using S = PrefillShape<T, KV, HEAD_DIM, THREADS, TILE_M, TILE_N, STAGES>;
    constexpr int V = S::kVec, NV = S::kRowVecs, ROW = S::kRowBytes, COPIES = S::kCopies;
    constexpr int KNV = S::kKVRowVecs, KROW = S::kKVRowBytes;
    constexpr int KSTEPS = HEAD_DIM / 16, DIM_TILES = HEAD_DIM / 8, KEY_TILES = TILE_N / 8;
    constexpr unsigned V_SMEM = STAGES * S::kTileBytes;  // a V stage's offset from its K stage, bytes
    constexpr bool FP8 = !same_type<KV, T>::value;
    using MT = typename conditional_type<FP8, __half, T>::type;  // the mma's input type
    static_assert(!FP8 || (same_type<KV, e4m3>::value && S::kQInRegisters), "FP8: e4m3 K/V, head_dim <= 128");

    extern __shared__ __align__(128) unsigned char smem_raw[];
    const unsigned smem = static_cast<unsigned>(__cvta_generic_to_shared(smem_raw));
    const unsigned smem_q = smem + S::kQOffset;

    const int4 item = items[blockIdx.x];
    const int seq = item.x, q_first = item.y, q_len = item.z, p_first = item.w;
    const int kv_head = blockIdx.y, q_heads = gridDim.y * group;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int p_end = min(p_first + TILE_M, q_len * group);  // the tile's packed rows: [p_first, p_end)
    const int kv_len = min(max(kv_lens[seq], 0), max_blocks * BLOCK_SIZE);
    const int* const table_row = block_tables + seq * table_stride;
    // Keys [0, limit) for packed row p: every key, or causal up to its query's diagonal.
    auto limit = [&](int p) { return causal ? min(kv_len, kv_len - q_len + p / group + 1) : kv_len; };
    const int tile_keys = limit(p_end - 1);  // the tile's last row sees the most keys
    const int shared_keys = limit(p_first);  // every row of the tile sees these: no mask needed
    const int num_tiles = tile_keys > 0 ? (tile_keys + TILE_N - 1) / TILE_N : 0;
    // Element offset of packed row p in q and out.
    auto row_offset = [&](int p) {
        const int i = p / group;
        return ((long long)(q_first + i) * q_heads + kv_head * group + (p - i * group)) * HEAD_DIM;
    };

    // The Q tile, rows past the tile zero-filled; it lands with the first key tile's copies.
#pragma unroll
    for (int c = 0; c < S::kRowCopies; ++c) {
        const int r = c * S::kRowsPerRound + tid / NV, x = tid % NV, p = p_first + r;
        const bool live = p < p_end;
        cp_async16_shared(smem_q + swizzled<ROW>(r, x), live ? q + row_offset(p) + x * V : q, live ? 16 : 0);
    }

    // Copy c of a key tile moves chunk tid % KNV of key row c * kKVRowsPerRound + tid / KNV, K and V.
    const char* const k_bytes = reinterpret_cast<const char*>(k);
    const long long stride_bytes = block_stride * (long long)sizeof(KV);
    const long long v_minus_k = reinterpret_cast<const char*>(v) - k_bytes;  // same offset in the V plane
    const int copy_row = tid / KNV, copy_chunk = tid % KNV;
    int ids[COPIES];  // block id of each copy's key, -1 past the sequence: read one tile before the copies
    auto fetch = [&](int tile) {
#pragma unroll
        for (int c = 0; c < COPIES; ++c) {
            const int key = tile * TILE_N + c * S::kKVRowsPerRound + copy_row;
            ids[c] = key < kv_len ? __ldg(table_row + key / BLOCK_SIZE) : -1;
        }
    };
    auto issue = [&](int tile) {
        const unsigned stage = smem + (tile % STAGES) * S::kTileBytes;
#pragma unroll
        for (int c = 0; c < COPIES; ++c) {
            const int r = c * S::kKVRowsPerRound + copy_row, slot = (tile * TILE_N + r) % BLOCK_SIZE;
            const bool live = ids[c] >= 0;  // else zero-fill, reading nothing
            const char* const from = live ? k_bytes + ids[c] * stride_bytes
                                                + (((long long)kv_head * BLOCK_SIZE + slot) * HEAD_DIM
                                                   + copy_chunk * (16 / (int)sizeof(KV))) * (long long)sizeof(KV)
                                          : reinterpret_cast<const char*>(q);
            const unsigned dst = stage + swizzled<KROW>(r, copy_chunk);
            cp_async16_shared(dst, from, live ? 16 : 0);
            cp_async16_shared(dst + V_SMEM, live ? from + v_minus_k : from, live ? 16 : 0);
        }
    };

    // This thread's rows of the warp's C fragments: row_c and row_c + 8 of the tile (h = 0, 1).
    const int row_c = warp * 16 + lane / 4, quad_col = lane % 4;
    int row_keys[2];
    float m[2], l[2], o[DIM_TILES][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        row_keys[h] = limit(p_first + row_c + 8 * h);
        m[h] = neg_inf();
        l[h] = 0.f;  // this lane's part of the row's sum; the quad's parts are added at the end
    }
#pragma unroll
    for (int j = 0; j < DIM_TILES; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;

    // Q as mma A fragments: ldmatrix.x4 matrix i covers rows +8 for odd i, dims +8 for i >= 2.
    const int q_row = warp * 16 + (lane & 7) + (((lane >> 3) & 1) << 3), q_upper = lane >> 4;
    unsigned qa[S::kQInRegisters ? KSTEPS : 1][4] = {};  // set at the first key tile, when Q has landed
    auto q_fragment = [&](int kk, unsigned (&a)[4]) {
        if constexpr (S::kQInRegisters) {
            a[0] = qa[kk][0], a[1] = qa[kk][1], a[2] = qa[kk][2], a[3] = qa[kk][3];
        } else {
            ldmatrix_x4(a, smem_q + swizzled<ROW>(q_row, 2 * kk + q_upper));
        }
    };

    // One staged key tile: S = Q K^T, the online softmax, O += P V. MASK: some key of the tile lies past
    // some row's limit (the causal diagonal or the sequence's end), so those scores become -inf.
    auto consume = [&](int tile, auto mask) {
        constexpr bool MASK = decltype(mask)::value;
        const unsigned sk = smem + (tile % STAGES) * S::kTileBytes, sv = sk + V_SMEM;
        float s[KEY_TILES][4];
#pragma unroll
        for (int j = 0; j < KEY_TILES; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
        if constexpr (FP8) {
            // ldmatrix.x4 of e4m3 K (common.cuh, qk_e4m3): matrix i covers keys +8 for i >= 2, the next
            // 16-dim chunk (k-step) for odd i
            const int k_row = (lane & 7) + ((lane >> 4) << 3), k_upper = (lane >> 3) & 1;
#pragma unroll
            for (int kk = 0; kk < KSTEPS; kk += 2)
#pragma unroll
                for (int j = 0; j < KEY_TILES / 2; ++j)
                    qk_e4m3(sk + swizzled<KROW>(16 * j + k_row, kk + k_upper), qa[kk], qa[kk + 1], s[2 * j],
                            s[2 * j + 1]);
        } else {
            // ldmatrix.x4 of K: matrix i covers dims +8 for odd i, keys +8 for i >= 2
            const int k_row = (lane & 7) + ((lane >> 4) << 3), k_upper = (lane >> 3) & 1;
            // unrolled whole when Q is in registers (its fragments are indexed by kk); from shared memory,
            // four k-steps at a time, which keeps head_dim 256 clear of spills
#pragma unroll(S::kQInRegisters ? KSTEPS : 4)
            for (int kk = 0; kk < KSTEPS; ++kk) {
                unsigned a[4];
                q_fragment(kk, a);
#pragma unroll
                for (int j = 0; j < KEY_TILES / 2; ++j) {
                    unsigned b[4];
                    ldmatrix_x4(b, sk + swizzled<ROW>(16 * j + k_row, 2 * kk + k_upper));
                    mma_16816<T>(s[2 * j], a[0], a[1], a[2], a[3], b[0], b[1]);
                    mma_16816<T>(s[2 * j + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
                }
            }
        }
        // s[j][e]: row row_c + 8 * (e / 2), key tile * TILE_N + 8 * j + 2 * quad_col + e % 2
        float top[2] = {neg_inf(), neg_inf()};
#pragma unroll
        for (int j = 0; j < KEY_TILES; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if constexpr (!FP8) s[j][e] *= scale_log2;  // FP8: folded into Q's fragments
                if (MASK && tile * TILE_N + 8 * j + 2 * quad_col + e % 2 >= row_keys[e / 2]) s[j][e] = neg_inf();
                top[e / 2] = fmaxf(top[e / 2], s[j][e]);
            }
        float shift[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            top[h] = fmaxf(top[h], __shfl_xor_sync(0xffffffffu, top[h], 1));
            top[h] = fmaxf(top[h], __shfl_xor_sync(0xffffffffu, top[h], 2));
            const float m_new = fmaxf(m[h], top[h]);
            // m_new = -inf: the row has seen no key yet (its o and l are 0); m = -inf: exp2f gives 0
            const float alpha = m_new == neg_inf() ? 1.f : exp2f(m[h] - m_new);
            shift[h] = m_new == neg_inf() ? 0.f : m_new;
            m[h] = m_new;
            l[h] *= alpha;
#pragma unroll
            for (int j = 0; j < DIM_TILES; ++j) {
                o[j][2 * h] *= alpha;
                o[j][2 * h + 1] *= alpha;
            }
        }
#pragma unroll
        for (int j = 0; j < KEY_TILES; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[j][e] = exp2f(s[j][e] - shift[e / 2]);
                l[e / 2] += s[j][e];
            }
#pragma unroll
        for (int kk = 0; kk < TILE_N / 16; ++kk) {
            const unsigned a0 = pack2<MT>(s[2 * kk][0], s[2 * kk][1]), a1 = pack2<MT>(s[2 * kk][2], s[2 * kk][3]);
            const unsigned a2 = pack2<MT>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            const unsigned a3 = pack2<MT>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            if constexpr (FP8) {
                const unsigned pa[4] = {a0, a1, a2, a3};
                pv_e4m3<HEAD_DIM>(sv, 16 * kk, lane, pa, o);  // V rows are the tile's keys
            } else {
                // ldmatrix.x4.trans of V: matrix i covers keys +8 for odd i, the next 8 dims for i >= 2
                const int v_row = (lane & 7) + (((lane >> 3) & 1) << 3), v_next = lane >> 4;
#pragma unroll
                for (int j = 0; j < DIM_TILES; j += 2) {
                    unsigned b[4];
                    ldmatrix_x4_trans(b, sv + swizzled<ROW>(16 * kk + v_row, j + v_next));
                    mma_16816<T>(o[j], a0, a1, a2, a3, b[0], b[1]);
                    mma_16816<T>(o[j + 1], a0, a1, a2, a3, b[2], b[3]);
                }
            }
        }
    };

    if (num_tiles > 0) fetch(0);
#pragma unroll
    for (int t = 0; t < STAGES - 1; ++t) {
        if (t < num_tiles) issue(t);
        cp_async_commit();  // the first group holds Q too
        if (t + 1 < num_tiles) fetch(t + 1);
    }
    for (int tile = 0; tile < num_tiles; ++tile) {
        cp_async_wait<STAGES - 2>();  // this thread's copies of `tile` (and Q) have landed
        __syncthreads();              // everyone's have, and everyone is done with tile-1's stage
        const int ahead = tile + STAGES - 1;
        if (ahead < num_tiles) issue(ahead);
        cp_async_commit();
        if (ahead + 1 < num_tiles) fetch(ahead + 1);
        if constexpr (FP8) {
            if (tile == 0) {  // a0, a2 (rows row_c) and a1, a3 (row_c + 8): dims 16kk + 4c .. + 3, scaled
                const float q_scale = scale_log2 * __ldg(k_scales + kv_head);
#pragma unroll
                for (int kk = 0; kk < KSTEPS; ++kk)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int d = 16 * kk + 4 * quad_col;
                        unsigned w[2];
                        load_shared<2>(w, smem_q + swizzled<ROW>(row_c + 8 * h, d / V) + (d % V) * (int)sizeof(T));
                        const T* const x = reinterpret_cast<const T*>(w);
                        qa[kk][h] = pack2<__half>(to_float(x[0]) * q_scale, to_float(x[1]) * q_scale);
                        qa[kk][2 + h] = pack2<__half>(to_float(x[2]) * q_scale, to_float(x[3]) * q_scale);
                    }
            }
        } else if constexpr (S::kQInRegisters) {
            if (tile == 0) {
#pragma unroll
                for (int kk = 0; kk < KSTEPS; ++kk)
                    ldmatrix_x4(qa[kk], smem_q + swizzled<ROW>(q_row, 2 * kk + q_upper));
            }
        }
        if ((tile + 1) * TILE_N <= shared_keys) consume(tile, integral_constant<bool, false>());
        else consume(tile, integral_constant<bool, true>());
    }

    // Normalise, stage the output tile where Q was (every warp is done with it), store 16 bytes at a time.
    cp_async_wait<0>();
    __syncthreads();
    float v_scale = 1.f;
    if constexpr (FP8) v_scale = __ldg(v_scales + kv_head);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
        const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;  // 0: a row that saw no key (not validated) gets zeros
        const int r = row_c + 8 * h;
#pragma unroll
        for (int j = 0; j < DIM_TILES; ++j) {
            if constexpr (FP8) {  // column n of dim tile j is dim n * HEAD_DIM / 8 + j
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int d = (2 * quad_col + e) * (HEAD_DIM / 8) + j;
                    *reinterpret_cast<T*>(smem_raw + S::kQOffset + swizzled<ROW>(r, d / V) + (d % V) * sizeof(T)) =
                        from_float<T>(o[j][2 * h + e] * inv * v_scale);
                }
            } else {
                *reinterpret_cast<unsigned*>(smem_raw + S::kQOffset + swizzled<ROW>(r, j) + 4 * quad_col) =
                    pack2<T>(o[j][2 * h] * inv, o[j][2 * h + 1] * inv);
            }
        }
    }
    __syncthreads();
#pragma unroll
    for (int c = 0; c < S::kRowCopies; ++c) {
        const int r = c * S::kRowsPerRound + tid / NV, x = tid % NV, p = p_first + r;
        if (p < p_end) {
            *reinterpret_cast<uint4*>(out + row_offset(p) + x * V) =
                *reinterpret_cast<const uint4*>(smem_raw + S::kQOffset + swizzled<ROW>(r, x));
        }
    }
}

// The kernel over K/V of the input type (arguments: see prefill_body).
template <typename T, int HEAD_DIM, int BLOCK_SIZE, int THREADS, int TILE_M, int TILE_N, int STAGES>
__global__ void __launch_bounds__(THREADS)
prefill(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, long long block_stride,
        const int* __restrict__ block_tables, long long table_stride, int max_blocks,
        const int* __restrict__ kv_lens, const int4* __restrict__ items, int group, int causal,
        float scale_log2, T* __restrict__ out) {
    prefill_body<T, T, HEAD_DIM, BLOCK_SIZE, THREADS, TILE_M, TILE_N, STAGES>(
        q, k, v, block_stride, block_tables, table_stride, max_blocks, kv_lens, items, group, causal, scale_log2,
        out, nullptr, nullptr);
}

// The kernel over float8 e4m3 K/V (q and out: __half or __nv_bfloat16): the arguments of prefill, then the
// scales.
template <typename T, int HEAD_DIM, int BLOCK_SIZE, int THREADS, int TILE_M, int TILE_N, int STAGES>
__global__ void __launch_bounds__(THREADS)
prefill_fp8(const T* __restrict__ q, const e4m3* __restrict__ k, const e4m3* __restrict__ v, long long block_stride,
            const int* __restrict__ block_tables, long long table_stride, int max_blocks,
            const int* __restrict__ kv_lens, const int4* __restrict__ items, int group, int causal,
            float scale_log2, T* __restrict__ out, const float* __restrict__ k_scales,
            const float* __restrict__ v_scales) {
    prefill_body<T, e4m3, HEAD_DIM, BLOCK_SIZE, THREADS, TILE_M, TILE_N, STAGES>(
        q, k, v, block_stride, block_tables, table_stride, max_blocks, kv_lens, items, group, causal, scale_log2,
        out, k_scales, v_scales);
}

}  // namespace pagedrt
