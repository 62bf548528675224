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
from .cases import BLOCK_SIZE, HEAD_DIM, KV_HEADS, PREFILL_CASES, Q_HEADS, PrefillCase, scattered_table

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


def case_arrays(cp, case, fp8=False):
    """A :class:`~pagedrt.bench.cases.PrefillCase`'s arrays on the GPU.

    Returns a dict: ``q`` [new tokens, Q_HEADS, HEAD_DIM] float16; ``tables``, the block table with scattered
    ids (:func:`~pagedrt.bench.cases.scattered_table`), then with ids in order, each [sequences, most blocks]
    int32 padded with -1; ``planes``, the (K, V) planes [blocks, KV_HEADS, BLOCK_SIZE, HEAD_DIM] each table
    reads (in the second, block j holds what the first's block ids[j] holds: both give the same output);
    ``lens`` the sequences' lengths (prefix + new) int32; ``qo`` the host's int64 query offsets [sequences + 1]
    and ``d_qo`` the same on the GPU, int32; ``blocks`` the host's blocks per sequence; ``scales``, FP8's
    ``k_scale`` and ``v_scale`` keywords of ``PrefillPlan.run`` (fp16: none). ``cp`` is CuPy, or NumPy for a
    host copy."""
    prefix, new = np.asarray(case.prefix, np.int64), np.asarray(case.new, np.int64)
    lens = prefix + new
    scattered, num_blocks = scattered_table(lens)
    ordered, _ = scattered_table(lens, shuffle=False)
    shape = (num_blocks, KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    gen = cp.random.default_rng(0)
    if fp8:  # bit 3 and the sign cleared: finite, positive e4m3 values (never the NaN code 0x7F)
        k, v = (gen.integers(0, 256, shape, dtype=np.uint8) & np.uint8(0x77) for _ in range(2))
    else:
        k, v = (gen.standard_normal(shape, dtype=np.float32).astype(np.float16) for _ in range(2))
    scales = {"k_scale": cp.full(KV_HEADS, 0.02, np.float32), "v_scale": cp.full(KV_HEADS, 0.05, np.float32)}
    q = gen.standard_normal((int(new.sum()), Q_HEADS, HEAD_DIM), dtype=np.float32).astype(np.float16)
    qo = np.zeros(lens.size + 1, np.int64)
    np.cumsum(new, out=qo[1:])
    gather = cp.asarray(scattered[scattered >= 0])  # row by row: the ordered table's block j is this block
    return {"q": q, "tables": [cp.asarray(scattered), cp.asarray(ordered)],
            "planes": [(k, v), (k[gather], v[gather])], "lens": cp.asarray(lens.astype(np.int32)), "qo": qo,
            "d_qo": cp.asarray(qo.astype(np.int32)), "blocks": -(-lens // BLOCK_SIZE), "scales": scales if fp8 else {}}


def run_case(cp, timer, case, repeats, fp8=False):
    """(paged us, contiguous us, whether both gave the same output, the case's arrays, the SM clock in MHz right
    after the paged calls) of one :class:`~pagedrt.bench.cases.PrefillCase`; ``fp8``: over FP8 planes."""
    from .. import attention
    new = np.asarray(case.new, np.int64)
    a = case_arrays(cp, case, fp8)
    q, scales = a["q"], a["scales"]
    times, outs, mhz = [], [], None
    for table, (k_plane, v_plane) in zip(a["tables"], a["planes"]):
        plan = attention.PrefillPlan(q, k_plane, table, a["lens"], a["d_qo"], query_lens=new, validate=False)
        out = cp.empty_like(q)
        times.append(timer.gpu_us(lambda: plan.run(q, k_plane, v_plane, out, **scales), repeats, flush_l2=True))
        mhz = timer.sm_mhz() if mhz is None else mhz  # the clock the paged calls ran at
        outs.append(out)
    same = bool(cp.array_equal(outs[0], outs[1]))
    return times[0], times[1], same, (q, a["planes"][0], a["tables"][0], a["lens"], a["qo"], scales), mhz


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
    ap.add_argument("--cases", default=",".join(PREFILL_CASES), help="comma-separated case names")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per measurement")
    ap.add_argument("--kv-dtype", choices=("same", FP8), default="same",
                    help="what the planes hold: fp16 (standard), or float8 e4m3 (FP8 K/V)")
    return ap


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    names = harness.case_names(ap, args.cases, PREFILL_CASES)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    import cupy as cp
    info, timer = harness.device_info(cp), harness.Timer(cp)
    bandwidth = harness.ceilings(timer, 10)
    print(harness.header(info, bandwidth))
    rows = []
    for name in names:
        case = PREFILL_CASES[name]
        paged, contiguous, same, arrays, mhz = run_case(cp, timer, case, args.repeats, args.kv_dtype == FP8)
        flops = case.flops
        rows.append({"case": name, "tokens": sum(case.new), "us": paged, "tflops": flops / (paged * 1e-6) / 1e12,
                     "sm_mhz": mhz, "contiguous_us": contiguous, "paging": paged / contiguous - 1, "flops": flops,
                     "note": "" if same else "paged and contiguous outputs differ"})
        if name == "mixed":
            rows[-1]["prompt_us"], rows[-1]["decode_us"] = parts_us(cp, timer, arrays, np.asarray(case.new),
                                                                    args.repeats)
        del arrays
        cp.get_default_memory_pool().free_all_blocks()
    dense = max((r["tflops"] for r in rows if r["case"] != "mixed"), default=None)
    for r in rows:
        if r["case"] == "mixed" and dense and args.kv_dtype == "same":  # the floor counts fp16 decode bytes
            mixed = PREFILL_CASES["mixed"]
            decode_bytes = 2 * sum(mixed.prefix[1:]) * KV_HEADS * HEAD_DIM * 2
            prompt_flops = PrefillCase("prompt", mixed.prefix[:1], mixed.new[:1]).flops
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
