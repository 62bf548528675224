// The GEMMs of a layered decode step with what sits between them fused in: out = epilogue(prologue(A) @ W.T)
// (pagedrt/engine/layer_gemm.py launches them, each variant beside its NumPy reference there).
//
// W: a weight [rows, K] in T (__half or __nv_bfloat16), row-major. Float32 accumulation on tensor cores
// (mma.m16n8k16). M rows of A, K a multiple of 64, N (the output's columns) a multiple of 8.
//
// Prologue NORM:   A[m] = round_T(x[m] * rsqrt(mean(x[m]^2) + eps) * norm_weight), x the float32 residual
//                  [M, K] (add_rms_norm's arithmetic: every CTA computes its rows' RMS in the same order).
// Prologue PLAIN:  A = a [M, K] in T.
// Epilogue STORE:  out[m, n] = round_T(acc)                                          (W [N, K])
// Epilogue SILU_UP: W [2N, K] is gate rows then up rows; out[m, j] = round_T(silu(round_T(g)) * round_T(u)),
//                  g of W row j and u of row N + j (silu_mul over the rounded gate_up GEMM).
// Epilogue ADD:    residual[m, n] += round_T(acc) in float32 (each element read, right after the wait, and
//                  written by one thread)                                           (W [N, K])
// Epilogue ROPE_WRITE: W [N, K] is the QKV weight (q's heads, k's, then v's: N = (q_heads + 2 kv_heads) *
//                  head_dim); row m is a decode row at position seq_lens[m] - 1. Each output rounded to T, q's
//                  and k's pairs (2i, 2i + 1) turned by that position * inv_freq[i] and rounded again, as
//                  rope_write.cu turns them; q into out [M, q_heads * head_dim], k and v into the planes at
//                  slots[m] as rope_write.cu stores them (none for a negative slot; FP8 planes when k_scales is
//                  given: each value divided by its KV head's scale, as e4m3). So this epilogue is the QKV GEMM
//                  then rope_write, bit for bit, in one launch.
//
// These GEMMs are small (M <= 256, K of 576 or 1536 for a 135M model): what they take is latency, not FLOPs.
// So a CTA (8 warps) keeps its BM rows of A in shared memory for the whole K, requested in one go (NORM: the
// float32 rows, normalised in place into T, the norm's weights beside them; PLAIN: the T rows); W streams through STAGES buffers of BN rows x
// BK with cp.async, the first STAGES - 1 requested before grid_dependency_wait (weights never depend on the
// kernel before, so under PDL they arrive while it finishes). The warps split the tile WARPS_M x WARPS_N and
// each BK's four k-steps WARPS_K ways (shorter chains of dependent mma); the WARPS_K partial sums are added in
// warp order through shared memory, so the result does not depend on timing. For SILU_UP a tile's BN rows are
// BN / 2 gate rows and their BN / 2 up rows, arranged so that each warp's accumulators hold a gate column and its
// up column. Shared rows are 16-byte chunks at swizzle<8>(chunk, row).
#include "common.cuh"

namespace pagedrt {

namespace layer {
constexpr int THREADS = 256, WARPS = THREADS / 32, BK = 64;
constexpr int NORM = 0, PLAIN = 1;             // prologues
constexpr int STORE = 0, SILU_UP = 1, ADD = 2, ROPE_WRITE = 3;  // epilogues
}  // namespace layer

// x rounded to T, as a float.
template <typename T> __device__ __forceinline__ float round_to(float x) { return to_float(from_float<T>(x)); }

// NORM: the CTA's float32 rows (staged at sa, rows of K floats) become their normalised T values (g: the norm's
// weight, staged in shared memory too), in place: T
// chunk c of row r at byte (swizzle<8>(c, r) << 4) of the row. A warp a row; a row's 256-value segments in order,
// each read whole before it is written (segment s writes bytes below 1024 s, which segments < s have read).
template <typename T>
__device__ __forceinline__ void normalise_rows(unsigned char* smem, const float* g, int rows, int K, float eps) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int r = warp; r < rows; r += layer::WARPS) {
        unsigned char* row = smem + (long long)r * K * 4;
        float sum = 0.0f;
        for (int k = lane * 4; k < K; k += 128) {
            const float4 v = *reinterpret_cast<const float4*>(row + k * 4);
            sum += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
        const float scale = rsqrtf(sum / K + eps);
        for (int k0 = 0; k0 < K; k0 += 256) {
            const int k = k0 + lane * 8;
            uint4 packed = make_uint4(0u, 0u, 0u, 0u);
            if (k < K) {
                const float4 v0 = *reinterpret_cast<const float4*>(row + k * 4);
                const float4 v1 = *reinterpret_cast<const float4*>(row + k * 4 + 16);
                const float4 g0 = *reinterpret_cast<const float4*>(g + k);
                const float4 g1 = *reinterpret_cast<const float4*>(g + k + 4);
                packed.x = pack2<T>(v0.x * scale * g0.x, v0.y * scale * g0.y);
                packed.y = pack2<T>(v0.z * scale * g0.z, v0.w * scale * g0.w);
                packed.z = pack2<T>(v1.x * scale * g1.x, v1.y * scale * g1.y);
                packed.w = pack2<T>(v1.z * scale * g1.z, v1.w * scale * g1.w);
            }
            __syncwarp();
            if (k < K) *reinterpret_cast<uint4*>(row + (swizzle<8>(k / 8, r) << 4)) = packed;
            __syncwarp();
        }
    }
}

