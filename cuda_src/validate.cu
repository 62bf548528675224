// Find the first bad sequence length and the first bad block-table entry (or
// write slot), so a launcher can refuse them before any kernel reads or writes
// through them. Results go to a [2] uint64 buffer preset to all ones (atomicMin).
//
// A plane that lies in a pool is described by a span: the pool's chunk mask
// ([num_chunks] uint8, nonzero = mapped now), its chunk size and the plane's
// first byte as an offset from the pool's base. Block `id` of the plane spans
// bytes [offset + id*block_stride, ... + block_bytes) and is usable only if every
// chunk under them is mapped. A null mask: the plane is not in a pool (no check).
// Each launch takes two spans (the K and V planes; the same one twice when only
// one is known).
//
// find_bad_entries:
// block_tables: [batch, >= width] int32 with row stride table_stride, or nullptr
//               to check lengths only (the contiguous baseline).
// seq_lens:     [batch] int32; bad unless 1 <= len <= width*block_size.
// block_mask:   [num_blocks] uint8 (nonzero = usable) or nullptr.
// first_bad:    [0] = lowest row with a bad length,
//               [1] = lowest row*width + column of a used entry that is out of
//               [0, num_blocks), masked, or not usable in a span. Only columns
//               < ceil(len/block_size) of rows with a good length are checked.
#include "common.cuh"

namespace pagedrt {

struct Span {
    const unsigned char* chunk_mask;
    long long num_chunks, chunk_bytes, offset;
};

// A span's fields travel as four scalar kernel arguments (what a launcher passes without a struct type).
#define PAGEDRT_SPAN_ARGS(name) const unsigned char *name##_mask, long long name##_chunks, \
                                long long name##_chunk_bytes, long long name##_offset
#define PAGEDRT_SPAN(name) Span{name##_mask, name##_chunks, name##_chunk_bytes, name##_offset}

__device__ __forceinline__ bool mapped(const Span& s, long long id, long long block_stride, long long block_bytes) {
    if (s.chunk_mask == nullptr) return true;
    const long long lo = s.offset + id * block_stride;
    if (lo < 0) return false;
    const long long first = lo / s.chunk_bytes, last = (lo + block_bytes - 1) / s.chunk_bytes;
    if (last >= s.num_chunks) return false;
    for (long long c = first; c <= last; ++c)
        if (s.chunk_mask[c] == 0) return false;
    return true;
}

__device__ __forceinline__ bool usable(long long id, const Span& k, const Span& v, long long block_stride,
                                       long long block_bytes) {
    return mapped(k, id, block_stride, block_bytes) && mapped(v, id, block_stride, block_bytes);
}

__global__ void find_bad_entries(const int* __restrict__ block_tables, long long table_stride, int batch,
                                 int width, int block_size, const int* __restrict__ seq_lens,
                                 long long num_blocks, const unsigned char* __restrict__ block_mask,
                                 PAGEDRT_SPAN_ARGS(k), PAGEDRT_SPAN_ARGS(v), long long block_stride,
                                 long long block_bytes, unsigned long long* __restrict__ first_bad) {
    const Span span_k = PAGEDRT_SPAN(k), span_v = PAGEDRT_SPAN(v);
    const long long total = (long long)batch * width;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int row = (int)(i / width), col = (int)(i % width);
        const int len = seq_lens[row];
        if (len < 1 || len > (long long)width * block_size) {
            if (col == 0) atomicMin(first_bad, (unsigned long long)row);
            continue;
        }
        if (block_tables == nullptr || col >= (len + block_size - 1) / block_size) continue;
        const int id = block_tables[row * table_stride + col];
        if (id < 0 || id >= num_blocks || (block_mask != nullptr && block_mask[id] == 0) ||
            !usable(id, span_k, span_v, block_stride, block_bytes))
            atomicMin(first_bad + 1, (unsigned long long)i);
    }
}

// find_bad_slots: first_bad[0] = lowest token whose slot is >= capacity or whose block is not usable in a
// span (negative = padding); first_bad[1] = lowest token that found its slot already claimed by another
// token (a duplicate; which of the two tokens finds it depends on timing, so the launcher names the pair
// from the slots themselves). Duplicates are found with an open-addressing hash set `seen` of
// table_size = 2^table_bits >= 2 * num_tokens entries, preset to all ones (no slot is negative there):
// one atomicCAS per token, more only on collisions.
__global__ void find_bad_slots(const long long* __restrict__ slots, long long num_tokens, long long capacity,
                               int block_size, PAGEDRT_SPAN_ARGS(k), PAGEDRT_SPAN_ARGS(v),
                               long long block_stride, long long block_bytes, unsigned long long* __restrict__ seen,
                               int table_bits, unsigned long long* __restrict__ first_bad) {
    const Span span_k = PAGEDRT_SPAN(k), span_v = PAGEDRT_SPAN(v);
    constexpr unsigned long long EMPTY = ~0ull;
    const unsigned long long table_mask = (1ull << table_bits) - 1;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < num_tokens;
         i += (long long)gridDim.x * blockDim.x) {
        const long long slot = slots[i];
        if (slot < 0) continue;
        if (slot >= capacity || !usable(slot / block_size, span_k, span_v, block_stride, block_bytes)) {
            atomicMin(first_bad, (unsigned long long)i);
            continue;
        }
        unsigned long long h = ((unsigned long long)slot * 0x9E3779B97F4A7C15ull) >> (64 - table_bits);
        for (;;) {  // terminates: the table is at most half full
            const unsigned long long prev = atomicCAS(seen + h, EMPTY, (unsigned long long)slot);
            if (prev == EMPTY) break;
            if (prev == (unsigned long long)slot) {
                atomicMin(first_bad + 1, (unsigned long long)i);
                break;
            }
            h = (h + 1) & table_mask;
        }
    }
}

}  // namespace pagedrt
