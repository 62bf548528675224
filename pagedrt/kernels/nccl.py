"""Blocks sent and received between ranks with NCCL: K/V between GPUs that are no peers, or in other processes.

:class:`BlockExchange` sends blocks of one set of planes to a rank and receives blocks into
another set from it (the planes checked once, the pairs on every run; :func:`exchange_blocks`
is one such exchange, made and run at once), with ``cupy.cuda.nccl`` (``NcclCommunicator.send``/``recv`` inside
``groupStart``/``groupEnd``). NCCL matches the i-th send to a rank with that rank's i-th
receive, of the same size; so both ranks pass the same pairs, and the messages are cut from
them alike: one per plane and run of consecutive pairs, in order.
"""

from typing import Any, List, NamedTuple, Optional, Sequence

import numpy as np

from .args import array_kind, check
from .copy import _distinct_destinations, _host_pairs, _one_device, _refuse_unmapped, _runs, _side
from .validate import Spans
from ..errors import BackendUnavailableError, CommunicatorError
from ..spec import Array

ANY = np.iinfo(np.int64).max  # the id limit of a side this rank does not touch: the other rank checks it


class BlockExchange:
    """Blocks of ``send_planes`` sent to rank ``peer`` and blocks of ``recv_planes`` received from it, for every
    (src, dst) row of the pairs of each :meth:`run`, in one NCCL group. The communicator and the planes are checked
    when it is made, the pairs on every run: an engine that moves blocks between the same two caches again and again
    makes one and runs it per batch of blocks, where :func:`exchange_blocks` checks every plane on every call.

    Both ranks pass the same pairs, and the receiver as many planes of the same block size as the sender: the
    messages, one per plane and run of consecutive pairs, must match. A run nests inside the caller's own
    ``groupStart``/``groupEnd``: one thread driving several communicators (``NcclCommunicator.initAll``) groups
    all their calls so.

    Parameters
    ----------
    comm : cupy.cuda.nccl.NcclCommunicator
        This rank's.
    peer : int
        A rank of ``comm``; this rank itself with a one-rank communicator (both planes given: the sends and
        receives meet in the one group).
    send_planes, recv_planes : sequence of cupy.ndarray [num_blocks, kv_heads, block_size, head_dim], optional
        On the communicator's device, blocks side by side (plane-major caches), so that a run is one message on
        either side; at least one side given.
    ranks : int, optional
        The number of ranks the caller means ``comm`` to have.

    Raises
    ------
    CommunicatorError
        A communicator of another size than ``ranks``, a peer it has no rank for, or planes on another device.
    BackendUnavailableError
        ``cupy.cuda.nccl`` cannot be loaded.
    LaunchArgumentError
        Planes that are not CuPy arrays, are not side by side or do not match, or no planes at all.
    PoolClosedError
        Planes in a closed pool.
    """

    def __init__(self, comm: Any, peer: int, *, send_planes: Optional[Sequence[Array]] = None,
                 recv_planes: Optional[Sequence[Array]] = None, ranks: Optional[int] = None):
        size = int(comm.size())
        if ranks is not None and size != ranks:
            raise CommunicatorError(f"the communicator has {size} ranks but {ranks} were expected: make it with "
                                    f"{ranks} ranks")
        if not isinstance(peer, (int, np.integer)) or isinstance(peer, bool) or not 0 <= peer < size:
            raise CommunicatorError(f"peer {peer!r:.40} is no rank of this communicator of {size} ranks "
                                    f"(0..{size - 1}): it needs more ranks, or another peer")
        self._nccl = _nccl()
        sides = [(name, list(planes)) for name, planes in (("send_planes", send_planes), ("recv_planes", recv_planes))
                 if planes is not None]
        check(any(planes for _, planes in sides), "no planes: pass send_planes, recv_planes or both")
        self.device = int(comm.device_id())
        found = {}
        for name, planes in sides:
            names = [f"{name}[{i}]" for i in range(len(planes))]
            check(len(planes) > 0, lambda: f"{name} is empty: pass at least one plane, or None")
            check(array_kind(**dict(zip(names, planes))) is not np,
                  lambda: f"{name} are NumPy arrays: NCCL moves device memory, so pass CuPy planes")
            block_bytes, num_blocks = _side(names, planes)
            check(planes[0].strides[0] == block_bytes,
                  lambda: f"{name} have a block stride of {planes[0].strides[0]} bytes for blocks of {block_bytes}: "
                          "NCCL sends need planes whose blocks lie side by side (a plane-major cache)")
            on = _one_device(names, planes)
            if on != self.device:
                raise CommunicatorError(f"{name} are on device {on} but this rank of the communicator is on device "
                                        f"{self.device}: pass the communicator of the planes' device")
            found[name] = _Side([p.data.ptr for p in planes], block_bytes, num_blocks,
                                Spans(planes, block_bytes, block_bytes))
        if len(found) == 2:
            send, recv = found["send_planes"], found["recv_planes"]
            check(len(send.pointers) == len(recv.pointers) and send.block_bytes == recv.block_bytes,
                  lambda: f"{len(send.pointers)} send planes of {send.block_bytes}-byte blocks but "
                          f"{len(recv.pointers)} receive planes of {recv.block_bytes}-byte blocks: a rank that sends "
                          "to itself receives what it sends")
        self.comm, self.peer = comm, int(peer)
        self._send, self._recv = found.get("send_planes"), found.get("recv_planes")

    def run(self, pairs: Any, stream: Optional[Any] = None) -> None:
        """Send and receive the blocks of ``pairs``; checked first, nothing sent on refusal.

        Parameters
        ----------
        pairs : ints [n, 2]
            (src, dst) block ids, the same on both ranks, each destination once.
        stream : cupy.cuda.Stream, optional
            Of the communicator's device; its current stream when None.

        Raises
        ------
        BlockTableError
            Ids outside the planes, or blocks not mapped now.
        LaunchArgumentError
            Malformed pairs, or a destination named twice.
        PoolClosedError
            Planes in a pool closed since.
        """
        for side in (self._send, self._recv):
            if side is not None:
                side.spans.check_open()
        send_limit, recv_limit = (side.num_blocks if side is not None else ANY for side in (self._send, self._recv))
        pairs = _host_pairs(pairs, send_limit, recv_limit, "the send planes'", "the receive planes'")
        if self._recv is not None:
            _distinct_destinations(pairs)
        for side, column, what in ((self._send, 0, "source block"), (self._recv, 1, "destination block")):
            if side is not None:
                _refuse_unmapped(side.spans, pairs, pairs[:, column:column + 1], what)
        if not len(pairs):
            return
        import cupy
        with cupy.cuda.Device(self.device):
            handle = (stream if stream is not None else cupy.cuda.get_current_stream()).ptr
        nccl, comm, peer = self._nccl, self.comm, self.peer
        nccl.groupStart()
        try:
            for src, dst, count in _runs(pairs, same_planes=False).tolist():
                if self._send is not None:
                    size = self._send.block_bytes
                    for base in self._send.pointers:
                        comm.send(base + src * size, count * size, nccl.NCCL_UINT8, peer, handle)
                if self._recv is not None:
                    size = self._recv.block_bytes
                    for base in self._recv.pointers:
                        comm.recv(base + dst * size, count * size, nccl.NCCL_UINT8, peer, handle)
        finally:
            nccl.groupEnd()