// ROPE_WRITE: the GEMM's outputs (c0, c1) of row m, columns n and n + 1 (n even: a rotary pair; `angle` its
// (cos, sin), used where the pair is q's or k's; `row` the row's slot_offset for KV head 0, or -1 for padding),
// as rope_write.cu would leave them after the QKV GEMM rounded them to T.
template <typename T>
__device__ __forceinline__ void rope_write_pair(float c0, float c1, float2 angle, long long row, int m, int n, T* q,
                                                void* k_cache, void* v_cache, const float* k_scales,
                                                const float* v_scales, int q_heads,
                                                int kv_heads, int head_dim, int block_size) {
    const int head = n / head_dim, col = n % head_dim;
    float x0 = round_to<T>(c0), x1 = round_to<T>(c1);
    if (head < q_heads + kv_heads) {
        rotate_pair(x0, x1, angle.x, angle.y);
        x0 = round_to<T>(x0), x1 = round_to<T>(x1);
    }
    if (head < q_heads) {
        *reinterpret_cast<unsigned*>(q + (long long)m * q_heads * head_dim + n) = pack2<T>(x0, x1);
        return;
    }
    if (row < 0) return;
    const bool is_k = head < q_heads + kv_heads;
    const int kv = head - q_heads - (is_k ? 0 : kv_heads);
    const long long at = row + (long long)kv * block_size * head_dim + col;
    if (k_scales != nullptr) {
        const float scale = (is_k ? k_scales : v_scales)[kv];
        *reinterpret_cast<unsigned short*>(static_cast<e4m3*>(is_k ? k_cache : v_cache) + at) =
            float2_to_e4m3x2(__fdiv_rn(x0, scale), __fdiv_rn(x1, scale));
    } else {
        *reinterpret_cast<unsigned*>(static_cast<T*>(is_k ? k_cache : v_cache) + at) = pack2<T>(x0, x1);
    }
}

