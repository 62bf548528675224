"""A decode step over every layer of a 32-layer model: placement, Python launches vs a plan vs a CUDA graph.

    python3 -m pagedrt.bench.layers [--cases b32,big,long-1] [--repeats 20] [--chunk-mib 64]

A standard fp16 decode case (``pagedrt.bench.cases``) with 32 layers, in a real
PagedKVCache, placed

- plane-major: one region of the range per layer and K/V (consecutive blocks of
  a layer are 32 KiB apart: 64 to a 2 MiB page), or
- block-major: a block holds every layer's K and V (2 MiB), so consecutive
  blocks of one layer are 2 MiB apart: each in its own page.

The cache maps its blocks by appending every sequence's tokens; the block table is
the standard seeded random permutation of those blocks (the same for every layer:
a block id names the same tokens in every layer). Per case and placement: the GPU
time of one step (32 layers' paged_decode, validate=False) launched from Python,
the same step as one DecodePlan run per layer, and the plan's 32 runs captured
once as a CUDA graph and replayed (CUDA events, one step at a time, median), the host time to launch the 32
layers either way, and the graph's bandwidth against the read-only streaming
ceiling measured in the same run.
"""

import statistics
import time

import numpy as np

from .. import PagedKVCache
from . import harness
from .cases import BLOCK_SIZE, DECODE_CASES, HEAD_DIM, KV_HEADS, Q_HEADS, scattered_table

LAYERS = 32
MiB = 1 << 20
FP16_CASES = [name for name, case in DECODE_CASES.items() if case.dtype == "float16"]
COLUMNS = (
    harness.Column("case", "case", width=7, left=True),
    harness.Column("placement", "placement", width=9, left=True),
    harness.Column("block_stride", "stride", width=9),
    harness.Column("chunk_mib", "chunk", "{}Mi", 6),
    harness.Column("plain_ms", "launched ms", "{:.3f}", 11),
    harness.Column("planned_ms", "planned ms", "{:.3f}", 10),
    harness.Column("graph_ms", "graph ms", "{:.3f}", 9),
    harness.Column("launch_us", "launch us", "{:.0f}", 9),
    harness.Column("planned_launch_us", "planned us", "{:.0f}", 10),
    harness.Column("graph_tb_s", "TB/s", "{:.2f}", 5),
    harness.Column("pct_stream", "%strm", "{:.1f}", 6),
)
LEGEND = ("launched: 32 paged_decode calls from Python per step; planned: one DecodePlan per step, run for each "
          "layer;\ngraph: the planned step's runs captured once and replayed; launch us, planned us: host time to "
          "issue one step;\nTB/s and %strm: the graph's K/V + q + out bytes per second")


def fill_random(cp, plane):
    """Fill a plane with random values by tiling one random buffer (fast for tens of GiB)."""
    tile = cp.random.default_rng(0).standard_normal((256,) + plane.shape[1:], dtype=np.float32).astype(plane.dtype)
    for lo in range(0, plane.shape[0], 256):
        n = min(256, plane.shape[0] - lo)
        plane[lo:lo + n] = tile[:n]


def fill_random_e4m3(cp, plane):
    """Fill an FP8 (uint8) plane with random finite e4m3 bytes: codes 0..126 of either sign (0x7F is NaN)."""
    for lo in range(0, plane.shape[0], 4096):
        part = plane[lo:lo + 4096]
        codes = cp.random.randint(0, 0x7F, part.shape, dtype=np.int32)
        part[...] = (codes | (cp.random.randint(0, 2, part.shape, dtype=np.int32) << 7)).astype(np.uint8)


