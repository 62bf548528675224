"""The pool: what a grow costs, split by driver call, against a contiguous re-allocation.

    python3 -m pagedrt.bench.pool [--backend auto|cuda|host] [--repeats 20] [--copy-gib 4]

Prints, per chunk size (2, 16, 64, 256, 1024 MiB): the median time of one grow
step (one chunk) and of growing 1 GiB in one call, each split into create / map /
set-access (the backend's primitives, timed by wrapping the backend the pool is
given), and the copy bandwidth inside a pool of such chunks; then what a
contiguous cache pays to grow by 1 GiB (allocate a larger buffer and copy the old
contents over), the copy bandwidth of ordinary cudaMalloc memory, and that bandwidth
again while another thread maps and releases 2 MiB chunks of a second pool (what
growth ahead of demand, on its worker thread, may cost kernels running meanwhile). Copies move
random data, bytes read + written, timed with the benchmarks' GPU timer, two ways:
a kernel that loads and stores every element (CuPy's ``copyto``, which reads
memory as an attention kernel does) and the driver's device-to-device memcpy.
"""

import statistics
import threading
import time
from collections import defaultdict

import numpy as np

from .. import Pool
from ..memory import select_backend
from . import harness

MiB, GiB = 1 << 20, 1 << 30
PRIMITIVES = ("create", "map", "set_access")
CHUNK_MIBS = (2, 16, 64, 256, 1024)


class TimedBackend:
    """Wraps a backend's primitives and adds up the host time spent in each."""

    def __init__(self, name):
        self.backend = select_backend(name)
        self.totals = defaultdict(float)
        for primitive in PRIMITIVES:
            setattr(self.backend, primitive, self.timed(primitive, getattr(self.backend, primitive)))

    def timed(self, name, fn):
        def call(*args):
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.totals[name] += time.perf_counter() - t
        return call

    def take(self):
        out = dict(self.totals)
        self.totals.clear()
        return out


def grow_costs(backend, chunk, repeats, grow_bytes):
    """Median seconds (total and per primitive) of a one-chunk grow and of a ``grow_bytes`` grow.

    Both grow an already-used pool: each repeat grows, then the chunks are released again.
    """
    per_grow = grow_bytes // chunk
    steps, bulks = [], []
    timed = TimedBackend(backend)
    with Pool(max(per_grow, repeats + 1) * chunk, chunk, backend=timed.backend) as pool:
        pool.release(pool.grow(1))  # first use of the range and the driver's pools, untimed
        timed.take()
        grown = []
        for _ in range(repeats):
            t = time.perf_counter()
            grown += pool.grow(1)
            steps.append({"total": time.perf_counter() - t, **timed.take()})
        pool.release(grown)
        for _ in range(repeats):
            holes = list(range(per_grow))
            t = time.perf_counter()
            pool.map(holes)
            bulks.append({"total": time.perf_counter() - t, **timed.take()})
            pool.release(holes)
    return medians(steps), medians(bulks)


def medians(rows):
    return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in ("total",) + PRIMITIVES}


def contiguous_regrow(cp, old_bytes, grow_bytes, repeats):
    """Median seconds for cudaMalloc(old + grow) plus copying the old contents over, then freeing the old."""
    rt = cp.cuda.runtime
    times = []
    for _ in range(repeats):
        old = rt.malloc(old_bytes)
        rt.memset(old, 1, old_bytes)
        rt.deviceSynchronize()
        t = time.perf_counter()
        new = rt.malloc(old_bytes + grow_bytes)
        rt.memcpy(new, old, old_bytes, rt.memcpyDeviceToDevice)
        rt.free(old)
        rt.deviceSynchronize()
        times.append(time.perf_counter() - t)
        rt.free(new)
    return statistics.median(times)


def copy_bandwidth(timer, src, dst, repeats):
    """Bytes read + written per second copying ``src`` (filled with random words first) to ``dst``:
    {"kernel": through a copy kernel (``cupy.copyto``), "memcpy": through the driver's memcpy}."""
    cp = timer.cp
    src[...] = cp.random.default_rng(0).integers(0, 2**31, src.size, dtype=np.int32)
    kernel_us = timer.gpu_us(lambda: cp.copyto(dst, src), repeats)
    memcpy_us = harness.copy_us(timer, dst.data.ptr, src.data.ptr, src.nbytes, repeats)
    return {"kernel": 2 * src.nbytes / (kernel_us * 1e-6), "memcpy": 2 * src.nbytes / (memcpy_us * 1e-6)}


