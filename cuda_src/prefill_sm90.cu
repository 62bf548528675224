// Prefill attention over a paged KV cache on Hopper (sm_90a): the semantics, arguments and work
// items of prefill.cu, computed by warpgroup MMA (wgmma) with warp-specialised roles, in the manner
// of FlashAttention-3.
//
// Work: one thread block per (work item, KV head); a work item is kTileM = 128 consecutive packed
// query rows of one sequence (packed row p: query token p / group, query head p % group of the KV
// head). Three warpgroups:
//   - the producer (warpgroup 0) gives registers away (setmaxnreg) and copies: the Q tile once,
//     then K and V tiles of TILE_N keys into a STAGES-deep ring of shared-memory stages. Each
//     16-byte copy (cp.async) finds its key's block through the block table (one lane per block
//     of the tile reads the table, the others take the id by shuffle); keys past the sequence are
//     zero-filled, reading nothing. A stage's copies arrive on its "full" mbarrier as they land
//     (cp.async.mbarrier.arrive.noinc); the producer refills a stage once its "empty" mbarrier
//     says every consumer warp is done with it. K and V have their own barriers, so a K stage is
//     refilled as soon as the scores are computed.
//   - two consumers (warpgroups 1 and 2) own 64 packed rows each. Per key tile: S = Q K^T by
//     wgmma m64nTILE_Nk16 with Q and K in shared memory (both K-major), the online softmax on S in
//     fp32 (exp2 of the scores scaled by scale * log2(e); a row's max and sum in four independent
//     chains), then O += P V by wgmma m64nHEAD_DIMk16
//     with P in registers (S's accumulator layout is the A fragment layout, rounded to T) and V in
//     shared memory read MN-major (transposed by the descriptor). The next tile's S = Q K^T is
//     issued before this tile's P V, so the softmax of one tile runs while the tensor cores do the
//     other's product (FlashAttention-3's intra-warpgroup overlap); the two consumers interleave
//     on the tensor cores by themselves.
// Shared memory tiles use the 128-byte swizzle that wgmma reads (hopper.cuh: smem_descriptor_lo, _hi):
// rows of 64-element panels, chunk c of row r at c ^ (r % 8), tiles 1024-byte aligned.
// Masking (causal aligned bottom-right, and the sequence's end) is applied only to the tiles that
// cross some row's limit. A unit's last tile, when none of a consumer's rows sees past its first half (a causal
// diagonal, a sequence's end), is a Half tile for that consumer: S by an m64n(TILE_N / 2) wgmma, P V over half
// the keys. At the end each consumer normalises its rows and stores them.
//
// Units come from a queue (FlashAttention-3's tile scheduler): a block's first unit is its own index, each
// next one it claims when its producer has issued the last one's copies (gridDim.x + atomicAdd on the
// queue's count), so a block that finishes early takes more. The producer's first thread claims and hands
// the unit to every warp through two slots in shared memory (an mbarrier each); a claim past the units ends
// the block. The last block to finish resets the queue for the next launch.
//
// Split-K (a wide group's decode, pagedrt/attention/decode.py; head_dim up to 128, where a consumer has the
// registers for the merge: at 256 num_splits is taken as 1): with num_splits > 1 a unit is also one
// segment of split_tiles key tiles of its (item, KV head), the last segment running on to the keys' end
// (as the decode kernel's: the plan's lengths only size the split); segments past the keys are skipped by
// producer and consumers alike. A consumer of a unit with more than one live segment writes its rows'
// unnormalised output and (max, sum) into the workspace (decode.cu's layout, by item: row = item x query
// heads + KV head x group + packed row, so split items are of one query token each: a decode's sequences,
// a mixed step's decode rows) and counts itself in on the arrival count of its first row; the consumer
// that arrives last merges the segments of its rows and resets the count. Unsplit (num_splits 1) the
// workspace pointers are null.
//
// FP8 K/V (prefill_sm90_fp8: float8 e4m3 planes, float32 scales per KV head; prefill.cu's prefill_fp8
// semantics): both products are f16 wgmma, whatever q's type, as in prefill_fp8 (sm_90 turns e4m3 into f16
// by one exact instruction, into bf16 by none). The producer cp.async's a key tile's K and V bytes into one
// of STAGING slots of its own and, STAGING - 1 tiles later, converts them (cvt.rn.f16x2.e4m3x2, exact) into
// the stage the consumers read, then arrives on the stage's full barrier. Each thread converts exactly the
// bytes it copied, so it waits for its own copies only (cp.async groups). A consumer first turns its rows of
// the Q tile into f16 in place, q * scale * log2(e) * the K scale (prefill_fp8's rounding), so its softmax
// takes exp2 of the scores as they are; the V scale multiplies the output once. No split-K: wide-group
// decodes over FP8 run on the decode kernel.
#include "common.cuh"
#include "hopper.cuh"

namespace pagedrt {

// Work decomposition of one thread block; TILE_N, STAGES and STAGING come from the planner
// (pagedrt/attention/planner.py: prefill_sm90_geometry), which also sizes shared memory. STAGING > 0: FP8 K/V,
// whose e4m3 bytes land in that many slots (after the stages) before their conversion.
template <typename T, int HEAD_DIM, int TILE_N, int STAGES, int STAGING = 0>
struct PrefillSm90Shape {
    static constexpr int kThreads = 384;               // a producer warpgroup, two consumer warpgroups
    static constexpr int kTileM = 128;                 // packed query rows: 64 per consumer
    static constexpr int kRowVecs = HEAD_DIM / 8;      // 16-byte chunks in a row of Q, K, V or out
    static constexpr int kRowsPerRound = 128 / kRowVecs;  // rows one 16-byte copy per producer thread covers
    static constexpr int kPanelBytes = 128;            // a row's 64-element panel
    static constexpr int kQBytes = kTileM * HEAD_DIM * 2;
    static constexpr int kStageBytes = TILE_N * HEAD_DIM * 2;  // one stage of K (and again of V)
    static constexpr int kKOffset = kQBytes;
    static constexpr int kVOffset = kKOffset + STAGES * kStageBytes;
    static constexpr int kStagingOffset = kVOffset + STAGES * kStageBytes;
    static constexpr int kStagingBytes = 2 * TILE_N * HEAD_DIM;  // FP8: a key tile's e4m3 K, then its V
    static constexpr int kSmemBytes = kStagingOffset + STAGING * kStagingBytes + 1024;  // + the 1024-byte alignment
    static constexpr int kProducerRegs = 56, kConsumerRegs = 224;  // 128 x 56 + 256 x 224 = 384 x 168
    // Split-K up to head_dim 128 (at 256 a consumer thread holds 128 floats of output, and the merge spilled), not
    // over FP8 K/V (no plan splits it)
    static constexpr bool kSplitK = HEAD_DIM <= 128 && STAGING == 0;
    // FP8: a producer thread's 16-byte copy covers 16 dims of a key row; a copy round covers kFp8Rows rows
    static constexpr int kFp8RowVecs = HEAD_DIM / 16, kFp8Rows = 128 / kFp8RowVecs;

