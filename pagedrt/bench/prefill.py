"""Prefill attention on the standard prefill workloads: time, TFLOP/s, and what paging costs.

    python3 -m pagedrt.bench.prefill [--cases p1,p16,chunk,mixed,var] [--repeats 20] [--out FILE]
    python3 -m pagedrt.bench.prefill --kv-dtype float8_e4m3 [--cases ...]   # K/V stored as FP8

The cases of ../shared/WORKLOADS.md ("Standard prefill workloads"): fp16, 32 query heads, 8 KV
heads, head_dim 128, block size 16, block ids a seeded random permutation, the new tokens' K/V
already in the cache, causal aligned bottom-right. Per case: the median GPU time of one
``PrefillPlan.run`` (the plan made once, as a step makes it; CUDA events, warm-up first, L2 flushed
before each timed call), TFLOP/s = 4 x 32 x 128 x (the keys each new token attends to, summed) /
time, the SM clock right after those calls (prefill is bound by its MMAs, and the clock falls within
a few hundred milliseconds of such load, so a case's figure depends on what ran before it:
docs/KERNELS.md), and the same kernel over the same K/V laid out contiguously (block ids in order:
what the table's scattering costs). For ``mixed`` (one 1024-token prompt beside 127 decode tokens
over 2048 cached tokens each): its floor, the decode rows' K/V bytes at the read-only streaming
ceiling plus the prompt's FLOPs at the best dense rate of this run, the time against it, and each
part run alone (a plan over the prompt row only, and one over the decode rows only), which shows how
much of one the plan hides behind the other.

``--kv-dtype float8_e4m3`` runs the same cases over FP8 planes (random finite e4m3 bytes, a scale per KV
head): the rows of many tokens on the sm_90a kernel's FP8 twin on compute capability 9.0 (elsewhere on
``prefill_fp8``, the mma.sync kernel converting K and V in registers), ``mixed``'s decode rows on
``decode_fp8``; ``mixed`` has no floor (it counts fp16 bytes).
"""

import numpy as np

from ..supported import FP8
from . import harness

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
COLUMNS = (
    harness.Column("case", "case", width=6, left=True),
    harness.Column("tokens", "new tokens", "{}", 10),
    harness.Column("us", "us", "{:.1f}", 9),
    harness.Column("tflops", "TFLOP/s", "{:.1f}", 8),
    harness.Column("sm_mhz", "SM MHz", "{:.0f}", 6),
    harness.Column("contiguous_us", "contig us", "{:.1f}", 9),
    harness.Column("paging", "paging", "{:+.1%}", 7),
    harness.Column("floor_us", "floor us", "{:.1f}", 8),
    harness.Column("over_floor", "x floor", "{:.2f}", 7),
    harness.Column("prompt_us", "prompt us", "{:.1f}", 9),
    harness.Column("decode_us", "decode us", "{:.1f}", 9),
    harness.Column("note", "note", "{}", 4, left=True),
)


def cases():
    """{name: (prefix per sequence, new tokens per sequence)} as WORKLOADS.md fixes them."""
    var = np.clip(np.random.default_rng(0).lognormal(np.log(512), 1.0, 32).astype(np.int64), 1, 8192)
    return {
        "p1": ([0], [8192]),
        "p16": ([0] * 16, [1024] * 16),
        "chunk": ([6144] * 4, [2048] * 4),
        "mixed": ([0] + [2048] * 127, [1024] + [1] * 127),
        "var": ([0] * 32, var.tolist()),
    }


