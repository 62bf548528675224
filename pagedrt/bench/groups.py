"""Decode at every group width: one query token per sequence, 1 to 64 query heads per KV head.

    python3 -m pagedrt.bench.groups [--groups 1,2,4,8,12,16,24,32,40,48,64] [--batch 64 --length 4096]
        [--repeats 50] [--out run.json]

One K/V shape for every group (not a standard case: ../shared/WORKLOADS.md fixes those at group 4):
by default 64 sequences of 4096 tokens, 2 KV heads, head_dim 128, fp16, blocks of 16 in the standard seeded
permutation, in a CUDA Pool: 256 MiB of K and V, so every group reads the same bytes and only the
query heads (2 x G) change. Per group it times (median, CUDA events, queued behind a spin kernel):

- ``decode``: ``DecodePlan.run``, the kernel alone (the plan made once): past 16 heads on compute
  capability 9.0 the sm_90a prefill kernel (``geometry`` wgmma), else the decode kernel;
- ``dec.cu``: the decode kernel itself (``DecodePlan(geometry="standard")``);
- ``contig``: the same kernel over contiguous K/V (``ContiguousDecodePlan``);
- ``folded``: the group folded into the query length, the way a contiguous prefill kernel (cuDNN SDPA,
  FlashAttention) is handed a wide group: ``PrefillPlan`` (non-causal) over the same planes, sequence b
  holding G query tokens of 2 heads each, token g carrying query heads g and G + g. On compute capability
  9.0 that is the sm_90a warpgroup kernel, the strongest attention kernel this package has;

and prints the decode's bandwidth ((K and V bytes + q + out) / time) against the read-only streaming
ceiling measured in the same run, its tensor-core rate (4 x 128 x 2G FLOP per token), the folded
prefill's time over the decode's (``folded/dec``: above 1, the decode is faster), and the largest
difference between the decode's output and the folded prefill's (the same attention, two kernels).
"""

import contextlib

import numpy as np

from .. import Pool
from . import harness
from .cases import BLOCK_SIZE, HEAD_DIM, scattered_table

BATCH, LENGTH, KV_HEADS = 64, 4096, 2
GROUPS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64)
COLUMNS = (
    harness.Column("group", "group", "{}", 5),
    harness.Column("q_heads", "q heads", "{}", 7),
    harness.Column("us", "decode us", "{:.1f}", 9),
    harness.Column("tb_s", "TB/s", "{:.2f}", 6),
    harness.Column("pct_stream", "%strm", "{:.1f}", 6),
    harness.Column("tflops", "TFLOP/s", "{:.0f}", 7),
    harness.Column("num_splits", "splits", "{}", 6),
    harness.Column("geometry", "geometry", "{}", 8),
    harness.Column("kernel_us", "dec.cu us", "{:.1f}", 9),
    harness.Column("contiguous_us", "contig us", "{:.1f}", 9),
    harness.Column("folded_us", "folded us", "{:.1f}", 9),
    harness.Column("folded_over_decode", "folded/dec", "{:.2f}", 10),
    harness.Column("max_abs_diff", "max diff", "{:.1e}", 8),
    harness.Column("note", "note", width=0, left=True),
)
LEGEND = ("decode: DecodePlan.run; dec.cu: the decode kernel (geometry standard); contig: the decode kernel over "
          "contiguous K/V; folded: PrefillPlan over the same "
          "planes with the group folded into the query length (non-causal); %strm: the decode's bandwidth against "
          "the read-only streaming ceiling; max diff: decode against folded outputs")


