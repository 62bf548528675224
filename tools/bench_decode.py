"""Decode attention on the standard workloads: time, bandwidth against measured ceilings, paging cost.

    python3 tools/bench_decode.py [--cases b8,big,...] [--repeats 100] [--out results.json]
                                  [--chunk-mib 64] [--splits 1,2,4,...]

The cases are the standard decode workloads, unchanged: fp16 (and `big` again in
bf16), 32 query heads, 8 KV heads, head_dim 128, block size 16, one query token
per sequence, block ids a seeded random permutation of the pool. K and V are two
plane views of a CUDA Pool. Per case it prints the median time (CUDA events,
warm-up first), effective bandwidth = (K and V bytes of the valid tokens + q + out)
/ time, that bandwidth against two ceilings measured in the same run (a
device-to-device copy, bytes read + written, and a read-only streaming kernel,
both over 4 GiB), the contiguous twin's time and the paging overhead (paged/twin
- 1), the split count the plan chose, and what validation costs. The twin's K/V
live in the same kind of memory as the paged planes (a pool), so the overhead is
that of the addressing alone. It also times the streaming kernel reading the
case's own K and V planes once (``strm us``, one launch over the same bytes: the
ceiling at this size, with its launch ramp and tail) and gives the decode time as
a share of it (``%size``).

Timing: before the timed calls a spin kernel keeps the GPU busy long enough for
the host to queue them all, so each call's events measure GPU time, not Python
launch overhead. validate=True reads a result back to the host before launching,
so it cannot be queued: it is timed call by call as it runs, and the validation
cost (validated - unvalidated) includes that round trip.

``--chunk-mib`` sets the pool's chunk size (the hardware layer: how much memory
one physical allocation, and so one run of contiguous pages, covers); ``--splits``
also times the paged kernel with each given split count, to check the plan.
Experiments only (the standard figures use neither): ``--order sequential`` gives
each sequence consecutive block ids, to separate the cost of scattered blocks from
that of reading the table; ``--block-size`` changes the block size (the standard
is 16); ``--memory cudamalloc`` puts the paged planes in plain
cudaMalloc memory instead of the pool (the twin's memory).
"""

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedrt import Pool  # noqa: E402
from pagedrt import source  # noqa: E402
from pagedrt.kernels import contiguous_decode, decode, paged_decode, split_plan  # noqa: E402
from pagedrt.kernels.configs import config  # noqa: E402
from timing import event_seconds  # noqa: E402  (tools/timing.py)

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
CEILING_BYTES = 4 << 30
CASES = {  # name: (dtype, batch, lengths)
    "long-1": ("float16", 1, [32768]),
    "b8": ("float16", 8, [8192] * 8),
    "b32": ("float16", 32, [4096] * 32),
    "b64": ("float16", 64, [2048] * 64),
    "b128": ("float16", 128, [1024] * 128),
    "b256": ("float16", 256, [512] * 256),
    "big": ("float16", 64, [8192] * 64),
    "var": ("float16", 64, np.random.default_rng(0).integers(1, 8193, 64).tolist()),
    "big-bf16": ("bfloat16", 64, [8192] * 64),
}


def np_dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def random_bits(cp, shape, dtype):
    """Random normal values of dtype as uint16 bits (bfloat16: a float32's upper half)."""
    x = cp.random.standard_normal(shape, dtype=np.float32)
    if dtype == "bfloat16":
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    return x.astype(np.float16).view(np.uint16)


class Timer:
    """Median GPU time of calls, measured with events around each, behind a spin kernel."""

    def __init__(self, cp):
        self.cp = cp
        self.spin = source.function("bench.cu", "pagedrt::spin")
        self.spin((1,), (1,), (np.int64(1000),))
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        self.spin((1,), (1,), (np.int64(10**7),))
        end.record()
        end.synchronize()
        self.cycles_per_s = 1e7 / (cp.cuda.get_elapsed_time(start, end) * 1e-3)

    def gpu_us(self, fn, repeats, warmup=5):
        cp = self.cp
        for _ in range(warmup):
            fn()
        cp.cuda.Device().synchronize()
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        host_s = time.perf_counter() - t  # host time to queue `repeats` calls
        cp.cuda.Device().synchronize()
        events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(repeats)]
        spin_s = 2 * host_s + 1e-3
        self.spin((1,), (1,), (np.int64(spin_s * self.cycles_per_s),))
        t = time.perf_counter()
        for start, end in events:
            start.record()
            fn()
            end.record()
        queued_s = time.perf_counter() - t
        events[-1][1].synchronize()
        times = [cp.cuda.get_elapsed_time(s, e) * 1e3 for s, e in events]
        if queued_s > spin_s:
            print(f"  warning: queueing took {queued_s * 1e3:.1f} ms > spin {spin_s * 1e3:.1f} ms; "
                  "the first calls may include launch gaps")
        return statistics.median(times)

    def wall_us(self, fn, repeats, warmup=5):
        """Median event time of calls run one at a time (for calls that synchronise inside)."""
        return 1e6 * event_seconds(self.cp, fn, repeats, warmup)


