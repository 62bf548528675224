"""KV between GPUs and processes, the parts that run without a GPU: peer access refused on the host backend,
block transfers between two caches' planes against their NumPy reference and their checks, export refused on the
host backend, the NCCL wrapper's checks. On a device: test_peer_gpu.py."""

import pytest

from pagedrt import Pool
from pagedrt.errors import UnsupportedConfigError

MiB = 1 << 20


# --- peer access on a pool -------------------------------------------------------------------------------------

def test_the_host_backend_refuses_peer_access_and_changes_nothing():
    with Pool(8 * MiB, 2 * MiB, backend="host") as pool:
        pool.grow(2)
        before = [r.as_dict() for r in pool.mappings()]
        for device in (0, 1, -1):
            with pytest.raises(UnsupportedConfigError, match=f"device {device} .*host backend"):
                pool.grant_access(device)
        assert [r.as_dict() for r in pool.mappings()] == before
        assert pool.access_devices == () and all(r.devices == () for r in pool.mappings())
        pool.grow(1)  # mapping goes on as before
        assert [r.chunk for r in pool.mappings()] == [0, 1, 2]
