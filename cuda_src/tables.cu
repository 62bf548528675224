// Apply the host's block-table and length changes to their device copies, in one launch.
//
// updates holds n_entries (flat table index, block id) pairs, then n_lens (row, length)
// pairs, as int64; thread i applies pair i.
namespace pagedrt {

__global__ void apply_table_updates(int* __restrict__ table, int* __restrict__ lens,
                                    const long long* __restrict__ updates, int n_entries, int n_lens) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n_entries) {
        table[updates[2 * i]] = static_cast<int>(updates[2 * i + 1]);
    } else if (i < n_entries + n_lens) {
        lens[updates[2 * i]] = static_cast<int>(updates[2 * i + 1]);
    }
}

}  // namespace pagedrt
