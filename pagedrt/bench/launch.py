"""Host time to launch one kernel call from Python: the launchers against CuPy's own launch.

    python3 -m pagedrt.bench.launch [--calls 2000] [--rounds 7]

The standard decode shape (fp16, 32 query heads, 8 KV heads, head_dim 128, block
16), batch 32 with 64 tokens per sequence, so the GPU finishes each call before the
next is queued and what is timed is the host: the median over rounds of (time to
queue --calls calls) / --calls, in microseconds. ``DecodePlan.run`` and
``WritePlan.run`` are the per-layer part of a decode step whose plans were made
once. ``raw launch`` is an empty kernel taking the decode kernel's 14 arguments
(pointers, int64s, int32s, a float), launched with ``cupy.RawKernel`` and its
arguments prepared once: the floor under any launcher, set by CuPy's launch itself.
"""

import statistics
import time

import numpy as np

from . import harness
from .cases import BLOCK_SIZE, HEAD_DIM, KV_HEADS, Q_HEADS, scattered_table

BATCH, PER_SEQ = 32, 4  # blocks per sequence
THREADS = 128

# The decode kernel's parameter list (kinds and order), with an empty body.
EMPTY_KERNEL = r"""
extern "C" __global__ void empty_decode(const void* q, const void* k, const void* v, long long block_stride,
                                        const int* block_tables, long long table_stride, int max_blocks,
                                        const int* seq_lens, float scale, int segment_tokens, void* out,
                                        void* partial_out, void* partial_lse, int* counters) {}
"""


def host_us(cp, fn, calls, rounds):
    """Median over ``rounds`` of the host time per call to queue ``calls`` calls of ``fn``."""
    fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
        cp.cuda.Device().synchronize()
    return statistics.median(times)


def calls(cp):
    """{label: a call to time}, over one set of arrays."""
    from .. import attention, kernels
    rng = cp.random.default_rng(0)
    blocks = BATCH * PER_SEQ
    k, v = (rng.standard_normal((blocks, KV_HEADS, BLOCK_SIZE, HEAD_DIM), dtype=np.float32).astype(np.float16)
            for _ in range(2))
    q = rng.standard_normal((BATCH, Q_HEADS, HEAD_DIM), dtype=np.float32).astype(np.float16)
    out = cp.empty_like(q)
    table = cp.asarray(scattered_table([PER_SEQ * BLOCK_SIZE] * BATCH)[0])
    lens = cp.full(BATCH, PER_SEQ * BLOCK_SIZE, np.int32)
    new_k, new_v = (rng.standard_normal((BATCH, KV_HEADS, HEAD_DIM), dtype=np.float32).astype(np.float16)
                    for _ in range(2))
    slots = cp.arange(BATCH, dtype=np.int64) * (PER_SEQ * BLOCK_SIZE)
    hints = dict(max_seq_len=PER_SEQ * BLOCK_SIZE, mean_seq_len=float(PER_SEQ * BLOCK_SIZE))

    step = attention.DecodePlan(q, k, table, lens, validate=False, **hints)
    write = kernels.WritePlan(new_k, k, slots, validate=False)
    empty = cp.RawKernel(EMPTY_KERNEL, "empty_decode")
    null = np.uint64(0)
    ptr = lambda a: np.uint64(a.data.ptr)  # noqa: E731
    raw_args = (ptr(q), ptr(k), ptr(v), np.int64(KV_HEADS * BLOCK_SIZE * HEAD_DIM), ptr(table), np.int64(PER_SEQ),
                np.int32(PER_SEQ), ptr(lens), np.float32(1 / np.sqrt(HEAD_DIM)), np.int32(PER_SEQ * BLOCK_SIZE),
                ptr(out), null, null, null)
    grid = (KV_HEADS, BATCH, step.split.num_splits)
    return {
        "paged_decode(validate=False, max_seq_len, mean_seq_len)":
            lambda: attention.paged_decode(q, k, v, table, lens, out=out, validate=False, **hints),
        "paged_decode(validate=False)": lambda: attention.paged_decode(q, k, v, table, lens, out=out, validate=False),
        "DecodePlan(validate=False, max_seq_len, mean_seq_len), made once: run()":
            lambda: step.run(q, k, v, out=out),
        "write_kv(validate=False)": lambda: kernels.write_kv(new_k, new_v, k, v, slots, validate=False),
        "WritePlan(validate=False), made once: run()": lambda: write.run(new_k, new_v, k, v),
        "raw launch (empty kernel, the decode kernel's 14 arguments, prepared)":
            lambda: empty(grid, (THREADS,), raw_args),
    }


def parser():
    ap = harness.parser("pagedrt.bench.launch", __doc__)
    ap.add_argument("--calls", type=int, default=2000, help="calls queued per round")
    ap.add_argument("--rounds", type=int, default=7, help="rounds; the median is reported")
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    import cupy as cp
    info = harness.device_info(cp)
    print(harness.header(info))
    rows = [{"call": name, "host_us": host_us(cp, fn, args.calls, args.rounds)} for name, fn in calls(cp).items()]
    text = (f"host us per call (median of {args.rounds} rounds of {args.calls} calls); batch {BATCH}, "
            f"{PER_SEQ * BLOCK_SIZE} tokens each\n"
            + harness.format_table((harness.Column("host_us", "host us", "{:.1f}"),
                                    harness.Column("call", "call", width=0, left=True)), rows))
    harness.publish("launch", args.out, info, rows, text, calls=args.calls, rounds=args.rounds)


if __name__ == "__main__":
    main()
