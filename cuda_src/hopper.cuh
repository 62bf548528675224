// Hopper (sm_90a) device helpers: cp.async completion on an mbarrier (the mbarriers are common.cuh's), warpgroup
// register reallocation, named barriers, shared-memory matrix descriptors and the warpgroup MMA (wgmma).
//
// Only for files compiled with -arch=sm_90a (pagedrt/source.py: ARCHES): wgmma and setmaxnreg exist
// on no other target. Everything here must compile under both nvcc and NVRTC: no standard headers.
#pragma once
#include "common.cuh"

namespace pagedrt {
namespace sm90 {

// One arrival on `bar` once every cp.async this thread issued so far has landed (the barrier's
// expected count includes it: .noinc).
__device__ __forceinline__ void cp_async_arrive(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(bar) : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// 16 bytes (four words, 16-byte aligned) to a shared-space address.
__device__ __forceinline__ void store_shared4(unsigned addr, unsigned a, unsigned b, unsigned c, unsigned d) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" :: "r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

// Order this thread's ordinary (generic-proxy) writes to shared memory before the async proxy's reads of them
// (wgmma's operands): after the writes, before the barrier that hands them on.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// --- warpgroups ---------------------------------------------------------------------------------

// The calling warpgroup's register budget per thread: lowered for a producer, raised for consumers.
template <int REGS> __device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(REGS));
}
template <int REGS> __device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(REGS));
}

// Hardware barrier `id` (0 is __syncthreads') among `threads` threads (whole warps): wait there, or only
// arrive (count this warp in and go on).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

// --- wgmma --------------------------------------------------------------------------------------

// A shared-memory matrix descriptor for the 128-byte swizzle: the operand is stored in panels of
// 64 16-bit elements (128 bytes) per row, 8-row atoms of 1024 bytes in which 16-byte chunk c of
// row r sits at c ^ (r % 8); tiles start 1024-byte aligned, so the swizzle is the address bits'.
// `leading` and `stride` are the byte offsets the operand's major-ness gives them: K-major (rows
// of K contiguous): stride = 1024 (from 8 rows to the next 8), leading unused (16); MN-major:
// leading = the panel stride (from 64 columns to the next 64), stride = 1024 (8 K-rows to the next).
// It is built from two words: the low one (the start address >> 4, and leading >> 4 << 16) and the high one
// (stride >> 4, the layout type). The low word is below 2^30, so a descriptor moved `bytes` further is the low
// word plus bytes >> 4 (no carry reaches the high word): built so, the high word stays a constant that ptxas
// does not recompute for each wgmma.
__device__ __forceinline__ unsigned smem_descriptor_lo(unsigned addr, unsigned leading) {
    return ((addr & 0x3ffff) >> 4) | (leading >> 4) << 16;
}
__host__ __device__ constexpr unsigned smem_descriptor_hi(unsigned stride) {
    return (stride >> 4) | 1u << 30;  // layout type 1: 128-byte swizzle
}
__device__ __forceinline__ unsigned long long descriptor(unsigned lo, unsigned hi) {
    return (unsigned long long)hi << 32 | lo;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}

// Keep the compiler from moving reads or writes of accumulator registers across a wgmma_wait (it
// does not know the tensor cores write them asynchronously).
template <int R> __device__ __forceinline__ void fence_registers(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}
// The same for A fragments held in registers (read by a wgmma until it completes).
template <int R> __device__ __forceinline__ void fence_registers(unsigned (&a)[R][4]) {
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j]) :: "memory");
}

// Register lists of the accumulators (written out: PTX names each of them).
#define PAGEDRT_D32_REGS \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define PAGEDRT_D64_REGS \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define PAGEDRT_D128_REGS \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define PAGEDRT_D32_OPERANDS(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define PAGEDRT_D64_OPERANDS(d) PAGEDRT_D32_OPERANDS(d), PAGEDRT_D32_OPERANDS((d + 32))
#define PAGEDRT_D128_OPERANDS(d) PAGEDRT_D64_OPERANDS(d), PAGEDRT_D64_OPERANDS((d + 64))

// The wgmma operand types of A and B, as PTX spells them.
#define PAGEDRT_AB_TYPES_half "f16.f16"
#define PAGEDRT_AB_TYPES_bf16 "bf16.bf16"

