"""A 32-layer decode step as a real step interleaves it: per layer the new token's K/V written, then attention.

    python3 -m pagedrt.bench.step_layers [--cases long-1,b8,...,skew] [--kv-dtype float8_e4m3] [--repeats 20]
                                         [--out run.json]

Each case (the standard fp16 decode cases and ``skew``, ``pagedrt.bench.cases``) lives in a real 32-layer
PagedKVCache (plane-major, random values), its block table the standard seeded permutation. A step makes one
``WritePlan`` (each sequence's newest token, the last of its length, into its slot) and one ``DecodePlan``,
then runs, for every layer, the write and the attention over that layer's planes. It is timed four ways
(GPU time, CUDA events around each step, steps queued behind a spin kernel, median):

- ``plain``: CuPy's launches, one after another;
- ``graph``: the plain step captured once as a CUDA graph and replayed;
- ``pdl``: the same launches through ``cuLaunchKernelEx`` with programmatic stream serialization
  (``pagedrt.kernels.launch.dependent_launches``): each kernel's blocks may start while the kernel before it
  finishes, and wait for it (``griddepcontrol.wait``) before they touch memory;
- ``pdl graph``: the PDL step captured and replayed.

Per case it prints the single launch (one layer's attention alone, as ``pagedrt.bench.decode`` times it) and
one layer's write alone, each way's step time, its bytes of all layers (K/V, q and out of every layer's
attention, and the written K/V read and stored) over the step time against the read-only streaming ceiling
measured in the same run, and the step per layer against the single launch plus the write
(``vs single``: +3% means a layer in the step costs 3% more than the two launches alone). It checks that
every way gives the plain step's output, bit for bit. The H200's figures are in docs/KERNELS.md
("Programmatic dependent launch").

``--kv-dtype float8_e4m3``: the cache stores K and V as float8 e4m3 (random finite bytes, every scale 1/64);
the write quantises the new fp16 tokens, the attention reads FP8, and the bytes count one a K/V value.
"""

import numpy as np

from .. import PagedKVCache
from ..supported import FP8
from . import harness
from .cases import BENCH_DECODE_CASES, BLOCK_SIZE, HEAD_DIM, KV_HEADS, Q_HEADS, scattered_table
from .layers import LAYERS, fill_random, fill_random_e4m3

CASES = [name for name, case in BENCH_DECODE_CASES.items() if case.dtype == "float16"]
WAYS = ("plain", "graph", "pdl", "pdl_graph")
COLUMNS = (
    harness.Column("case", "case", width=7, left=True),
    harness.Column("single_us", "single us", "{:.1f}", 9),
    harness.Column("write_us", "write us", "{:.1f}", 8),
) + tuple(col for way in WAYS for col in (
    harness.Column(f"{way}_ms", f"{way.replace('_', ' ')} ms", "{:.3f}", max(8, len(way) + 3)),
    harness.Column(f"{way}_pct_stream", "%strm", "{:.1f}", 5),
    harness.Column(f"{way}_vs_single_pct", "vs single", "{:+.1f}%", 9),
)) + (harness.Column("note", "note", width=0, left=True),)
LEGEND = ("single us: one layer's attention launched alone; write us: one layer's K/V write alone; per way: the "
          "step's GPU ms,\n%strm: bytes of all layers / step time against the streaming ceiling, vs single: step / "
          f"{LAYERS} against single + write")


