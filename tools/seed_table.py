"""Experiment: the seed's Llama 2 70B figures, computed by pagedrt's own code paths.

    PYTHONPATH=. python3 tools/seed_table.py

The explainer seed gives, for Llama 2 70B (80 layers, 8 KV heads, head_dim 128,
fp16): the KV bytes of one token; the tail waste of one sequence, as a bound
(``B - 1`` empty slots in its last block) and as "the mean under a uniform
distribution", which it puts at ``B / 2`` tokens (8 for B = 16); and the size of
the dense block table, one int32 per block of ``max_model_len`` per request.

Every figure here comes from a real :class:`PagedKVCache` on the host backend
(nothing is mapped but the few blocks the measurement appends):

- bytes per token: ``cache.layout.bytes_per_token``;
- the bound and the seed's mean: ``B - 1`` and ``B / 2`` tokens times that;
- the measured mean: sequences of every length 1..B appended to a cache (every
  remainder mod B once, so the uniform case exactly), their tail waste read from
  the block table (blocks held x B - length); its maximum must be the bound;
- the block table: ``cache.block_tables().nbytes`` (the dense int32 array a kernel
  reads) for 1 and 100 requests at ``max_seq_len=32768``.
"""

import argparse

import numpy as np

from pagedrt.cache import PagedKVCache

LLAMA2_70B = dict(num_layers=80, num_kv_heads=8, head_dim=128, dtype="float16")
WASTE_BLOCK_SIZES = (16, 32)
TABLE_BLOCK_SIZES = (8, 16)
MAX_MODEL_LEN, REQUESTS = 32768, 100
KiB, MiB = 1 << 10, 1 << 20


def tail_waste(block_size):
    """Per sequence of length 1..block_size: the empty slots of its blocks, read from the block table."""
    lengths = np.arange(1, block_size + 1)
    with PagedKVCache(**LLAMA2_70B, block_size=block_size, max_tokens=block_size * block_size,
                      max_seqs=block_size, backend="host") as cache:
        seqs = [cache.add_sequence() for _ in lengths]
        cache.append(seqs, lengths)
        held = (cache.block_tables(seqs) >= 0).sum(axis=1)
        return cache.layout.bytes_per_token, held * block_size - cache.seq_lens(seqs)


def table_bytes(block_size, requests):
    """nbytes of the dense block table of a cache sized for ``requests`` x MAX_MODEL_LEN."""
    with PagedKVCache(**LLAMA2_70B, block_size=block_size, max_tokens=block_size, max_seqs=requests,
                      max_seq_len=MAX_MODEL_LEN, backend="host") as cache:
        return cache.max_blocks_per_seq, int(cache.block_tables().nbytes)


def measure():
    """Every figure of the table, as a dict."""
    waste = {}
    for bs in WASTE_BLOCK_SIZES:
        bytes_per_token, w = tail_waste(bs)
        waste[bs] = {"bound_tokens": bs - 1, "seed_mean_tokens": bs / 2,
                     "measured_max_tokens": int(w.max()), "measured_mean_tokens": float(w.mean()),
                     "bytes_per_token": bytes_per_token}
    tables = {}
    for bs in TABLE_BLOCK_SIZES:
        entries, one = table_bytes(bs, 1)
        _, many = table_bytes(bs, REQUESTS)
        tables[bs] = {"entries": entries, "bytes_one": one, "bytes_many": many}
    return {"bytes_per_token": waste[WASTE_BLOCK_SIZES[0]]["bytes_per_token"], "waste": waste, "tables": tables}


def _mib(n):
    return f"{n / MiB:.2f} MiB"


def _size(n):
    return f"{n / KiB:.0f} KiB" if n < MiB else f"{n / MiB:.2f} MiB"


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    r = measure()
    bpt = r["bytes_per_token"]
    print("Llama 2 70B: 80 layers, 8 KV heads, head_dim 128, float16 (pagedrt Layout, host backend)")
    print(f"KV bytes per token: {bpt:,} B ({bpt / KiB:.0f} KiB)")
    print()
    print("Tail waste of one sequence (empty slots of its last block)")
    print(f"{'block':>5} | {'bound: B-1 tokens':>22} | {'seed mean: B/2 tokens':>22} | "
          f"{'measured mean, lengths 1..B':>27} | {'measured max':>12}")
    for bs, w in r["waste"].items():
        print(f"{bs:>5} | {w['bound_tokens']:>6} tok {_mib(w['bound_tokens'] * bpt):>11} | "
              f"{w['seed_mean_tokens']:>6g} tok {_mib(w['seed_mean_tokens'] * bpt):>11} | "
              f"{w['measured_mean_tokens']:>10g} tok {_mib(w['measured_mean_tokens'] * bpt):>12} | "
              f"{w['measured_max_tokens']:>8} tok")
    print()
    print(f"Dense block table (int32), max_model_len {MAX_MODEL_LEN}")
    print(f"{'block':>5} | {'entries per request':>19} | {'1 request':>9} | {f'{REQUESTS} requests':>12}")
    for bs, t in r["tables"].items():
        print(f"{bs:>5} | {t['entries']:>19} | {_size(t['bytes_one']):>9} | {_size(t['bytes_many']):>12}")
    return r


if __name__ == "__main__":
    main()