def stream_us(cp, timer, ptr, nbytes, repeats):
    """Median time of the read-only streaming kernel over nbytes (a multiple of 16) at device pointer ptr."""
    read = source.function("bench.cu", "pagedrt::stream_read")
    sms = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["multiProcessorCount"]
    sink = cp.zeros(1, np.uint32)
    return timer.gpu_us(lambda: read((sms * 8,), (256,), (np.uint64(ptr), np.int64(nbytes // 16),
                                                          np.uint32(0x9E3779B9), sink)), repeats)


def ceilings(cp, timer, repeats):
    """(copy, stream) bandwidth in bytes/s over CEILING_BYTES: copy counts bytes read + written."""
    src = cp.empty(CEILING_BYTES, np.uint8)
    dst = cp.empty(CEILING_BYTES, np.uint8)
    src.fill(1)
    stream = cp.cuda.get_current_stream().ptr
    copy_us = timer.gpu_us(lambda: cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, CEILING_BYTES,
                                                                 cp.cuda.runtime.memcpyDeviceToDevice, stream),
                           repeats)
    read_us = stream_us(cp, timer, src.data.ptr, CEILING_BYTES, repeats)
    return 2 * CEILING_BYTES / (copy_us * 1e-6), CEILING_BYTES / (read_us * 1e-6)


def twin_bytes(shape):
    return int(np.prod(shape)) * 2  # uint16 bits


