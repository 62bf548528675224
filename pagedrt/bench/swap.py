"""The host tier: swap-out and swap-in bandwidth against plain cudaMemcpyAsync, with attention running meanwhile.

    python3 -m pagedrt.bench.swap [--tokens 8192] [--repeats 5] [--busy-seqs 32] [--busy-len 4096]

One sequence of ``--tokens`` tokens in the Llama 3 8B shape (32 layers, 8 KV heads,
head_dim 128, fp16, block 16, plane-major) is swapped out to the cache's host tier
and back (``cache.swap_out``/``swap_in``, then the copies on a stream of their own),
``--repeats`` times, and its K/V compared bit for bit after each round trip. Each
direction is timed between two CUDA events on the copy stream, alone and while a
decode step's attention (``--busy-seqs`` sequences of ``--busy-len`` tokens, every
layer, several steps queued first) runs on another stream, and made two ways: with
the copy engines (``kernels.swap_blocks``: one ``cuMemcpyAsync`` per plane and run
of blocks) and with the SMs (``kernels.copy_blocks``: one kernel launch). The
ceiling is one ``cudaMemcpyAsync`` of the same bytes between ``cudaMalloc`` memory
and ``cudaHostAlloc`` (pinned) memory, alone and beside the same attention; the same
bytes in as many copies as a swap makes (one per plane) say what the copy count costs. The
bookkeeping (the swap call and the table upload) is timed on the host.

Then decode attention of the sequence, one layer, over its blocks in the host tier
(read through the same pointers) against the same over device blocks; and a probe of
whole-chunk swap by remapping: the sequence's 64 plane chunks copied to pinned host
chunks, then each place unmapped and the host chunk mapped there (block ids
unchanged), and back, timing the driver calls that block-level swap does not make.
"""

import statistics
import time

import numpy as np

from .. import PagedKVCache, attention, kernels
from ..memory import select_backend
from . import harness

MiB, GiB = 1 << 20, 1 << 30
LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK = 32, 8, 32, 128, 16
BUSY_STEPS = 12  # attention steps queued on the compute stream before a timed copy starts


def median_ms(samples):
    return 1e3 * statistics.median(samples)


class Busy:
    """A decode step's attention over many sequences, queued on its own stream: the compute a copy overlaps."""

    def __init__(self, cp, cache, seqs):
        self.cp, self.cache, self.stream = cp, cache, cp.cuda.Stream(non_blocking=True)
        rng = np.random.default_rng(1)
        with self.stream:
            self.q = cp.asarray(rng.standard_normal((len(seqs), Q_HEADS, HEAD_DIM)).astype(np.float16))
            self.plan = attention.DecodePlan(self.q, cache.k(0), cache.block_tables(seqs), cache.seq_lens(seqs))
            self.out = cp.empty_like(self.q)
        self.stream.synchronize()

    def queue(self, steps):
        """Queue ``steps`` steps of every layer's attention; returns the event recorded after them."""
        with self.stream:
            for _ in range(steps):
                for layer in range(LAYERS):
                    self.plan.run(self.q, self.cache.k(layer), self.cache.v(layer), self.out)
            done = self.cp.cuda.Event()
            done.record(self.stream)
        return done

    def step_ms(self):
        """GPU milliseconds of one step (every layer) alone."""
        start, end = self.cp.cuda.Event(), self.cp.cuda.Event()
        start.record(self.stream)
        end_event = self.queue(1)
        end.record(self.stream)
        end_event.synchronize()
        return self.cp.cuda.get_elapsed_time(start, end)


def timed(cp, stream, issue, busy=None):
    """GPU seconds of the copies ``issue()`` queues on ``stream``, alone or after ``busy`` queued its attention;
    and whether that attention was still running when the copies ended."""
    cp.cuda.Device().synchronize()
    done = busy.queue(BUSY_STEPS) if busy is not None else None
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    issue()
    end.record(stream)
    end.synchronize()
    covered = True
    if done is not None:
        done.synchronize()
        covered = cp.cuda.get_elapsed_time(end, done) > 0
    return cp.cuda.get_elapsed_time(start, end) * 1e-3, covered


