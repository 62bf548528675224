// Copy whole blocks (copy-on-write, compaction) in every plane, in one launch.
//
// planes: [num_planes] base addresses; all planes share block_stride_bytes and
//         block_bytes (a multiple of 16). pairs: [num_pairs, 2] int64 (src, dst).
// One thread per 16-byte vector of a (pair, plane) block, grid-stride. The
// launcher guarantees that no block is both a source and a destination.
#include "common.cuh"

namespace pagedrt {

__global__ void copy_blocks(const unsigned long long* __restrict__ planes, int num_planes,
                            const long long* __restrict__ pairs, int num_pairs,
                            long long block_stride_bytes, int block_vecs) {
    const long long total = (long long)num_pairs * num_planes * block_vecs;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int vec = (int)(i % block_vecs);
        const long long rest = i / block_vecs;
        const int plane = (int)(rest % num_planes);
        const long long pair = rest / num_planes;
        char* const base = reinterpret_cast<char*>(planes[plane]);
        const uint4* const src = reinterpret_cast<const uint4*>(base + pairs[2 * pair] * block_stride_bytes);
        uint4* const dst = reinterpret_cast<uint4*>(base + pairs[2 * pair + 1] * block_stride_bytes);
        dst[vec] = src[vec];
    }
}

}  // namespace pagedrt