// k_cache .. block_size: ROPE_WRITE's (rope_write_pair's), null or 0 for the other epilogues.
template <typename T, int PROLOGUE, int EPILOGUE, int BM, int BN, int STAGES, int WARPS_K>
__global__ void __launch_bounds__(layer::THREADS)
layer_gemm(const float* __restrict__ x, const float* __restrict__ norm_weight, const T* __restrict__ a,
           const T* __restrict__ w, T* __restrict__ out, float* __restrict__ residual, int M, int N, int K,
           float eps, void* k_cache, void* v_cache, long long block_stride, const long long* __restrict__ slots,
           const int* __restrict__ seq_lens, const float* __restrict__ inv_freq, const float* __restrict__ k_scales,
           const float* __restrict__ v_scales, int q_heads, int kv_heads, int head_dim, int block_size) {
    using namespace layer;
    constexpr int WARPS_MN = WARPS / WARPS_K, WARPS_M = BM / 16 < WARPS_MN ? BM / 16 : WARPS_MN;
    constexpr int WARPS_N = WARPS_MN / WARPS_M, WM = BM / WARPS_M, WN = BN / WARPS_N, MI = WM / 16, NI = WN / 8;
    static_assert(WARPS_K == 1 || WARPS_K == 2 || WARPS_K == 4, "a BK's four k-steps split evenly");
    static_assert(WM % 16 == 0 && WN % 16 == 0 && WARPS_M * WARPS_N == WARPS_MN, "whole 16x16 fragments a warp");
    static_assert(STAGES >= 2, "a ring of at least two buffers");
    extern __shared__ __align__(128) unsigned char smem[];
    const unsigned sa = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    const int row_bytes = K * (PROLOGUE == NORM ? 4 : 2);  // A's rows in shared memory
    const unsigned sw = sa + BM * row_bytes;               // STAGES buffers of BN rows x BK
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int wk = warp / WARPS_MN, wm = (warp % WARPS_MN) / WARPS_N, wn = warp % WARPS_N;
    const int m0 = blockIdx.y * BM, KT = K / BK;
    const int n0 = blockIdx.x * (EPILOGUE == SILU_UP ? BN / 2 : BN);  // the tile's first output column

    // The weight row of tile row L, or -1 past the weight.
    auto w_row = [&](int L) {
        if constexpr (EPILOGUE == SILU_UP) {
            const int u = L % WN, half = WN / 2, j = n0 + (L / WN) * half + u % half;
            return j < N ? (u < half ? j : N + j) : -1;
        } else {
            return n0 + L < N ? n0 + L : -1;
        }
    };
    auto load_w = [&](int kt) {  // one commit group, empty past the last tile
        if (kt < KT) {
            const unsigned base = sw + (kt % STAGES) * BN * BK * 2;
            for (int i = tid; i < BN * BK / 8; i += THREADS) {
                const int L = i / 8, c = i % 8, row = w_row(L);
                cp_async16_shared(base + L * BK * 2 + (swizzle<8>(c, L) << 4),
                                  w + (long long)max(row, 0) * K + kt * BK + c * 8, row >= 0 ? 16 : 0);
            }
        }
        cp_async_commit();
    };

    const int g_offset = BM * row_bytes + STAGES * BN * BK * 2;  // NORM: the norm's K weights, after W's buffers
    if constexpr (PROLOGUE == NORM)
        for (int i = tid; i < K / 4; i += THREADS) cp_async16_shared(sa + g_offset + i * 16, norm_weight + i * 4, 16);
    for (int s = 0; s < STAGES - 1; ++s) load_w(s);  // (the first group holds g too)
    // f(mi, h, ni, m, n) for each of this thread's accumulator pairs acc[mi][ni][2h..2h+1]: row m, columns n, n + 1.
    auto each_pair = [&](auto f) {
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int ni = 0; ni < NI; ++ni)
                    f(mi, h, ni, m0 + wm * WM + mi * 16 + lane / 4 + h * 8, n0 + wn * WN + ni * 8 + 2 * (lane % 4));
    };
    // ROPE_WRITE: this thread's rows' slots and positions and its pairs' frequencies (the step's and the model's:
    // no kernel before writes them), requested before the wait; the angles and the slots' plane offsets are worked
    // out while A arrives. And no early launch of the next kernel: attention reads q before its own wait.
    constexpr int RM = EPILOGUE == ROPE_WRITE ? MI : 1, RN = EPILOGUE == ROPE_WRITE ? NI : 1;
    long long kv_row[RM][2];  // a row's slot, then its slot_offset
    int pos[RM][2];
    float freq[RM][2][RN];
    float2 angle[RM][2][RN];
    if constexpr (EPILOGUE == ROPE_WRITE) {
        if (wk == 0) {
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int m = min(m0 + wm * WM + mi * 16 + lane / 4 + h * 8, M - 1);
                    kv_row[mi][h] = slots[m];
                    pos[mi][h] = seq_lens[m] - 1;
#pragma unroll
                    for (int ni = 0; ni < NI; ++ni)
                        freq[mi][h][ni] = inv_freq[(n0 + wn * WN + ni * 8 + 2 * (lane % 4)) % head_dim / 2];
                }
        }
    } else {
        launch_dependents();
    }
    grid_dependency_wait();
    // ADD: this thread's residual values, requested now and added after the GEMM (each read and written by one
    // thread of the warps with wk == 0, which sum the partials).
    float2 res[MI][2][EPILOGUE == ADD ? NI : 1];
    if constexpr (EPILOGUE == ADD) {
        if (wk == 0)
            each_pair([&](int mi, int h, int ni, int m, int n) {
                res[mi][h][ni] = m < M && n < N ? *reinterpret_cast<const float2*>(residual + (long long)m * N + n)
                                                : make_float2(0.0f, 0.0f);
            });
    }
    // A's rows: a warp a row, its lanes along it (no division by K in the addresses); past M nothing is copied
    for (int r = warp; r < BM; r += WARPS) {
        const int m = m0 + r, bytes = m < M ? 16 : 0;
        if constexpr (PROLOGUE == NORM) {  // the float32 rows, as they are; normalised below
            const float* row = x + (long long)min(m, M - 1) * K;
            for (int c = lane; c < K / 4; c += 32) cp_async16_shared(sa + r * row_bytes + c * 16, row + c * 4, bytes);
        } else {
            const T* row = a + (long long)min(m, M - 1) * K;
            for (int c = lane; c < K / 8; c += 32)
                cp_async16_shared(sa + r * row_bytes + (swizzle<8>(c, r) << 4), row + c * 8, bytes);
        }
    }
    cp_async_commit();
    if constexpr (EPILOGUE == ROPE_WRITE) {
        if (wk == 0) {
            each_pair([&](int mi, int h, int ni, int, int) {
                float sn, cs;
                sincosf((float)pos[mi][h] * freq[mi][h][ni], &sn, &cs);
                angle[mi][h][ni] = make_float2(cs, sn);
            });
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    kv_row[mi][h] = kv_row[mi][h] < 0
                                        ? -1 : slot_offset(kv_row[mi][h], 0, block_stride, block_size, head_dim);
        }
    }
    cp_async_wait<0>();
    __syncthreads();
    if constexpr (PROLOGUE == NORM) {
        normalise_rows<T>(smem, reinterpret_cast<const float*>(smem + g_offset), BM, K, eps);
        __syncthreads();
    }

    float acc[MI][NI][4] = {};
    for (int kt = 0; kt < KT; ++kt) {
        if (kt > 0) {
            cp_async_wait<STAGES - 2>();
            __syncthreads();
        }
        load_w(kt + STAGES - 1);  // into the buffer every warp finished reading in iteration kt - 1
        const unsigned base = sw + (kt % STAGES) * BN * BK * 2;
#pragma unroll
        for (int q = 0; q < BK / 16 / WARPS_K; ++q) {
            const int ks = q * WARPS_K + wk;
            unsigned af[MI][4];
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
                const int r = wm * WM + mi * 16 + lane % 16, c = (kt * BK + ks * 16) / 8 + lane / 16;
                ldmatrix_x4(af[mi], sa + r * row_bytes + (swizzle<8>(c, r) << 4));
            }
#pragma unroll
            for (int nj = 0; nj < NI / 2; ++nj) {
                unsigned bf[4];
                const int L = wn * WN + nj * 16 + (lane / 16) * 8 + lane % 8, c = ks * 2 + (lane / 8) % 2;
                ldmatrix_x4(bf, base + L * BK * 2 + (swizzle<8>(c, L) << 4));
#pragma unroll
                for (int mi = 0; mi < MI; ++mi) {
                    mma_16816<T>(acc[mi][2 * nj], af[mi][0], af[mi][1], af[mi][2], af[mi][3], bf[0], bf[1]);
                    mma_16816<T>(acc[mi][2 * nj + 1], af[mi][0], af[mi][1], af[mi][2], af[mi][3], bf[2], bf[3]);
                }
            }
        }
    }

    if constexpr (WARPS_K > 1) {  // the partial sums of warps wk > 0, added in warp order by warps wk == 0
        float* red = reinterpret_cast<float*>(smem);
        constexpr int VALUES = MI * NI * 4;
        __syncthreads();  // every warp is done with A and W
        if (wk > 0) {
#pragma unroll
            for (int i = 0; i < VALUES; ++i)
                red[(((wk - 1) * WARPS_MN + warp % WARPS_MN) * VALUES + i) * 32 + lane] = (&acc[0][0][0])[i];
        }
        __syncthreads();
        if (wk > 0) return;
        for (int s = 1; s < WARPS_K; ++s)
#pragma unroll
            for (int i = 0; i < VALUES; ++i)
                (&acc[0][0][0])[i] += red[(((s - 1) * WARPS_MN + warp) * VALUES + i) * 32 + lane];
    }