// d (64 x N, fp32; N / 2 registers a thread) = [d +] A (64 x 16) B (16 x N), A and B in shared memory,
// both K-major; `accumulate` 0 overwrites d.
#define PAGEDRT_WGMMA_SS(N, REGS, OPERANDS, A, B, ACC, TYPES) \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " ACC ", 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPES " {" REGS "}, " A ", " B ", p, 1, 1, 0, 0;\n" \
                 "}\n" : OPERANDS(d) : "l"(a), "l"(b), "r"(accumulate))
// d (64 x N, fp32) += A (64 x 16, from registers: the mma.m16n8k16 A fragment of each warp's 16 rows) B (16 x N,
// MN-major in shared memory)
#define PAGEDRT_WGMMA_RS(N, REGS, OPERANDS, A, B, TYPES) \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPES " {" REGS "}, {" A "}, " B ", p, 1, 1, 1;\n" \
                 "}\n" : OPERANDS(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b))

template <typename T> struct IsBf16 { static constexpr bool value = false; };
template <> struct IsBf16<__nv_bfloat16> { static constexpr bool value = true; };

template <typename T, int N> struct Wgmma;

template <typename T> struct Wgmma<T, 64> {
    static __device__ __forceinline__ void ss(float (&d)[32], unsigned long long a, unsigned long long b,
                                              int accumulate) {
        if constexpr (IsBf16<T>::value) {
            PAGEDRT_WGMMA_SS(64, PAGEDRT_D32_REGS, PAGEDRT_D32_OPERANDS, "%32", "%33", "%34", PAGEDRT_AB_TYPES_bf16);
        } else {
            PAGEDRT_WGMMA_SS(64, PAGEDRT_D32_REGS, PAGEDRT_D32_OPERANDS, "%32", "%33", "%34", PAGEDRT_AB_TYPES_half);
        }
    }
    static __device__ __forceinline__ void rs(float (&d)[32], const unsigned (&a)[4], unsigned long long b) {
        if constexpr (IsBf16<T>::value) {
            PAGEDRT_WGMMA_RS(64, PAGEDRT_D32_REGS, PAGEDRT_D32_OPERANDS, "%32, %33, %34, %35", "%36",
                             PAGEDRT_AB_TYPES_bf16);
        } else {
            PAGEDRT_WGMMA_RS(64, PAGEDRT_D32_REGS, PAGEDRT_D32_OPERANDS, "%32, %33, %34, %35", "%36",
                             PAGEDRT_AB_TYPES_half);
        }
    }
};

template <typename T> struct Wgmma<T, 128> {
    static __device__ __forceinline__ void ss(float (&d)[64], unsigned long long a, unsigned long long b,
                                              int accumulate) {
        if constexpr (IsBf16<T>::value) {
            PAGEDRT_WGMMA_SS(128, PAGEDRT_D64_REGS, PAGEDRT_D64_OPERANDS, "%64", "%65", "%66", PAGEDRT_AB_TYPES_bf16);
        } else {
            PAGEDRT_WGMMA_SS(128, PAGEDRT_D64_REGS, PAGEDRT_D64_OPERANDS, "%64", "%65", "%66", PAGEDRT_AB_TYPES_half);
        }
    }
    static __device__ __forceinline__ void rs(float (&d)[64], const unsigned (&a)[4], unsigned long long b) {
        if constexpr (IsBf16<T>::value) {
            PAGEDRT_WGMMA_RS(128, PAGEDRT_D64_REGS, PAGEDRT_D64_OPERANDS, "%64, %65, %66, %67", "%68",
                             PAGEDRT_AB_TYPES_bf16);
        } else {
            PAGEDRT_WGMMA_RS(128, PAGEDRT_D64_REGS, PAGEDRT_D64_OPERANDS, "%64, %65, %66, %67", "%68",
                             PAGEDRT_AB_TYPES_half);
        }
    }
};

template <typename T> struct Wgmma<T, 256> {
    static __device__ __forceinline__ void rs(float (&d)[128], const unsigned (&a)[4], unsigned long long b) {
        if constexpr (IsBf16<T>::value) {
            PAGEDRT_WGMMA_RS(256, PAGEDRT_D128_REGS, PAGEDRT_D128_OPERANDS, "%128, %129, %130, %131", "%132",
                             PAGEDRT_AB_TYPES_bf16);
        } else {
            PAGEDRT_WGMMA_RS(256, PAGEDRT_D128_REGS, PAGEDRT_D128_OPERANDS, "%128, %129, %130, %131", "%132",
                             PAGEDRT_AB_TYPES_half);
        }
    }
};

}  // namespace sm90
}  // namespace pagedrt
