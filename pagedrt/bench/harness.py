"""What every benchmark shares: the GPU timer, the bandwidth ceilings, the run header, tables and records.

Timing. :meth:`Timer.gpu_us` gives the median GPU time of a call between two CUDA
events, after a warm-up. Before the timed calls it launches a spin kernel that
keeps the GPU busy while the host queues them all, so each call's events bracket
its GPU time rather than Python's launch overhead. With ``flush_l2`` it writes a
buffer twice the L2's size before each timed call (outside its events), so the call
reads from HBM, not from what the previous call left in L2. :meth:`Timer.wall_us`
times calls one at a time, for calls that synchronise inside.

Ceilings. The bandwidth a memory-bound kernel is measured against, both over
:data:`CEILING_BYTES` in the same run: a device-to-device copy (bytes read + written)
and a read-only streaming kernel (``cuda_src/bench.cu``'s ``stream_read``). Decode
reads almost only, so it is reported against both. Per case, two bounds at the case's
own size: :func:`stream_us`, the streaming kernel over its bytes in one contiguous
run, and :func:`paged_read_us`, a read-only kernel (``paged_read``) over exactly the
K/V chunks paged decode reads, through the block table in decode's order
(:func:`chunk_offsets`), doing no arithmetic.

Every function that touches the GPU takes the ``cupy`` module from its caller, so the
pure parts (tables, records) and every benchmark's ``--help`` work without CuPy.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import source

CEILING_BYTES = 4 << 30
STREAM_BLOCKS_PER_SM, STREAM_THREADS = 8, 256
# the paged read's grid: small ranges of chunks, many blocks, the fastest of the grids tried (docs/KERNELS.md,
# "Decode", has the figures)
PAGED_READ_BLOCKS_PER_SM, PAGED_READ_THREADS = 32, 512


def event_seconds(cp, fn, repeats, warmup=0):
    """Median seconds of ``fn()`` between two CUDA events, one call at a time (after ``warmup`` calls).

    Each call is waited for, so this includes any launch gap: right for calls that
    synchronise inside, or long enough for the gap not to matter.
    """
    for _ in range(warmup):
        fn()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) * 1e-3)
    return statistics.median(times)


class Timer:
    """Median GPU time of calls, measured with events around each, behind a spin kernel."""

    def __init__(self, cp):
        self.cp = cp
        self.spin = source.function("bench.cu", "pagedrt::spin")
        self.spin((1,), (1,), (np.int64(1000),))
        self.cycles_per_s = self.sm_mhz() * 1e6
        self._scrub = None  # written before each timed call when flushing L2

    def sm_mhz(self):
        """The SM clock now, in MHz: a spin of 10^7 cycles (about 5 ms) between two events.

        Read right after timed calls, it is about the clock they ran at: under sustained tensor-core load
        these GPUs lower their clock within a few hundred milliseconds (docs/KERNELS.md, "Prefill on Hopper").
        """
        cp = self.cp
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        self.spin((1,), (1,), (np.int64(10**7),))
        end.record()
        end.synchronize()
        return 1e7 / (cp.cuda.get_elapsed_time(start, end) * 1e-3) / 1e6

    def scrub_l2(self):
        """Write a buffer twice the L2's size, evicting whatever the last call left there."""
        cp = self.cp
        if self._scrub is None:
            l2 = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["l2CacheSize"]
            self._scrub = cp.empty(2 * l2, np.uint8)
        self._scrub.fill(0)

    def gpu_us(self, fn, repeats, warmup=5, flush_l2=False):
        """Median microseconds of ``fn()``'s GPU time over ``repeats`` calls queued behind a spin."""
        cp = self.cp
        before = self.scrub_l2 if flush_l2 else (lambda: None)
        for _ in range(warmup):
            before()
            fn()
        cp.cuda.Device().synchronize()
        t = time.perf_counter()
        for _ in range(repeats):
            before()
            fn()
        host_s = time.perf_counter() - t  # host time to queue `repeats` calls
        cp.cuda.Device().synchronize()
        events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(repeats)]
        spin_s = 2 * host_s + 1e-3
        self.spin((1,), (1,), (np.int64(spin_s * self.cycles_per_s),))
        t = time.perf_counter()
        for start, end in events:
            before()
            start.record()
            fn()
            end.record()
        queued_s = time.perf_counter() - t
        events[-1][1].synchronize()
        times = [cp.cuda.get_elapsed_time(s, e) * 1e3 for s, e in events]
        if queued_s > spin_s:
            print(f"  warning: queueing took {queued_s * 1e3:.1f} ms > spin {spin_s * 1e3:.1f} ms; "
                  "the first calls may include launch gaps")
        return statistics.median(times)

    def wall_us(self, fn, repeats, warmup=5):
        """Median event time of calls run one at a time (for calls that synchronise inside)."""
        return 1e6 * event_seconds(self.cp, fn, repeats, warmup)


