// Shared device helpers: element types and their conversion to and from float,
// 16-byte vectors, the cp.async primitives, ldmatrix and mma (sm_80+).
//
// Everything here must compile under both nvcc and NVRTC: no standard headers.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace pagedrt {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// A compile-time value as a type: lambdas take it as an `auto` argument to be instantiated per value.
template <typename X, X VALUE> struct integral_constant { static constexpr X value = VALUE; };

// Whether A and B are one type (NVRTC has no <type_traits> and no __is_same builtin).
template <typename A, typename B> struct same_type { static constexpr bool value = false; };
template <typename A> struct same_type<A, A> { static constexpr bool value = true; };
// conditional_type<C, A, B>::type: A when C, else B (std::conditional, which NVRTC does not have either).
template <bool C, typename A, typename B> struct conditional_type { using type = A; };
template <typename A, typename B> struct conditional_type<false, A, B> { using type = B; };

// Programmatic dependent launch (sm_90+). A kernel launched with programmatic stream serialization
// (pagedrt/kernels/launch.py) may start while the kernel before it on the stream still runs.
// grid_dependency_wait() returns once that kernel has completed and its writes are visible, at once
// when the kernel was launched normally; a kernel calls it before it touches global memory.
// launch_dependents() lets the next such kernel start its thread blocks (they run up to their own
// wait); a grid that never calls it lets them start as it completes. Below sm_90: nothing.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n");
#endif
}

// The layout contract's write side (docs/KERNELS.md): where KV head `head` of the token in slot `slot` >= 0
// (row slot % block_size of block slot / block_size) starts in a plane, in elements.
__device__ __forceinline__ long long slot_offset(long long slot, int head, long long block_stride, int block_size,
                                                 int head_dim) {
    return (slot / block_size) * block_stride + ((long long)head * block_size + slot % block_size) * head_dim;
}

// Elements of T in one 16-byte vector.
template <typename T> struct Vec16 { static constexpr int kElems = 16 / sizeof(T); };

// The kElems values of a 16-byte vector of T, as floats.
template <typename T> __device__ __forceinline__ void unpack(const uint4& raw, float* out);

template <> __device__ __forceinline__ void unpack<float>(const uint4& raw, float* out) {
    out[0] = __uint_as_float(raw.x);
    out[1] = __uint_as_float(raw.y);
    out[2] = __uint_as_float(raw.z);
    out[3] = __uint_as_float(raw.w);
}

template <> __device__ __forceinline__ void unpack<__half>(const uint4& raw, float* out) {
    const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        __half2 h = *reinterpret_cast<const __half2*>(&words[i]);
        const float2 f = __half22float2(h);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

// bfloat16 is the upper half of a float: widening is a shift or a mask.
template <> __device__ __forceinline__ void unpack<__nv_bfloat16>(const uint4& raw, float* out) {
    const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = __uint_as_float(words[i] << 16);
        out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
}

// kElems floats as one 16-byte vector of T (the inverse of unpack).
template <typename T> __device__ __forceinline__ uint4 pack16(const float (&x)[Vec16<T>::kElems]) {
    uint4 raw;
    T* const elems = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < Vec16<T>::kElems; ++i) elems[i] = from_float<T>(x[i]);
    return raw;
}

// --- cp.async: global -> shared copies that bypass registers (and L1) ----------

// An L2 cache policy for data read once: evict it first. The decode kernel streams K and V
// with it, so that what is read again (tables, q, split partials, out) stays in L2.
__device__ __forceinline__ unsigned long long evict_first_policy() {
    unsigned long long policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}

// Copy 16 bytes to a shared-space address (see __cvta_generic_to_shared) under an L2 cache
// policy; with src_bytes == 0 nothing is read and the 16 bytes are zero-filled.
__device__ __forceinline__ void cp_async16_shared(unsigned smem_dst, const void* gmem_src, int src_bytes,
                                                  unsigned long long policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n"
                 :: "r"(smem_dst), "l"(gmem_src), "r"(src_bytes), "l"(policy) : "memory");
}

// The same under L2's default policy: for data that other thread blocks read too (prefill's
// K and V, read once per query tile).
__device__ __forceinline__ void cp_async16_shared(unsigned smem_dst, const void* gmem_src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_dst), "l"(gmem_src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Wait until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

// --- tensor cores (sm_80+): ldmatrix and mma.m16n8k16 with fp32 accumulators ----

// Two floats as the 16-bit pair of an mma operand register (the first in the low half).
template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
}
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
}

// Four 8x8 16-bit matrices from shared memory; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr) : "memory");
}

// The same, each matrix transposed.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned smem_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr) : "memory");
}

