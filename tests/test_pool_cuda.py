"""What only the CUDA backend can show: device memory accounting, out-of-memory rollback, leaks."""

import numpy as np
import pytest

from pagedrt import Pool
from pagedrt.errors import DeviceOutOfMemoryError, MappingLimitError

pytestmark = [pytest.mark.gpu, pytest.mark.alone]  # every test here reads device-wide free memory
MiB, GiB = 1 << 20, 1 << 30


def free_bytes(pool):
    return pool._backend.device.mem_info()[0]


def test_device_memory_follows_grow_release_close():
    pool = Pool(64 * GiB, 256 * MiB, backend="cuda")
    start = free_bytes(pool)
    pool.grow(8)
    grown = 8 * 256 * MiB
    # other allocations are not happening; allow one page of driver bookkeeping slack
    assert abs((start - free_bytes(pool)) - grown) <= 2 * MiB * 8
    pool.release([1, 2, 3])
    assert abs((start - free_bytes(pool)) - 5 * 256 * MiB) <= 2 * MiB * 8
    pool.close()
    assert abs(free_bytes_after_close() - start) <= 2 * MiB * 8


def free_bytes_after_close():
    from pagedrt.driver import current_device
    return current_device().mem_info()[0]


def test_out_of_memory_mid_grow_rolls_back():
    device_total = free_bytes_after_close()
    chunk = 4 * GiB
    chunks = (2 * device_total) // chunk + 1
    with Pool(chunks * chunk, chunk, backend="cuda") as pool:
        start = free_bytes(pool)
        first = pool.grow(1)
        pattern = np.arange(1024, dtype=np.int64) * 7919
        pool.view(0, 1024, np.int64)[...] = pool.xp.asarray(pattern)
        before = [r.as_dict() for r in pool.mappings()]
        with pytest.raises(DeviceOutOfMemoryError, match="CUDA_ERROR_OUT_OF_MEMORY"):
            pool.grow(chunks - 1)  # more than the device has: fails part-way through
        assert [r.as_dict() for r in pool.mappings()] == before
        assert abs((start - free_bytes(pool)) - chunk) <= 64 * MiB  # only the first chunk is held
        assert np.array_equal(pool.view(0, 1024, np.int64).get(), pattern)
        # growing one by one until the device refuses keeps every chunk that did map
        grown = list(first)
        with pytest.raises(DeviceOutOfMemoryError):
            while True:
                grown += pool.grow(1)
        assert [r.chunk for r in pool.mappings()] == grown
        assert len(grown) * chunk > 0.8 * device_total
    assert abs(free_bytes_after_close() - device_total) <= 64 * MiB


def test_1000_grow_release_cycles_leak_nothing():
    with Pool(1 * GiB, 2 * MiB, backend="cuda") as pool:
        pool.grow(1)
        start = free_bytes(pool)
        for i in range(1000):
            new = pool.grow(1) if i % 2 == 0 or pool.frontier >= pool.num_chunks else pool.map([1])
            pool.release(new)
        assert free_bytes(pool) == start
        assert [r.state for r in pool.mappings()].count("mapped") == 1


def test_cupy_views_read_and_write():
    import cupy
    with Pool(256 * MiB, 32 * MiB, backend="cuda") as pool:
        pool.grow(3)
        n = 3 * 32 * MiB // 2
        halves = pool.view(0, n, np.float16)
        data = cupy.random.default_rng(11).standard_normal(n, dtype=cupy.float32).astype(cupy.float16)
        halves[...] = data
        doubled = pool.view(0, n, np.float16) * 2  # a CuPy kernel reads the pool
        assert cupy.array_equal(doubled, data * 2)
        cupy.copyto(pool.view(32 * MiB, 8, np.float16), cupy.full(8, 3.5, cupy.float16))
        assert (halves[16 * MiB:16 * MiB + 8].get() == 3.5).all()


def test_absurd_reservation_is_named_and_leaks_nothing():
    start = free_bytes_after_close()
    for _ in range(3):
        with pytest.raises(MappingLimitError, match="cuMemAddressReserve failed with CUDA_ERROR_"):
            Pool(1 << 62, 2 * MiB, backend="cuda")
    assert abs(free_bytes_after_close() - start) <= 2 * MiB
    with Pool(64 * MiB, 2 * MiB, backend="cuda") as pool:
        pool.grow(1)


def test_a_closed_pools_addresses_are_not_handed_to_other_memory_while_it_lives():
    """A closed pool keeps its range reserved until it is gone, so a new allocation never lands where a
    stale view of it points (find_pool would then mistake the new memory for the closed pool)."""
    import cupy
    from pagedrt.memory import find_pool
    pool = Pool(256 * MiB, 32 * MiB, backend="cuda")
    pool.grow(8)
    view = pool.view(0, 1 << 20, np.uint8)
    lo, hi = pool.base, pool.base + pool.max_bytes
    pool.close()
    fresh = [cupy.empty(n, np.uint8) for n in (1 << 20, 32 << 20, 64 << 20) for _ in range(4)]
    fresh.append(Pool(256 * MiB, 32 * MiB, backend="cuda"))
    addresses = [a.data.ptr for a in fresh[:-1]] + [fresh[-1].base]
    assert not [a for a in addresses if lo <= a < hi]
    assert find_pool(view.data.ptr) is pool and pool.closed
    fresh[-1].close()
