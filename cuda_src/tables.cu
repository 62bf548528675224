// The step's device metadata, from one upload of the host's decisions.
//
// The device keeps the block table [max_seqs, width] and lengths [max_seqs] of every
// sequence, and the step's own arrays in fixed buffers a captured CUDA graph can read:
// the batch's block table and lengths (row b is sequence rows[b]), the new tokens' slots
// and the query offsets. pos[r] is sequence r's row in the step's arrays, -1 if none.
//
// The upload is int64: a header, then its arrays in order:
//   header: n_entries, n_lens, n_tokens, batch, clear_tokens, clear_batch, width, gather, qo_end
//   entries[n_entries] (flat table index), blocks[n_entries], rows[n_lens], lens[n_lens],
//   slots[n_tokens], qo[batch + 1], and when gather: batch_rows[batch], pos[max_seqs]
//
// apply_step writes the changed entries and lengths, and, unless the step gathers, the
// same values into the step's arrays of sequences that have a row there; it writes the
// slots and the query offsets, padding past the step: slots up to clear_tokens (the last
// step's count) with -1 (write_kv skips it), offsets up to qo_end (the whole buffer: their
// padding is the token count, which changes) with n_tokens (no queries).
// When the batch changed (gather), gather_step then fills the step's block table and
// lengths from the updated table (block -1, length 0 past the batch) and sets pos.
namespace pagedrt {

enum { N_ENTRIES, N_LENS, N_TOKENS, BATCH, CLEAR_TOKENS, CLEAR_BATCH, WIDTH, GATHER, QO_END, HEADER };

__global__ void apply_step(int* __restrict__ table, int* __restrict__ lens, const long long* __restrict__ up,
                           const int* __restrict__ pos, int* __restrict__ step_table, int* __restrict__ step_lens,
                           long long* __restrict__ slots_out, int* __restrict__ qo_out) {
    const long long n_entries = up[N_ENTRIES], n_lens = up[N_LENS], n_tokens = up[N_TOKENS], batch = up[BATCH];
    const long long clear_tokens = up[CLEAR_TOKENS], qo_end = up[QO_END], width = up[WIDTH];
    const bool gather = up[GATHER] != 0;
    const long long* entries = up + HEADER;
    const long long* blocks = entries + n_entries;
    const long long* rows = blocks + n_entries;
    const long long* new_lens = rows + n_lens;
    const long long* slots = new_lens + n_lens;
    const long long* qo = slots + n_tokens;
    long long total = n_entries + n_lens;
    total = total > clear_tokens ? total : clear_tokens;
    total = total > qo_end ? total : qo_end;
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
        if (i < n_entries) {
            const long long e = entries[i];
            const int block = static_cast<int>(blocks[i]);
            table[e] = block;
            const int p = gather ? -1 : pos[e / width];
            if (p >= 0) step_table[p * width + e % width] = block;
        } else if (i < n_entries + n_lens) {
            const long long r = rows[i - n_entries];
            const int len = static_cast<int>(new_lens[i - n_entries]);
            lens[r] = len;
            const int p = gather ? -1 : pos[r];
            if (p >= 0) step_lens[p] = len;
        }
        if (i < clear_tokens) slots_out[i] = i < n_tokens ? slots[i] : -1;
        if (i < qo_end) qo_out[i] = static_cast<int>(i <= batch ? qo[i] : n_tokens);
    }
}

__global__ void gather_step(const int* __restrict__ table, const int* __restrict__ lens,
                            const long long* __restrict__ up, int max_seqs, int* __restrict__ pos,
                            int* __restrict__ step_table, int* __restrict__ step_lens) {
    const long long n_entries = up[N_ENTRIES], n_lens = up[N_LENS], n_tokens = up[N_TOKENS], batch = up[BATCH];
    const long long clear_batch = up[CLEAR_BATCH], width = up[WIDTH];
    const long long* rows = up + HEADER + 2 * (n_entries + n_lens) + n_tokens + batch + 1;
    const long long* new_pos = rows + batch;
    const long long table_items = clear_batch * width;
    const long long total = table_items + clear_batch + max_seqs;
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
        if (i < table_items) {
            const long long b = i / width;
            step_table[i] = b < batch ? table[rows[b] * width + i % width] : -1;
        } else if (i < table_items + clear_batch) {
            const long long b = i - table_items;
            step_lens[b] = b < batch ? lens[rows[b]] : 0;
        } else {
            const long long r = i - table_items - clear_batch;
            pos[r] = static_cast<int>(new_pos[r]);
        }
    }
}

}  // namespace pagedrt