    static_assert(sizeof(T) == 2, "tensor cores: half or bfloat16");
    static_assert(HEAD_DIM % 64 == 0 && HEAD_DIM <= 256, "whole 128-byte panels; wgmma N <= 256");
    static_assert(TILE_N % 16 == 0 && TILE_N >= 64 && TILE_N <= 256, "whole k-steps of keys; wgmma N <= 256");
    static_assert(TILE_N % kRowsPerRound == 0 && kTileM % kRowsPerRound == 0, "whole copy rounds");
    static_assert(STAGES >= 2, "the ring needs at least two stages");
    static_assert(STAGING == 0 || (STAGING >= 2 && HEAD_DIM <= 128 && TILE_N % kFp8Rows == 0),
                  "FP8: a tile's bytes land while the one before is converted; whole copy rounds of 8-row groups");
};

// Byte offset of 16-byte chunk x of row r in a tile of ROWS rows stored as 128-byte panels, swizzled.
template <int ROWS>
__device__ __forceinline__ unsigned panel_offset(int row, int chunk) {
    return (chunk / 8) * (ROWS * 128) + row * 128 + (((chunk % 8) ^ (row % 8)) << 4);
}

// Arguments as prefill.cu's, but the block size is a run-time power of two (block_shift = log2), and the
// grid is persistent: thread block b takes unit b, then those it claims from the queue, of the num_items *
// num_kv_heads * num_splits units (unit u: segment u % num_splits of work item u / num_splits % num_items for
// KV head u / num_splits / num_items: a KV head's items in their order, then the next head's, so the units in
// flight share one KV head's K/V of a sequence or two in L2).
// q, out:       [num_tokens, num_kv_heads * group, HEAD_DIM], contiguous
// k, v:         planes; element (block b, kv head h, slot s, dim d) at
//               b*block_stride + ((h << block_shift) + s)*HEAD_DIM + d
// block_tables: [batch, >= max_blocks] int32 with row stride table_stride
// kv_lens:      [batch] int32 (keys after the step: cached and new), clamped to [0, max_blocks << block_shift]
// items:        [num_items] (batch row, its first query token, its query count, the tile's first packed row)
// causal:       nonzero for the bottom-right causal mask; scale_log2 > 0
// num_splits, split_tiles: segments per (item, KV head) and key tiles per segment (split_tiles covers every
//               tile when num_splits is 1)
// part_o, part_ml, arrivals: split partials (items of one query token), float32 [num_items * q_heads,
//               num_splits, HEAD_DIM], float2 [num_items * q_heads, num_splits] (max in the log2 domain, sum),
//               int [num_items * q_heads] zeroed before the first launch (each merge resets its count); null
//               when unsplit
// queue:        int [2] (units claimed past the first gridDim.x, blocks finished), zeroed before the first
//               launch (the last block resets them); the launches over one queue run one at a time
// k_scales, v_scales: FP8 only (KV = e4m3, STAGING > 0): float32 [num_kv_heads], as prefill_fp8's; the element
//               type of k, v and block_stride is KV.
template <typename T, typename KV, int HEAD_DIM, int TILE_N, int STAGES, int STAGING>
__device__ __forceinline__ void
prefill_sm90_body(const T* __restrict__ q, const KV* __restrict__ k, const KV* __restrict__ v, long long block_stride,
                  const int* __restrict__ block_tables, long long table_stride, int max_blocks,
                  const int* __restrict__ kv_lens, const int4* __restrict__ items, int group, int causal,
                  float scale_log2, int block_shift, int num_items, int num_kv_heads, int num_splits,
                  int split_tiles, float* __restrict__ part_o, float2* __restrict__ part_ml,
                  int* __restrict__ arrivals, int* __restrict__ queue, T* __restrict__ out,
                  const float* __restrict__ k_scales, const float* __restrict__ v_scales) {
    using S = PrefillSm90Shape<T, HEAD_DIM, TILE_N, STAGES, STAGING>;
    constexpr int NV = S::kRowVecs, RPR = S::kRowsPerRound, TILE_M = S::kTileM;
    constexpr bool FP8 = STAGING > 0;
    static_assert(FP8 ? same_type<KV, e4m3>::value : same_type<KV, T>::value, "K/V: e4m3 when staged, else T");
    using MT = typename conditional_type<FP8, __half, T>::type;  // the wgmma's input type

    extern __shared__ unsigned char smem_raw[];
    // mbarriers: Q landed, Q free; per stage: K landed, V landed, K free, V free; per unit slot: written
    __shared__ __align__(8) unsigned long long barriers[2 + 4 * STAGES + 2];
    __shared__ int merges[2];  // split-K: whether each consumer arrived last on its rows' count
    // The units handed to the warps, in turn: the unit, its item and its sequence's key count (read by the claiming
    // thread, so that no other warp waits on global memory at a unit's start)
    struct Claim {
        int4 item;
        int u, kv_len;
    };
    __shared__ Claim slots[2];
    const unsigned smem = (static_cast<unsigned>(__cvta_generic_to_shared(smem_raw)) + 1023) & ~1023u;
    const unsigned smem_q = smem, smem_k = smem + S::kKOffset, smem_v = smem + S::kVOffset;
    const unsigned smem_staging = smem + S::kStagingOffset;  // FP8
    const unsigned q_full = static_cast<unsigned>(__cvta_generic_to_shared(barriers)), q_empty = q_full + 8;
    auto k_full = [&](int s) { return q_full + 8 * (2 + s); };
    auto v_full = [&](int s) { return q_full + 8 * (2 + STAGES + s); };
    auto k_empty = [&](int s) { return q_full + 8 * (2 + 2 * STAGES + s); };
    auto v_empty = [&](int s) { return q_full + 8 * (2 + 3 * STAGES + s); };
    auto unit_full = [&](int n) { return q_full + 8 * (2 + 4 * STAGES + n % 2); };  // the n-th unit's slot
    if (threadIdx.x == 0) {
        sm90::mbarrier_init(q_full, 128);  // every producer thread's copies
        sm90::mbarrier_init(q_empty, 8);   // every consumer warp
        for (int s = 0; s < STAGES; ++s) {
            sm90::mbarrier_init(k_full(s), 128);
            sm90::mbarrier_init(v_full(s), 128);
            sm90::mbarrier_init(k_empty(s), 8);
            sm90::mbarrier_init(v_empty(s), 8);
        }
        sm90::mbarrier_init(unit_full(0), 1);  // the claiming thread
        sm90::mbarrier_init(unit_full(1), 1);
        sm90::mbarrier_init_fence();
    }
    __syncthreads();

    const int num_units = num_items * num_kv_heads * (S::kSplitK ? num_splits : 1), q_heads = num_kv_heads * group;
    // One unit's work: its sequence, query tokens, packed rows [p_first, p_end), keys, its segment (key tiles
    // [tile0, tile0 + num_tiles) of its (item, KV head)'s, whose first `live` segments hold keys).
    struct Unit {
        int seq, q_first, q_len, p_first, p_end, kv_head, kv_len, tile0, num_tiles, consumers, split, live;
        long long part_row;  // split-K: the workspace row of packed row 0 (item x q_heads + KV head x group)
    };
    const int splits = S::kSplitK ? num_splits : 1;
    auto unit_of = [&](const Claim& c) {
        const int seg_tiles = S::kSplitK ? split_tiles : 0x7fffffff;
        const int u = c.u, pair = u / splits;
        const int item_index = pair % num_items;
        const int4 item = c.item;
        Unit w;
        w.seq = item.x, w.q_first = item.y, w.q_len = item.z, w.p_first = item.w;
        w.p_end = min(w.p_first + TILE_M, w.q_len * group);
        w.kv_head = pair / num_items;
        w.split = u % splits;
        w.part_row = (long long)item_index * q_heads + w.kv_head * group;
        w.kv_len = c.kv_len;
        // the tile's last row sees the most keys
        const int tile_keys = causal ? min(w.kv_len, w.kv_len - w.q_len + (w.p_end - 1) / group + 1) : w.kv_len;
        const int all_tiles = tile_keys > 0 ? (tile_keys + TILE_N - 1) / TILE_N : 0;
        // live segments: as many as hold keys (a keyless unit: one), at most the launch's; the last takes the
        // rest of the keys, more than seg_tiles when the split plan was sized for shorter sequences
        w.live = all_tiles <= seg_tiles ? 1 : min(splits, (all_tiles - 1) / seg_tiles + 1);
        w.tile0 = w.split * seg_tiles;
        w.num_tiles = w.split < w.live ? (w.split == w.live - 1 ? all_tiles - w.tile0 : seg_tiles) : 0;
        w.consumers = w.p_end - w.p_first > 64 ? 2 : 1;  // a consumer without a live row passes the tiles on
        return w;
    };
    // Keys [0, limit) for packed row p of unit w: every key, or causal up to its query's diagonal.
    auto limit = [&](const Unit& w, int p) {
        return causal ? min(w.kv_len, w.kv_len - w.q_len + p / group + 1) : w.kv_len;
    };
    // Element offset of packed row p of unit w in q and out.
    auto row_offset = [&](const Unit& w, int p) {
        const int i = p / group;
        return ((long long)(w.q_first + i) * q_heads + w.kv_head * group + (p - i * group)) * HEAD_DIM;
    };

    // The n-th unit handed to this block's warps (num_units or more: none is left). Its slot is written again
    // for unit n + 2 only after the producer, in unit n + 1's turn, has waited for the consumers to be done with
    // unit n's Q tile: by then every warp has read it (the producer's before copying unit n's Q, the consumers'
    // before using it).
    auto take = [&](int n) {
        sm90::mbarrier_wait(unit_full(n), (n / 2) & 1);
        return slots[n % 2];
    };
    // The claiming thread's part: unit u's item and key count into slot n % 2 (nothing past the units).
    auto claim = [&](int n, int u) {
        Claim c = {make_int4(0, 0, 0, 0), u, 0};
        if (u < num_units) {
            c.item = items[u / splits % num_items];
            c.kv_len = min(max(kv_lens[c.item.x], 0), max_blocks << block_shift);
        }
        slots[n % 2] = c;
    };

    if (threadIdx.x < 128) {
        // ---- producer ----
        sm90::setmaxnreg_dec<S::kProducerRegs>();
        const int tid = threadIdx.x, lane = tid % 32, copy_row = tid / NV, chunk = tid % NV;
        const int block_mask = (1 << block_shift) - 1;
        const unsigned long long stream_policy = evict_first_policy();
        const int tile_blocks = max(1, TILE_N >> block_shift);  // blocks a tile's keys span (at most 16)
        // K and V: this thread copies chunk `chunk` of the RPT consecutive key rows from row0 (within one
        // block, or two when blocks are shorter than RPT), from plane (K or V) into stage.
        constexpr int RPT = TILE_N / RPR;
        static_assert(RPT % 8 == 0 && RPT <= 16, "a thread's rows: whole swizzle atoms, within two blocks of 8+");
        const int row0 = copy_row * RPT;
        const unsigned dst0 = panel_offset<TILE_N>(row0, chunk & ~7), swizzle = chunk % 8;
        constexpr int QRPT = TILE_M / RPR;  // the same for the Q tile's rows
        const int qrow0 = copy_row * QRPT;
        const unsigned qdst0 = panel_offset<TILE_M>(qrow0, chunk & ~7);
        // FP8: this thread's copy i of a tile's e4m3 K (and V) bytes is dims [16 c8, 16 c8 + 16) of key row
        // i * R8 + r8, into its own 16 bytes of the staging slot. The 8 threads of one shared-memory phase take 8
        // consecutive rows, so the two f16 chunks each converts (wide0, wide1 in the stage) lie in 8 bank groups.
        constexpr int C8 = S::kFp8RowVecs, R8 = S::kFp8Rows;
        const int r8 = tid / (8 * C8) * 8 + tid % 8, c8 = tid / 8 % C8;
        const unsigned wide0 = panel_offset<TILE_N>(r8, 2 * c8), wide1 = panel_offset<TILE_N>(r8, 2 * c8 + 1);
        int tiles = 0;  // tiles produced so far: stage tiles % STAGES, round tiles / STAGES
        for (int n = 0;; ++n) {
            if (tid == 0) {  // hand the block's n-th unit on: its own index first, then one claimed
                claim(n, static_cast<int>(n == 0 ? blockIdx.x : gridDim.x + atomicAdd(queue, 1)));
                sm90::mbarrier_arrive(unit_full(n));
            }
            __syncwarp();
            const Claim c = take(n);
            if (c.u >= num_units) break;
            const Unit w = unit_of(c);
            // The Q tile, rows past the tile zero-filled, once the consumers are done with the last unit's (also
            // for a segment without keys, whose Q barriers keep the unit slots in step).
            // This thread copies chunk `chunk` of the packed rows [qrow0, qrow0 + QRPT), stepping through them.
            sm90::mbarrier_wait(q_empty, (n & 1) ^ 1);
            {
                const int p0 = w.p_first + qrow0, live_rows = w.p_end - p0;
                int head = p0 % group;
                const T* from = q + row_offset(w, p0) + chunk * 8;
                // not unrolled: unrolled, its addresses were hoisted out of the unit loop, and spilled
#pragma unroll 1
                for (int i = 0; i < QRPT; ++i) {
                    const bool live = i < live_rows;
                    cp_async16_shared(smem_q + qdst0 + i * 128 + ((swizzle ^ (i % 8)) << 4), live ? from : q,
                                      live ? 16 : 0);
                    from += ++head < group ? HEAD_DIM : (q_heads - group + 1) * HEAD_DIM;  // the next packed row
                    head = head < group ? head : 0;
                }
            }
            sm90::cp_async_arrive(q_full);

            const int* const table_row = block_tables + w.seq * table_stride;
            // K/V that this unit alone reads (its sequence's only item: a decode's, or a prompt of at most
            // TILE_M / group tokens) are streamed evict-first, as the decode kernel streams them; other items of
            // the sequence read them again.
            const bool read_once = w.q_len * group <= TILE_M;
            // lane j: the id of the tile's j-th block (-1 past the sequence: never read)
            auto block_id = [&](int first_key) {
                const int block = (first_key >> block_shift) + lane;
                return lane < tile_blocks && (block << block_shift) < w.kv_len ? __ldg(table_row + block) : -1;
            };
            if constexpr (FP8) {
                const long long within = ((long long)w.kv_head << block_shift) * HEAD_DIM + c8 * 16;  // in a block
                // Tile `tiles`'s K and V bytes into its staging slot (one cp.async group), rows past the sequence
                // zero-filled, reading nothing. The slot's last tile is converted: by this thread, its only reader.
                auto stage_bytes = [&](int first_key, int id) {
                    const unsigned slot = smem_staging + (tiles % STAGING) * S::kStagingBytes + tid * 16;
                    // four copies at a time: all eight at head_dim 128 spilled the producer's 56 registers
#pragma unroll 4
                    for (int i = 0; i < TILE_N / R8; ++i) {
                        const int row = i * R8 + r8;  // in a block: 8-row groups do not cross blocks (8 or more)
                        const bool live = first_key + row < w.kv_len;
                        const long long at = __shfl_sync(0xffffffffu, id, row >> block_shift) * block_stride + within
                                             + (row & block_mask) * HEAD_DIM;
                        const void* const from_k = live ? static_cast<const void*>(k + at) : q;
                        const void* const from_v = live ? static_cast<const void*>(v + at) : q;
                        const unsigned dst = slot + i * 128 * 16;
                        if (read_once) {
                            cp_async16_shared(dst, from_k, live ? 16 : 0, stream_policy);
                            cp_async16_shared(dst + S::kStagingBytes / 2, from_v, live ? 16 : 0, stream_policy);
                        } else {
                            cp_async16_shared(dst, from_k, live ? 16 : 0);
                            cp_async16_shared(dst + S::kStagingBytes / 2, from_v, live ? 16 : 0);
                        }
                    }
                    cp_async_commit();
                };
                // e4m3 bytes this thread copied (at `from`) as f16 in the stage, then visible to wgmma
                auto widen = [&](unsigned from, unsigned stage) {
#pragma unroll
                    for (int i = 0; i < TILE_N / R8; ++i) {
                        unsigned b[4], h[8];
                        load_shared<4>(b, from + i * 128 * 16);
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            h[2 * e] = e4m3x2_to_half2(b[e] & 0xffffu);
                            h[2 * e + 1] = e4m3x2_to_half2(b[e] >> 16);
                        }
                        sm90::store_shared4(stage + wide0 + i * R8 * 128, h[0], h[1], h[2], h[3]);
                        sm90::store_shared4(stage + wide1 + i * R8 * 128, h[4], h[5], h[6], h[7]);
                    }
                    sm90::fence_proxy_async();
                };
                // Tile j (its bytes landed) into its stage, K then V, each once the consumers are done with it
                auto convert = [&](int j) {
                    const int s = j % STAGES;
                    const unsigned parity = ((j / STAGES) & 1) ^ 1, from = smem_staging + (j % STAGING)
                                                                              * S::kStagingBytes + tid * 16;
                    sm90::mbarrier_wait(k_empty(s), parity);
                    widen(from, smem_k + s * S::kStageBytes);
                    sm90::mbarrier_arrive(k_full(s));
                    sm90::mbarrier_wait(v_empty(s), parity);
                    widen(from + S::kStagingBytes / 2, smem_v + s * S::kStageBytes);
                    sm90::mbarrier_arrive(v_full(s));
                };
                for (int t = 0; t < w.num_tiles; ++t, ++tiles) {
                    stage_bytes((w.tile0 + t) * TILE_N, block_id((w.tile0 + t) * TILE_N));
                    if (t >= STAGING - 1) {  // the tile STAGING - 1 before this one has landed
                        cp_async_wait<STAGING - 1>();
                        convert(tiles - (STAGING - 1));
                    }
                }
                // the unit's last tiles now: the next unit's Q waits for the consumers, who wait for these
                cp_async_wait<0>();
                for (int j = tiles - min(w.num_tiles, STAGING - 1); j < tiles; ++j) convert(j);
            } else {
                const long long within = ((long long)w.kv_head << block_shift) * HEAD_DIM + chunk * 8;  // in a block
                auto issue = [&](const T* plane, unsigned stage, int first_key, int id) {
                    const int key0 = first_key + row0, slot0 = key0 & block_mask;
                    const int split = min(RPT, block_mask + 1 - slot0);  // rows [0, split) lie in key0's block
                    const int id0 = __shfl_sync(0xffffffffu, id, row0 >> block_shift);
                    const int id1 = __shfl_sync(0xffffffffu, id, (row0 + RPT - 1) >> block_shift);
                    const T* const from0 = plane + id0 * block_stride + within + slot0 * HEAD_DIM;
                    const int live_rows = w.kv_len - key0;  // rows past the sequence are zero-filled, reading nothing
                    auto dst = [&](int i) { return stage + dst0 + i * 128 + ((swizzle ^ (i % 8)) << 4); };
                    // all in one block, all in the sequence: no choices (at head_dim 256 the producer's registers
                    // do not hold the unrolled addresses)
                    if (HEAD_DIM <= 128 && split == RPT && live_rows >= RPT) {
                        if (read_once) {
#pragma unroll
                            for (int i = 0; i < RPT; ++i)
                                cp_async16_shared(dst(i), from0 + i * HEAD_DIM, 16, stream_policy);
                        } else {
#pragma unroll
                            for (int i = 0; i < RPT; ++i) cp_async16_shared(dst(i), from0 + i * HEAD_DIM, 16);
                        }
                        return;
                    }
                    const T* const from1 = plane + id1 * block_stride + within - split * HEAD_DIM;  // the split: slot 0
#pragma unroll
                    for (int i = 0; i < RPT; ++i) {
                        const bool live = i < live_rows;
                        const T* const from = (i < split ? from0 : from1) + i * HEAD_DIM;
                        if (read_once)
                            cp_async16_shared(dst(i), live ? from : q, live ? 16 : 0, stream_policy);
                        else
                            cp_async16_shared(dst(i), live ? from : q, live ? 16 : 0);
                    }
                };
                for (int t = 0; t < w.num_tiles; ++t, ++tiles) {
                    const int s = tiles % STAGES, first_key = (w.tile0 + t) * TILE_N;
                    const unsigned parity = ((tiles / STAGES) & 1) ^ 1;  // the stage's last round was released
                    const int id = block_id(first_key);
                    sm90::mbarrier_wait(k_empty(s), parity);
                    issue(k, smem_k + s * S::kStageBytes, first_key, id);
                    sm90::cp_async_arrive(k_full(s));
                    sm90::mbarrier_wait(v_empty(s), parity);
                    issue(v, smem_v + s * S::kStageBytes, first_key, id);
                    sm90::cp_async_arrive(v_full(s));
                }
            }
        }
        if (tid == 0) {  // this block claims no more; the last block to finish resets the queue
            __threadfence();
            if (atomicAdd(queue + 1, 1) == static_cast<int>(gridDim.x) - 1) queue[0] = queue[1] = 0;
        }
        sm90::cp_async_wait_all();
        return;
    }