def run(cp, case, placement, chunk, repeats):
    from .. import attention
    lens_host = np.asarray(case.lengths, np.int32)
    table_host, num_blocks = scattered_table(lens_host)
    with PagedKVCache(LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, case.dtype, max_tokens=num_blocks * BLOCK_SIZE,
                      max_seqs=case.batch, max_seq_len=int(lens_host.max()), placement=placement,
                      chunk_bytes=chunk, backend="cuda") as cache:
        seqs = np.array([cache.add_sequence() for _ in range(case.batch)])
        cache.append(seqs, lens_host)  # maps the chunks the blocks need
        held = cache.block_tables()
        if int(held.max()) != num_blocks - 1:
            raise RuntimeError(f"the cache holds blocks up to {int(held.max())}, not 0..{num_blocks - 1}")
        table, lens = cp.asarray(table_host), cp.asarray(lens_host)
        planes = ([cache.k(layer)[:num_blocks] for layer in range(LAYERS)],
                  [cache.v(layer)[:num_blocks] for layer in range(LAYERS)])
        for plane in planes[0] + planes[1]:
            fill_random(cp, plane)
        q = cp.random.default_rng(2).standard_normal((LAYERS, case.batch, Q_HEADS, HEAD_DIM), dtype=np.float32)
        q = q.astype(cache.dtype)
        out = cp.empty_like(q)

        def step():
            for layer in range(LAYERS):
                attention.paged_decode(q[layer], planes[0][layer], planes[1][layer], table, lens, out=out[layer],
                                       validate=False)

        def runs(plan):
            for layer in range(LAYERS):
                plan.run(q[layer], planes[0][layer], planes[1][layer], out=out[layer])

        def planned_step():
            runs(attention.DecodePlan(q[0], planes[0][0], table, lens, validate=False))

        cp.cuda.Device().synchronize()  # the uploads and fills above ran on the legacy stream: done before
        stream = cp.cuda.Stream(non_blocking=True)  # a non-blocking stream, which does not wait for it, reads them
        with stream:
            step()  # compile, plan and workspace on this stream before capture
            stream.synchronize()
            launch_us = {}
            for name, fn in (("plain", step), ("planned", planned_step)):
                times = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t)
                    stream.synchronize()
                launch_us[name] = statistics.median(times) * 1e6
            plain_ms = 1e3 * harness.event_seconds(cp, step, repeats)
            planned_ms = 1e3 * harness.event_seconds(cp, planned_step, repeats)
            plan = attention.DecodePlan(q[0], planes[0][0], table, lens, validate=False)  # holds its workspace
            stream.begin_capture()
            runs(plan)
            graph = stream.end_capture()
            graph_ms = 1e3 * harness.event_seconds(cp, lambda: graph.launch(stream), repeats)
        itemsize = cache.dtype.itemsize
        kv_bytes = 2 * int(lens_host.sum()) * KV_HEADS * HEAD_DIM * itemsize
        moved = LAYERS * (kv_bytes + 2 * case.batch * Q_HEADS * HEAD_DIM * itemsize)
        return {"case": case.name, "placement": placement, "block_stride": cache.k(0).strides[0],
                "chunk_mib": chunk // MiB, "plain_ms": plain_ms, "planned_ms": planned_ms, "graph_ms": graph_ms,
                "launch_us": launch_us["plain"], "planned_launch_us": launch_us["planned"],
                "graph_tb_s": moved / (graph_ms * 1e-3) / 1e12}


def parser():
    ap = harness.parser("pagedrt.bench.layers", __doc__)
    ap.add_argument("--cases", default="b32,big,long-1", help=f"comma-separated, of {', '.join(FP16_CASES)}")
    ap.add_argument("--repeats", type=int, default=20, help="steps timed per measurement")
    ap.add_argument("--chunk-mib", type=int, default=64, help="physical chunk size in MiB (per plane when "
                                                              "plane-major)")
    return ap


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    names = harness.case_names(ap, args.cases, FP16_CASES)
    import cupy as cp
    info = harness.device_info(cp)
    bandwidth = harness.ceilings(harness.Timer(cp), 10)
    print(harness.header(info, bandwidth))
    print(f"{LAYERS} layers, fp16, {Q_HEADS}/{KV_HEADS} heads x {HEAD_DIM}, block {BLOCK_SIZE}")
    rows = []
    for name in names:
        for placement in ("plane", "block"):
            row = run(cp, DECODE_CASES[name], placement, args.chunk_mib * MiB, args.repeats)
            row["pct_stream"] = 100 * row["graph_tb_s"] * 1e12 / bandwidth["stream"]
            rows.append(row)
            print(harness.format_table(COLUMNS, [row]).splitlines()[-1])
            cp.get_default_memory_pool().free_all_blocks()
    print()
    harness.publish("layers", args.out, info, rows, harness.format_table(COLUMNS, rows) + "\n" + LEGEND,
                    repeats=args.repeats, ceilings=bandwidth)


if __name__ == "__main__":
    main()
