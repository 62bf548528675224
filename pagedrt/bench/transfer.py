"""KV between GPUs: a block transfer between two caches (copy engines, peer-mapped kernel, NCCL) against a peer copy.

    python3 -m pagedrt.bench.transfer [--tokens 16,256,4096,32768] [--layers 1,32] [--repeats 20] [--out run.json]

Two caches in the Llama 3 8B shape (32 layers, 8 KV heads x 128, fp16, block 16,
plane-major), the source on device 0 and the destination on device 1; with one GPU both on
device 0, which the note column says. Each holds one sequence of the largest ``--tokens``.
For every size (``--tokens`` tokens, whole blocks, of one layer's K and V or of every
layer's: ``--layers``) the same blocks move four ways:

- ``peer copy``: one ``cudaMemcpyPeerAsync`` of the same bytes between two ``cudaMalloc``
  buffers, one on each device: the ceiling;
- ``transfer_blocks``: ``kernels.transfer_blocks``, the copy engines (one
  ``cuMemcpyPeerAsync`` per plane and run of blocks), every plane checked on every call;
- ``copy engines``: the same copies through a ``kernels.BlockTransfer`` made once (the
  planes checked once, the pairs on every run), as an engine moving sequence after
  sequence between two caches would hold it;
- ``mapped kernel``: ``kernels.BlockTransfer(mapped=True)`` made once, the copy kernel on
  the destination device reading the source over the peer mapping (``Pool.grant_access``);
  only where the destination device can access the source's;
- ``nccl``: ``kernels.nccl.BlockExchange`` made once a rank, NCCL send and receive of the
  blocks (two ranks in this process, ``NcclCommunicator.initAll``; one rank sending to
  itself on one GPU); only where ``cupy.cuda.nccl`` loads.

Each is timed as ``--repeats`` transfers queued back to back between two synchronisations of
both devices (wall clock, after one warm-up transfer): the mean time of one transfer, its
bandwidth in bytes moved, and its fraction of the peer copy's. After the timed transfers the
first and last destination planes are compared with the source's blocks (the destination
blocks are zeroed before each path).
"""

import time

import numpy as np

from .. import PagedKVCache, kernels
from ..errors import BackendUnavailableError
from ..kernels import nccl
from . import harness

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
ITEMSIZE = 2  # fp16


def transfer_bytes(tokens, layers):
    """Bytes of ``tokens`` tokens' K and V in ``layers`` layers of the standard shape."""
    return 2 * layers * tokens * KV_HEADS * HEAD_DIM * ITEMSIZE


def int_list(text):
    return [int(x) for x in text.split(",")]


def parser():
    ap = harness.parser("pagedrt.bench.transfer", __doc__)
    ap.add_argument("--tokens", type=int_list, default=[16, 256, 4096, 32768],
                    help="comma-separated token counts to transfer, each a whole number of blocks of 16")
    ap.add_argument("--layers", type=int_list, default=[1, LAYERS],
                    help=f"comma-separated layer counts whose K and V move, each 1 to {LAYERS}")
    ap.add_argument("--repeats", type=int, default=20, help="transfers queued back to back per timing")
    return ap


def parse(argv=None):
    """The command line, checked: every size whole blocks, every layer count in the cache."""
    ap = parser()
    args = ap.parse_args(argv)
    bad = [t for t in args.tokens if t <= 0 or t % BLOCK]
    if bad:
        ap.error(f"--tokens {bad}: each must be a positive multiple of the block size {BLOCK}")
    bad = [n for n in args.layers if not 1 <= n <= LAYERS]
    if bad:
        ap.error(f"--layers {bad}: each must be 1 to {LAYERS}")
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    return args


def devices(count):
    """(source device, destination device, note) for a machine of ``count`` GPUs."""
    if count > 1:
        return 0, 1, "device 0 to device 1"
    return 0, 0, "one GPU: device 0 to device 0"


def held_cache(cp, device, tokens):
    """A cache on ``device`` holding one sequence of ``tokens`` tokens, and that sequence's block ids."""
    with cp.cuda.Device(device):
        cache = PagedKVCache(LAYERS, KV_HEADS, HEAD_DIM, BLOCK, "float16", max_tokens=tokens, max_seqs=1,
                             max_seq_len=tokens, backend="cuda")
        seq = cache.add_sequence()
        cache.append(seq, tokens)
    return cache, np.asarray(cache.tables.blocks(seq), np.int64)


def exchange(module, comms, send_planes, recv_planes, pairs, streams):
    """One NCCL transfer of ``pairs`` as a call: a rank sending to itself (one communicator), or rank 0 sending
    and rank 1 receiving in one group; the BlockExchanges made once."""
    if len(comms) == 1:
        both = nccl.BlockExchange(comms[0], 0, send_planes=send_planes, recv_planes=recv_planes)
        return lambda: both.run(pairs, streams[0])
    send = nccl.BlockExchange(comms[0], 1, send_planes=send_planes)
    recv = nccl.BlockExchange(comms[1], 0, recv_planes=recv_planes)

    def issue():
        module.groupStart()
        send.run(pairs, streams[0])
        recv.run(pairs, streams[1])
        module.groupEnd()
    return issue