    // ---- consumers ----
    sm90::setmaxnreg_inc<S::kConsumerRegs>();
    constexpr int S_REGS = TILE_N / 2, O_REGS = HEAD_DIM / 2, KSTEPS = HEAD_DIM / 16, PSTEPS = TILE_N / 16;
    // warp-uniform values through a shuffle from lane 0, so that the compiler keeps what it derives from them (the
    // wgmma descriptors) in uniform registers
    const int consumer = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0) - 1;
    const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
    const int quad_col = lane % 4, row_base = 64 * consumer;  // this consumer's rows of the tile
    // This thread's rows of the accumulators: row_c and row_c + 8 (h = 0, 1).
    const int row_c = row_base + 16 * warp + lane / 4;
    // Descriptors: Q (this consumer's 64 rows) and K K-major, V MN-major; k-steps move along them. Here their low
    // words (the high word is one constant: hopper.cuh), from the tiles' address as lane 0 has it (derived from the
    // shared window's address in each thread, ptxas recomputes it, and Q's descriptors, for every key tile).
    const unsigned tiles_at = __shfl_sync(0xffffffffu, smem, 0);
    constexpr unsigned DESC_HI = sm90::smem_descriptor_hi(1024);
    const unsigned q_lo = sm90::smem_descriptor_lo(tiles_at + row_base * S::kPanelBytes, 16);
    auto k_desc = [&](int s) { return sm90::smem_descriptor_lo(tiles_at + S::kKOffset + s * S::kStageBytes, 16); };
    auto v_desc = [&](int s) {
        return sm90::smem_descriptor_lo(tiles_at + S::kVOffset + s * S::kStageBytes, TILE_N * S::kPanelBytes);
    };
    float o[O_REGS], sc[S_REGS], m[2], l[2];
    unsigned pa[PSTEPS][4];
    // A tile's keys that take part: all (Full), or in a unit's last tile, where no row of this consumer sees past
    // the first half, that half (Half): S by an m64n(TILE_N / 2) wgmma into registers of its own (aliasing the
    // first half of sc made ptxas serialise the wgmmas, C7511), copied into sc, the softmax over them, P V over
    // half the k-steps (the other half's probabilities would be 0). Only at TILE_N 128 (wgmma n64).
    constexpr bool TRIM = TILE_N == 128;
    using Full = integral_constant<int, TILE_N>;
    using Half = integral_constant<int, TILE_N / 2>;
    auto scores = [&](int s, auto cols, float (&acc)[decltype(cols)::value / 2]) {  // issue S = Q K^T over the
        constexpr int C = decltype(cols)::value;                                      // first `cols` keys of stage s
        const unsigned kd = k_desc(s);
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            // in 16-byte units: the kk / 4-th panel, 16 elements (32 bytes) further in it for each k-step
            const unsigned q_at = (kk / 4) * TILE_M * S::kPanelBytes / 16 + (kk % 4) * 2;
            const unsigned k_at = (kk / 4) * TILE_N * S::kPanelBytes / 16 + (kk % 4) * 2;
            sm90::Wgmma<MT, C>::ss(acc, sm90::descriptor(q_lo + q_at, DESC_HI), sm90::descriptor(kd + k_at, DESC_HI),
                                   kk > 0);
        }
    };
    auto weighted = [&](int s, auto cols) {  // issue O += P V over the first `cols` keys of stage s
        const unsigned vd = v_desc(s);
#pragma unroll
        for (int kk = 0; kk < decltype(cols)::value / 16; ++kk)
            sm90::Wgmma<MT, HEAD_DIM>::rs(o, pa[kk], sm90::descriptor(vd + kk * 16 * S::kPanelBytes / 16, DESC_HI));
    };
    auto release = [&](unsigned bar) {  // this warp is done with a stage (or the Q tile)
        __syncwarp();
        if (lane == 0) sm90::mbarrier_arrive(bar);
    };
    // P as wgmma A fragments: two 8-key column blocks of S's accumulators make one 16-key k-step.
    auto to_operand = [&](auto cols) {
#pragma unroll
        for (int kk = 0; kk < decltype(cols)::value / 16; ++kk) {
            pa[kk][0] = pack2<MT>(sc[8 * kk + 0], sc[8 * kk + 1]);
            pa[kk][1] = pack2<MT>(sc[8 * kk + 2], sc[8 * kk + 3]);
            pa[kk][2] = pack2<MT>(sc[8 * kk + 4], sc[8 * kk + 5]);
            pa[kk][3] = pack2<MT>(sc[8 * kk + 6], sc[8 * kk + 7]);
        }
    };

    // Pingpong: in a unit with two live consumers they take turns issuing their wgmmas, so that one's softmax
    // runs while the tensor cores do the other's products. Consumer c waits on barrier 1 + c and, once its
    // wgmmas are issued, arrives on the other's; consumer 0 gets the first turn (an arrival of its own, once),
    // consumer 1's last arrival is taken at the end. At most one arrival is ever pending on either barrier.
    struct Place {  // a tile's place in the ring: its stage, and the parity of its round
        int stage;
        unsigned round;
    };
    auto after = [](Place x) { return x.stage == STAGES - 1 ? Place{0, x.round ^ 1} : Place{x.stage + 1, x.round}; };
    bool pinged = false;  // a pingpong unit has run
    int tiles = 0;        // tiles consumed so far, as the producer counts them
    for (int n = 0;; ++n) {
        const Claim c = take(n);
        if (c.u >= num_units) break;
        const Unit w = unit_of(c);
        const int num_tiles = __shfl_sync(0xffffffffu, w.num_tiles, 0), first = tiles;
        tiles += num_tiles;
        auto stage = [&](int t) { return (first + t) % STAGES; };
        auto round = [&](int t) { return unsigned((first + t) / STAGES) & 1; };
        sm90::mbarrier_wait(q_full, n & 1);
        if (consumer >= w.consumers || w.split >= w.live) {  // no live row, or no keys: pass the stages on
            release(q_empty);
            for (int t = 0; t < num_tiles; ++t) {
                sm90::mbarrier_wait(k_full(stage(t)), round(t));
                release(k_empty(stage(t)));
                sm90::mbarrier_wait(v_full(stage(t)), round(t));
                release(v_empty(stage(t)));
            }
            continue;
        }
        const bool pingpong = w.consumers == 2;
        auto turn = [&]() {
            if (pingpong) sm90::named_barrier_sync(1 + consumer, 256);
        };
        auto pass_turn = [&]() {
            if (pingpong) sm90::named_barrier_arrive(2 - consumer, 256);
        };
        if (pingpong && !pinged && consumer == 0) sm90::named_barrier_arrive(1, 256);
        pinged |= pingpong;
        if constexpr (FP8) {
            // This consumer's rows of the Q tile as f16, in place, scaled as prefill_fp8 scales its fragments
            // (16-byte chunk c of the rows' bytes in panel c / 512); then handed to wgmma (the async proxy)
            const float q_scale = scale_log2 * __ldg(k_scales + w.kv_head);
#pragma unroll
            for (int i = 0; i < NV / 2; ++i) {
                const int c = 128 * i + threadIdx.x % 128;
                const unsigned at = smem_q + (c / 512) * (TILE_M * S::kPanelBytes) + row_base * S::kPanelBytes
                                    + (c % 512) * 16;
                unsigned x[4];
                float f[8];
                load_shared<4>(x, at);
                unpack<T>(make_uint4(x[0], x[1], x[2], x[3]), f);
                sm90::store_shared4(at, pack2<__half>(f[0] * q_scale, f[1] * q_scale),
                                    pack2<__half>(f[2] * q_scale, f[3] * q_scale),
                                    pack2<__half>(f[4] * q_scale, f[5] * q_scale),
                                    pack2<__half>(f[6] * q_scale, f[7] * q_scale));
            }
            sm90::fence_proxy_async();
            sm90::named_barrier_sync(3 + consumer, 128);
        }
        // FP8: the scale is in Q, so the softmax takes the scores as they are
        const float softmax_scale = FP8 ? 1.f : scale_log2;

        const int shared_keys = limit(w, w.p_first + row_base);  // every row of this consumer sees these
        int row_keys[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            row_keys[h] = limit(w, w.p_first + row_c + 8 * h);
            m[h] = neg_inf();
            l[h] = 0.f;  // this lane's part of the row's sum; the quad's parts are added at the end
        }
#pragma unroll
        for (int i = 0; i < O_REGS; ++i) o[i] = 0.f;
        // The online softmax of the unit's tile t's scores (in sc): the running max and sum, sc becomes the
        // probabilities; returns (through alpha) the factor the output rows must be rescaled by. MASK:
        // some key of the tile lies past some row's limit, so those scores become -inf. The scale is
        // positive (the plan sends other scales to prefill.cu), so the max is taken over the raw scores
        // and the scale folds into the exponent: exp2(s * softmax_scale - m * softmax_scale), one FFMA.
        auto softmax = [&](int t, float (&alpha)[2], auto mask, auto cols) {
            constexpr bool MASK = decltype(mask)::value;
            constexpr int C = decltype(cols)::value;
            const int key0 = (w.tile0 + t) * TILE_N;
            // sc[4j + e]: row row_c + 8 * (e / 2), key key0 + 8 * j + 2 * quad_col + e % 2. A row's max and sum
            // run in four independent chains (chain (j % 2) * 2 + e % 2), not one of TILE_N / 4 dependent steps.
            // A chain starts at its first score (j < 2), not at max(-inf, it): the same max (a NaN score yields a
            // NaN chain rather than -inf only when all of the row's scores are NaN, and max(m, NaN) = max(m, -inf)
            // = m), one instruction fewer a chain; its sum likewise at its first term, not 0 + it (the same,
            // exp2 giving no -0).
            float top[2][4];
            // masked: key key0 + 8 * j + 2 * quad_col + e % 2 past row_keys[e / 2], compared as 8 * j + e % 2 (a
            // constant) with the row's keys past this thread's first column
            const int past[2] = {row_keys[0] - key0 - 2 * quad_col, row_keys[1] - key0 - 2 * quad_col};
#pragma unroll
            for (int j = 0; j < C / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    if (MASK && 8 * j + e % 2 >= past[e / 2]) sc[4 * j + e] = neg_inf();
                    float& chain = top[e / 2][(j % 2) * 2 + e % 2];
                    chain = j < 2 ? sc[4 * j + e] : fmaxf(chain, sc[4 * j + e]);
                }
            float shift[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                top[h][0] = fmaxf(fmaxf(top[h][0], top[h][1]), fmaxf(top[h][2], top[h][3]));
                top[h][0] = fmaxf(top[h][0], __shfl_xor_sync(0xffffffffu, top[h][0], 1));
                top[h][0] = fmaxf(top[h][0], __shfl_xor_sync(0xffffffffu, top[h][0], 2));
                const float m_new = fmaxf(m[h], top[h][0]);
                // m_new = -inf: the row has seen no key yet (its o and l are 0); m = -inf: exp2f gives 0
                alpha[h] = m_new == neg_inf() ? 1.f : exp2f((m[h] - m_new) * softmax_scale);
                shift[h] = (m_new == neg_inf() ? 0.f : m_new) * softmax_scale;
                m[h] = m_new;
                l[h] *= alpha[h];
            }
            float sum[2][4];
#pragma unroll
            for (int j = 0; j < C / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    sc[4 * j + e] = exp2f(fmaf(sc[4 * j + e], softmax_scale, -shift[e / 2]));
                    float& chain = sum[e / 2][(j % 2) * 2 + e % 2];
                    chain = j < 2 ? sc[4 * j + e] : chain + sc[4 * j + e];
                }
#pragma unroll
            for (int h = 0; h < 2; ++h) l[h] += (sum[h][0] + sum[h][1]) + (sum[h][2] + sum[h][3]);
        };
        auto softmax_of = [&](int t, float (&alpha)[2], auto cols) {
            if ((w.tile0 + t) * TILE_N + decltype(cols)::value <= shared_keys)
                softmax(t, alpha, integral_constant<bool, false>(), cols);
            else
                softmax(t, alpha, integral_constant<bool, true>(), cols);
        };
        // Whether the unit's last tile is a Half one for this consumer (its last live row sees the most keys).
        const bool half_last = TRIM && num_tiles > 0
                               && limit(w, min(w.p_first + row_base + 63, w.p_end - 1))
                                      <= (w.tile0 + num_tiles - 1) * TILE_N + TILE_N / 2;
        // f(Full(), sc), or f(Half(), registers of its own for the scores)
        auto widths = [&](bool half, auto f) {
            if constexpr (TRIM) {
                if (half) {
                    float half_scores[TILE_N / 4];
                    return f(Half(), half_scores);
                }
            }
            f(Full(), sc);
        };
        // A tile's scores have landed in acc: into sc (a Half tile's, from its own registers).
        auto landed = [&](auto cols, float (&acc)[decltype(cols)::value / 2]) {
            sm90::fence_registers(acc);
            if constexpr (decltype(cols)::value != TILE_N) {
#pragma unroll
                for (int i = 0; i < decltype(cols)::value / 2; ++i) sc[i] = acc[i];
            }
        };

        if (num_tiles == 0) release(q_empty);
        if (num_tiles > 0) {
            float alpha[2];
            // Tile 0: its scores, then their softmax (nothing to overlap with yet).
            auto first = [&](auto cols, float (&acc)[decltype(cols)::value / 2]) {  // acc: sc, or Half's own
                sm90::mbarrier_wait(k_full(stage(0)), round(0));
                turn();
                sm90::wgmma_fence();
                scores(stage(0), cols, acc);
                sm90::wgmma_commit();
                pass_turn();
                sm90::wgmma_wait<0>();
                landed(cols, acc);
                release(k_empty(stage(0)));
                if (num_tiles == 1) release(q_empty);
                softmax_of(0, alpha, cols);
                to_operand(cols);
            };
            widths(num_tiles == 1 && half_last, first);
            // Tile t: its scores issued before tile t - 1's P V (a Full tile: only the last may be Half).
            // cur, prev: tile t's and tile t - 1's place in the ring; last: t is the unit's last tile.
            auto next = [&](int t, Place cur, Place prev, auto last, auto cols,
                            float (&acc)[decltype(cols)::value / 2]) {  // acc: sc, or Half's own
                sm90::mbarrier_wait(k_full(cur.stage), cur.round);
                sm90::mbarrier_wait(v_full(prev.stage), prev.round);
                turn();
                sm90::fence_registers(acc);
                sm90::fence_registers(o);
                sm90::wgmma_fence();
                scores(cur.stage, cols, acc);
                sm90::wgmma_commit();
                weighted(prev.stage, Full());
                sm90::wgmma_commit();
                pass_turn();
                sm90::wgmma_wait<1>();  // the scores have landed; P V of the previous tile may still run
                landed(cols, acc);
                release(k_empty(cur.stage));
                if (decltype(last)::value) release(q_empty);  // the unit's last use of its Q tile
                softmax_of(t, alpha, cols);
                sm90::wgmma_wait<0>();
                sm90::fence_registers(o);
                sm90::fence_registers(pa);
                release(v_empty(prev.stage));
#pragma unroll
                for (int i = 0; i < O_REGS; ++i) o[i] *= alpha[(i / 2) % 2];
                to_operand(cols);
            };
            // the ring's place carried from tile to tile, not recomputed (a division by STAGES) for each
            Place prev = {stage(0), round(0)};
            for (int t = 1; t < num_tiles - 1; ++t) {
                const Place cur = after(prev);
                next(t, cur, prev, integral_constant<bool, false>(), Full(), sc);
                prev = cur;
            }
            if (num_tiles > 1)
                widths(half_last, [&](auto cols, auto& acc) {
                    next(num_tiles - 1, after(prev), prev, integral_constant<bool, true>(), cols, acc);
                });
            // The last tile's P V.
            widths(half_last, [&](auto cols, auto&) {
                sm90::mbarrier_wait(v_full(stage(num_tiles - 1)), round(num_tiles - 1));
                turn();
                sm90::fence_registers(o);
                sm90::wgmma_fence();
                weighted(stage(num_tiles - 1), cols);
                sm90::wgmma_commit();
                pass_turn();
                sm90::wgmma_wait<0>();
                sm90::fence_registers(o);
                release(v_empty(stage(num_tiles - 1)));
            });
        }

#pragma unroll
        for (int h = 0; h < 2; ++h) {
            l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
            l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
        }
        // The sums to normalise by: the unit's own, or, split, the merged ones (the output merged into o).
        float sum[2] = {l[0], l[1]};
        if (w.live > 1) {
            // Split-K: this segment's partials, then the consumer arriving last on its rows merges them.
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int p = w.p_first + row_c + 8 * h;
                if (p >= w.p_end) continue;
                const long long part = (w.part_row + p) * num_splits + w.split;
                float* const po = part_o + part * HEAD_DIM + 2 * quad_col;
#pragma unroll
                for (int j = 0; j < HEAD_DIM / 8; ++j)
                    *reinterpret_cast<float2*>(po + 8 * j) = make_float2(o[4 * j + 2 * h], o[4 * j + 2 * h + 1]);
                if (quad_col == 0)
                    part_ml[part] = make_float2(m[h] == neg_inf() ? neg_inf() : m[h] * softmax_scale, l[h]);
            }
            __threadfence();
            sm90::named_barrier_sync(3 + consumer, 128);
            if (threadIdx.x % 128 == 0) {
                int* const count = arrivals + w.part_row + w.p_first + row_base;
                const bool last = atomicAdd(count, 1) == w.live - 1;
                if (last) *count = 0;  // ready for the next launch
                __threadfence();
                merges[consumer] = last;
            }
            sm90::named_barrier_sync(3 + consumer, 128);
            if (!merges[consumer]) continue;
            // o = sum_s o_s 2^(m_s - m), sum = sum_s l_s 2^(m_s - m), m = max_s m_s, for this thread's rows and
            // columns: a segment's loads (a row's whole slice of o_s) are in flight together.
            long long part[2];
            float top[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int p = min(w.p_first + row_c + 8 * h, w.p_end - 1);  // a dead row merges a live one's
                part[h] = (w.part_row + p) * num_splits;
                top[h] = neg_inf(), sum[h] = 0.f;
            }
            for (int s = 0; s < w.live; ++s)
#pragma unroll
                for (int h = 0; h < 2; ++h) top[h] = fmaxf(top[h], __ldcg(part_ml + part[h] + s).x);
#pragma unroll
            for (int i = 0; i < O_REGS; ++i) o[i] = 0.f;
#pragma unroll
            for (int h = 0; h < 2; ++h)
                for (int s = 0; s < w.live; ++s) {
                    const float2 ml = __ldcg(part_ml + part[h] + s);
                    const float weight = ml.x == neg_inf() ? 0.f : exp2f(ml.x - top[h]);
                    sum[h] += ml.y * weight;
                    const float2* const po =
                        reinterpret_cast<const float2*>(part_o + (part[h] + s) * HEAD_DIM) + quad_col;
#pragma unroll
                    for (int j = 0; j < HEAD_DIM / 8; ++j) {
                        const float2 x = __ldcg(po + 4 * j);
                        o[4 * j + 2 * h] += x.x * weight;
                        o[4 * j + 2 * h + 1] += x.y * weight;
                    }
                }
        }
        // Normalise (FP8: times the V scale) and store this thread's two rows.
        // Both rows' factors and addresses before any store: worked out between the stores, they waited for the
        // stores to read their registers.
        float out_scale = 1.f;
        if constexpr (FP8) out_scale = __ldg(v_scales + w.kv_head);
        // o[4j + 2h + e] is column 8j + 2 quad_col + e. Two lanes of a quad (quad_col 2c, 2c + 1) swap a column pair
        // so that each stores 4 adjacent columns, 8 bytes: for j even, the even lane columns 8j + 4c on, the odd lane
        // 8(j + 1) + 4c on (8j + 2 quad_col + 6); a row's 32 bytes of two column blocks are then one whole sector
        // (4-byte stores wrote half sectors, twice as many, and queued behind each other).
        const bool odd = quad_col & 1;
        float inv[2];
        T* row[2];  // from where this thread stores in each of its rows (null: a row past the unit)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            inv[h] = sum[h] > 0.f ? out_scale / sum[h] : 0.f;  // 0: a row that saw no key (an empty sequence)
            const int p = w.p_first + row_c + 8 * h;
            row[h] = p < w.p_end ? out + row_offset(w, p) + 2 * quad_col + (odd ? 6 : 0) : nullptr;
        }
