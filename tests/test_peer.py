"""KV between GPUs and processes, the parts that run without a GPU: peer access refused on the host backend,
block transfers between two caches' planes against their NumPy reference and their checks, export refused on the
host backend, the NCCL wrapper's checks. On a device: test_peer_gpu.py."""

import os
import socket
from types import SimpleNamespace

import numpy as np
import pytest

from helpers import to_host
from pagedrt import PagedKVCache, Pool, kernels
from pagedrt.errors import (BackendUnavailableError, BlockTableError, ChunkStateError, CommunicatorError, CudaError,
                            LaunchArgumentError, PoolClosedError, PoolSizeError, UnsupportedConfigError)
from pagedrt.kernels import nccl
from pagedrt.memory import ImportedChunks, receive_chunks, send_chunks

MiB = 1 << 20
LAYERS, HEADS, DIM, BS = 2, 2, 64, 16  # blocks of 4 KiB per plane
HELD = 128  # blocks each test cache's sequence holds: the first 2 MiB chunk's, block-major; part of it, plane-major


def filled_cache(backend, seed, tokens=HELD * BS, placement="plane"):
    """A cache with one sequence of ``tokens`` tokens (its blocks mapped, in the first of the 2 MiB chunks), its
    blocks' K/V seeded random numbers (zeros for seed 0)."""
    cache = PagedKVCache(LAYERS, HEADS, DIM, BS, "float16", max_tokens=2 * 512 * BS, max_seqs=2, max_seq_len=tokens,
                         chunk_bytes=2 * MiB, placement=placement, backend=backend)
    cache.append(cache.add_sequence(), tokens)
    for plane in cache.planes:
        values = np.random.default_rng(seed).standard_normal((tokens // BS,) + plane.shape[1:]) * seed
        plane[:tokens // BS] = cache.xp.asarray(values.astype(np.float16))
    return cache


def two_caches(backend, placement="plane"):
    """Two caches of one layout (a prefill cache and a decode cache): the source's K/V random, the destination's
    zeros."""
    return filled_cache(backend, 1, placement=placement), filled_cache(backend, 0, placement=placement)


def planes_on_host(cache):
    """The held blocks of every plane, on the host (on a GPU, reading the rest of a plane would reach a hole)."""
    return [to_host(p[:HELD]) for p in cache.planes]


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


# --- block transfers between two caches' planes ---------------------------------------------------------------

@pytest.mark.parametrize("placement", ["plane", "block"])
def test_transfer_copies_every_plane_and_only_the_pairs_destinations(placement):
    src, dst = two_caches("host", placement=placement)
    with src, dst:
        pairs = np.array([[0, 10], [1, 11], [2, 12], [40, 3], [7, 7], [8, 8], [63, 0]])
        before_src, expected = planes_on_host(src), planes_on_host(dst)
        for s, t in zip(before_src, expected):
            t[pairs[:, 1]] = s[pairs[:, 0]]
        kernels.transfer_blocks(src.planes, dst.planes, pairs)
        assert all(np.array_equal(a, b) for a, b in zip(planes_on_host(dst), expected))
        assert all(np.array_equal(a, b) for a, b in zip(planes_on_host(src), before_src))  # the source unchanged


def test_transfer_runs_merge_same_ids_across_two_sets_of_planes():
    pairs = np.array([[0, 0], [1, 1], [2, 2], [5, 9], [6, 10], [3, 4]])
    assert kernels.copy._runs(pairs, same_planes=False).tolist() == [[0, 0, 3], [5, 9, 2], [3, 4, 1]]
    assert kernels.copy._runs(pairs).tolist()[:3] == [[0, 0, 1], [1, 1, 1], [2, 2, 1]]  # in one set: not merged


def test_transfer_checks_change_nothing():
    src, dst = two_caches("host")
    with src, dst:
        before = planes_on_host(dst)
        other = np.zeros((1024, HEADS, BS, 2 * DIM), np.float16)  # blocks twice the size
        refused = (
            (dst.planes, src.planes[:-1], [[0, 1]], LaunchArgumentError, "4 source planes but 3 destination"),
            ([], [], [[0, 1]], LaunchArgumentError, "src_planes is empty"),
            (src.planes, [other] * len(dst.planes), [[0, 1]], LaunchArgumentError, "destination blocks 8192"),
            (src.planes, dst.planes, [[0, 1], [2, 1]], LaunchArgumentError, "same destination twice"),
            (src.planes, src.planes, [[0, 1]], LaunchArgumentError, r"src_planes\[0\] and dst_planes\[0\] share"),
            (src.planes, dst.planes, [[0.5, 1]], LaunchArgumentError, "integers"),
            (src.planes, dst.planes, [[0, 2 ** 20]], BlockTableError, "outside the destination planes'"),
            (src.planes, dst.planes, [[-1, 0]], BlockTableError, "outside the source planes'"),
            (src.planes, dst.planes, [[0, 1], [600, 2]], BlockTableError, r"pairs\[1\] = \(600, 2\) names source "
                                                                          "block 600, a block whose memory is not"),
        )
        for s, t, pairs, error, words in refused:
            with pytest.raises(error, match=words):
                kernels.transfer_blocks(s, t, pairs)
            assert all(np.array_equal(a, b) for a, b in zip(planes_on_host(dst), before))
        dst.close()
        with pytest.raises(PoolClosedError):
            kernels.transfer_blocks(src.planes, dst.planes, [[0, 1]])


def test_a_transfer_made_once_runs_pair_after_pair_set():
    src, dst = two_caches("host")
    with src, dst:
        transfer = kernels.BlockTransfer(src.planes, dst.planes)
        expected = planes_on_host(dst)
        for pairs in ([[0, 10], [1, 11]], np.array([[5, 0], [9, 9], [100, 127]]), np.zeros((0, 2), np.int64)):
            pairs = np.asarray(pairs, np.int64).reshape(-1, 2)
            for s, t in zip(planes_on_host(src), expected):
                t[pairs[:, 1]] = s[pairs[:, 0]]
            transfer.run(pairs)
            assert all(np.array_equal(a, b) for a, b in zip(planes_on_host(dst), expected))
        with pytest.raises(LaunchArgumentError, match="4 source planes but 3 destination"):
            kernels.BlockTransfer(src.planes, dst.planes[:-1])


def test_a_made_transfer_checks_what_is_mapped_at_each_run():
    """The planes are checked once, the mapping on every run: chunks mapped, released and pools closed after the
    transfer was made count."""
    src = filled_cache("host", 1)
    dst = PagedKVCache(LAYERS, HEADS, DIM, BS, "float16", max_tokens=2 * 512 * BS, max_seqs=8, max_seq_len=HELD * BS,
                       chunk_bytes=2 * MiB, backend="host")
    dst.append(dst.add_sequence(), HELD * BS)
    with src, dst:
        transfer = kernels.BlockTransfer(src.planes, dst.planes)
        far = [[0, 600]]  # destination block 600 lies in every plane's second 2 MiB chunk, not mapped yet
        before = planes_on_host(dst)
        with pytest.raises(BlockTableError, match=r"pairs\[0\] = \(0, 600\) names destination block 600, a block "
                                                  "whose memory is not mapped"):
            transfer.run(far)
        assert all(np.array_equal(a, b) for a, b in zip(planes_on_host(dst), before))
        grown = [dst.add_sequence() for _ in range(4)]
        dst.append(grown, HELD * BS)  # 640 blocks held: the second chunk of every plane is mapped now
        transfer.run(far)
        assert all(np.array_equal(t[600], s[0]) for s, t in zip(src.planes, dst.planes))
        dst.free(grown)
        dst.trim()
        with pytest.raises(BlockTableError, match="not mapped"):
            transfer.run(far)
        transfer.run([[1, 2]])
        dst.close()
        with pytest.raises(PoolClosedError):
            transfer.run([[0, 1]])


# --- export to another process -----------------------------------------------------------------------------------

def open_fds(target=""):
    """This process's open descriptors (those whose target starts with ``target``)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(target):
                found.add(fd)
        except OSError:  # the listing's own descriptor, gone
            pass
    return found


def test_the_host_backend_exports_nothing():
    with Pool(8 * MiB, 2 * MiB, backend="host") as pool:
        pool.grow(2)
        before = open_fds()
        with pytest.raises(ChunkStateError, match="cannot export chunk 3: it is never mapped"):
            pool.export_chunks([0, 3])
        with pytest.raises(UnsupportedConfigError, match="host backend cannot export"):
            pool.export_chunks([0, 1])
        assert open_fds() == before


def test_received_descriptors_are_closed_whatever_the_import_does():
    memfds = [os.memfd_create("pagedrt-test") for _ in range(2)]
    for fd in memfds:
        os.ftruncate(fd, 2 * MiB)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        before = open_fds("/memfd:pagedrt-test")  # the driver may open descriptors of its own meanwhile
        assert len(before) == 2
        send_chunks(a, memfds, 2 * MiB)
        # no GPU here: no backend; on a GPU, memfds are no exported chunks and the driver refuses them
        with pytest.raises((BackendUnavailableError, CudaError)):
            receive_chunks(b)
        assert open_fds("/memfd:pagedrt-test") == before
        socket.send_fds(a, [b"something else 1"], memfds[:1])
        with pytest.raises(ChunkStateError, match="not one send_chunks sent"):
            receive_chunks(b)
        assert open_fds("/memfd:pagedrt-test") == before
    for fd in memfds:
        os.close(fd)


def test_imported_chunks_check_their_arguments_first():
    r, w = os.pipe()
    os.close(w)
    for fds, size, error, words in (([], 2 * MiB, PoolSizeError, "0 descriptors"),
                                    ([r] * 254, 2 * MiB, PoolSizeError, "at most 253"),
                                    ([r, -1], 2 * MiB, ChunkStateError, "-1 is not a file descriptor"),
                                    ([r, w], 2 * MiB, ChunkStateError, f"descriptor {w} is not open"),
                                    ([r], 0, PoolSizeError, "positive int")):
        with pytest.raises(error, match=words):
            ImportedChunks(fds, size)
    os.close(r)


# --- NCCL ------------------------------------------------------------------------------------------------------

def fake_communicator(ranks, device=0):
    """What exchange_blocks asks a communicator before NCCL is loaded: its size, rank and device."""
    return SimpleNamespace(size=lambda: ranks, rank_id=lambda: 0, device_id=lambda: device)


def nccl_loads():
    try:
        nccl._nccl()
    except BackendUnavailableError:
        return False
    return True


def test_a_communicator_of_the_wrong_size_is_refused_before_nccl_is_needed():
    comm = fake_communicator(2)
    planes = [np.zeros((4, 2, 16, 64), np.float16)]
    for peer, ranks, words in ((1, 4, "has 2 ranks but 4 were expected"), (2, None, "peer 2 is no rank"),
                               (-1, 2, "peer -1 is no rank"), ("1", None, "peer '1' is no rank"),
                               (True, None, "peer True is no rank")):
        with pytest.raises(CommunicatorError, match=words):
            nccl.exchange_blocks(comm, [[0, 1]], peer, send_planes=planes, ranks=ranks)


def test_without_nccl_the_exchange_says_so():
    if nccl_loads():
        pytest.skip("NCCL loads here: test_peer_gpu.py exchanges blocks through it")
    with pytest.raises(BackendUnavailableError, match="NCCL"):
        nccl.exchange_blocks(fake_communicator(2), [[0, 1]], 1, send_planes=[np.zeros((4, 2, 16, 64), np.float16)],
                             ranks=2)