def seconds(cp, used, issue, repeats):
    """Mean wall seconds of one ``issue()`` over ``repeats`` queued back to back, between synchronisations of the
    ``used`` devices, after one warm-up."""
    def sync():
        for d in used:
            cp.cuda.Device(d).synchronize()
    issue()
    sync()
    t = time.perf_counter()
    for _ in range(repeats):
        issue()
    sync()
    return (time.perf_counter() - t) / repeats


def main(argv=None):
    args = parse(argv)
    import cupy as cp
    info = harness.device_info(cp)
    print(harness.header(info))
    src_dev, dst_dev, note = devices(cp.cuda.runtime.getDeviceCount())
    used = sorted({src_dev, dst_dev})
    most = max(args.tokens)
    src, src_blocks = held_cache(cp, src_dev, most)
    dst, dst_blocks = held_cache(cp, dst_dev, most)
    with cp.cuda.Device(src_dev):
        for plane in src.planes:
            plane[src_blocks] = cp.random.standard_normal(plane[src_blocks].shape, dtype=np.float32).astype(np.float16)
        stream0 = cp.cuda.Stream(non_blocking=True)
        a = cp.empty(transfer_bytes(most, max(args.layers)), np.uint8)
    with cp.cuda.Device(dst_dev):
        stream1 = cp.cuda.Stream(non_blocking=True)
        b = cp.empty(a.size, np.uint8)
    mapped = src_dev == dst_dev or bool(cp.cuda.runtime.deviceCanAccessPeer(dst_dev, src_dev))
    if mapped and src_dev != dst_dev:
        src.pool.grant_access(dst_dev)
    try:
        module = nccl._nccl()
        comms = (module.NcclCommunicator.initAll(used) if src_dev != dst_dev else
                 [module.NcclCommunicator(1, module.get_unique_id(), 0)])
        skipped_nccl = None
    except BackendUnavailableError as exc:
        module, comms, skipped_nccl = None, None, str(exc)
    rt = cp.cuda.runtime

    rows = []
    for tokens in args.tokens:
        for layers in args.layers:
            n, planes = tokens // BLOCK, 2 * layers
            pairs = np.stack([src_blocks[:n], dst_blocks[:n]], axis=1)
            nbytes = transfer_bytes(tokens, layers)
            s_planes, d_planes = src.planes[:planes], dst.planes[:planes]

            copies = kernels.BlockTransfer(s_planes, d_planes)
            paths = [("peer copy",
                      lambda: rt.memcpyPeerAsync(b.data.ptr, dst_dev, a.data.ptr, src_dev, nbytes, stream0.ptr)),
                     ("transfer_blocks", lambda: kernels.transfer_blocks(s_planes, d_planes, pairs, stream0)),
                     ("copy engines", lambda: copies.run(pairs, stream0))]
            if mapped:
                mapped_copies = kernels.BlockTransfer(s_planes, d_planes, mapped=True)
                paths.append(("mapped kernel", lambda: mapped_copies.run(pairs, stream1)))
            if comms is not None:
                paths.append(("nccl", exchange(module, comms, s_planes, d_planes, pairs, (stream0, stream1))))
            peer_s = None
            for path, issue in paths:
                checked = path != "peer copy"
                if checked:
                    with cp.cuda.Device(dst_dev):
                        for p in (d_planes[0], d_planes[-1]):
                            p[dst_blocks[:n]] = 0
                t = seconds(cp, used, issue, args.repeats)
                peer_s = t if path == "peer copy" else peer_s
                row = {"tokens": tokens, "layers": layers, "bytes": nbytes, "path": path, "us": t * 1e6,
                       "gbs": nbytes / t / 1e9, "of_peer": peer_s / t, "note": note}
                if checked:
                    row["identical"] = all(np.array_equal(s[src_blocks[:n]].get(), d[dst_blocks[:n]].get())
                                           for s, d in ((s_planes[0], d_planes[0]), (s_planes[-1], d_planes[-1])))
                rows.append(row)
    src.close()
    dst.close()

    columns = (harness.Column("tokens", "tokens", "{}", 7), harness.Column("layers", "layers", "{}", 6),
               harness.Column("bytes", "MiB", "{:.3f}", 10), harness.Column("path", "", width=16, left=True),
               harness.Column("us", "us", "{:.1f}", 10), harness.Column("gbs", "GB/s", "{:.1f}", 7),
               harness.Column("of_peer", "of peer copy", "{:.3f}", 12),
               harness.Column("identical", "identical", "{}", 9), harness.Column("note", "note", width=30, left=True))
    shown = [{**r, "bytes": r["bytes"] / 2**20} for r in rows]
    unmapped = f"not measured: device {dst_dev} cannot access device {src_dev}"
    lines = [f"two caches, Llama 3 8B shape (32 layers, 8 KV heads x 128, fp16, block 16, plane-major); {note}; "
             f"mean of {args.repeats} transfers queued back to back; the blocks of one sequence, in order",
             f"mapped kernel: {'measured' if mapped else unmapped}; "
             f"nccl: {'measured' if comms is not None else f'not measured: {skipped_nccl}'}",
             harness.format_table(columns, shown)]
    harness.publish("transfer", args.out, info, rows, "\n".join(lines), repeats=args.repeats, source_device=src_dev,
                    destination_device=dst_dev)


if __name__ == "__main__":
    main()