#pragma unroll
        for (int j = 0; j < HEAD_DIM / 8; j += 2)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const unsigned a = pack2<T>(o[4 * j + 2 * h] * inv[h], o[4 * j + 2 * h + 1] * inv[h]);
                const unsigned b = pack2<T>(o[4 * j + 4 + 2 * h] * inv[h], o[4 * j + 4 + 2 * h + 1] * inv[h]);
                const unsigned got = __shfl_xor_sync(0xffffffffu, odd ? a : b, 1);
                if (row[h] != nullptr)
                    *reinterpret_cast<uint2*>(row[h] + 8 * j) =
                        odd ? make_uint2(got, b) : make_uint2(a, got);
            }
    }
    if (pinged && consumer == 0) sm90::named_barrier_sync(1, 256);
}

// The kernel over K/V of q's type (arguments: see prefill_sm90_body).
template <typename T, int HEAD_DIM, int TILE_N, int STAGES>
__global__ void __launch_bounds__(384, 1)
prefill_sm90(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, long long block_stride,
             const int* __restrict__ block_tables, long long table_stride, int max_blocks,
             const int* __restrict__ kv_lens, const int4* __restrict__ items, int group, int causal,
             float scale_log2, int block_shift, int num_items, int num_kv_heads, int num_splits, int split_tiles,
             float* __restrict__ part_o, float2* __restrict__ part_ml, int* __restrict__ arrivals,
             int* __restrict__ queue, T* __restrict__ out) {
    prefill_sm90_body<T, T, HEAD_DIM, TILE_N, STAGES, 0>(
        q, k, v, block_stride, block_tables, table_stride, max_blocks, kv_lens, items, group, causal, scale_log2,
        block_shift, num_items, num_kv_heads, num_splits, split_tiles, part_o, part_ml, arrivals, queue, out, nullptr,
        nullptr);
}

