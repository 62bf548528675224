// Find the first bad sequence length and the first bad block-table entry (or
// write slot), so a launcher can refuse them before any kernel reads or writes
// through them. Results go to a [2] uint64 buffer preset to all ones (atomicMin).
//
// find_bad_entries:
// block_tables: [batch, >= width] int32 with row stride table_stride, or nullptr
//               to check lengths only (the contiguous baseline).
// seq_lens:     [batch] int32; bad unless 1 <= len <= width*block_size.
// block_mask:   [num_blocks] uint8 (nonzero = usable) or nullptr.
// first_bad:    [0] = lowest row with a bad length,
//               [1] = lowest row*width + column of a used entry that is out of
//               [0, num_blocks) or masked. Only columns < ceil(len/block_size)
//               of rows with a good length are checked.
#include "common.cuh"

namespace pagedrt {

__global__ void find_bad_entries(const int* __restrict__ block_tables, long long table_stride, int batch,
                                 int width, int block_size, const int* __restrict__ seq_lens,
                                 long long num_blocks, const unsigned char* __restrict__ block_mask,
                                 unsigned long long* __restrict__ first_bad) {
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
        if (id < 0 || id >= num_blocks || (block_mask != nullptr && block_mask[id] == 0))
            atomicMin(first_bad + 1, (unsigned long long)i);
    }
}

// find_bad_slots: first_bad[0] = lowest token whose slot is >= capacity (negative = padding).
__global__ void find_bad_slots(const long long* __restrict__ slots, long long num_tokens, long long capacity,
                               unsigned long long* __restrict__ first_bad) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < num_tokens;
         i += (long long)gridDim.x * blockDim.x) {
        if (slots[i] >= capacity) atomicMin(first_bad, (unsigned long long)i);
    }
}

}  // namespace pagedrt