class _Side(NamedTuple):
    """One side of an exchange, checked: its planes' first bytes, block bytes, blocks, and where they lie."""
    pointers: List[int]
    block_bytes: int
    num_blocks: int
    spans: Spans


def exchange_blocks(comm: Any, pairs: Any, peer: int, *, send_planes: Optional[Sequence[Array]] = None,
                    recv_planes: Optional[Sequence[Array]] = None, ranks: Optional[int] = None,
                    stream: Optional[Any] = None) -> None:
    """One exchange of blocks with rank ``peer``: ``BlockExchange(comm, peer, send_planes=send_planes,
    recv_planes=recv_planes, ranks=ranks).run(pairs, stream)``, every check made first (see
    :class:`BlockExchange`). To move blocks between the same planes again and again, make the
    :class:`BlockExchange` once."""
    BlockExchange(comm, peer, send_planes=send_planes, recv_planes=recv_planes, ranks=ranks).run(pairs, stream)


def _nccl() -> Any:
    """``cupy.cuda.nccl``, or BackendUnavailableError saying why it cannot be loaded."""
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        raise BackendUnavailableError(f"NCCL cannot be loaded through CuPy ({exc}): install CuPy and NCCL") from None
    if not getattr(nccl, "available", True):
        raise BackendUnavailableError("CuPy found no NCCL library: install NCCL where CuPy loads it "
                                      "(python -m cupyx.tools.install_library --library nccl)")
    return nccl
