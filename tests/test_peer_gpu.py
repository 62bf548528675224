"""KV between GPUs and processes on the device: peer access on a pool, block transfers between two caches (copy
engines, the peer-mapped copy kernel), a pool's chunks exported to another process, NCCL send/recv. Tests that need
a second GPU skip with that reason on one; those of NCCL skip where ``cupy.cuda.nccl`` cannot be loaded.
The parts that need no GPU: test_peer.py."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pagedrt import Pool, kernels
from pagedrt.errors import (BlockTableError, ChunkStateError, CommunicatorError, HostOutOfMemoryError,
                            LaunchArgumentError, PeerAccessError, PoolClosedError, PoolSizeError,
                            UnsupportedConfigError)
from pagedrt.kernels import nccl
from pagedrt.memory import send_chunks
from test_peer import HELD, filled_cache, planes_on_host, two_caches

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


# --- block transfers between two caches ------------------------------------------------------------------------

PAIRS = np.array([[0, 10], [1, 11], [2, 12], [40, 3], [7, 7], [8, 8], [63, 0]])


def expected_after(src, dst, pairs):
    expected = planes_on_host(dst)
    for s, t in zip(planes_on_host(src), expected):
        t[pairs[:, 1]] = s[pairs[:, 0]]
    return expected


@pytest.mark.parametrize("placement", ["plane", "block"])
@pytest.mark.parametrize("mapped", [False, True])
def test_transfer_on_one_gpu_matches_the_reference(placement, mapped):
    import cupy
    src, dst = two_caches("cuda", placement=placement)
    with src, dst:
        expected = expected_after(src, dst, PAIRS)
        stream = cupy.cuda.Stream(non_blocking=True)
        kernels.transfer_blocks(src.planes, dst.planes, cupy.asarray(PAIRS), stream, mapped=mapped)
        stream.synchronize()
        assert all(np.array_equal(a, b) for a, b in zip(planes_on_host(dst), expected))


@pytest.mark.parametrize("mapped", [False, True])
def test_a_transfer_made_once_runs_pair_set_after_pair_set(mapped):
    import cupy
    src, dst = two_caches("cuda")
    with src, dst:
        transfer = kernels.BlockTransfer(src.planes, dst.planes, mapped=mapped)
        stream = cupy.cuda.Stream(non_blocking=True)
        for pairs in (PAIRS, PAIRS[::-1] + np.array([64, 20]), np.array([[5, 100]])):
            expected = expected_after(src, dst, pairs)
            transfer.run(cupy.asarray(pairs), stream)
            stream.synchronize()
            assert all(np.array_equal(a, b) for a, b in zip(planes_on_host(dst), expected))
        before = planes_on_host(dst)
        with pytest.raises(BlockTableError, match="not mapped"):
            transfer.run([[0, 1], [1, 600]], stream)  # block 600: the second chunk of every plane, never mapped
        stream.synchronize()
        assert all(np.array_equal(a, b) for a, b in zip(planes_on_host(dst), before))


def test_mapped_transfer_needs_two_caches_of_one_layout():
    from pagedrt import PagedKVCache
    src = filled_cache("cuda", 1)
    other = PagedKVCache(2, 2, 64, 16, "float16", max_tokens=4 * 512 * 16, max_seqs=2, chunk_bytes=2 * MiB,
                         backend="cuda")  # planes of another size: another distance from each source plane
    with src, other:
        other.append(other.add_sequence(), HELD * 16)
        before = planes_on_host(other)
        with pytest.raises(LaunchArgumentError, match="one distance from the source planes"):
            kernels.transfer_blocks(src.planes, other.planes, [[0, 1]], mapped=True)
        assert all(np.array_equal(a, b) for a, b in zip(planes_on_host(other), before))
        kernels.transfer_blocks(src.planes, other.planes, [[0, 1]])  # the copy engines do not mind
        assert all(np.array_equal(a[1], b[0]) for a, b in zip(planes_on_host(other), planes_on_host(src)))


def test_transfer_from_one_gpu_to_another():
    needs_two_gpus()
    import cupy
    with cupy.cuda.Device(0):
        src = filled_cache("cuda", 1)
    with cupy.cuda.Device(1):
        dst = filled_cache("cuda", 0)
    with src, dst:
        expected = expected_after(src, dst, PAIRS)
        with cupy.cuda.Device(0):
            kernels.transfer_blocks(src.planes, dst.planes, PAIRS)  # the copy engines: no peer mapping needed
            cupy.cuda.Device(0).synchronize()
        assert all(np.array_equal(a, b) for a, b in zip(planes_on_host(dst), expected))
        back = PAIRS[:, ::-1] + np.array([0, 64])  # back into fresh places of the source, over the peer mapping
        with pytest.raises(PeerAccessError, match="grant_access"):
            kernels.transfer_blocks(dst.planes, src.planes, back, mapped=True)
        if not peers(0, 1):
            pytest.skip("device 0 has no peer access to device 1: the copy engines' transfer and the refusal were "
                        "checked")
        dst.pool.grant_access(0)
        expected = expected_after(dst, src, back)
        with cupy.cuda.Device(0):
            kernels.transfer_blocks(dst.planes, src.planes, back, mapped=True)
            cupy.cuda.Device(0).synchronize()
        assert all(np.array_equal(a, b) for a, b in zip(planes_on_host(src), expected))


# --- export to another process -----------------------------------------------------------------------------------

def test_another_process_reads_and_writes_exported_chunks():
    import cupy
    from peer_child import pattern
    root = Path(__file__).resolve().parents[1]
    with Pool(64 * MiB, 2 * MiB, backend="cuda") as pool:
        pool.grow(3)
        n = 2 * 2 * MiB // 4  # chunks 1 and 2
        pool.view(2 * MiB, n, np.uint32)[...] = cupy.asarray(pattern(n, 3, 1))
        pool.synchronize()
        fds = pool.export_chunks([2, 1])  # by chunk index: 1, then 2
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with parent:
            with child:
                proc = subprocess.Popen([sys.executable, str(root / "tests" / "peer_child.py"), str(child.fileno())],
                                        cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                                        pass_fds=(child.fileno(),))
            send_chunks(parent, fds, pool.chunk_bytes)
            for fd in fds:
                os.close(fd)
            assert proc.wait(timeout=300) == 0
            assert parent.recv(64) == b"wrote"
        assert cupy.array_equal(pool.view(2 * MiB, n, np.uint32), cupy.asarray(pattern(n, 7, 5)))


def test_export_refuses_chunks_it_cannot_give_and_makes_nothing():
    with Pool(64 * MiB, 2 * MiB, backend="cuda") as pool:
        pool.grow(2)
        pool.release([1])
        with pytest.raises(ChunkStateError, match="cannot export chunk 1: it is already released"):
            pool.export_chunks([0, 1])
        try:
            pool.map([4], "host")
        except (PoolSizeError, UnsupportedConfigError, HostOutOfMemoryError) as exc:
            pytest.skip(f"a released chunk was refused; no host-tier chunk could be made here to try: {exc}")
        with pytest.raises(UnsupportedConfigError, match="host-tier chunks are not exportable"):
            pool.export_chunks([4])


# --- NCCL ------------------------------------------------------------------------------------------------------

@pytest.fixture
def nccl_module():
    from pagedrt.errors import BackendUnavailableError
    try:
        return nccl._nccl()
    except BackendUnavailableError as exc:
        pytest.skip(f"needs NCCL: {exc}")


def test_one_rank_sends_blocks_to_itself(nccl_module):
    import cupy
    comm = nccl_module.NcclCommunicator(1, nccl_module.get_unique_id(), 0)
    src, dst = two_caches("cuda")
    with src, dst:
        expected = expected_after(src, dst, PAIRS)
        stream = cupy.cuda.Stream(non_blocking=True)
        nccl.exchange_blocks(comm, PAIRS, 0, send_planes=src.planes, recv_planes=dst.planes, ranks=1, stream=stream)
        stream.synchronize()
        assert all(np.array_equal(a, b) for a, b in zip(planes_on_host(dst), expected))
        before = planes_on_host(dst)
        for peer, ranks, words in ((0, 2, "has 1 ranks but 2 were expected"), (1, None, "peer 1 is no rank")):
            with pytest.raises(CommunicatorError, match=words):
                nccl.exchange_blocks(comm, PAIRS, peer, send_planes=src.planes, recv_planes=dst.planes, ranks=ranks)
        with pytest.raises(LaunchArgumentError, match="side by side"):
            nccl.exchange_blocks(comm, PAIRS, 0, send_planes=[p[::2] for p in src.planes])
        assert all(np.array_equal(a, b) for a, b in zip(planes_on_host(dst), before))


def test_an_exchange_made_once_runs_pair_set_after_pair_set(nccl_module):
    import cupy
    comm = nccl_module.NcclCommunicator(1, nccl_module.get_unique_id(), 0)
    src, dst = two_caches("cuda")
    with src, dst:
        exchange = nccl.BlockExchange(comm, 0, send_planes=src.planes, recv_planes=dst.planes, ranks=1)
        stream = cupy.cuda.Stream(non_blocking=True)
        for pairs in (PAIRS, np.array([[5, 100], [6, 101]])):
            expected = expected_after(src, dst, pairs)
            exchange.run(pairs, stream)
            stream.synchronize()
            assert all(np.array_equal(a, b) for a, b in zip(planes_on_host(dst), expected))


def test_two_ranks_in_one_process_send_blocks_between_gpus(nccl_module):
    needs_two_gpus()
    import cupy
    comms = nccl_module.NcclCommunicator.initAll([0, 1])
    with cupy.cuda.Device(0):
        src = filled_cache("cuda", 1)
    with cupy.cuda.Device(1):
        dst = filled_cache("cuda", 0)
    with src, dst:
        expected = expected_after(src, dst, PAIRS)
        with pytest.raises(CommunicatorError, match="on device 0 but this rank of the communicator is on device 1"):
            nccl.exchange_blocks(comms[1], PAIRS, 0, send_planes=src.planes, ranks=2)
        nccl_module.groupStart()  # one thread drives both ranks: their calls in one group
        nccl.exchange_blocks(comms[0], PAIRS, 1, send_planes=src.planes, ranks=2)
        nccl.exchange_blocks(comms[1], PAIRS, 0, recv_planes=dst.planes, ranks=2)
        nccl_module.groupEnd()
        for device in (0, 1):
            cupy.cuda.Device(device).synchronize()
        assert all(np.array_equal(a, b) for a, b in zip(planes_on_host(dst), expected))