def total_twin(shape, chunk):
    return -(-2 * twin_bytes(shape) // chunk) * chunk


def run_case(cp, timer, name, repeats, copy_bw, stream_bw, l2_bytes, chunk, sweep, order, memory, block):
    dtype, batch, lens = CASES[name]
    dt = np_dtype(dtype)
    lens = np.asarray(lens, np.int32)
    used = -(-lens // block)
    num_blocks, width = int(used.sum()), int(used.max())
    block_bytes = KV_HEADS * block * HEAD_DIM * dt.itemsize
    plane_bytes = num_blocks * block_bytes
    total = -(-2 * plane_bytes // chunk) * chunk
    rng = np.random.default_rng(1)
    perm = (rng.permutation(num_blocks) if order == "random" else np.arange(num_blocks)).astype(np.int32)
    table = np.full((batch, width), -1, np.int32)
    starts = np.concatenate([[0], np.cumsum(used)[:-1]])
    for i, (s, n) in enumerate(zip(starts, used)):
        table[i, :n] = perm[s:s + n]
    shape = (num_blocks, KV_HEADS, block, HEAD_DIM)
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(Pool(total, chunk, backend="cuda"))
        if memory == "pool":
            pool.grow(total // chunk)
            bits = [pool.view(i * plane_bytes, shape, np.uint16) for i in range(2)]
        else:  # the experiment's control: the same planes in cudaMalloc memory
            bits = [cp.empty(shape, np.uint16) for _ in range(2)]
        for plane in bits:
            for lo in range(0, num_blocks, 4096):
                plane[lo:lo + 4096] = random_bits(cp, plane[lo:lo + 4096].shape, dtype)
        k, v = (b.view(dt) for b in bits)
        q = random_bits(cp, (batch, Q_HEADS, HEAD_DIM), dtype).view(dt)
        out, twin_out = cp.empty_like(q), cp.empty_like(q)
        d_table, d_lens = cp.asarray(table), cp.asarray(lens)
        gather = cp.asarray(np.maximum(table, 0))
        twin_shape = (batch, width) + shape[1:]  # [batch, width, kv, block, dim]
        if memory == "pool":  # the twin lives in pool memory too: only the addressing differs
            twin_pool = stack.enter_context(Pool(total_twin(twin_shape, chunk), chunk, backend="cuda"))
            twin_pool.grow(twin_pool.num_chunks)
            twin_bits = [twin_pool.view(i * twin_bytes(twin_shape), twin_shape, np.uint16) for i in range(2)]
        else:
            twin_bits = [cp.empty(twin_shape, np.uint16) for _ in range(2)]
        for src, dst in zip(bits, twin_bits):
            dst[...] = src[gather]
        k_twin, v_twin = (b.view(dt) for b in twin_bits)
        hints = dict(max_seq_len=int(lens.max()), mean_seq_len=float(lens.mean()))  # host-side, as an engine has
        plan = split_plan(q, k, d_table, **hints)
        cfg = config(dt, HEAD_DIM, block, Q_HEADS // KV_HEADS)
        geo = decode.geometry(cfg, plan.short)

        paged = lambda: paged_decode(q, k, v, d_table, d_lens, out=out, validate=False, **hints)  # noqa: E731
        checked = lambda: paged_decode(q, k, v, d_table, d_lens, out=out, **hints)  # noqa: E731
        twin = lambda: contiguous_decode(q, k_twin, v_twin, d_lens, out=twin_out, validate=False,  # noqa: E731
                                         **hints)
        paged_us = timer.gpu_us(paged, repeats)
        # the streaming kernel over the same planes, one launch (the pool's planes are adjacent)
        size_us = stream_us(cp, timer, bits[0].data.ptr, 2 * plane_bytes, repeats) if memory == "pool" else None
        twin_us = timer.gpu_us(twin, repeats)
        checked_us = timer.wall_us(checked, repeats)
        unchecked_us = timer.wall_us(paged, repeats)
        split_us = {n: timer.gpu_us(lambda: paged_decode(q, k, v, d_table, d_lens, out=out, validate=False,
                                                           num_splits=n), repeats) for n in sweep}
        a, b = (cp.asnumpy(x.view(np.uint16)).view(dt).astype(np.float64) for x in (out, twin_out))
        agree = float(np.abs(a - b).max()) if np.isfinite(a).all() else float("nan")
    kv_bytes = int(lens.sum()) * KV_HEADS * HEAD_DIM * dt.itemsize * 2
    moved = kv_bytes + 2 * batch * Q_HEADS * HEAD_DIM * dt.itemsize
    bw = moved / (paged_us * 1e-6)
    return {
        "case": name, "dtype": dtype, "batch": batch, "tokens": int(lens.sum()), "kv_mib": kv_bytes / 2**20,
        "us": paged_us, "tb_s": bw / 1e12, "pct_copy": 100 * bw / copy_bw, "pct_stream": 100 * bw / stream_bw,
        "size_stream_us": size_us, "pct_size_stream": 100 * size_us / paged_us if size_us else None,
        "twin_us": twin_us, "paging_overhead_pct": 100 * (paged_us / twin_us - 1), "num_splits": plan.num_splits,
        "lanes": geo.lanes, "stages": geo.stages, "tensor_cores": geo.mma, "threads": geo.threads,
        "segment_tokens": plan.segment_tokens, "validate_us": checked_us - unchecked_us,
        "validated_wall_us": checked_us, "unvalidated_wall_us": unchecked_us,
        "paged_vs_twin_max_abs_diff": agree, "fits_l2": kv_bytes <= l2_bytes,
        "chunk_mib": chunk >> 20 if memory == "pool" else 0, "order": order, "block_size": block,
        "split_sweep_us": split_us,
    }


def table(rows, copy_bw, stream_bw):
    head = (f"{'case':<9} {'dtype':<8} {'us':>8} {'TB/s':>6} {'%copy':>6} {'%strm':>6} {'twin us':>8} "
            f"{'paging':>7} {'splits':>6} {'lanes':>7} {'valid us':>8} {'strm us':>8} {'%size':>6}  note")
    lines = [f"ceilings: copy {copy_bw / 1e12:.2f} TB/s (read + written), stream {stream_bw / 1e12:.2f} TB/s; "
             f"pool chunks of {rows[0]['chunk_mib']} MiB; block order {rows[0]['order']}; "
             f"geometry per case: lanes x stages, or mmaS (tensor cores, S stages; /N: N threads a block, if not 128); "
             f"strm us: the streaming kernel over the case's own planes, %size: its time over the decode's; "
             f"block size {rows[0]['block_size']}"
             if rows else "",
             head, "-" * len(head)]
    for r in rows:
        note = "fits in L2: measures the cache" if r["fits_l2"] else ""
        if not r["paged_vs_twin_max_abs_diff"] < 1e-2:
            note += f" paged and twin disagree ({r['paged_vs_twin_max_abs_diff']})"
        geo = f"mma{r['stages']}" if r["tensor_cores"] else f"{r['lanes']}x{r['stages']}"
        geo += f"/{r['threads']}" if r["threads"] != decode.THREADS else ""
        lines.append(f"{r['case']:<9} {r['dtype']:<8} {r['us']:8.1f} {r['tb_s']:6.2f} {r['pct_copy']:6.1f} "
                     f"{r['pct_stream']:6.1f} {r['twin_us']:8.1f} {r['paging_overhead_pct']:+6.1f}% "
                     f"{r['num_splits']:6d} {geo:>7} {r['validate_us']:8.1f} "
                     + (f"{r['size_stream_us']:8.1f} {r['pct_size_stream']:6.1f}" if r["size_stream_us"]
                        else f"{'-':>8} {'-':>6}") + f"  {note}")
    sweeps = [r for r in rows if r["split_sweep_us"]]
    if sweeps:
        counts = list(sweeps[0]["split_sweep_us"])
        lines += ["", "paged kernel time (us) by forced split count; * = the plan's choice",
                  f"{'case':<9} " + " ".join(f"{n:>8}" for n in counts)]
        for r in sweeps:
            cells = [f"{t:7.1f}" + ("*" if n == r["num_splits"] else " ") for n, t in r["split_sweep_us"].items()]
            lines.append(f"{r['case']:<9} " + " ".join(f"{c:>8}" for c in cells))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--repeats", type=int, default=100, help="timed calls per measurement (>= 50)")
    ap.add_argument("--out", help="also write the results and the table here as JSON")
    ap.add_argument("--chunk-mib", type=int, default=64, help="the pool's chunk size (a multiple of 2)")
    ap.add_argument("--splits", default="", help="comma-separated split counts to time as well")
    ap.add_argument("--order", choices=("random", "sequential"), default="random",
                    help="block ids: a random permutation (standard) or consecutive per sequence")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per block (the standard cases use 16)")
    ap.add_argument("--memory", choices=("pool", "cudamalloc"), default="pool",
                    help="where the paged planes live: a pagedrt Pool (standard) or plain cudaMalloc memory")
    args = ap.parse_args()
    sweep = [int(n) for n in args.splits.split(",") if n]
    names = args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown or args.repeats < 50:
        ap.error(f"unknown cases {unknown}" if unknown else "--repeats must be at least 50")
    import cupy as cp
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    timer = Timer(cp)
    copy_bw, stream_bw = ceilings(cp, timer, max(10, args.repeats // 10))
    cp.get_default_memory_pool().free_all_blocks()
    print(f"{props['name'].decode()}: {props['multiProcessorCount']} SMs, L2 {props['l2CacheSize'] >> 20} MiB; "
          f"copy ceiling {copy_bw / 1e12:.2f} TB/s, stream ceiling {stream_bw / 1e12:.2f} TB/s")
    rows = []
    for name in names:
        row = run_case(cp, timer, name, args.repeats, copy_bw, stream_bw, props["l2CacheSize"],
                       args.chunk_mib << 20, sweep, args.order, args.memory, args.block_size)
        rows.append(row)
        cp.get_default_memory_pool().free_all_blocks()
        print(f"{name}: {row['us']:.1f} us, {row['tb_s']:.2f} TB/s ({row['pct_copy']:.1f}% of copy, "
              f"{row['pct_stream']:.1f}% of stream), twin {row['twin_us']:.1f} us "
              f"(paging {row['paging_overhead_pct']:+.1f}%), {row['num_splits']} splits, "
              f"validation +{row['validate_us']:.1f} us" + ("  [fits in L2]" if row["fits_l2"] else ""))
    text = table(rows, copy_bw, stream_bw)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "device": props["name"].decode(), "copy_bytes_per_s": copy_bw, "stream_bytes_per_s": stream_bw,
            "repeats": args.repeats, "cases": rows, "table": text}, indent=2))


if __name__ == "__main__":
    main()
