"""Benchmark the pool: what a grow costs, split by driver call, against a contiguous re-allocation.

    PYTHONPATH=. python3 tools/bench_pool.py [--backend cuda|host] [--repeats 20]

Prints, per chunk size (2, 16, 64, 256 MiB): the median time of one grow step
(one chunk) and of growing 1 GiB in one call, each split into create / map /
set-access; then what a contiguous cache pays to grow by 1 GiB (allocate a
larger buffer and copy the old contents over), and the copy bandwidth inside the
pool against ordinary cudaMalloc memory (bytes read + written).
"""

import argparse
import statistics
import time
from collections import defaultdict

import numpy as np

from pagedrt import Pool

MiB, GiB = 1 << 20, 1 << 30
PRIMITIVES = ("create", "map", "set_access")


class Timed:
    """Wraps the pool's backend primitives and adds up the time spent in each."""

    def __init__(self, pool):
        self.totals = defaultdict(float)
        backend = pool._backend
        for name in PRIMITIVES:
            setattr(backend, name, self._wrap(name, getattr(backend, name)))

    def _wrap(self, name, fn):
        def timed(*args):
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.totals[name] += time.perf_counter() - t
        return timed

    def take(self):
        out = dict(self.totals)
        self.totals.clear()
        return out


def grow_costs(backend, chunk, repeats, grow_bytes):
    """Median seconds (total and per primitive) of a one-chunk grow and a ``grow_bytes`` grow."""
    per_grow = grow_bytes // chunk
    steps, bulks = [], []
    for _ in range(repeats):
        with Pool((per_grow + 1) * chunk, chunk, backend=backend) as pool:
            timer = Timed(pool)
            t = time.perf_counter()
            pool.grow(1)
            steps.append({"total": time.perf_counter() - t, **timer.take()})
            pool.release(0)
            t = time.perf_counter()
            pool.grow(per_grow)
            bulks.append({"total": time.perf_counter() - t, **timer.take()})
    med = lambda rows: {k: statistics.median(r.get(k, 0.0) for r in rows) for k in ("total",) + PRIMITIVES}
    return med(steps), med(bulks)


def contiguous_regrow(old_bytes, grow_bytes, repeats):
    """Median seconds for cudaMalloc(old + grow) plus copying the old contents over, then freeing the old."""
    import cupy
    rt = cupy.cuda.runtime
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


def copy_bandwidth(src, dst, repeats):
    """Bytes read + written per second for dst[...] = src, timed with CUDA events."""
    import cupy
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    for _ in range(3):
        cupy.copyto(dst, src)
    times = []
    for _ in range(repeats):
        start.record()
        cupy.copyto(dst, src)
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    return 2 * src.nbytes / statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="auto", choices=("auto", "cuda", "host"))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--copy-gib", type=int, default=4, help="bytes copied per direction in the bandwidth test")
    args = ap.parse_args()

    with Pool(GiB, 2 * MiB, backend=args.backend) as probe:
        backend, reason = probe.backend, probe.backend_reason
    print(f"backend: {reason}")
    if backend == "cuda":
        from pagedrt.driver import probe as cuda_probe
        info = cuda_probe()
        print(f"device: {info['device']}, driver {info['driver_version']}, page {info['page_bytes'] // MiB} MiB")

    us = lambda s: f"{s * 1e6:9.1f}"
    print("\none grow step (one chunk) and growing 1 GiB in one call; median of", args.repeats, "(us)")
    print(f"{'chunk':>8} | {'step':>9} {'create':>9} {'map':>9} {'access':>9} | "
          f"{'1 GiB':>9} {'create':>9} {'map':>9} {'access':>9}")
    for chunk_mib in (2, 16, 64, 256):
        step, bulk = grow_costs(backend, chunk_mib * MiB, args.repeats, GiB)
        print(f"{chunk_mib:>5} MiB | " + " ".join(us(step[k]) for k in ("total",) + PRIMITIVES)
              + " | " + " ".join(us(bulk[k]) for k in ("total",) + PRIMITIVES))

    if backend != "cuda":
        return
    import cupy
    print("\ncontiguous cache growing by 1 GiB: cudaMalloc(old + 1 GiB) + copy old + free old; median (us)")
    for old_gib in (1, 4, 16):
        print(f"  from {old_gib:>2} GiB: {us(contiguous_regrow(old_gib * GiB, GiB, max(5, args.repeats // 4)))}")

    n = args.copy_gib * GiB
    with Pool(2 * n, 256 * MiB, backend="cuda") as pool:
        pool.grow(2 * n // pool.chunk_bytes)
        a, b = pool.view(0, n // 2, np.uint16), pool.view(n, n // 2, np.uint16)
        a[...] = 1
        in_pool = copy_bandwidth(a, b, args.repeats)
        del a, b
    src = cupy.ones(n // 2, cupy.uint16)
    dst = cupy.empty_like(src)
    plain = copy_bandwidth(src, dst, args.repeats)
    print(f"\ncopy bandwidth ({args.copy_gib} GiB, read + written): pool {in_pool / 1e12:.2f} TB/s, "
          f"cudaMalloc {plain / 1e12:.2f} TB/s")


if __name__ == "__main__":
    main()
