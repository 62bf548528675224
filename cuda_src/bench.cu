// Kernels the benchmarks use: a read-only streaming ceiling, and a spin that keeps
// the GPU busy while the host queues timed launches (so host overhead is not timed).
#include "common.cuh"

namespace pagedrt {

// Read `count` 16-byte vectors once, four independent loads in flight per thread.
// The XOR of everything read goes to sink only when it equals `never`, so the
// loads cannot be optimised away and nothing is written in practice.
__global__ void stream_read(const uint4* __restrict__ src, long long count, unsigned never,
                            unsigned* __restrict__ sink) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    unsigned x = 0;
    for (; i + 3 * stride < count; i += 4 * stride) {
        const uint4 a = __ldcs(src + i), b = __ldcs(src + i + stride);
        const uint4 c = __ldcs(src + i + 2 * stride), d = __ldcs(src + i + 3 * stride);
        x ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < count; i += stride) {
        const uint4 a = __ldcs(src + i);
        x ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    if (x == never) sink[0] = x;
}

// Busy-wait for `cycles` SM clock cycles (launch with one thread).
__global__ void spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
}

}  // namespace pagedrt
