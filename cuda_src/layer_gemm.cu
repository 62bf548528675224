// The GEMMs of a layered decode step with what sits between them fused in: out = epilogue(prologue(A) @ W.T)
// (pagedrt/engine/layer_gemm.py launches them, each variant beside its NumPy reference there).
//
// W: a weight [rows, K] in T (__half or __nv_bfloat16), row-major. Float32 accumulation on tensor cores
// (mma.m16n8k16). M rows of A, K a multiple of 64, N (the output's columns) a multiple of 8.
//
// Prologue NORM:   A[m] = round_T(x[m] * rsqrt(mean(x[m]^2) + eps) * norm_weight), x the float32 residual
//                  [M, K] (add_rms_norm's arithmetic: each CTA computes its rows' RMS itself).
// Prologue PLAIN:  A = a [M, K] in T.
// Epilogue STORE:  out[m, n] = round_T(acc)                                          (W [N, K])
// Epilogue SILU_UP: W [2N, K] is gate rows then up rows; out[m, j] = round_T(silu(round_T(g)) * round_T(u)),
//                  g of W row j and u of row N + j (silu_mul over the rounded gate_up GEMM).
// Epilogue ADD:    residual[m, n] += round_T(acc) in float32 (each element written by one thread)  (W [N, K])
//
// A CTA (4 warps) computes a tile of BM rows by BN columns of W's rows: for SILU_UP, BN / 2 gate rows and
// their BN / 2 up rows, arranged so that each warp's accumulators hold a gate column and its up column.
// Its BM rows of A stay in shared memory for the whole K (BM * K * 2 bytes); W streams through STAGES
// buffers of BN rows x BK with cp.async. Shared rows are 16-byte chunks at swizzle<8>(chunk, row).
//
// PDL (pagedrt/kernels/launch.py): the first STAGES - 1 weight tiles are requested before
// grid_dependency_wait (weights never depend on the kernel before); A and the residual only after it. The
// kernel then lets its dependents launch, so that the next GEMM's weights stream while this one computes.
#include "common.cuh"

namespace pagedrt {

namespace layer {
constexpr int THREADS = 128, BK = 64, STAGES = 4;
constexpr int NORM = 0, PLAIN = 1;             // prologues
constexpr int STORE = 0, SILU_UP = 1, ADD = 2;  // epilogues
}  // namespace layer

// x rounded to T, as a float.
template <typename T> __device__ __forceinline__ float round_to(float x) { return to_float(from_float<T>(x)); }

// The BM rows of A from m0, into shared memory at sa (rows of K values): NORM normalises x's rows (a warp a
// row), PLAIN copies a's with cp.async (committed by the caller). Rows past M are zeros.
template <typename T, int PROLOGUE, int BM>
__device__ __forceinline__ void load_a(unsigned char* smem, unsigned sa, const float* __restrict__ x,
                                       const float* __restrict__ norm_weight, const T* __restrict__ a, int m0,
                                       int M, int K, float eps) {
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    if constexpr (PROLOGUE == layer::PLAIN) {
        const int chunks = K / 8;
        for (int c = tid; c < BM * chunks; c += layer::THREADS) {
            const int r = c / chunks, xk = c % chunks, m = m0 + r;
            cp_async16_shared(sa + r * K * 2 + (swizzle<8>(xk, r) << 4), a + (long long)min(m, M - 1) * K + xk * 8,
                              m < M ? 16 : 0);
        }
    } else {
        for (int r = warp; r < BM; r += layer::THREADS / 32) {
            const int m = m0 + r;
            const float* row = x + (long long)min(m, M - 1) * K;
            float sum = 0.0f;
            for (int k = lane * 4; k < K; k += 128) {
                const float4 v = *reinterpret_cast<const float4*>(row + k);
                sum += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
            }
#pragma unroll
            for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
            const float scale = rsqrtf(sum / K + eps);
            for (int k = lane * 4; k < K; k += 128) {
                const float4 v = *reinterpret_cast<const float4*>(row + k);
                const float4 g = *reinterpret_cast<const float4*>(norm_weight + k);
                uint2 packed = make_uint2(0u, 0u);
                if (m < M) {
                    packed.x = pack2<T>(v.x * scale * g.x, v.y * scale * g.y);
                    packed.y = pack2<T>(v.z * scale * g.z, v.w * scale * g.w);
                }
                *reinterpret_cast<uint2*>(smem + r * K * 2 + (swizzle<8>(k / 8, r) << 4) + (k % 8) * 2) = packed;
            }
        }
    }
}

template <typename T, int PROLOGUE, int EPILOGUE, int BM, int BN>
__global__ void __launch_bounds__(layer::THREADS)
layer_gemm(const float* __restrict__ x, const float* __restrict__ norm_weight, const T* __restrict__ a,
           const T* __restrict__ w, T* __restrict__ out, float* __restrict__ residual, int M, int N, int K,
           float eps) {
    using namespace layer;
    constexpr int WARPS_M = BM >= 32 ? 2 : 1, WARPS_N = THREADS / 32 / WARPS_M;
    constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N, MI = WM / 16, NI = WN / 8;
    static_assert(WM % 16 == 0 && WN % 16 == 0, "warp tiles of whole 16x16 fragments");
    static_assert(EPILOGUE != SILU_UP || NI % 2 == 0, "a warp holds as many gate columns as up columns");
    extern __shared__ __align__(128) unsigned char smem[];
    const unsigned sa = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    const unsigned sw = sa + BM * K * 2;  // STAGES buffers of BN rows x BK
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, wm = warp / WARPS_N, wn = warp % WARPS_N;
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
#pragma unroll
            for (int i = 0; i < BN / 16; ++i) {
                const int L = tid / 8 + 16 * i, c = tid % 8, row = w_row(L);
                cp_async16_shared(base + L * BK * 2 + (swizzle<8>(c, L) << 4),
                                  w + (long long)max(row, 0) * K + kt * BK + c * 8, row >= 0 ? 16 : 0);
            }
        }
        cp_async_commit();
    };

    for (int s = 0; s < STAGES - 1; ++s) load_w(s);
    grid_dependency_wait();
    launch_dependents();
    load_a<T, PROLOGUE, BM>(smem, sa, x, norm_weight, a, m0, M, K, eps);
    cp_async_commit();

    float acc[MI][NI][4] = {};
    for (int kt = 0; kt < KT; ++kt) {
        if (kt == 0) cp_async_wait<0>();  // A's group came after the first tiles'
        else cp_async_wait<STAGES - 2>();
        __syncthreads();
        load_w(kt + STAGES - 1);  // into the buffer every warp finished reading in iteration kt - 1
        const unsigned base = sw + (kt % STAGES) * BN * BK * 2;
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks) {
            unsigned af[MI][4];
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
                const int r = wm * WM + mi * 16 + lane % 16, c = (kt * BK + ks * 16) / 8 + lane / 16;
                ldmatrix_x4(af[mi], sa + r * K * 2 + (swizzle<8>(c, r) << 4));
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
                    } else {
                        float2* dst = reinterpret_cast<float2*>(residual + (long long)m * N + n);
                        float2 v = *dst;
                        v.x += round_to<T>(c0);
                        v.y += round_to<T>(c1);
                        *dst = v;
                    }
                }
            }
        }
}

}  // namespace pagedrt
