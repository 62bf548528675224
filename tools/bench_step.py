"""Host time of one decode step's bookkeeping, by batch size and placement.

    PYTHONPATH=. python3 tools/bench_step.py [--backend auto|cuda|host] [--steps 256]

One step: append one token to every sequence (a new block where a block fills,
table entries and lengths updated), then bring the device block table and
lengths up to date (what a kernel launch needs). Shape: 32 layers, 8 KV heads,
head_dim 128, block 16, fp16, chunks of 2 MiB per plane (plane-major) or 64 MiB
(block-major); prompts of 1 to 512 tokens (seeded), so that sequences fill their
blocks on different steps, as in a real batch.

"steady" steps run on a pool mapped in advance: the bookkeeping alone (median,
p90, p99). "growing" starts from an empty pool, so some steps map chunks: the
mean per step, and how many grows happened.
"""

import argparse
import time

import numpy as np

from pagedrt.cache import PagedKVCache

MiB = 1 << 20


def run(batch, steps, backend, placement, pregrow, max_prompt=512):
    prompts = np.random.default_rng(0).integers(1, max_prompt + 1, batch)
    chunk = 2 * MiB if placement == "plane" else 64 * MiB
    with PagedKVCache(32, 8, 128, 16, "float16", max_tokens=batch * (max_prompt + steps), max_seqs=batch,
                      max_seq_len=max_prompt + steps, placement=placement, chunk_bytes=chunk,
                      backend=backend) as cache:
        if pregrow:
            cache.allocator.grow(cache.allocator.num_chunks)
        seqs = np.array([cache.add_sequence() for _ in range(batch)])
        cache.append(seqs, prompts)
        cache.block_tables(), cache.seq_lens()
        version = cache.allocator.version
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            cache.append(seqs, 1)
            cache.block_tables(), cache.seq_lens()
            times.append(time.perf_counter() - t)
        return cache.pool.backend, np.array(times) * 1e6, cache.allocator.version - version


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="auto", choices=("auto", "cuda", "host"))
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--batches", default="1,64,256,1024")
    args = ap.parse_args()
    print(f"{'batch':>6} {'placement':>9} | {'steady median':>13} {'p90':>7} {'p99':>7} | "
          f"{'growing mean':>12} {'grows':>5}  (us per step)")
    for batch in (int(b) for b in args.batches.split(",")):
        for placement in ("plane", "block"):
            backend, steady, _ = run(batch, args.steps, args.backend, placement, pregrow=True)
            _, growing, grows = run(batch, args.steps, args.backend, placement, pregrow=False)
            print(f"{batch:>6} {placement:>9} | {np.median(steady):>13.1f} {np.percentile(steady, 90):>7.1f} "
                  f"{np.percentile(steady, 99):>7.1f} | {growing.mean():>12.1f} {grows:>5}")
    print(f"backend: {backend}")


if __name__ == "__main__":
    main()