def run_group(cp, timer, group, repeats, planes, contiguous, table, lens, stream_bw):
    from .. import attention
    q_heads, (batch, length) = KV_HEADS * group, (len(lens), int(lens[0]))
    gen = cp.random.default_rng(group)
    q = gen.standard_normal((batch, q_heads, HEAD_DIM), dtype=np.float32).astype(np.float16)
    # folded: token b*G + g of sequence b holds query heads (kv*G + g) for kv = 0, 1
    q_folded = cp.ascontiguousarray(q.reshape(batch, KV_HEADS, group, HEAD_DIM).transpose(0, 2, 1, 3)).reshape(
        batch * group, KV_HEADS, HEAD_DIM)
    qo = np.arange(batch + 1, dtype=np.int64) * group
    k, v = planes
    hints = dict(max_seq_len=length, mean_seq_len=float(length))
    plan = attention.DecodePlan(q, k, table, lens, validate=False, **hints)
    kernel = attention.DecodePlan(q, k, table, lens, validate=False, geometry="standard", **hints)
    contig = attention.ContiguousDecodePlan(q, contiguous[0], lens, validate=False, **hints)
    folded = attention.PrefillPlan(q_folded, k, table, lens, cp.asarray(qo.astype(np.int32)),
                                   query_lens=np.full(batch, group, np.int64), causal=False, validate=False)
    out, contig_out, folded_out = cp.empty_like(q), cp.empty_like(q), cp.empty_like(q_folded)
    kernel_out = cp.empty_like(q)
    us = timer.gpu_us(lambda: plan.run(q, k, v, out), repeats)
    kernel_us = timer.gpu_us(lambda: kernel.run(q, k, v, kernel_out), repeats)
    contig_us = timer.gpu_us(lambda: contig.run(q, contiguous[0], contiguous[1], contig_out), repeats)
    folded_us = timer.gpu_us(lambda: folded.run(q_folded, k, v, folded_out), repeats)
    unfolded = folded_out.reshape(batch, group, KV_HEADS, HEAD_DIM).transpose(0, 2, 1, 3).reshape(q.shape)
    diff = float(cp.abs(out.astype(np.float32) - unfolded.astype(np.float32)).max())
    contig_diff = float(cp.abs(kernel_out.astype(np.float32) - contig_out.astype(np.float32)).max())
    kernel_diff = float(cp.abs(out.astype(np.float32) - kernel_out.astype(np.float32)).max())
    kv_bytes = 2 * batch * length * KV_HEADS * HEAD_DIM * 2
    moved = kv_bytes + 2 * q.nbytes
    flops = 4 * HEAD_DIM * q_heads * batch * length
    note = "; ".join(([] if contig_diff < 1e-2 else [f"paged and contiguous disagree ({contig_diff})"])
                     + ([] if kernel_diff < 1e-2 else [f"plan and decode kernel disagree ({kernel_diff})"]))
    return {"group": group, "q_heads": q_heads, "us": us, "tb_s": moved / (us * 1e-6) / 1e12,
            "pct_stream": 100 * moved / (us * 1e-6) / stream_bw, "tflops": flops / (us * 1e-6) / 1e12,
            "num_splits": plan.split.num_splits, "geometry": plan.split.geometry, "kernel_us": kernel_us,
            "kernel_splits": kernel.split.num_splits, "contiguous_us": contig_us,
            "folded_us": folded_us, "folded_kernel": folded.kernel, "folded_over_decode": folded_us / us,
            "max_abs_diff": diff, "bytes": moved, "flops": flops, "note": note}


def parser():
    ap = harness.parser("pagedrt.bench.groups", __doc__)
    ap.add_argument("--groups", default=",".join(map(str, GROUPS)), help="comma-separated query heads per KV head")
    ap.add_argument("--batch", type=int, default=BATCH, help="sequences")
    ap.add_argument("--length", type=int, default=LENGTH, help="tokens a sequence")
    ap.add_argument("--repeats", type=int, default=50, help="timed calls per measurement")
    return ap


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    groups = [int(g) for g in args.groups.split(",")]
    if any(not 1 <= g <= 64 for g in groups):
        ap.error("groups run from 1 to 64")
    if args.batch < 1 or args.length < 1:
        ap.error("--batch and --length must be positive")
    batch, length = args.batch, args.length
    import cupy as cp
    info, timer = harness.device_info(cp), harness.Timer(cp)
    bandwidth = harness.ceilings(timer, 10)
    print(harness.header(info, bandwidth))
    print(f"{batch} sequences x {length} tokens, {KV_HEADS} KV heads x {HEAD_DIM}, fp16, block {BLOCK_SIZE}")
    lens = np.full(batch, length, np.int32)
    table_host, num_blocks = scattered_table(lens)
    shape = (num_blocks, KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    contiguous_shape = (batch, table_host.shape[1]) + shape[1:]
    rows = []
    with contextlib.ExitStack() as stack:
        chunk = 64 << 20
        pool = stack.enter_context(Pool(-(-4 * int(np.prod(shape)) * 2 // chunk) * chunk, chunk, backend="cuda"))
        pool.grow(pool.num_chunks)
        plane_bytes = int(np.prod(shape)) * 2
        planes = [pool.view(i * plane_bytes, shape, np.float16) for i in range(2)]
        contiguous = [pool.view((2 + i) * plane_bytes, contiguous_shape, np.float16) for i in range(2)]
        gen = cp.random.default_rng(0)
        for plane in planes:
            for lo in range(0, num_blocks, 4096):
                plane[lo:lo + 4096] = gen.standard_normal(plane[lo:lo + 4096].shape, dtype=np.float32)
        gather = cp.asarray(table_host)
        for src, dst in zip(planes, contiguous):
            dst[...] = src[gather]
        table, d_lens = cp.asarray(table_host), cp.asarray(lens)
        for group in groups:
            row = run_group(cp, timer, group, args.repeats, planes, contiguous, table, d_lens, bandwidth["stream"])
            rows.append(row)
            print(harness.format_table(COLUMNS, [row]).splitlines()[-1])
    print()
    harness.publish("groups", args.out, info, rows, harness.format_table(COLUMNS, rows) + "\n" + LEGEND,
                    repeats=args.repeats, ceilings=bandwidth, batch=batch, length=length, kv_heads=KV_HEADS)


if __name__ == "__main__":
    main()
