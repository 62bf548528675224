"""Benchmark the pool: what a grow costs, split by driver call, against a contiguous re-allocation.

    PYTHONPATH=. python3 tools/bench_pool.py [--backend cuda|host] [--repeats 20]

Prints, per chunk size (2, 16, 64, 256, 1024 MiB): the median time of one grow
step (one chunk) and of growing 1 GiB in one call, each split into create / map /
set-access, and the copy bandwidth inside a pool of such chunks; then what a
contiguous cache pays to grow by 1 GiB (allocate a larger buffer and copy the
old contents over), and the copy bandwidth of ordinary cudaMalloc memory (bytes
read + written, random data).
"""

import argparse
import statistics
import time
from collections import defaultdict

import numpy as np

from pagedrt import Pool
from timing import event_seconds  # tools/timing.py

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
    """Median seconds (total and per primitive) of a one-chunk grow and of a ``grow_bytes`` grow.

    Both grow an already-used pool: each repeat grows, then the chunks are released again.
    """
    per_grow = grow_bytes // chunk
    steps, bulks = [], []
    with Pool(max(per_grow, repeats + 1) * chunk, chunk, backend=backend) as pool:
        timer = Timed(pool)
        pool.release(pool.grow(1))  # first use of the range and the driver's pools, untimed
        timer.take()
        grown = []
        for _ in range(repeats):
            t = time.perf_counter()
            grown += pool.grow(1)
            steps.append({"total": time.perf_counter() - t, **timer.take()})
        pool.release(grown)
        for _ in range(repeats):
            holes = [c for c in range(per_grow)]
            t = time.perf_counter()
            pool.map(holes)
            bulks.append({"total": time.perf_counter() - t, **timer.take()})
            pool.release(holes)
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
    return 2 * src.nbytes / event_seconds(cupy, lambda: cupy.copyto(dst, src), repeats, warmup=3)


def random_words(n):
    import cupy
    return cupy.random.default_rng(0).integers(0, 2**31, n // 4, dtype=cupy.int32)


def pool_copy_bandwidth(chunk, nbytes, repeats):
    """Copy bandwidth between two ``nbytes`` halves of a pool of ``chunk``-byte chunks."""
    with Pool(2 * nbytes, chunk, backend="cuda") as pool:
        pool.grow(2 * nbytes // chunk)
        a, b = pool.view(0, nbytes // 4, np.int32), pool.view(nbytes, nbytes // 4, np.int32)
        a[...] = random_words(nbytes)
        bandwidth = copy_bandwidth(a, b, repeats)
        del a, b
    return bandwidth


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
    cuda = backend == "cuda"
    n = args.copy_gib * GiB
    print("\none grow step (one chunk) and growing 1 GiB in one call, in a pool already used; "
          f"median of {args.repeats} (us)" + ("; copy bandwidth inside a pool of such chunks" if cuda else ""))
    print(f"{'chunk':>8} | {'step':>9} {'create':>9} {'map':>9} {'access':>9} | "
          f"{'1 GiB':>9} {'create':>9} {'map':>9} {'access':>9}" + (" | copy TB/s" if cuda else ""))
    for chunk_mib in (2, 16, 64, 256, 1024):
        step, bulk = grow_costs(backend, chunk_mib * MiB, args.repeats, GiB)
        row = (f"{chunk_mib:>5} MiB | " + " ".join(us(step[k]) for k in ("total",) + PRIMITIVES)
               + " | " + " ".join(us(bulk[k]) for k in ("total",) + PRIMITIVES))
        if cuda:
            row += f" | {pool_copy_bandwidth(chunk_mib * MiB, n, args.repeats) / 1e12:9.2f}"
        print(row)
    if not cuda:
        return

    print("\ncontiguous cache growing by 1 GiB: cudaMalloc(old + 1 GiB) + copy old + free old; median (us)")
    for old_gib in (1, 4, 16):
        print(f"  from {old_gib:>2} GiB: {us(contiguous_regrow(old_gib * GiB, GiB, max(5, args.repeats // 4)))}")
    import cupy
    src = random_words(n)
    plain = copy_bandwidth(src, cupy.empty_like(src), args.repeats)
    print(f"\ncopy bandwidth of cudaMalloc memory ({args.copy_gib} GiB, read + written): {plain / 1e12:.2f} TB/s")


if __name__ == "__main__":
    main()
