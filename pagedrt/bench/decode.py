"""Decode attention on the standard workloads: time, bandwidth against measured ceilings, paging cost.

    python3 -m pagedrt.bench.decode [--cases b8,big,...] [--repeats 100] [--out run.json]
    python3 -m pagedrt.bench.decode --kv-dtype float8_e4m3 [--cases ...]   # K/V stored as FP8

The cases are the standard decode workloads (``pagedrt.bench.cases``), unchanged, and ``skew``, a
heavy-tailed batch that is not one of them (64 lognormal lengths, median 2560, sigma 1, seed 0, capped at
16384).
K and V are two plane views of a CUDA Pool. Per case it prints the median time
(CUDA events, warm-up first, queued behind a spin kernel), effective bandwidth =
(K and V bytes of the valid tokens + q + out) / time, that bandwidth against the
two ceilings measured in the same run (a device-to-device copy, bytes read +
written, and a read-only streaming kernel, both over 4 GiB), the contiguous
baseline's time (the same kernel over contiguous K/V) and the paging overhead
(paged / contiguous - 1), the split count and geometry the plan chose, and what
validation costs. A second table gives each case's split plan as ``pagedrt.bench.partition`` does on the
host, with this device's resident blocks (from the occupancy API): segment tokens, thread blocks launched
and holding tokens, waves of them over the resident blocks, the longest segment over the mean, the
busiest resident slot's K/V bytes over the mean (blocks handed out in launch order) and that schedule's
modelled share of the floor, beside the measured one: what limits a case, the split plan, the tail or the
imbalance. The contiguous K/V live in the same kind of memory as the paged
planes (a pool), so the overhead is that of the addressing alone. It also times
the streaming kernel reading the case's own K and V planes once (``strm us``, one
launch over the same bytes: the ceiling at this size, with its launch ramp and
tail) and gives its time as a share of the decode's (``%size``). And it times a
read-only kernel over exactly the K/V chunks the decode reads (a block of a KV
head each), through the block table in the decode's order (per sequence, per KV
head, its blocks in table order), doing no arithmetic (``pread us``: the bound
of a paged kernel at this size), and gives its time as a share of the decode's
(``%pread``).

The paged and contiguous times are those of a plan's ``run`` (the plans made once,
as a step makes them): the kernel alone. validate=True reads a result back to the
host before launching, so it cannot be queued: ``paged_decode`` (a plan made and
run) is timed call by call with and without it, and the validation cost (validated
- unvalidated) includes that round trip.

``--kv-dtype float8_e4m3`` runs the same cases over FP8 planes (random e4m3 bytes, scales per KV head, q
and out in the case's dtype) and counts bandwidth in FP8 bytes: (K and V bytes of the valid tokens, one
byte a value, + q + out) / time, against the same ceilings; no contiguous baseline and no validation
figures (FP8 runs on the paged kernel only); ``pread us`` reads the FP8 chunks.
"""

import contextlib

import numpy as np

from .. import Pool
from ..spec import numpy_dtype
from ..supported import FP8
from . import harness, partition
from .cases import BENCH_DECODE_CASES, HEAD_DIM, KV_HEADS, Q_HEADS, scattered_table
from .layers import fill_random_e4m3

COLUMNS = (
    harness.Column("case", "case", width=9, left=True),
    harness.Column("dtype", "dtype", width=8, left=True),
    harness.Column("us", "us", "{:.1f}"),
    harness.Column("tb_s", "TB/s", "{:.2f}", 6),
    harness.Column("pct_copy", "%copy", "{:.1f}", 6),
    harness.Column("pct_stream", "%strm", "{:.1f}", 6),
    harness.Column("contiguous_us", "contig us", "{:.1f}", 9),
    harness.Column("paging_overhead_pct", "paging", "{:+.1f}%", 7),
    harness.Column("num_splits", "splits", "{}", 6),
    harness.Column("geometry", "geometry", "{}", 8),
    harness.Column("validate_us", "valid us", "{:.1f}"),
    harness.Column("size_stream_us", "strm us", "{:.1f}"),
    harness.Column("pct_size_stream", "%size", "{:.1f}", 6),
    harness.Column("paged_read_us", "pread us", "{:.1f}"),
    harness.Column("pct_paged_read", "%pread", "{:.1f}", 6),
    harness.Column("note", "note", width=0, left=True),
)