// c (16x8, fp32) += a (16x16, row) * b (16x8, col), a and b in T (half or bfloat16).
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                          unsigned b0, unsigned b1);
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&c)[4], unsigned a0, unsigned a1, unsigned a2,
                                                  unsigned a3, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], unsigned a0, unsigned a1, unsigned a2,
                                                         unsigned a3, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Where the tensor-core paths store 16-byte chunk x of row r of a staged tile, for rows of ROW_CHUNKS chunks:
// x ^ (r % 8), so an ldmatrix of 8 rows touches 8 different banks; rows of 4 chunks (FP8 at head_dim
// 64: two rows per 128 bytes) xor with (r / 2) % 4 instead.
template <int ROW_CHUNKS> __device__ __forceinline__ int swizzle(int x, int r) {
    static_assert(ROW_CHUNKS >= 8 || ROW_CHUNKS == 4, "rows of 4 or at least 8 chunks");
    return ROW_CHUNKS >= 8 ? x ^ (r % 8) : x ^ ((r >> 1) % ROW_CHUNKS);
}

// 32-bit words of shared memory at a shared-space address: 4 (16-byte aligned) or 2 (8-byte aligned).
template <int WORDS> __device__ __forceinline__ void load_shared(unsigned (&w)[WORDS], unsigned addr);
template <> __device__ __forceinline__ void load_shared<4>(unsigned (&w)[4], unsigned addr) {
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(addr) : "memory");
}
template <> __device__ __forceinline__ void load_shared<2>(unsigned (&w)[2], unsigned addr) {
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(w[0]), "=r"(w[1]) : "r"(addr) : "memory");
}

// --- float8 e4m3 (sm_89+): K/V storage, converted in registers ----------------------

// Rotary embeddings: the pair (x0, x1) turned by the angle of (c, s) = (cos, sin), in float, each product rounded
// before the sum (no contraction into an fma), so every kernel that rotates (rope_write, layer_gemm's ROPE_WRITE
// epilogue) turns a pair to the same bits.
__device__ __forceinline__ void rotate_pair(float& x0, float& x1, float c, float s) {
    const float r0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)), r1 = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
    x0 = r0, x1 = r1;
}

// One float8 e4m3 value's bits (OCP E4M3, CUDA's __nv_fp8_e4m3): K/V planes of FP8 caches.
struct e4m3 { unsigned char bits; };

// Two e4m3 values (low byte first) as an f16 pair (low half first): exact, one instruction.
__device__ __forceinline__ unsigned e4m3x2_to_half2(unsigned short x) {
    unsigned r;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(r) : "h"(x));
    return r;
}

// Two floats as e4m3 (lo in the low byte): round to nearest even, saturating to +-448 (infinities
// too); a NaN becomes 0x7F whatever its sign (pagedrt/fp8.py defines the same on the host).
__device__ __forceinline__ unsigned short float2_to_e4m3x2(float lo, float hi) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));
    const unsigned b0 = lo != lo ? 0x7Fu : (r & 0xFFu), b1 = hi != hi ? 0x7Fu : (unsigned)(r >> 8);
    return (unsigned short)(b0 | (b1 << 8));
}

// The two tensor-core products over e4m3 K/V tiles in shared memory (rows of HEAD_DIM bytes, 16-byte
// chunk x of row r at swizzle(x, r)), shared by decode_fp8 and prefill_fp8. Both are f16 mma with K and V
// converted in registers; the A fragments (q, P) are f16.
//
// S += q K^T for 16 keys and two k-steps: `addr` is this lane's address for an ldmatrix.x4 whose matrix i
// covers keys +8 for i >= 2 and the next 16-byte chunk (k-step) for odd i. Lane l gets bytes 4(l%4)..+3 of
// its key's chunk: dims 4c, 4c+1 serve as k = 2c, 2c+1 of the k-step and 4c+2, 4c+3 as k = 2c+8, 2c+9, so
// q's A fragments (a for the first k-step, a_next for the second) must carry the same permutation.
// s0, s1: the C fragments of keys 0-7 and 8-15.
__device__ __forceinline__ void qk_e4m3(unsigned addr, const unsigned (&a)[4], const unsigned (&a_next)[4],
                                        float (&s0)[4], float (&s1)[4]) {
    unsigned b[4];
    ldmatrix_x4(b, addr);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned (&q)[4] = i % 2 ? a_next : a;
        mma_16816<__half>(i < 2 ? s0 : s1, q[0], q[1], q[2], q[3], e4m3x2_to_half2(b[i] & 0xffffu),
                          e4m3x2_to_half2(b[i] >> 16));
    }
}

