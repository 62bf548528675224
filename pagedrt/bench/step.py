"""Host time of one engine step's bookkeeping and metadata, by batch size, step kind and placement.

    python3 -m pagedrt.bench.step [--backend auto|cuda|host] [--steps 256] [--batches 1,64,256,1024]
                                  [--chunk 512] [--gap-us 2000]

Step kinds, each timed from the call to its return (the device copies and launches queued,
not waited for). Between two steps, outside the timing, stands a model's forward pass: on a
GPU a kernel that keeps the stream busy ``--gap-us`` (``cuda_src/forward_stand_in.cu``) and
a stream synchronise, as an engine waits; on the host backend a sleep:

- ``calls``: the building blocks a step took before ``cache.step()``: ``append(None, 1)``,
  then ``block_tables()`` and ``seq_lens()`` (the device table and lengths brought up to date).
- ``decode``: ``cache.step()``: one token for every sequence, with the slot mapping, the
  batch's block tables, lengths and query offsets in the step's device buffers.
- ``mixed``: ``cache.step(frees=[oldest], arrivals=[prompt], arrival_tokens=chunk)``: one
  sequence finishes, a new one arrives with a ``--chunk``-token prompt chunk (its token ids
  hashed for the prefix cache) and every other sequence decodes one token.

Shape: 32 layers, 8 KV heads, head_dim 128, block 16, fp16, chunks of 2 MiB per plane
(plane-major) or 64 MiB (block-major); prompts of 1 to 512 tokens (seeded), so that
sequences fill their blocks on different steps, as in a real batch. "steady" runs on a
pool mapped in advance (the median, p90 and p99 of the bookkeeping alone). The other two
start from an empty pool: "on demand" without growth ahead (an append that runs out maps
chunks itself: the steps that did, and their effect on the median and p99), "ahead" with
``growth=dict(low_blocks=2 chunks, high_blocks=4 chunks)``, the worker mapping while the
host waits between steps (``calls`` does not tick growth: it has no ahead run). "stalls"
counts the steps whose allocation mapped chunks itself or waited for chunks in flight.
"""

import time

import numpy as np

from .. import PagedKVCache, source
from . import harness

MiB = 1 << 20
MAX_PROMPT = 512
KINDS = ("calls", "decode", "mixed")
COLUMNS = (
    harness.Column("batch", "batch", width=6),
    harness.Column("placement", "placement", width=9),
    harness.Column("kind", "step", width=6),
    harness.Column("steady_median_us", "steady median", "{:.1f}", 13),
    harness.Column("steady_p90_us", "p90", "{:.1f}", 7),
    harness.Column("steady_p99_us", "p99", "{:.1f}", 7),
    harness.Column("demand_median_us", "on demand", "{:.1f}", 9),
    harness.Column("demand_p99_us", "p99", "{:.1f}", 7),
    harness.Column("demand_stalls", "stalls", "{}", 6),
    harness.Column("ahead_median_us", "ahead", "{:.1f}", 7),
    harness.Column("ahead_p99_us", "p99", "{:.1f}", 7),
    harness.Column("ahead_stalls", "stalls", "{}", 6),
)
MODES = ("steady", "demand", "ahead")


def run(batch, steps, backend, placement, kind, mode, chunk=MAX_PROMPT, gap_us=0):
    """(backend name, per-step microseconds, steps whose allocation stalled on mapping) over ``steps`` steps of
    ``kind``; ``mode`` is "steady" (every chunk mapped first), "demand" or "ahead" (growth on)."""
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, MAX_PROMPT + 1, batch)
    plane_chunk = 2 * MiB if placement == "plane" else 64 * MiB
    capacity = batch * (MAX_PROMPT + steps) + (steps + 1) * chunk
    shape = dict(max_tokens=capacity, max_seqs=batch + 1, max_seq_len=MAX_PROMPT + steps + chunk,
                 placement=placement, chunk_bytes=plane_chunk, backend=backend)
    plane_block = 8 * 16 * 128 * 2  # bytes of one block in one plane
    bpc = plane_chunk // (plane_block if placement == "plane" else 2 * 32 * plane_block)
    growth = dict(low_blocks=2 * bpc, high_blocks=4 * bpc, release_after=10 * steps) if mode == "ahead" else None
    with PagedKVCache(32, 8, 128, 16, "float16", growth=growth, **shape) as cache:
        a = cache.allocator
        if mode == "steady":
            a.grow(a.num_chunks)
        seqs = [cache.add_sequence() for _ in range(batch)]
        cache.append(seqs, prompts)
        cache.block_tables(), cache.seq_lens()
        step = _kind(cache, kind, rng, chunk)
        forward = _forward(cache, gap_us)
        times, grows = np.empty(steps), 0
        for i in range(steps):
            forward()
            before = _stalls(cache)
            t = time.perf_counter()
            step()
            times[i] = time.perf_counter() - t
            grows += _stalls(cache) > before
        return cache.pool.backend, times * 1e6, grows


def _stalls(cache):
    """Times an allocation mapped chunks itself or waited for chunks in flight."""
    return cache.allocator.stats.sync_grows + (cache.growth.waits if cache.growth is not None else 0)


def _forward(cache, us):
    """A stand-in for the forward pass between two steps: ``us`` microseconds the host waits for."""
    if cache.xp is np:
        return lambda: time.sleep(us * 1e-6)
    spin = source.function("forward_stand_in.cu", "pagedrt::forward_stand_in")
    stream = cache.xp.cuda.get_current_stream()

    def forward():
        spin((1,), (1,), (np.int64(us * 1000),))
        stream.synchronize()
    return forward


def _kind(cache, kind, rng, chunk):
    """The step of ``kind``, as a function of no arguments."""
    if kind == "calls":
        def calls():
            cache.append(None, 1)
            cache.block_tables(), cache.seq_lens()
        return calls
    if kind == "decode":
        return cache.step
    live = list(cache.sequences)

    def mixed():
        prompt = rng.integers(0, 32000, chunk + 1)
        step = cache.step(frees=[live.pop(0)], arrivals=[prompt], arrival_tokens=chunk)
        live.append(int(step.arrived[0]))
    return mixed


def parser():
    ap = harness.parser("pagedrt.bench.step", __doc__, backend=True)
    ap.add_argument("--steps", type=int, default=256, help="steps per run")
    ap.add_argument("--batches", default="1,64,256,1024", help="comma-separated batch sizes")
    ap.add_argument("--chunk", type=int, default=MAX_PROMPT, help="prompt tokens a mixed step's arrival appends")
    ap.add_argument("--gap-us", type=int, default=2000, help="untimed wait between steps (the forward pass)")
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for placement in ("plane", "block"):
            for kind in KINDS:
                row = {"batch": batch, "placement": placement, "kind": kind}
                for mode in MODES if kind != "calls" else MODES[:2]:
                    backend, times, grows = run(batch, args.steps, args.backend, placement, kind, mode, args.chunk,
                                                args.gap_us)
                    row |= {f"{mode}_median_us": float(np.median(times)),
                            f"{mode}_p99_us": float(np.percentile(times, 99))}
                    if mode == "steady":
                        row["steady_p90_us"] = float(np.percentile(times, 90))
                    else:
                        row[f"{mode}_stalls"] = grows
                rows.append(row)
    harness.publish("step", args.out, {"backend": backend}, rows,
                    harness.format_table(COLUMNS, rows) + f"\nus per step; backend: {backend}", steps=args.steps,
                    chunk=args.chunk, gap_us=args.gap_us)


if __name__ == "__main__":
    main()