#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int m = m0 + wm * WM + mi * 16 + lane / 4 + h * 8;
            if (m >= M) continue;
#pragma unroll
            for (int ni = 0; ni < (EPILOGUE == SILU_UP ? NI / 2 : NI); ++ni) {
                const float c0 = acc[mi][ni][2 * h], c1 = acc[mi][ni][2 * h + 1];
                if constexpr (EPILOGUE == SILU_UP) {
                    const int j = n0 + wn * (WN / 2) + ni * 8 + 2 * (lane % 4);
                    if (j >= N) continue;
                    const float* u = acc[mi][ni + NI / 2] + 2 * h;
                    const float g0 = round_to<T>(c0), g1 = round_to<T>(c1);
                    *reinterpret_cast<unsigned*>(out + (long long)m * N + j) =
                        pack2<T>(g0 / (1.0f + __expf(-g0)) * round_to<T>(u[0]),
                                 g1 / (1.0f + __expf(-g1)) * round_to<T>(u[1]));
                } else {
                    const int n = n0 + wn * WN + ni * 8 + 2 * (lane % 4);
                    if (n >= N) continue;
                    if constexpr (EPILOGUE == STORE) {
                        *reinterpret_cast<unsigned*>(out + (long long)m * N + n) = pack2<T>(c0, c1);
                    } else if constexpr (EPILOGUE == ROPE_WRITE) {
                        rope_write_pair<T>(c0, c1, angle[mi][h][ni], kv_row[mi][h], m, n, out, k_cache, v_cache,
                                           k_scales, v_scales, q_heads, kv_heads, head_dim,
                                           block_size);
                    } else {
                        const float2 v = res[mi][h][ni];
                        *reinterpret_cast<float2*>(residual + (long long)m * N + n) =
                            make_float2(v.x + round_to<T>(c0), v.y + round_to<T>(c1));
                    }
                }
            }
        }
}

}  // namespace pagedrt