def ceiling(cp, nbytes, stream, busy, repeats, pieces):
    """Median seconds of one cudaMemcpyAsync of ``nbytes`` device -> pinned host and back, alone and busy; and,
    alone, of the same bytes cut into ``pieces`` copies (as many as a swap makes: one per plane), which tells
    the cost of the copy count apart from that of the host tier's memory."""
    import cupyx
    rt = cp.cuda.runtime
    device, pinned = cp.empty(nbytes, np.uint8), cupyx.empty_pinned(nbytes, np.uint8)
    device.fill(3)
    piece = nbytes // pieces
    out = {}
    for name, dst, src, kind in (("d2h", pinned.ctypes.data, device.data.ptr, rt.memcpyDeviceToHost),
                                 ("h2d", device.data.ptr, pinned.ctypes.data, rt.memcpyHostToDevice)):
        for load in (None, busy):
            issue = lambda: rt.memcpyAsync(dst, src, nbytes, kind, stream.ptr)  # noqa: E731
            times = [timed(cp, stream, issue, load) for _ in range(repeats)]
            out[name, load is not None] = (statistics.median(t for t, _ in times), all(c for _, c in times))

        def split():
            for i in range(pieces):
                rt.memcpyAsync(dst + i * piece, src + i * piece, piece, kind, stream.ptr)
        out[name, "split"] = (statistics.median(timed(cp, stream, split)[0] for _ in range(repeats)), None)
    return out


def swap_rounds(cp, cache, seq, stream, busy, engine, repeats, reference):
    """Swap ``seq`` out and in ``repeats`` times with ``engine`` ("dma": swap_blocks, "sm": copy_blocks), alone or
    busy; median copy seconds per direction, whether attention covered them, host seconds of the bookkeeping, and
    whether the K/V came back bit-identical every time."""
    def copy(pairs):
        if engine == "dma":
            return lambda: kernels.swap_blocks(cache.planes, pairs, stream)

        def launch():
            with stream:
                kernels.copy_blocks(cache.planes, pairs)
        return launch

    result = {"out": [], "in": [], "covered": True, "book": [], "identical": True}
    for _ in range(repeats):
        for direction, call in (("out", cache.swap_out), ("in", cache.swap_in)):
            t = time.perf_counter()
            pairs = call([seq])
            cache.block_tables([seq])  # the table upload the next kernel needs
            result["book"].append(time.perf_counter() - t)
            seconds, covered = timed(cp, stream, copy(pairs), busy)
            result[direction].append(seconds)
            result["covered"] &= covered
        result["identical"] &= bool(cp.array_equal(gather(cp, cache, seq), reference))
    return result


def gather(cp, cache, seq):
    """The sequence's K/V in every plane, through its block table: [planes, blocks, ...]."""
    blocks = cp.asarray(cache.tables.blocks(seq))
    return cp.stack([plane[blocks] for plane in cache.planes])


def decode_over(timer, cp, cache, seq, repeats):
    """Median microseconds of one layer's decode attention of ``seq`` (alone) over its blocks where they are."""
    q = cp.asarray(np.random.default_rng(2).standard_normal((1, Q_HEADS, HEAD_DIM)).astype(np.float16))
    plan = attention.DecodePlan(q, cache.k(0), cache.block_tables([seq]), cache.seq_lens([seq]))
    out = cp.empty_like(q)
    return timer.gpu_us(lambda: plan.run(q, cache.k(0), cache.v(0), out), repeats, flush_l2=True)


