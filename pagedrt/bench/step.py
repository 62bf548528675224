"""Host time of one decode step's bookkeeping, by batch size and placement.

    python3 -m pagedrt.bench.step [--backend auto|cuda|host] [--steps 256] [--batches 1,64,256,1024]

One step: append one token to every sequence (a new block where a block fills,
table entries and lengths updated), then bring the device block table and
lengths up to date (``cache.block_tables()`` and ``cache.seq_lens()``: what a
kernel launch needs). Shape: 32 layers, 8 KV heads, head_dim 128, block 16, fp16,
chunks of 2 MiB per plane (plane-major) or 64 MiB (block-major); prompts of 1 to
512 tokens (seeded), so that sequences fill their blocks on different steps, as
in a real batch.

"steady" steps run on a pool mapped in advance (the allocator maps every chunk
of the reservation first): the bookkeeping alone (median, p90, p99). "growing"
starts from an empty pool, so some steps map chunks: the mean per step, and how
many steps grew the pool.
"""

import time

import numpy as np

from .. import PagedKVCache
from . import harness

MiB = 1 << 20
MAX_PROMPT = 512
COLUMNS = (
    harness.Column("batch", "batch", width=6),
    harness.Column("placement", "placement", width=9),
    harness.Column("steady_median_us", "steady median", "{:.1f}", 13),
    harness.Column("steady_p90_us", "p90", "{:.1f}", 7),
    harness.Column("steady_p99_us", "p99", "{:.1f}", 7),
    harness.Column("growing_mean_us", "growing mean", "{:.1f}", 12),
    harness.Column("grows", "grows", "{}", 5),
)


def run(batch, steps, backend, placement, premap):
    """(backend name, per-step microseconds, steps that grew the pool) over ``steps`` steps."""
    prompts = np.random.default_rng(0).integers(1, MAX_PROMPT + 1, batch)
    chunk = 2 * MiB if placement == "plane" else 64 * MiB
    with PagedKVCache(32, 8, 128, 16, "float16", max_tokens=batch * (MAX_PROMPT + steps), max_seqs=batch,
                      max_seq_len=MAX_PROMPT + steps, placement=placement, chunk_bytes=chunk,
                      backend=backend) as cache:
        if premap:  # the software layer maps every chunk of the reservation, as growth ahead of need would
            cache.allocator.grow(cache.allocator.num_chunks)
        seqs = np.array([cache.add_sequence() for _ in range(batch)])
        cache.append(seqs, prompts)
        cache.block_tables(), cache.seq_lens()
        mapped = cache.pool.mapped_bytes
        times, grows = [], 0
        for _ in range(steps):
            t = time.perf_counter()
            cache.append(seqs, 1)
            cache.block_tables(), cache.seq_lens()
            times.append(time.perf_counter() - t)
            now = cache.pool.mapped_bytes  # a property: nothing between two timed steps but this
            grows += now > mapped
            mapped = now
        return cache.pool.backend, np.array(times) * 1e6, grows


def parser():
    ap = harness.parser("pagedrt.bench.step", __doc__, backend=True)
    ap.add_argument("--steps", type=int, default=256, help="decode steps per run")
    ap.add_argument("--batches", default="1,64,256,1024", help="comma-separated batch sizes")
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for placement in ("plane", "block"):
            backend, steady, _ = run(batch, args.steps, args.backend, placement, premap=True)
            _, growing, grows = run(batch, args.steps, args.backend, placement, premap=False)
            rows.append({"batch": batch, "placement": placement, "steady_median_us": float(np.median(steady)),
                         "steady_p90_us": float(np.percentile(steady, 90)),
                         "steady_p99_us": float(np.percentile(steady, 99)),
                         "growing_mean_us": float(growing.mean()), "grows": grows})
    harness.publish("step", args.out, {"backend": backend}, rows,
                    harness.format_table(COLUMNS, rows) + f"\nus per step; backend: {backend}", steps=args.steps)


if __name__ == "__main__":
    main()