def pool_copy_bandwidth(timer, chunk, nbytes, repeats):
    """Copy bandwidths (as :func:`copy_bandwidth`) between two ``nbytes`` halves of a pool of ``chunk``-byte
    chunks."""
    with Pool(2 * nbytes, chunk, backend="cuda") as pool:
        pool.grow(2 * nbytes // chunk)
        a, b = pool.view(0, nbytes // 4, np.int32), pool.view(nbytes, nbytes // 4, np.int32)
        bandwidth = copy_bandwidth(timer, a, b, repeats)
        del a, b
    return bandwidth


def copy_while_mapping(timer, src, dst, repeats, chunk=2 * MiB):
    """:func:`copy_bandwidth` while a thread maps (and, when full, releases) chunks of another pool one at a
    time; also the chunks that thread mapped per second."""
    stop, mapped = threading.Event(), [0]

    def grow():
        with Pool(256 * chunk, chunk, backend="cuda") as pool:
            while not stop.is_set():
                if pool.mapped_bytes == pool.max_bytes:
                    pool.release([r.chunk for r in pool.mappings() if r.state == "mapped"])
                pool.map([next(c for c in range(pool.num_chunks) if not pool.is_mapped(c))])
                mapped[0] += 1

    worker = threading.Thread(target=grow)
    t = time.perf_counter()
    worker.start()
    try:
        bandwidth = copy_bandwidth(timer, src, dst, repeats)
    finally:
        stop.set()
        worker.join()
    return bandwidth, mapped[0] / (time.perf_counter() - t)


def parser():
    ap = harness.parser("pagedrt.bench.pool", __doc__, backend=True)
    ap.add_argument("--repeats", type=int, default=20, help="timed grows and copies per measurement")
    ap.add_argument("--copy-gib", type=int, default=4, help="bytes copied per direction in the bandwidth test")
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    with Pool(GiB, 2 * MiB, backend=args.backend) as probe:
        backend, reason = probe.backend, probe.backend_reason
    cuda = backend == "cuda"
    if cuda:
        import cupy as cp
        info, timer = harness.device_info(cp), harness.Timer(cp)
        print(harness.header(info))
    else:
        info, timer = {"backend": reason}, None
    print(f"backend: {reason}")

    n = args.copy_gib * GiB
    rows = []
    for chunk_mib in CHUNK_MIBS:
        step, bulk = grow_costs(backend, chunk_mib * MiB, args.repeats, GiB)
        row = {"chunk_mib": chunk_mib, **{f"step_{k}_us": 1e6 * v for k, v in step.items()},
               **{f"gib_{k}_us": 1e6 * v for k, v in bulk.items()}}
        if cuda:
            copies = pool_copy_bandwidth(timer, chunk_mib * MiB, n, args.repeats)
            row["copy_tb_s"], row["memcpy_tb_s"] = copies["kernel"] / 1e12, copies["memcpy"] / 1e12
        rows.append(row)
    columns = [harness.Column("chunk_mib", "chunk", "{} MiB", 8)]
    for prefix, label in (("step", "step"), ("gib", "1 GiB")):
        columns += [harness.Column(f"{prefix}_total_us", label, "{:.1f}", 9)]
        columns += [harness.Column(f"{prefix}_{k}_us", k.replace("set_", ""), "{:.1f}", 9) for k in PRIMITIVES]
    if cuda:
        columns += [harness.Column("copy_tb_s", "copy TB/s", "{:.2f}", 9),
                    harness.Column("memcpy_tb_s", "memcpy TB/s", "{:.2f}", 11)]
    lines = [f"one grow step (one chunk) and growing 1 GiB in one call, in a pool already used; median of "
             f"{args.repeats} (us)" + ("; copy bandwidth inside a pool of such chunks" if cuda else ""),
             harness.format_table(columns, rows)]
    extra = {}
    if cuda:
        regrow = {old_gib: 1e6 * contiguous_regrow(cp, old_gib * GiB, GiB, max(5, args.repeats // 4))
                  for old_gib in (1, 4, 16)}
        src = cp.empty(n // 4, np.int32)
        plain = copy_bandwidth(timer, src, cp.empty_like(src), args.repeats)
        lines += ["", "contiguous cache growing by 1 GiB: cudaMalloc(old + 1 GiB) + copy old + free old; median (us)"]
        lines += [f"  from {old:>2} GiB: {us:9.1f}" for old, us in regrow.items()]
        lines += ["", f"copy bandwidth of cudaMalloc memory ({args.copy_gib} GiB, read + written): "
                      f"{plain['kernel'] / 1e12:.2f} TB/s through a copy kernel, "
                      f"{plain['memcpy'] / 1e12:.2f} TB/s through memcpy"]
        busy, rate = copy_while_mapping(timer, src, cp.empty_like(src), args.repeats)
        lines += [f"the same while another thread maps 2 MiB chunks ({rate:.0f} per second): "
                  f"{busy['kernel'] / 1e12:.2f} TB/s through a copy kernel, {busy['memcpy'] / 1e12:.2f} TB/s "
                  f"through memcpy"]
        extra = {"contiguous_regrow_us": regrow, "cudamalloc_copy_tb_s": plain["kernel"] / 1e12,
                 "cudamalloc_memcpy_tb_s": plain["memcpy"] / 1e12, "mapping_copy_tb_s": busy["kernel"] / 1e12,
                 "mapping_memcpy_tb_s": busy["memcpy"] / 1e12, "mapping_chunks_per_s": rate}
    harness.publish("pool", args.out, info, rows, "\n".join(lines), args.plot, repeats=args.repeats, **extra)


if __name__ == "__main__":
    main()
