"""Host time to launch one kernel call from Python: the launchers against CuPy's own launch.

    PYTHONPATH=. python3 tools/bench_launch.py [--calls 2000] [--rounds 7]

The standard decode shape (fp16, 32 query heads, 8 KV heads, head_dim 128, block 16)
with 64 tokens per sequence, so the GPU finishes each call before the next is queued
and what is timed is the host: the median over rounds of (time to queue --calls
calls) / --calls, in microseconds. ``DecodePlan.run`` and ``WritePlan.run`` are the per-layer
part of a decode step whose plans were made once. ``raw launch`` is the decode kernel launched
directly with its arguments prepared once: the floor under any launcher, set by
CuPy's RawKernel call.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedrt.kernels import DecodePlan, WritePlan, decode, paged_decode, write_kv  # noqa: E402
from pagedrt.kernels.args import NULL, ptr  # noqa: E402
from pagedrt.kernels.configs import config  # noqa: E402

BATCH, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK, PER_SEQ = 32, 32, 8, 128, 16, 4


def host_us(cp, fn, calls, rounds):
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    import cupy as cp
    rng = cp.random.default_rng(0)
    blocks = BATCH * PER_SEQ
    k, v = (rng.standard_normal((blocks, KV_HEADS, BLOCK, HEAD_DIM), dtype=np.float32).astype(np.float16)
            for _ in range(2))
    q = rng.standard_normal((BATCH, Q_HEADS, HEAD_DIM), dtype=np.float32).astype(np.float16)
    out = cp.empty_like(q)
    table = cp.asarray(np.random.default_rng(1).permutation(blocks).astype(np.int32).reshape(BATCH, PER_SEQ))
    lens = cp.full(BATCH, PER_SEQ * BLOCK, np.int32)
    new_k, new_v = (rng.standard_normal((BATCH, KV_HEADS, HEAD_DIM), dtype=np.float32).astype(np.float16)
                    for _ in range(2))
    slots = cp.arange(BATCH, dtype=np.int64) * (PER_SEQ * BLOCK)
    hints = dict(max_seq_len=PER_SEQ * BLOCK, mean_seq_len=float(PER_SEQ * BLOCK))

    cfg = config(q.dtype, HEAD_DIM, BLOCK, Q_HEADS // KV_HEADS)
    kern = decode._kernels(cfg, True, False, cp.cuda.Device().id)
    plan = decode._plan(cfg, BATCH, KV_HEADS, PER_SEQ * BLOCK, None, cp.cuda.Device().id)
    raw_args = (ptr(q), ptr(k), ptr(v), np.int64(KV_HEADS * BLOCK * HEAD_DIM), ptr(table), np.int64(PER_SEQ),
                np.int32(PER_SEQ), ptr(lens), np.float32(decode.LOG2E / np.sqrt(HEAD_DIM)),
                np.int32(plan.segment_tokens), ptr(out), NULL, NULL, NULL)
    grid = (KV_HEADS, BATCH, plan.num_splits)
    step = DecodePlan(q, k, table, lens, validate=False, **hints)
    write = WritePlan(new_k, k, slots, validate=False)
    calls = {
        "paged_decode(validate=False, max_seq_len, mean_seq_len)":
            lambda: paged_decode(q, k, v, table, lens, out=out, validate=False, **hints),
        "paged_decode(validate=False)": lambda: paged_decode(q, k, v, table, lens, out=out, validate=False),
        "DecodePlan(validate=False, max_seq_len, mean_seq_len), made once: run()":
            lambda: step.run(q, k, v, out=out),
        "write_kv(validate=False)": lambda: write_kv(new_k, new_v, k, v, slots, validate=False),
        "WritePlan(validate=False), made once: run()": lambda: write.run(new_k, new_v, k, v),
        "raw launch (decode kernel, arguments prepared)":
            lambda: kern.decode(grid, (kern.geometry.threads,), raw_args, shared_mem=kern.geometry.smem_bytes),
    }
    print(f"host us per call (median of {args.rounds} rounds of {args.calls} calls); batch {BATCH}, "
          f"{PER_SEQ * BLOCK} tokens each")
    for name, fn in calls.items():
        print(f"{host_us(cp, fn, args.calls, args.rounds):8.1f}  {name}")


if __name__ == "__main__":
    main()
