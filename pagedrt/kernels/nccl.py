"""Blocks sent and received between ranks with NCCL: K/V between GPUs that are no peers, or in other processes.

:func:`exchange_blocks` sends blocks of one set of planes to a rank and receives blocks into
another set from it, with ``cupy.cuda.nccl`` (``NcclCommunicator.send``/``recv`` inside
``groupStart``/``groupEnd``). NCCL matches the i-th send to a rank with that rank's i-th
receive, of the same size; so both ranks pass the same pairs, and the messages are cut from
them alike: one per plane and run of consecutive pairs, in order.
"""

import numpy as np

from .args import array_kind, check
from .copy import _distinct_destinations, _host_pairs, _one_device, _refuse_unmapped, _runs, _side
from ..errors import BackendUnavailableError, CommunicatorError

ANY = np.iinfo(np.int64).max  # the id limit of a side this rank does not touch: the other rank checks it


def exchange_blocks(comm, pairs, peer, *, send_planes=None, recv_planes=None, ranks=None, stream=None):
    """Send block src of every plane of ``send_planes`` to rank ``peer``, and receive block dst of every plane of
    ``recv_planes`` from it, for every (src, dst) row of ``pairs``, in one NCCL group.

    comm: a ``cupy.cuda.nccl.NcclCommunicator`` of this rank; ``ranks``, if given, the number of ranks the caller
    means it to have. peer: a rank of ``comm``; this rank itself with a one-rank communicator (both planes given:
    the sends and receives meet in the one group). Both ranks pass the same ``pairs`` (ints [n, 2], each
    destination once), and the receiver as many planes of the same block size as the sender: the messages, one per
    plane and run of consecutive pairs, must match. Planes are CuPy arrays on the communicator's device whose
    blocks lie side by side (plane-major caches), so that a run is one message on either side. The messages are
    queued on ``stream`` (a CuPy stream of that device; its current one if None). A call nests inside the caller's
    own ``groupStart``/``groupEnd``: one thread driving several communicators (``NcclCommunicator.initAll``)
    groups all their calls so.

    Checked first, nothing sent on refusal: ``CommunicatorError`` for a communicator of another size than
    ``ranks``, a peer it has no rank for, or planes on another device than its own; ``BackendUnavailableError``
    when ``cupy.cuda.nccl`` cannot be loaded; ``LaunchArgumentError`` for planes that are not CuPy arrays, are not
    side by side or do not match, or for no planes at all; ``BlockTableError`` for ids outside the planes or
    blocks not mapped now.
    """
    size = int(comm.size())
    if ranks is not None and size != ranks:
        raise CommunicatorError(f"the communicator has {size} ranks but {ranks} were expected: make it with "
                                f"{ranks} ranks")
    if not isinstance(peer, (int, np.integer)) or isinstance(peer, bool) or not 0 <= peer < size:
        raise CommunicatorError(f"peer {peer!r:.40} is no rank of this communicator of {size} ranks "
                                f"(0..{size - 1}): it needs more ranks, or another peer")
    nccl = _nccl()
    sides = [(name, list(planes)) for name, planes in (("send_planes", send_planes), ("recv_planes", recv_planes))
             if planes is not None]
    check(any(planes for _, planes in sides), "no planes: pass send_planes, recv_planes or both")
    device = int(comm.device_id())
    found = {}
    for name, planes in sides:
        names = [f"{name}[{i}]" for i in range(len(planes))]
        check(len(planes) > 0, lambda: f"{name} is empty: pass at least one plane, or None")
        check(array_kind(**dict(zip(names, planes))) is not np,
              lambda: f"{name} are NumPy arrays: NCCL moves device memory, so pass CuPy planes")
        block_bytes, num_blocks = _side(names, planes)
        check(planes[0].strides[0] == block_bytes,
              lambda: f"{name} have a block stride of {planes[0].strides[0]} bytes for blocks of {block_bytes}: NCCL "
                      "sends need planes whose blocks lie side by side (a plane-major cache)")
        on = _one_device(names, planes)
        if on != device:
            raise CommunicatorError(f"{name} are on device {on} but this rank of the communicator is on device "
                                    f"{device}: pass the communicator of the planes' device")
        found[name] = (planes, block_bytes, num_blocks)
    if len(found) == 2:
        (send, sent, _), (recv, received, _) = found["send_planes"], found["recv_planes"]
        check(len(send) == len(recv) and sent == received,
              lambda: f"{len(send)} send planes of {sent}-byte blocks but {len(recv)} receive planes of "
                      f"{received}-byte blocks: a rank that sends to itself receives what it sends")
    limits = [found[name][2] if name in found else ANY for name in ("send_planes", "recv_planes")]
    pairs = _host_pairs(pairs, *limits, "the send planes'", "the receive planes'")
    if "recv_planes" in found and len(pairs):
        _distinct_destinations(pairs)
    for name, column, what in (("send_planes", 0, "source block"), ("recv_planes", 1, "destination block")):
        if name in found:
            planes, block_bytes, _ = found[name]
            _refuse_unmapped(planes, block_bytes, pairs, pairs[:, column:column + 1], what)
    if not len(pairs):
        return
    import cupy
    with cupy.cuda.Device(device):
        handle = (stream if stream is not None else cupy.cuda.get_current_stream()).ptr
    runs = _runs(pairs, same_planes=False).tolist()
    nccl.groupStart()
    try:
        for src, dst, count in runs:
            if "send_planes" in found:
                planes, block_bytes, _ = found["send_planes"]
                for p in planes:
                    comm.send(p.data.ptr + src * block_bytes, count * block_bytes, nccl.NCCL_UINT8, peer, handle)
            if "recv_planes" in found:
                planes, block_bytes, _ = found["recv_planes"]
                for p in planes:
                    comm.recv(p.data.ptr + dst * block_bytes, count * block_bytes, nccl.NCCL_UINT8, peer, handle)
    finally:
        nccl.groupEnd()


def _nccl():
    """``cupy.cuda.nccl``, or BackendUnavailableError saying why it cannot be loaded."""
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        raise BackendUnavailableError(f"NCCL cannot be loaded through CuPy ({exc}): install CuPy and NCCL") from None
    if not getattr(nccl, "available", True):
        raise BackendUnavailableError("CuPy found no NCCL library: install NCCL where CuPy loads it "
                                      "(python -m cupyx.tools.install_library --library nccl)")
    return nccl