def new_token_slots(table, lens, block_size=BLOCK_SIZE):
    """int64 slot of each sequence's newest token (position ``len - 1``) under ``table``."""
    last = np.asarray(lens, np.int64) - 1
    blocks = np.asarray(table)[np.arange(len(last)), last // block_size].astype(np.int64)
    return blocks * block_size + last % block_size


def step_bytes(lens, batch, itemsize, kv_itemsize=None):
    """Bytes one layer moves: its attention's K/V, q and out, and the written tokens' K/V read (in q's dtype,
    ``itemsize``) and stored (in the cache's, ``kv_itemsize``: ``itemsize`` unless given)."""
    kv_itemsize = itemsize if kv_itemsize is None else kv_itemsize
    kv = 2 * int(np.sum(lens)) * KV_HEADS * HEAD_DIM * kv_itemsize
    written = 2 * batch * KV_HEADS * HEAD_DIM * (itemsize + kv_itemsize)
    return kv + 2 * batch * Q_HEADS * HEAD_DIM * itemsize + written


def run(cp, timer, case, repeats, stream_bw, kv_dtype=None):
    from .. import attention, kernels
    from ..kernels.launch import dependent_launches
    lens_host = np.asarray(case.lengths, np.int32)
    table_host, num_blocks = scattered_table(lens_host)
    scales = None if kv_dtype is None else np.full((LAYERS, 2, KV_HEADS), 1 / 64, np.float32)
    with PagedKVCache(LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, case.dtype, max_tokens=num_blocks * BLOCK_SIZE,
                      max_seqs=case.batch, max_seq_len=int(lens_host.max()), backend="cuda", kv_dtype=kv_dtype,
                      kv_scales=scales) as cache:
        seqs = np.array([cache.add_sequence() for _ in range(case.batch)])
        cache.append(seqs, lens_host)  # maps the chunks the blocks need
        held = cache.block_tables()
        if int(held.max()) != num_blocks - 1:
            raise RuntimeError(f"the cache holds blocks up to {int(held.max())}, not 0..{num_blocks - 1}")
        planes = ([cache.k(layer)[:num_blocks] for layer in range(LAYERS)],
                  [cache.v(layer)[:num_blocks] for layer in range(LAYERS)])
        for plane in planes[0] + planes[1]:
            (fill_random if kv_dtype is None else fill_random_e4m3)(cp, plane)
        k_scales = [cache.k_scale(layer) for layer in range(LAYERS)]  # None but for FP8
        v_scales = [cache.v_scale(layer) for layer in range(LAYERS)]
        rng = cp.random.default_rng(2)
        q = rng.standard_normal((LAYERS, case.batch, Q_HEADS, HEAD_DIM), dtype=np.float32).astype(cache.dtype)
        new = rng.standard_normal((2, LAYERS, case.batch, KV_HEADS, HEAD_DIM), dtype=np.float32).astype(cache.dtype)
        out = cp.empty_like(q)
        table, lens = cp.asarray(table_host), cp.asarray(lens_host)
        slots = cp.asarray(new_token_slots(table_host, lens_host))
        hints = dict(max_seq_len=int(lens_host.max()), mean_seq_len=float(lens_host.mean()))
        cp.cuda.Device().synchronize()  # the uploads and fills above ran on the legacy stream: done before
        stream = cp.cuda.Stream(non_blocking=True)  # a non-blocking stream, which does not wait for it, reads them
        with stream:
            plan = attention.DecodePlan(q[0], planes[0][0], table, lens, validate=False, **hints)
            writer = kernels.WritePlan(new[0, 0], planes[0][0], slots, validate=False)

            def step():
                for layer in range(LAYERS):
                    k, v = planes[0][layer], planes[1][layer]
                    layer_scales = dict(k_scale=k_scales[layer], v_scale=v_scales[layer])
                    writer.run(new[0, layer], new[1, layer], k, v, **layer_scales)
                    plan.run(q[layer], k, v, out[layer], **layer_scales)

            def pdl_step():
                with dependent_launches():
                    step()

            def capture(fn):
                fn()  # compiled and warm before capture
                stream.synchronize()
                stream.begin_capture()
                fn()
                return stream.end_capture()

            first = dict(k_scale=k_scales[0], v_scale=v_scales[0])
            single_us = timer.gpu_us(lambda: plan.run(q[0], planes[0][0], planes[1][0], out[0], **first), repeats)
            write_us = timer.gpu_us(lambda: writer.run(new[0, 0], new[1, 0], planes[0][0], planes[1][0], **first),
                                    repeats)
            graphs = {"graph": capture(step), "pdl_graph": capture(pdl_step)}
            calls = {"plain": step, "pdl": pdl_step, **{w: (lambda g=g: g.launch(stream)) for w, g in graphs.items()}}
            row, note = {"case": case.name, "single_us": single_us, "write_us": write_us}, []
            moved = LAYERS * step_bytes(lens_host, case.batch, cache.dtype.itemsize, planes[0][0].dtype.itemsize)
            for way in WAYS:
                us = timer.gpu_us(calls[way], max(10, repeats // 2))
                row[f"{way}_ms"] = us * 1e-3
                row[f"{way}_pct_stream"] = 100 * moved / (us * 1e-6) / stream_bw
                row[f"{way}_vs_single_pct"] = 100 * (us / LAYERS / (single_us + write_us) - 1)
                out.fill(0)
                calls[way]()
                stream.synchronize()
                result = cp.asnumpy(out.view(np.uint16))
                if way == "plain":
                    expected = result
                elif not np.array_equal(result, expected):
                    note.append(f"{way} differs from plain")
        row.update(note="; ".join(note), batch=case.batch, tokens=int(lens_host.sum()), bytes_per_step=moved,
                   kv_dtype=cache.kv_dtype,
                   num_splits=plan.split.num_splits, geometry=plan.split.geometry)
        return row


def parser():
    ap = harness.parser("pagedrt.bench.step_layers", __doc__)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--kv-dtype", choices=("same", FP8), default="same",
                    help="K/V in the cases' dtype (fp16) or as float8 e4m3")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per single-launch measurement (steps: "
                                                            "half as many, at least 10)")
    return ap


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    names = harness.case_names(ap, args.cases, CASES)
    import cupy as cp
    info = harness.device_info(cp)
    timer = harness.Timer(cp)
    bandwidth = harness.ceilings(timer, 10)
    print(harness.header(info, bandwidth))
    kv_dtype = None if args.kv_dtype == "same" else args.kv_dtype
    print(f"{LAYERS} layers, fp16" + (f" (K/V {kv_dtype}, bytes counted as stored)" if kv_dtype else "") +
          f", {Q_HEADS}/{KV_HEADS} heads x {HEAD_DIM}, block {BLOCK_SIZE}; per layer: write_kv of the new tokens, "
          "then decode attention")
    rows = []
    for name in names:
        row = run(cp, timer, BENCH_DECODE_CASES[name], args.repeats, bandwidth["stream"], kv_dtype)
        rows.append(row)
        print(harness.format_table(COLUMNS, [row]).splitlines()[-1])
        cp.get_default_memory_pool().free_all_blocks()
    print()
    harness.publish("step_layers", args.out, info, rows, harness.format_table(COLUMNS, rows) + "\n" + LEGEND,
                    repeats=args.repeats, ceilings=bandwidth)


if __name__ == "__main__":
    main()