def attended_keys(prefix, new):
    """Keys attended, summed over new tokens: token i of n after P cached sees P + i + 1."""
    p, n = np.asarray(prefix, np.int64), np.asarray(new, np.int64)
    return int((n * p + n * (n + 1) // 2).sum())


def run_case(cp, timer, prefix, new, repeats, fp8=False):
    """(paged us, contiguous us, whether both gave the same output, the case's arrays, the SM clock in MHz right
    after the paged calls) of one case; ``fp8``: over FP8 planes."""
    from .. import attention
    prefix, new = np.asarray(prefix, np.int64), np.asarray(new, np.int64)
    lens = prefix + new
    blocks = -(-lens // BLOCK)
    width, num_blocks = int(blocks.max()), int(blocks.sum())
    rng = np.random.default_rng(0)
    ids = rng.permutation(num_blocks).astype(np.int32)
    ordered = np.arange(num_blocks, dtype=np.int32)
    tables = []
    for order in (ids, ordered):
        table = np.zeros((lens.size, width), np.int32)
        start = 0
        for b, nb in enumerate(blocks.tolist()):
            table[b, :nb] = order[start:start + nb]
            start += nb
        tables.append(cp.asarray(table))
    shape = (num_blocks, KV_HEADS, BLOCK, HEAD_DIM)
    gen = cp.random.default_rng(0)
    if fp8:  # bit 3 and the sign cleared: finite, positive e4m3 values (never the NaN code 0x7F)
        k, v = (gen.integers(0, 256, shape, dtype=np.uint8) & np.uint8(0x77) for _ in range(2))
    else:
        k, v = (gen.standard_normal(shape, dtype=np.float32).astype(np.float16) for _ in range(2))
    scales = {"k_scale": cp.full(KV_HEADS, 0.02, np.float32), "v_scale": cp.full(KV_HEADS, 0.05, np.float32)}
    scales = scales if fp8 else {}
    q = gen.standard_normal((int(new.sum()), Q_HEADS, HEAD_DIM), dtype=np.float32).astype(np.float16)
    qo = np.zeros(lens.size + 1, np.int64)
    np.cumsum(new, out=qo[1:])
    d_lens, d_qo = cp.asarray(lens.astype(np.int32)), cp.asarray(qo.astype(np.int32))
    gather = cp.asarray(ids)
    planes = [(k, v), (k[gather], v[gather])]  # the second: block j holds what block ids[j] holds
    times, outs, mhz = [], [], None
    for table, (k_plane, v_plane) in zip(tables, planes):
        plan = attention.PrefillPlan(q, k_plane, table, d_lens, d_qo, query_lens=new, validate=False)
        out = cp.empty_like(q)
        times.append(timer.gpu_us(lambda: plan.run(q, k_plane, v_plane, out, **scales), repeats, flush_l2=True))
        mhz = timer.sm_mhz() if mhz is None else mhz  # the clock the paged calls ran at
        outs.append(out)
    same = bool(cp.array_equal(outs[0], outs[1]))
    return times[0], times[1], same, (q, planes[0], tables[0], d_lens, qo, scales), mhz


def parts_us(cp, timer, arrays, new, repeats):
    """(us of the multi-token rows alone, us of the one-token rows alone): a plan over each set of rows."""
    from .. import attention
    q, (k, v), table, lens, qo, scales = arrays
    times = []
    for rows in (np.flatnonzero(new != 1), np.flatnonzero(new == 1)):
        tokens = np.concatenate([np.arange(qo[b], qo[b + 1]) for b in rows])
        part_q = q[cp.asarray(tokens)]
        part_qo = np.concatenate(([0], np.cumsum(new[rows]))).astype(np.int32)
        plan = attention.PrefillPlan(part_q, k, table[cp.asarray(rows)], lens[cp.asarray(rows)], cp.asarray(part_qo),
                                     query_lens=new[rows], validate=False)
        out = cp.empty_like(part_q)
        times.append(timer.gpu_us(lambda: plan.run(part_q, k, v, out, **scales), repeats, flush_l2=True))
    return tuple(times)


def parser():
    ap = harness.parser("pagedrt.bench.prefill", __doc__)
    ap.add_argument("--cases", default=",".join(cases()), help="comma-separated case names")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per measurement")
    ap.add_argument("--kv-dtype", choices=("same", FP8), default="same",
                    help="what the planes hold: fp16 (standard), or float8 e4m3 (FP8 K/V)")
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    import cupy as cp
    info, timer = harness.device_info(cp), harness.Timer(cp)
    bandwidth = harness.ceilings(timer, 10)
    print(harness.header(info, bandwidth))
    table = cases()
    rows = []
    for name in args.cases.split(","):
        prefix, new = table[name]
        fp8 = args.kv_dtype == FP8
        paged, contiguous, same, arrays, mhz = run_case(cp, timer, prefix, new, args.repeats, fp8)
        flops = 4 * Q_HEADS * HEAD_DIM * attended_keys(prefix, new)
        rows.append({"case": name, "tokens": int(sum(new)), "us": paged, "tflops": flops / (paged * 1e-6) / 1e12,
                     "sm_mhz": mhz, "contiguous_us": contiguous, "paging": paged / contiguous - 1, "flops": flops,
                     "note": "" if same else "paged and contiguous outputs differ"})
        if name == "mixed":
            rows[-1]["prompt_us"], rows[-1]["decode_us"] = parts_us(cp, timer, arrays, np.asarray(new), args.repeats)
        del arrays
        cp.get_default_memory_pool().free_all_blocks()
    dense = max((r["tflops"] for r in rows if r["case"] != "mixed"), default=None)
    for r in rows:
        if r["case"] == "mixed" and dense and args.kv_dtype == "same":  # the floor counts fp16 decode bytes
            prefix, new = table["mixed"]
            decode_bytes = 2 * sum(prefix[1:]) * KV_HEADS * HEAD_DIM * 2
            prompt_flops = 4 * Q_HEADS * HEAD_DIM * attended_keys(prefix[:1], new[:1])
            r["floor_us"] = 1e6 * (decode_bytes / bandwidth["stream"] + prompt_flops / (dense * 1e12))
            r["over_floor"] = r["us"] / r["floor_us"]
    harness.publish("prefill", args.out, info, rows,
                    harness.format_table(COLUMNS, rows) + "\nmedian us, L2 flushed; SM MHz: the clock right after "
                    "the paged calls (the spin kernel); contig: the same kernel over "
                    "block ids in order; floor (mixed): decode K/V at the stream ceiling + prompt FLOPs at the "
                    "best dense rate above; prompt, decode (mixed): a plan over the prompt row alone, and one over "
                    "the decode rows alone", args.plot,
                    repeats=args.repeats, ceilings=bandwidth, kv_dtype=args.kv_dtype)


if __name__ == "__main__":
    main()