// The kernel over float8 e4m3 K/V (q and out: __half or __nv_bfloat16): the arguments of prefill_sm90, then the
// scales.
template <typename T, int HEAD_DIM, int TILE_N, int STAGES, int STAGING>
__global__ void __launch_bounds__(384, 1)
prefill_sm90_fp8(const T* __restrict__ q, const e4m3* __restrict__ k, const e4m3* __restrict__ v,
                 long long block_stride, const int* __restrict__ block_tables, long long table_stride, int max_blocks,
                 const int* __restrict__ kv_lens, const int4* __restrict__ items, int group, int causal,
                 float scale_log2, int block_shift, int num_items, int num_kv_heads, int num_splits, int split_tiles,
                 float* __restrict__ part_o, float2* __restrict__ part_ml, int* __restrict__ arrivals,
                 int* __restrict__ queue, T* __restrict__ out, const float* __restrict__ k_scales,
                 const float* __restrict__ v_scales) {
    prefill_sm90_body<T, e4m3, HEAD_DIM, TILE_N, STAGES, STAGING>(
        q, k, v, block_stride, block_tables, table_stride, max_blocks, kv_lens, items, group, causal, scale_log2,
        block_shift, num_items, num_kv_heads, num_splits, split_tiles, part_o, part_ml, arrivals, queue, out,
        k_scales, v_scales);
}

}  // namespace pagedrt