def copy_us(timer, dst_ptr, src_ptr, nbytes, repeats):
    """Median time of one device-to-device copy of ``nbytes`` from ``src_ptr`` to ``dst_ptr``."""
    rt = timer.cp.cuda.runtime
    stream = timer.cp.cuda.get_current_stream().ptr
    return timer.gpu_us(lambda: rt.memcpyAsync(dst_ptr, src_ptr, nbytes, rt.memcpyDeviceToDevice, stream), repeats)


def stream_us(timer, ptr, nbytes, repeats):
    """Median time of the read-only streaming kernel over ``nbytes`` (a multiple of 16) at device pointer ``ptr``."""
    cp = timer.cp
    read = source.function("bench.cu", "pagedrt::stream_read")
    sms = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["multiProcessorCount"]
    sink = cp.zeros(1, np.uint32)
    args = (np.uint64(ptr), np.int64(nbytes // 16), np.uint32(0x9E3779B9), sink)
    return timer.gpu_us(lambda: read((sms * STREAM_BLOCKS_PER_SM,), (STREAM_THREADS,), args), repeats)


def chunk_offsets(table, lengths, block_size, kv_heads, chunk_bytes):
    """Byte offsets in a K or V plane of the chunks paged decode reads, in its order: per sequence, per KV head,
    the sequence's blocks in table order.

    A chunk is one block's run of one KV head in a ``[num_blocks, kv_heads, block_size, head_dim]`` plane:
    ``chunk_bytes`` (block_size x head_dim x itemsize) at ``block_id * kv_heads * chunk_bytes + head *
    chunk_bytes``.

    Parameters
    ----------
    table : numpy.ndarray
        ``[batch, width]`` int block table (``cases.scattered_table``); entries past a sequence's blocks are
        not read.
    lengths : array-like
        ``[batch]`` tokens per sequence: sequence b reads its first ``ceil(lengths[b] / block_size)`` blocks.
    block_size, kv_heads, chunk_bytes : int
        Tokens per block, KV heads, bytes of one chunk.

    Returns
    -------
    numpy.ndarray
        int64 ``[kv_heads * sum(ceil(lengths / block_size))]``.
    """
    table = np.asarray(table, np.int64)
    used = -(-np.asarray(lengths, np.int64) // block_size)
    every = table[:, None, :] * (kv_heads * chunk_bytes) + np.arange(kv_heads)[:, None] * chunk_bytes
    read = np.arange(table.shape[1]) < used[:, None]  # [batch, width]
    return every[np.broadcast_to(read[:, None, :], every.shape)]  # [batch, kv_heads, width] in row-major order


def paged_read_us(timer, k_ptr, v_ptr, offsets, chunk_bytes, repeats):
    """Median time of the read-only paged kernel over the chunks at ``offsets`` of both planes, each read once.

    PAGED_READ_BLOCKS_PER_SM blocks of PAGED_READ_THREADS an SM; each thread block reads a contiguous range of
    the chunks, in order.

    Parameters
    ----------
    timer : Timer
    k_ptr, v_ptr : int
        Device pointers of the K and V planes.
    offsets : cupy.ndarray
        ``[num_chunks]`` int64: each chunk's byte offset in either plane, a multiple of 16
        (:func:`chunk_offsets`).
    chunk_bytes : int
        Bytes of one chunk, a multiple of 16.
    repeats : int
        Timed calls.
    """
    cp = timer.cp
    read = source.function("bench.cu", "pagedrt::paged_read")
    sms = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["multiProcessorCount"]
    sink = cp.zeros(1, np.uint32)
    args = (np.uint64(k_ptr), np.uint64(v_ptr), offsets, np.int64(offsets.size), np.int32(chunk_bytes // 16),
            np.uint32(0x9E3779B9), sink)
    return timer.gpu_us(lambda: read((sms * PAGED_READ_BLOCKS_PER_SM,), (PAGED_READ_THREADS,), args), repeats)


def ceilings(timer, repeats):
    """{"copy", "stream"} bandwidth in bytes/s over CEILING_BYTES; the copy counts bytes read + written."""
    cp = timer.cp
    src, dst = cp.empty(CEILING_BYTES, np.uint8), cp.empty(CEILING_BYTES, np.uint8)
    src.fill(1)
    copy = 2 * CEILING_BYTES / (copy_us(timer, dst.data.ptr, src.data.ptr, CEILING_BYTES, repeats) * 1e-6)
    stream = CEILING_BYTES / (stream_us(timer, src.data.ptr, CEILING_BYTES, repeats) * 1e-6)
    del src, dst
    cp.get_default_memory_pool().free_all_blocks()
    return {"copy": copy, "stream": stream}


# --- what a run reports ------------------------------------------------------------------------------------


def device_info(cp):
    """The device and software a run measured on, and the checkout's commit when run from one."""
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    driver, runtime = cp.cuda.runtime.driverGetVersion(), cp.cuda.runtime.runtimeGetVersion()
    return {"device": props["name"].decode(), "sms": props["multiProcessorCount"],
            "l2_bytes": props["l2CacheSize"], "driver": f"{driver // 1000}.{driver % 1000 // 10}",
            "runtime": f"{runtime // 1000}.{runtime % 1000 // 10}", "cupy": cp.__version__, "commit": commit()}


def commit():
    """The checkout's commit (``+dirty`` with uncommitted changes), or None outside a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def header(info, bandwidth=None):
    """One line naming the device, driver and commit, and the ceilings when measured."""
    line = (f"{info['device']}: {info['sms']} SMs, L2 {info['l2_bytes'] >> 20} MiB; driver {info['driver']}, "
            f"CUDA runtime {info['runtime']}, CuPy {info['cupy']}; commit {info['commit'] or 'unknown'}")
    if bandwidth:
        line += (f"\nceilings: copy {bandwidth['copy'] / 1e12:.2f} TB/s (read + written), "
                 f"stream {bandwidth['stream'] / 1e12:.2f} TB/s (read only)")
    return line


@dataclass(frozen=True)
class Column:
    """A table column: the row key it shows, its header, a ``str.format`` template and its width."""

    key: str
    title: str
    template: str = "{}"
    width: int = 8
    left: bool = False


def format_table(columns, rows):
    """The rows (dicts) as a text table: a header, a rule, one line per row; a missing value prints as ``-``."""
    def cell(text, col):
        return text.ljust(col.width) if col.left else text.rjust(col.width)

    head = " ".join(cell(c.title, c) for c in columns).rstrip()
    lines = [head, "-" * len(head)]
    for row in rows:
        values = [row.get(c.key) for c in columns]
        lines.append(" ".join(cell("-" if v is None else c.template.format(v), c)
                              for c, v in zip(columns, values)).rstrip())
    return "\n".join(lines)


def command(benchmark):
    """The command line that ran ``benchmark`` (a module name under ``pagedrt.bench``), as typed."""
    return " ".join([f"python3 -m pagedrt.bench.{benchmark}"] + sys.argv[1:])


def record(benchmark, info, rows, table, **extra):
    """A run as a JSON-ready dict: what ran, where, the measured rows and the printed table."""
    return {"benchmark": benchmark, "command": command(benchmark), "device": info, **extra,
            "rows": rows, "table": table}


def write_record(path, rec):
    Path(path).write_text(json.dumps(rec, indent=2) + "\n")


def publish(benchmark, out, info, rows, table, plot=None, **extra):
    """Print a run's table; with ``out`` (the ``--out`` option) also write its record there, with ``plot``
    (``--plot``) draw it there (``pagedrt.bench.plots``)."""
    print(table)
    rec = record(benchmark, info, rows, table, **extra)
    if out:
        write_record(out, rec)
    if plot:
        from .plots import draw
        draw(rec, plot)


def case_names(ap, text, known):
    """The comma-separated case names in ``text``, each one of ``known``; any other stops the run through
    ``ap.error``, naming it."""
    names = text.split(",")
    unknown = [n for n in names if n not in known]
    if unknown:
        ap.error(f"unknown cases {unknown}")
    return names


def plot_path(text):
    """``--plot``'s value, once matplotlib is known to be there: a long run does not end in an ImportError."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise argparse.ArgumentTypeError("plots need matplotlib: pip install 'pagedrt[plot]'") from None
    return text


def parser(module, doc, *, backend=False, **kwargs):
    """The command line every benchmark shares: ``python3 -m MODULE``, its docstring's first line, ``--out``
    (a JSON record of the run), ``--plot`` for those ``pagedrt.bench.plots`` draws and, for those that also
    run without a GPU, ``--backend``."""
    from .plots import DRAWERS
    ap = argparse.ArgumentParser(prog=f"python3 -m {module}", description=doc.splitlines()[0], **kwargs)
    if backend:
        ap.add_argument("--backend", default="auto", choices=("auto", "cuda", "host"), help="the pool's backend")
    ap.add_argument("--out", help="also write the run as a JSON record here")
    if module.rsplit(".", 1)[-1] in DRAWERS:
        ap.add_argument("--plot", type=plot_path, metavar="FILE.png",
                        help="also draw the run here as a PNG (matplotlib: the plot extra)")
    return ap
