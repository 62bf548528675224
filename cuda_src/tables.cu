// The step's device metadata, from one upload of the host's decisions.
//
// apply_table_updates: updates holds n_entries (flat table index, block id) pairs, then
// n_lens (row, length) pairs, as int64; thread i applies pair i to the device block table
// and lengths (every sequence's row, kept current step by step).
//
// gather_step (launched after it): the step's own arrays, in fixed buffers a captured CUDA
// graph can read. step holds the new tokens' slots [n_tokens], then the batch's rows
// [batch], then the query offsets [batch + 1], as int64. Row b of step_table/step_lens is
// row rows[b] of the table and lengths; query offsets become int32. Past the step, up to
// clear_tokens and clear_batch (the previous step's sizes), the buffers are padded: slot -1
// (write_kv skips it), block -1, length 0 and offset n_tokens (no queries).
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

__global__ void gather_step(const int* __restrict__ table, const int* __restrict__ lens, int width,
                            const long long* __restrict__ step, int n_tokens, int batch,
                            int clear_tokens, int clear_batch,
                            long long* __restrict__ slots_out, int* __restrict__ table_out,
                            int* __restrict__ lens_out, int* __restrict__ qo_out) {
    const long long* rows = step + n_tokens;
    const long long* qo = rows + batch;
    const long long table_items = static_cast<long long>(clear_batch) * width;
    const long long total = clear_tokens + table_items + 2 * static_cast<long long>(clear_batch) + 1;
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
        long long j = i;
        if (j < clear_tokens) {
            slots_out[j] = j < n_tokens ? step[j] : -1;
            continue;
        }
        j -= clear_tokens;
        if (j < table_items) {
            const int b = static_cast<int>(j / width);
            const int c = static_cast<int>(j - static_cast<long long>(b) * width);
            table_out[j] = b < batch ? table[rows[b] * width + c] : -1;
            continue;
        }
        j -= table_items;
        if (j < clear_batch) {
            lens_out[j] = j < batch ? lens[rows[j]] : 0;
            continue;
        }
        j -= clear_batch;
        qo_out[j] = static_cast<int>(j <= batch ? qo[j] : n_tokens);
    }
}

}  // namespace pagedrt
