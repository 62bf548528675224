"""Experiment: does memory in a VMM pool stream as fast as cudaMalloc memory?

    PYTHONPATH=. python3 tools/exp_pool_bandwidth.py [--gib 4]

Copies ``--gib`` GiB of random data (bytes read + written, CUDA events, median of
20) between two buffers, and reads it with a streaming-sum kernel (CuPy's
reduction), for: cudaMalloc buffers; pool buffers for several chunk sizes; and a
pool whose range is reserved with 2 MiB versus 1 GiB alignment.
"""

import argparse

import numpy as np

from pagedrt import Pool, driver
from pagedrt.bench.harness import event_seconds
from pagedrt.memory import select_backend

MiB, GiB = 1 << 20, 1 << 30


def measure(a, b):
    import cupy
    a[...] = cupy.random.default_rng(0).integers(0, 2**31, a.size, dtype=cupy.int32)
    copy = 2 * a.nbytes / event_seconds(cupy, lambda: cupy.copyto(b, a), 20, warmup=3)
    read = a.nbytes / event_seconds(cupy, lambda: a.sum(dtype=cupy.int64), 20, warmup=3)
    return copy / 1e12, read / 1e12


def aligned_backend(alignment):
    """The CUDA backend, reserving its range at a multiple of ``alignment`` instead of the page size."""
    backend = select_backend("cuda")

    def reserve(size):
        backend.device.activate()
        return int(driver.call(backend.device.driver, "cuMemAddressReserve", size, alignment, 0, 0))

    backend.reserve = reserve
    return backend


def pool_buffers(nbytes, chunk, alignment=None):
    pool = Pool(2 * nbytes, chunk, backend=aligned_backend(alignment) if alignment else "cuda")
    pool.grow(2 * nbytes // chunk)
    return pool, pool.view(0, nbytes // 4, np.int32), pool.view(nbytes, nbytes // 4, np.int32)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=int, default=4)
    n = ap.parse_args().gib * GiB
    import cupy
    print(f"{'memory':<36} {'copy TB/s':>9} {'read TB/s':>9}")
    a, b = cupy.empty(n // 4, cupy.int32), cupy.empty(n // 4, cupy.int32)
    copy, read = measure(a, b)
    print(f"{'cudaMalloc':<36} {copy:>9.2f} {read:>9.2f}")
    del a, b
    for chunk, alignment in ((2 * MiB, None), (64 * MiB, None), (256 * MiB, None), (2 * GiB, None),
                             (2 * MiB, GiB), (256 * MiB, GiB), (2 * GiB, 2 * GiB)):
        pool, a, b = pool_buffers(n, chunk, alignment)
        copy, read = measure(a, b)
        label = f"pool, {chunk // MiB} MiB chunks, base {pool.base:#x}"
        print(f"{label:<36} {copy:>9.2f} {read:>9.2f}  (aligned {alignment or 2 * MiB:#x})")
        del a, b
        pool.close()


if __name__ == "__main__":
    main()
