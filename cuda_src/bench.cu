// Kernels the benchmarks use: a read-only streaming ceiling, a read-only paged bound
// (the K/V chunks paged decode reads, through the block table, doing no arithmetic),
// and a spin that keeps the GPU busy while the host queues timed launches (so host
// overhead is not timed).
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

// Read `num_chunks` chunks of `chunk_vecs` 16-byte vectors once from both K and V, the
// chunk at byte `offsets[i]` of each plane (16-byte aligned), in the order listed. Thread
// block c of G takes the chunks [c * num_chunks / G, (c + 1) * num_chunks / G) and reads
// them as stream_read reads its vectors: two vectors of K and the same two of V (four
// loads) in flight per thread. The same sink as stream_read. A block's range is far below
// 2^31 vectors, so positions in it are ints.
__global__ void paged_read(const uint4* __restrict__ k, const uint4* __restrict__ v,
                           const long long* __restrict__ offsets, long long num_chunks, int chunk_vecs,
                           unsigned never, unsigned* __restrict__ sink) {
    const long long first = num_chunks * blockIdx.x / gridDim.x;
    const int count = (int)(num_chunks * (blockIdx.x + 1) / gridDim.x - first) * chunk_vecs;
    // the vector index, in either plane, of vector p of this block's range
    auto at = [&](int p) { return (__ldg(offsets + first + p / chunk_vecs) >> 4) + p % chunk_vecs; };
    const int stride = blockDim.x;
    int i = threadIdx.x;
    unsigned x = 0;
    for (; i + stride < count; i += 2 * stride) {
        const long long p = at(i), q = at(i + stride);
        const uint4 a = __ldcs(k + p), b = __ldcs(v + p), c = __ldcs(k + q), d = __ldcs(v + q);
        x ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    if (i < count) {
        const long long p = at(i);
        const uint4 a = __ldcs(k + p), b = __ldcs(v + p);
        x ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
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
