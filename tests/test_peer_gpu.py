"""KV between GPUs and processes on the device: peer access on a pool, block transfers between two caches (copy
engines, the peer-mapped copy kernel), a pool's chunks exported to another process, NCCL send/recv. Tests that need
a second GPU skip with that reason on one; those of NCCL skip where ``cupy.cuda.nccl`` cannot be loaded.
The parts that need no GPU: test_peer.py."""

import numpy as np
import pytest

from pagedrt import Pool
from pagedrt.errors import PeerAccessError, PoolClosedError

pytestmark = pytest.mark.gpu
MiB = 1 << 20


def device_count():
    import cupy
    return cupy.cuda.runtime.getDeviceCount()


def needs_two_gpus():
    if device_count() < 2:
        pytest.skip(f"needs two GPUs: this machine has {device_count()}")


def peers(a, b):
    """Whether device a can access device b's memory."""
    import cupy
    return bool(cupy.cuda.runtime.deviceCanAccessPeer(a, b))


# --- peer access on a pool -------------------------------------------------------------------------------------

def test_granting_the_pools_own_device_changes_nothing_and_bad_devices_are_refused():
    with Pool(64 * MiB, 2 * MiB, backend="cuda") as pool:
        pool.grow(2)
        own = pool._backend.device.ordinal
        assert pool.access_devices == (own,)
        before = [r.as_dict() for r in pool.mappings()]
        assert all(r.devices == (own,) for r in pool.mappings())
        pool.grant_access(own)
        assert pool.access_devices == (own,)
        count = device_count()
        for device in (count, -1, 1.0, True, "1"):
            with pytest.raises(PeerAccessError, match="no such device"):
                pool.grant_access(device)
        assert [r.as_dict() for r in pool.mappings()] == before and pool.access_devices == (own,)
    with pytest.raises(PoolClosedError):
        pool.grant_access(own)


def test_a_granted_device_reads_and_writes_chunks_mapped_before_and_after():
    needs_two_gpus()
    import cupy
    with cupy.cuda.Device(0):
        pool = Pool(64 * MiB, 2 * MiB, backend="cuda")
    with pool:
        if not peers(1, 0):
            with pytest.raises(PeerAccessError, match="device 1 cannot access the memory of device 0"):
                pool.grant_access(1)
            assert pool.access_devices == (0,)
            pytest.skip("device 1 has no peer access to device 0: the refusal was checked")
        pool.grow(1)
        pool.grant_access(1)
        pool.grow(1)  # mapped after the grant
        assert pool.access_devices == (0, 1) and all(r.devices == (0, 1) for r in pool.mappings())
        n = 2 * 2 * MiB // 4
        with cupy.cuda.Device(0):
            data = cupy.arange(n, dtype=cupy.uint32)
            pool.view(0, n, np.uint32)[...] = data
            pool.synchronize()
        with cupy.cuda.Device(1):
            mem = cupy.cuda.UnownedMemory(pool.base, 4 * n, pool, 1)  # the pool's addresses, as device 1 sees them
            seen = cupy.ndarray((n,), cupy.uint32, cupy.cuda.MemoryPointer(mem, 0))
            doubled = seen * 2  # a kernel on device 1 reads both chunks over the peer mapping
            seen[...] = doubled  # and writes them
            cupy.cuda.Device(1).synchronize()
        with cupy.cuda.Device(0):
            assert cupy.array_equal(pool.view(0, n, np.uint32), data * 2)