// Lane (r = l/4, c = l%4)'s bytes of keys key0 + 2c, 2c+1, 2c+8, 2c+9 (w[0..3]) of an e4m3 V tile: bytes
// [r*HEAD_DIM/8, (r+1)*HEAD_DIM/8) of each, one shared load a key (swizzled rows, as qk_e4m3's).
template <int HEAD_DIM>
__device__ __forceinline__ void load_v_keys(unsigned sv, int key0, int lane, unsigned (&w)[4][HEAD_DIM / 32]) {
    constexpr int ROW_CHUNKS = HEAD_DIM / 16, LANE_BYTES = HEAD_DIM / 8;
    const int byte = (lane / 4) * LANE_BYTES, quad_col = lane % 4;
#pragma unroll
    for (int t = 0; t < 4; ++t) {
        const int key = key0 + 2 * quad_col + (t & 1) + 8 * (t >> 1);
        load_shared<HEAD_DIM / 32>(w[t], sv + key * HEAD_DIM + (swizzle<ROW_CHUNKS>(byte / 16, key) << 4) + byte % 16);
    }
}

// o += P V for keys [key0, key0 + 16) of a V tile (pa: P's A fragment of that k-step). Lane (r = l/4,
// c = l%4) reads keys 2c, 2c+1, 2c+8, 2c+9 (P's k order), bytes [r*HEAD_DIM/8, (r+1)*HEAD_DIM/8) of each
// with one shared load, and pairs each dim's two keys with a byte permute: column n of dim tile j is dim
// n*HEAD_DIM/8 + j, an order the caller's final store undoes.
template <int HEAD_DIM>
__device__ __forceinline__ void pv_e4m3(unsigned sv, int key0, int lane, const unsigned (&pa)[4],
                                        float (&o)[HEAD_DIM / 8][4]) {
    constexpr int WORDS = HEAD_DIM / 32;
    unsigned w[4][WORDS];
    load_v_keys<HEAD_DIM>(sv, key0, lane, w);
#pragma unroll
    for (int i = 0; i < WORDS; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // the lane's bytes 4i + 2h and + 1: dim tiles j and j + 1
            const unsigned select = h ? 0x7362u : 0x5140u;  // (t0, t1) of byte 2h, then of byte 2h + 1
            const unsigned lo = __byte_perm(w[0][i], w[1][i], select), hi = __byte_perm(w[2][i], w[3][i], select);
            const int j = 4 * i + 2 * h;
            mma_16816<__half>(o[j], pa[0], pa[1], pa[2], pa[3], e4m3x2_to_half2(lo & 0xffffu),
                              e4m3x2_to_half2(hi & 0xffffu));
            mma_16816<__half>(o[j + 1], pa[0], pa[1], pa[2], pa[3], e4m3x2_to_half2(lo >> 16),
                              e4m3x2_to_half2(hi >> 16));
        }
}

// --- mbarriers and bulk copies (compute capability 9.0) ------------------------------------------
// A phase of an mbarrier completes when its expected count of arrivals has arrived and the bytes it
// expects (expect_tx) have landed. `bar`: a shared-space address (see __cvta_generic_to_shared).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
namespace sm90 {

__device__ __forceinline__ void mbarrier_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}

// Make initialised mbarriers visible to every thread (and to the copy engine) before any use them.
__device__ __forceinline__ void mbarrier_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}

// Wait until the phase of parity `parity` (0 or 1) has completed. Before a barrier's first phase
// completes, waiting on parity 1 returns at once (the phase "before" the first counts as done).
__device__ __forceinline__ void mbarrier_wait(unsigned bar, unsigned parity) {
    asm volatile("{\n"
                 ".reg .pred done;\n"
                 "WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT;\n"
                 "}\n" :: "r"(bar), "r"(parity) : "memory");
}

// One arrival on `bar` that also expects `bytes` more to land in its current phase.
__device__ __forceinline__ void mbarrier_expect_bytes(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}

// Copy `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to shared memory by the copy
// engine; they count against `bar`'s expected bytes as they land.
__device__ __forceinline__ void bulk_copy(unsigned smem_dst, const void* gmem_src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 :: "r"(smem_dst), "l"(gmem_src), "r"(bytes), "r"(bar) : "memory");
}

// Prefetch `bytes` (a multiple of 16, from a 16-byte aligned address) of global memory into L2 by the copy engine.
__device__ __forceinline__ void bulk_prefetch_l2(const void* gmem_src, unsigned bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" :: "l"(gmem_src), "r"(bytes) : "memory");
}

}  // namespace sm90
#endif

}  // namespace pagedrt