def random_bits(cp, shape, dtype):
    """Random normal values of dtype as uint16 bits (bfloat16: a float32's upper half)."""
    x = cp.random.standard_normal(shape, dtype=np.float32)
    if dtype == "bfloat16":
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    return x.astype(np.float16).view(np.uint16)


def pool_planes(stack, shape, chunk, dtype=np.uint16):
    """Two adjacent planes of ``shape`` (uint16, or uint8 for FP8) in one CUDA pool of ``chunk``-byte chunks,
    mapped."""
    plane_bytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    total = -(-2 * plane_bytes // chunk) * chunk
    pool = stack.enter_context(Pool(total, chunk, backend="cuda"))
    pool.grow(total // chunk)
    return [pool.view(i * plane_bytes, shape, dtype) for i in range(2)]


def resident(dt, block):
    """{geometry: resident thread blocks} of the paged decode kernel of the standard shape at dtype ``dt``."""
    from ..kernels.configs import config
    return partition.device_resident(config(dt, HEAD_DIM, block, Q_HEADS // KV_HEADS))


def paged_read_us(cp, timer, planes, table, lens, block, repeats):
    """The read-only paged kernel's time over the chunks of ``planes`` (K and V, ``[num_blocks, KV_HEADS, block,
    HEAD_DIM]``) that decode reads through ``table`` (``[batch, width]``) for ``lens`` (``[batch]``)."""
    chunk_bytes = block * HEAD_DIM * planes[0].itemsize
    offsets = cp.asarray(harness.chunk_offsets(table, lens, block, KV_HEADS, chunk_bytes))
    return harness.paged_read_us(timer, planes[0].data.ptr, planes[1].data.ptr, offsets, chunk_bytes, repeats)


def run_case(cp, timer, case, repeats, bandwidth, l2_bytes, chunk, sweep, order, memory, block):
    from .. import attention
    dt = numpy_dtype(case.dtype)
    lens = np.asarray(case.lengths, np.int32)
    table, num_blocks = scattered_table(lens, block, shuffle=order == "random")
    width = table.shape[1]
    shape = (num_blocks, KV_HEADS, block, HEAD_DIM)
    contiguous_shape = (case.batch, width) + shape[1:]  # [batch, width, kv, block, dim]
    with contextlib.ExitStack() as stack:
        if memory == "pool":
            bits = pool_planes(stack, shape, chunk)
            contiguous_bits = pool_planes(stack, contiguous_shape, chunk)
        else:  # the experiment's control: the same planes in cudaMalloc memory
            bits = [cp.empty(shape, np.uint16) for _ in range(2)]
            contiguous_bits = [cp.empty(contiguous_shape, np.uint16) for _ in range(2)]
        for plane in bits:
            for lo in range(0, num_blocks, 4096):
                plane[lo:lo + 4096] = random_bits(cp, plane[lo:lo + 4096].shape, case.dtype)
        gather = cp.asarray(np.maximum(table, 0))
        for src, dst in zip(bits, contiguous_bits):
            dst[...] = src[gather]
        k, v = (b.view(dt) for b in bits)
        k_contiguous, v_contiguous = (b.view(dt) for b in contiguous_bits)
        q = random_bits(cp, (case.batch, Q_HEADS, HEAD_DIM), case.dtype).view(dt)
        out, contiguous_out = cp.empty_like(q), cp.empty_like(q)
        d_table, d_lens = cp.asarray(table), cp.asarray(lens)
        hints = dict(max_seq_len=int(lens.max()), mean_seq_len=float(lens.mean()))  # host-side, as an engine has
        plan = attention.DecodePlan(q, k, d_table, d_lens, validate=False, **hints)
        split = plan.split
        token_bytes = 2 * HEAD_DIM * dt.itemsize
        cut = partition.describe(lens, split, resident(dt, block), token_bytes, stream_tb_s=bandwidth["stream"] / 1e12)
        contiguous = attention.ContiguousDecodePlan(q, k_contiguous, d_lens, validate=False, **hints)

        def call(validate):  # a plan made and run per call, as paged_decode does
            return lambda: attention.paged_decode(q, k, v, d_table, d_lens, out=out, validate=validate, **hints)

        def forced(n):
            forced_plan = attention.DecodePlan(q, k, d_table, d_lens, validate=False, num_splits=n)
            return lambda: forced_plan.run(q, k, v, out)

        # The kernels alone: plans made once, as a step makes them, and run per timed call.
        paged_us = timer.gpu_us(lambda: plan.run(q, k, v, out), repeats)
        # the streaming kernel over the same planes, one launch (the pool's planes are adjacent)
        size_us = (harness.stream_us(timer, bits[0].data.ptr, 2 * bits[0].nbytes, repeats)
                   if memory == "pool" else None)
        # the read-only kernel over the chunks the decode reads, through the table in its order
        read_us = paged_read_us(cp, timer, bits, table, lens, block, repeats) if memory == "pool" else None
        contiguous_us = timer.gpu_us(lambda: contiguous.run(q, k_contiguous, v_contiguous, contiguous_out), repeats)
        checked_us = timer.wall_us(call(validate=True), repeats)
        unchecked_us = timer.wall_us(call(validate=False), repeats)
        split_us = {n: timer.gpu_us(forced(n), repeats) for n in sweep}
        a, b = (cp.asnumpy(x.view(np.uint16)).view(dt).astype(np.float64) for x in (out, contiguous_out))
        agree = float(np.abs(a - b).max()) if np.isfinite(a).all() else float("nan")
    kv_bytes = int(lens.sum()) * KV_HEADS * HEAD_DIM * dt.itemsize * 2
    moved = kv_bytes + 2 * case.batch * Q_HEADS * HEAD_DIM * dt.itemsize
    bw = moved / (paged_us * 1e-6)
    note = "fits in L2: measures the cache" if kv_bytes <= l2_bytes else ""
    if not agree < 1e-2:
        note += f" paged and contiguous disagree ({agree})"
    return {
        "case": case.name, "dtype": case.dtype, "batch": case.batch, "tokens": int(lens.sum()),
        "kv_mib": kv_bytes / 2**20, "us": paged_us, "tb_s": bw / 1e12, "pct_copy": 100 * bw / bandwidth["copy"],
        "pct_stream": 100 * bw / bandwidth["stream"], "size_stream_us": size_us,
        "pct_size_stream": 100 * size_us / paged_us if size_us else None, "paged_read_us": read_us,
        "pct_paged_read": 100 * read_us / paged_us if read_us else None, "contiguous_us": contiguous_us,
        "paging_overhead_pct": 100 * (paged_us / contiguous_us - 1), "num_splits": split.num_splits,
        "segment_tokens": split.segment_tokens, "geometry": split.geometry, "validate_us": checked_us - unchecked_us,
        "validated_wall_us": checked_us, "unvalidated_wall_us": unchecked_us,
        "paged_vs_contiguous_max_abs_diff": agree, "fits_l2": kv_bytes <= l2_bytes, "note": note.strip(),
        "chunk_mib": chunk >> 20 if memory == "pool" else 0, "order": order, "block_size": block,
        "split_sweep_us": split_us, "plan": cut,
    }


PLAN_COLUMNS = partition.COLUMNS[:1] + partition.COLUMNS[3:] + (
    harness.Column("measured_pct", "%floor measured", "{:.1f}", 15),)
PLAN_LEGEND = ("pagedrt.bench.partition's columns with this device's resident blocks; %floor: the model's, then "
               "the measured time's")


FP8_COLUMNS = (
    harness.Column("case", "case", width=9, left=True),
    harness.Column("dtype", "q dtype", width=8, left=True),
    harness.Column("us", "us", "{:.1f}"),
    harness.Column("tb_s", "TB/s", "{:.2f}", 6),
    harness.Column("pct_stream", "%strm", "{:.1f}", 6),
    harness.Column("num_splits", "splits", "{}", 6),
    harness.Column("geometry", "geometry", "{}", 8),
    harness.Column("size_stream_us", "strm us", "{:.1f}"),
    harness.Column("pct_size_stream", "%size", "{:.1f}", 6),
    harness.Column("paged_read_us", "pread us", "{:.1f}"),
    harness.Column("pct_paged_read", "%pread", "{:.1f}", 6),
    harness.Column("note", "note", width=0, left=True),
)


def run_fp8_case(cp, timer, case, repeats, bandwidth, l2_bytes, chunk, block):
    """One case over FP8 (float8 e4m3) planes: the plan's run timed, bandwidth in FP8 bytes."""
    from .. import attention
    dt = numpy_dtype(case.dtype)
    lens = np.asarray(case.lengths, np.int32)
    table, num_blocks = scattered_table(lens, block, shuffle=True)
    shape = (num_blocks, KV_HEADS, block, HEAD_DIM)
    with contextlib.ExitStack() as stack:
        k, v = pool_planes(stack, shape, chunk, np.uint8)
        for plane in (k, v):
            fill_random_e4m3(cp, plane)
        k_scale = cp.full(KV_HEADS, 1 / 64, np.float32)
        v_scale = cp.full(KV_HEADS, 1 / 64, np.float32)
        q = random_bits(cp, (case.batch, Q_HEADS, HEAD_DIM), case.dtype).view(dt)
        out = cp.empty_like(q)
        hints = dict(max_seq_len=int(lens.max()), mean_seq_len=float(lens.mean()))
        plan = attention.DecodePlan(q, k, cp.asarray(table), cp.asarray(lens), validate=False, **hints)
        paged_us = timer.gpu_us(lambda: plan.run(q, k, v, out, k_scale=k_scale, v_scale=v_scale), repeats)
        size_us = harness.stream_us(timer, k.data.ptr, 2 * k.nbytes, repeats)
        read_us = paged_read_us(cp, timer, (k, v), table, lens, block, repeats)
    kv_bytes = int(lens.sum()) * KV_HEADS * HEAD_DIM * 2  # one byte a value, K and V
    moved = kv_bytes + 2 * case.batch * Q_HEADS * HEAD_DIM * dt.itemsize
    bw = moved / (paged_us * 1e-6)
    note = "fits in L2: measures the cache" if kv_bytes <= l2_bytes else ""
    split = plan.split
    return {
        "case": case.name, "dtype": case.dtype, "kv_dtype": FP8, "batch": case.batch,
        "tokens": int(lens.sum()), "kv_mib": kv_bytes / 2**20, "us": paged_us, "tb_s": bw / 1e12,
        "pct_copy": 100 * bw / bandwidth["copy"], "pct_stream": 100 * bw / bandwidth["stream"],
        "size_stream_us": size_us, "pct_size_stream": 100 * size_us / paged_us, "paged_read_us": read_us,
        "pct_paged_read": 100 * read_us / paged_us, "num_splits": split.num_splits,
        "segment_tokens": split.segment_tokens, "geometry": split.geometry, "fits_l2": kv_bytes <= l2_bytes,
        "note": note.strip(), "chunk_mib": chunk >> 20, "block_size": block,
    }


def table(rows):
    """The results table, and the forced-split sweep under it when one was asked for."""
    first = rows[0]
    if first.get("kv_dtype") == FP8:
        return "\n".join([f"K/V float8_e4m3 (TB/s in FP8 bytes); pool chunks of {first['chunk_mib']} MiB; block size "
                          f"{first['block_size']}; strm us: the streaming kernel over the case's own FP8 planes, "
                          "pread us: the read-only paged kernel over the FP8 chunks the decode reads",
                          harness.format_table(FP8_COLUMNS, rows)])
    lines = [f"pool chunks of {first['chunk_mib']} MiB (0: cudaMalloc); block order {first['order']}; "
             f"block size {first['block_size']}; strm us: the streaming kernel over the case's own planes, "
             "%size: its time over the decode's; pread us: a read-only kernel over the K/V chunks the decode "
             "reads, through the table in its order, %pread: its time over the decode's",
             harness.format_table(COLUMNS, rows)]
    plans = [{"case": r["case"], **r["plan"], "measured_pct": 100 * r["plan"]["floor_us"] / r["us"]} for r in rows]
    lines += ["", f"split plans ({PLAN_LEGEND})", harness.format_table(PLAN_COLUMNS, plans)]
    sweeps = [r for r in rows if r["split_sweep_us"]]
    if sweeps:
        counts = list(sweeps[0]["split_sweep_us"])
        lines += ["", "paged kernel time (us) by forced split count; * = the plan's choice",
                  f"{'case':<9} " + " ".join(f"{n:>8}" for n in counts)]
        for r in sweeps:
            cells = [f"{t:7.1f}" + ("*" if n == r["num_splits"] else " ") for n, t in r["split_sweep_us"].items()]
            lines.append(f"{r['case']:<9} " + " ".join(f"{c:>8}" for c in cells))
    return "\n".join(lines)


def parser():
    ap = harness.parser("pagedrt.bench.decode", __doc__,
                        epilog="Experiments only (the standard figures use none of these): --order, "
                               "--block-size, --memory, --splits.")
    ap.add_argument("--cases", default=",".join(BENCH_DECODE_CASES),
                    help=f"comma-separated, of {', '.join(BENCH_DECODE_CASES)} (skew is not a standard case)")
    ap.add_argument("--repeats", type=int, default=100, help="timed calls per measurement (at least 50)")
    ap.add_argument("--chunk-mib", type=int, default=64, help="the pool's chunk size in MiB (a multiple of 2)")
    ap.add_argument("--splits", default="", help="comma-separated split counts to time as well, to check the plan")
    ap.add_argument("--order", choices=("random", "sequential"), default="random",
                    help="block ids: a seeded random permutation (standard) or consecutive per sequence, to "
                         "separate the cost of scattered blocks from that of reading the table")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block (the standard cases use 16)")
    ap.add_argument("--kv-dtype", choices=("same", FP8), default="same",
                    help="what the planes hold: the case's dtype (standard), or float8 e4m3 (FP8 K/V)")
    ap.add_argument("--memory", choices=("pool", "cudamalloc"), default="pool",
                    help="where the paged and contiguous K/V live: a pagedrt Pool (standard) or cudaMalloc memory")
    return ap


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    sweep = [int(n) for n in args.splits.split(",") if n]
    names = args.cases.split(",")
    unknown = [n for n in names if n not in BENCH_DECODE_CASES]
    if unknown or args.repeats < 50:
        ap.error(f"unknown cases {unknown}" if unknown else "--repeats must be at least 50")
    import cupy as cp
    info = harness.device_info(cp)
    timer = harness.Timer(cp)
    bandwidth = harness.ceilings(timer, max(10, args.repeats // 10))
    print(harness.header(info, bandwidth))
    rows = []
    for name in names:
        if args.kv_dtype == FP8:
            row = run_fp8_case(cp, timer, BENCH_DECODE_CASES[name], args.repeats, bandwidth, info["l2_bytes"],
                               args.chunk_mib << 20, args.block_size)
            rows.append(row)
            cp.get_default_memory_pool().free_all_blocks()
            print(f"{name}: {row['us']:.1f} us, {row['tb_s']:.2f} TB/s in FP8 bytes ({row['pct_stream']:.1f}% of "
                  f"stream), {row['num_splits']} splits" + ("  [fits in L2]" if row["fits_l2"] else ""))
            continue
        row = run_case(cp, timer, BENCH_DECODE_CASES[name], args.repeats, bandwidth, info["l2_bytes"],
                       args.chunk_mib << 20, sweep, args.order, args.memory, args.block_size)
        rows.append(row)
        cp.get_default_memory_pool().free_all_blocks()
        print(f"{name}: {row['us']:.1f} us, {row['tb_s']:.2f} TB/s ({row['pct_copy']:.1f}% of copy, "
              f"{row['pct_stream']:.1f}% of stream), contiguous {row['contiguous_us']:.1f} us "
              f"(paging {row['paging_overhead_pct']:+.1f}%), {row['num_splits']} splits, "
              f"validation +{row['validate_us']:.1f} us" + ("  [fits in L2]" if row["fits_l2"] else ""))
    print()
    harness.publish("decode", args.out, info, rows, table(rows), args.plot, repeats=args.repeats, ceilings=bandwidth)


if __name__ == "__main__":
    main()