def remap_probe(cp, chunks, chunk_bytes, repeats):
    """Whole-chunk swap by remapping, on a bare CUDA backend: ``chunks`` device chunks at places [0, chunks) and
    pinned host chunks at [chunks, 2 chunks). Out: copy each device chunk to its host chunk, then unmap both places,
    map the host chunk at the device place, enable access, release the device chunk. In: create device chunks at
    the host places, copy the host data there, unmap both, map the device chunks back. Median wall ms of each
    direction's driver calls (the copies excluded), and whether the data read back unchanged."""
    b = select_backend("cuda")
    n, size = chunks, chunk_bytes
    base = b.reserve(2 * n * size)
    place = lambda i: base + i * size  # noqa: E731
    stream = cp.cuda.Stream(non_blocking=True)
    rt = cp.cuda.runtime
    out_ms, in_ms, same = [], [], True
    device = [b.create(size) for _ in range(n)]
    host = [b.create(size, "host") for _ in range(n)]
    for i in range(n):
        b.map(place(i), size, device[i])
        b.map(place(n + i), size, host[i])
    b.set_access(base, 2 * n * size)
    view = b.array(base, 2 * n * size, 0, (n * size // 4,), np.uint32, (4,), b)
    view[...] = cp.random.randint(0, 2**31, view.shape, dtype=np.uint32)
    saved = view.copy()
    for _ in range(repeats):
        for i in range(n):
            rt.memcpyAsync(place(n + i), place(i), size, rt.memcpyDefault, stream.ptr)
        stream.synchronize()
        t = time.perf_counter()
        for i in range(n):
            b.unmap(place(i), size)
            b.unmap(place(n + i), size)
            b.map(place(i), size, host[i])
            b.release(device[i])
        b.set_access(base, n * size)
        out_ms.append(time.perf_counter() - t)
        same &= bool(cp.array_equal(view, saved))
        t = time.perf_counter()
        device = [b.create(size) for _ in range(n)]
        for i in range(n):
            b.map(place(n + i), size, device[i])
        b.set_access(base + n * size, n * size)
        staged = time.perf_counter() - t
        for i in range(n):
            rt.memcpyAsync(place(n + i), place(i), size, rt.memcpyDefault, stream.ptr)
        stream.synchronize()
        t = time.perf_counter()
        for i in range(n):
            b.unmap(place(i), size)
            b.unmap(place(n + i), size)
            b.map(place(i), size, device[i])
            b.map(place(n + i), size, host[i])
        b.set_access(base, 2 * n * size)
        in_ms.append(staged + time.perf_counter() - t)
        same &= bool(cp.array_equal(view, saved))
    del view
    b.synchronize()
    for i in range(n):
        b.unmap(place(i), size)
        b.unmap(place(n + i), size)
        b.release(device[i])
        b.release(host[i])
    b.free(base, 2 * n * size)
    b.close()
    return median_ms(out_ms), median_ms(in_ms), same


def parser():
    ap = harness.parser("pagedrt.bench.swap", __doc__)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the swapped sequence")
    ap.add_argument("--repeats", type=int, default=5, help="timed round trips per measurement")
    ap.add_argument("--busy-seqs", type=int, default=32, help="sequences of the attention running meanwhile")
    ap.add_argument("--busy-len", type=int, default=4096, help="tokens of each of them")
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    import cupy as cp
    info = harness.device_info(cp)
    print(harness.header(info))
    busy_tokens = args.busy_seqs * args.busy_len
    t = time.perf_counter()
    cache = PagedKVCache(LAYERS, KV_HEADS, HEAD_DIM, BLOCK, "float16", max_tokens=busy_tokens + args.tokens,
                         host_tokens=args.tokens, max_seqs=args.busy_seqs + 1, max_seq_len=max(args.tokens,
                                                                                           args.busy_len),
                         backend="cuda")
    created_ms = 1e3 * (time.perf_counter() - t)
    host_chunks = [r for r in cache.pool.mappings() if r.location == "host"]
    seq = cache.add_sequence()
    cache.append(seq, args.tokens)
    busy_seqs = [cache.add_sequence() for _ in range(args.busy_seqs)]
    cache.append(busy_seqs, args.busy_len)
    blocks = cp.asarray(cache.tables.blocks(seq))
    for plane in cache.planes:  # random K/V in the swapped sequence's blocks
        plane[blocks] = cp.random.standard_normal(plane[blocks].shape, dtype=np.float32).astype(np.float16)
    reference = gather(cp, cache, seq)
    nbytes = int(reference.nbytes)
    stream = cp.cuda.Stream(non_blocking=True)
    busy = Busy(cp, cache, busy_seqs)
    busy_ms = busy.step_ms()
    gbs = lambda seconds: nbytes / seconds / 1e9  # noqa: E731

    pieces = cache.layout.num_planes
    top = ceiling(cp, nbytes, stream, busy, args.repeats, pieces)
    rows = []
    for name, key in (("out", "d2h"), ("in", "h2d")):
        for loaded in (False, True, "split"):
            what = {False: "", True: " + attention", "split": f", {pieces} copies"}[loaded]
            row = {"what": f"cudaMemcpyAsync {key}{what}", "ms": 1e3 * top[key, loaded][0],
                   "gbs": gbs(top[key, loaded][0]), "of": top[key, loaded is True][0] / top[key, loaded][0]}
            if loaded != "split":
                row["covered"] = top[key, loaded][1]
            rows.append(row)
    results = {}
    for engine in ("dma", "sm"):
        for loaded in (False, True):
            r = swap_rounds(cp, cache, seq, stream, busy if loaded else None, engine, args.repeats, reference)
            results[engine, loaded] = r
            for direction, key in (("out", "d2h"), ("in", "h2d")):
                seconds = statistics.median(r[direction])
                rows.append({"what": f"swap {direction}, {'copy engines' if engine == 'dma' else 'SM kernel'}"
                                     + (" + attention" if loaded else ""),
                             "ms": 1e3 * seconds, "gbs": gbs(seconds), "of": top[key, loaded][0] / seconds,
                             "covered": r["covered"], "identical": r["identical"]})
    columns = (harness.Column("what", "", width=44, left=True), harness.Column("ms", "ms", "{:.2f}", 8),
               harness.Column("gbs", "GB/s", "{:.1f}", 7), harness.Column("of", "of ceiling", "{:.3f}", 10),
               harness.Column("covered", "attention ran throughout", "{}", 24),
               harness.Column("identical", "bit-identical", "{}", 13))
    book = statistics.median(results["dma", False]["book"]) * 1e3

    kernels.swap_blocks(cache.planes, cache.swap_out([seq]), stream)
    stream.synchronize()
    timer = harness.Timer(cp)
    host_us = decode_over(timer, cp, cache, seq, 20)
    kernels.swap_blocks(cache.planes, cache.swap_in([seq]), stream)
    stream.synchronize()
    device_us = decode_over(timer, cp, cache, seq, 20)
    layer_bytes = nbytes // LAYERS

    lay = cache.layout
    remap_out, remap_in, remap_same = remap_probe(cp, lay.num_planes, lay.chunk_bytes, args.repeats)
    cache.close()

    lines = [f"one sequence of {args.tokens} tokens, Llama 3 8B shape (32 layers, 8 KV heads x 128, fp16, block 16, "
             f"plane-major): {nbytes / GiB:.3f} GiB; median of {args.repeats}; attention meanwhile: decode of "
             f"{args.busy_seqs} x {args.busy_len} tokens, {busy_ms:.2f} ms a step (32 layers) alone, "
             f"{BUSY_STEPS} steps queued first on another stream",
             f"host tier: {len(host_chunks)} pinned chunks of {lay.chunk_bytes // MiB} MiB, NUMA node "
             f"{host_chunks[0].location_id}; the cache made in {created_ms:.0f} ms",
             harness.format_table(columns, rows),
             f"bookkeeping per swap (swap_out/swap_in and the table upload, host): {book:.3f} ms",
             "",
             f"decode attention of that sequence, one layer ({layer_bytes / MiB:.0f} MiB of K/V), median of 20, L2 "
             f"flushed: {device_us:.1f} us over device blocks ({layer_bytes / device_us / 1e3:.0f} GB/s), "
             f"{host_us:.1f} us over host-tier blocks ({layer_bytes / host_us / 1e3:.1f} GB/s); a 32-layer step "
             f"over the host tier {32 * host_us / 1e3:.2f} ms",
             "",
             f"whole-chunk swap by remapping ({lay.num_planes} chunks of {lay.chunk_bytes // MiB} MiB, the sequence's "
             f"plane chunks), driver calls besides the copies, median of {args.repeats}: out {remap_out:.2f} ms "
             f"(unmap, map the host chunk, access, release), in {remap_in:.2f} ms (create, map, access, unmap, "
             f"map back); data unchanged: {remap_same}"]
    harness.publish("swap", args.out, info, rows, "\n".join(lines), tokens=args.tokens, repeats=args.repeats,
                    bookkeeping_ms=book, decode_device_us=device_us, decode_host_us=host_us,
                    remap_out_ms=remap_out, remap_in_ms=remap_in, remap_unchanged=remap_same,
                    busy_step_ms=busy_ms, cache_created_ms=created_ms)


if __name__ == "__main__":
    main()
