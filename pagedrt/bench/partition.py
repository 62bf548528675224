"""The decode split plan's work partition for a case, on the host (no GPU): what the plan cuts, and a model of
how the thread blocks fill the device.

    python3 -m pagedrt.bench.partition [--cases var,skew] [--sms 132] [--per-sm 2] [--splits N]

:func:`~pagedrt.attention.planner.plan_splits` is host code: given the device's resident thread blocks
(SMs x blocks per SM of the standard geometry, which ``attention.decode`` reads from the occupancy API) it
picks the split count, the segment length and the geometry. The defaults are the H200's: 132 SMs, 2 blocks
per SM in the standard fp16 tensor-core geometry, 4 in the short one.

Per case it prints the plan (splits, segment tokens, geometry), the grid it launches ((kv_heads, batch,
splits) thread blocks: live ones hold tokens, empty ones, past their sequence's end, exit at once), the
longest segment against the mean of the live ones, and the waves (live blocks / resident blocks). Then a
model, not a measurement: the blocks are handed out in launch order (kv head fastest, then sequence, then
split) to whichever resident slot frees first; a live block costs ``--start-us`` (its start: table window,
q, pipeline fill, as far as another resident block's streaming does not hide it) plus its K/V bytes at an
equal share of ``--stream-tb-s`` among the blocks that run at once (every resident slot, or every live block
when there are fewer, as in a split of one long sequence), an empty block ``--empty-us``. The model leaves out
a single wave's exposed start and the split merge, and a block in the tail streams faster than its equal
share: it is for comparing cuts of one batch, not for predicting times (docs/KERNELS.md, "Skewed batches", sets
it beside the measured times). It gives the busiest slot's K/V bytes against the mean over the slots that ran
a live block (the critical path), the modelled time against the floor (all K/V bytes at the ceiling) and that
floor as a share of it.
``--splits N`` forces a split count as ``DecodePlan(num_splits=N)`` does, to compare cuts.
"""

import heapq

import numpy as np

from ..attention.planner import GEOMETRIES, geometry, plan_splits, split_residency
from ..kernels.configs import config
from . import harness
from .cases import BENCH_DECODE_CASES, BLOCK_SIZE, HEAD_DIM, KV_HEADS, Q_HEADS

H200_SMS = 132
PER_SM = {"standard": 2, "short": 4}  # resident blocks per SM of the fp16 tensor-core kernel on the H200
COLUMNS = (
    harness.Column("case", "case", width=9, left=True),
    harness.Column("batch", "batch", "{}", 5),
    harness.Column("kv_mib", "K/V MiB", "{:.0f}", 7),
    harness.Column("num_splits", "splits", "{}", 6),
    harness.Column("segment_tokens", "segment", "{}", 7),
    harness.Column("geometry", "geometry", "{}", 8),
    harness.Column("grid_blocks", "grid", "{}", 6),
    harness.Column("live_blocks", "live", "{}", 6),
    harness.Column("waves", "waves", "{:.2f}", 5),
    harness.Column("longest_over_mean", "max/mean seg", "{:.2f}", 12),
    harness.Column("critical_over_mean", "crit/mean slot", "{:.2f}", 14),
    harness.Column("model_us", "model us", "{:.1f}", 8),
    harness.Column("floor_us", "floor us", "{:.1f}", 8),
    harness.Column("model_pct", "%floor", "{:.1f}", 6),
)
LEGEND = ("grid: thread blocks launched; live: those holding tokens; waves: live / resident blocks; max/mean seg: "
          "the longest segment's tokens over the live segments' mean;\ncrit/mean slot: K/V bytes of the busiest "
          "resident slot over the mean of the slots that ran a live block, blocks handed out in launch order; "
          "model us: that schedule's end\n(a model, not a measurement); floor us: all K/V bytes at the ceiling; "
          "%floor: floor / model")


def segments(lengths, split):
    """Tokens of every thread block of the grid (kv head fastest, then sequence, then split), as the kernel
    cuts them: int64 [splits, batch, kv_heads], 0 for the empty blocks past a sequence's end."""
    lens = np.asarray(lengths, np.int64)
    begin = np.arange(split.num_splits, dtype=np.int64)[:, None] * split.segment_tokens
    end = np.where(np.arange(split.num_splits)[:, None] == split.num_splits - 1, lens[None, :],
                   np.minimum(lens[None, :], begin + split.segment_tokens))
    tokens = np.maximum(end - begin, 0)
    return np.repeat(tokens[:, :, None], KV_HEADS, axis=2)


def schedule(block_us, slots):
    """End time of each resident slot when blocks costing ``block_us`` (launch order) go to the first free one,
    and the slot each block ran on."""
    heap = [(0.0, s) for s in range(slots)]
    where = np.empty(len(block_us), np.int64)
    for i, cost in enumerate(block_us):
        free, slot = heapq.heappop(heap)
        where[i] = slot
        heapq.heappush(heap, (free + cost, slot))
    ends = np.zeros(slots)
    for free, slot in heap:
        ends[slot] = free
    return ends, where


def describe(lengths, split, resident, token_bytes, stream_tb_s=4.54, start_us=1.0, empty_us=0.2):
    """The partition of a batch of ``lengths`` under ``split`` (a SplitPlan) and its modelled schedule, as a
    row of :data:`COLUMNS` (less the case's name). ``resident``: {geometry name: thread blocks the device
    holds at once}; ``token_bytes``: K and V bytes of one token and KV head. The ceiling is shared by the
    blocks running at once: the resident slots, or the live blocks where fewer."""
    lens = np.asarray(lengths, np.int64)
    slots = resident[split.geometry]
    tokens = segments(lens, split).ravel()
    live = tokens[tokens > 0]
    slot_bytes_per_us = stream_tb_s * 1e6 / min(slots, live.size)
    block_us = np.where(tokens > 0, start_us + tokens * token_bytes / slot_bytes_per_us, empty_us)
    ends, where = schedule(block_us, slots)
    per_slot = np.bincount(where, weights=tokens * token_bytes, minlength=slots)
    kv_bytes = int(lens.sum()) * KV_HEADS * token_bytes
    floor_us = kv_bytes / (stream_tb_s * 1e6)
    return {
        "batch": len(lens), "kv_mib": kv_bytes / 2**20, "num_splits": split.num_splits,
        "segment_tokens": split.segment_tokens, "geometry": split.geometry, "grid_blocks": int(tokens.size),
        "live_blocks": int(live.size), "waves": live.size / slots, "resident_blocks": slots,
        "longest_over_mean": float(live.max() / live.mean()),
        "critical_over_mean": float(per_slot[np.argmax(ends)] / per_slot[per_slot > 0].mean()),
        "model_us": float(ends.max()), "floor_us": floor_us, "model_pct": 100 * floor_us / float(ends.max()),
    }


def partition(case, sms=H200_SMS, per_sm=None, num_splits=None, **model):
    """The plan of ``case`` on a device of ``sms`` SMs holding ``per_sm`` ({geometry: blocks per SM}, default
    the H200's) and its modelled schedule (:func:`describe`; ``model``: its keywords)."""
    per_sm = dict(PER_SM, **(per_sm or {}))
    cfg = config(np.dtype(case.dtype), HEAD_DIM, BLOCK_SIZE, Q_HEADS // KV_HEADS)
    lens = np.asarray(case.lengths, np.int64)
    token_bytes = 2 * HEAD_DIM * cfg.kv_itemsize
    resident = {name: sms * n for name, n in per_sm.items()}
    standard = geometry(cfg, "standard")
    split = plan_splits(len(lens), KV_HEADS, int(lens.max()), standard.tile, token_bytes,
                        split_residency(resident["standard"], sms, standard.pipeline_bytes), num_splits=num_splits,
                        mean_seq_len=float(lens.mean()), wave_blocks=resident["standard"])
    return {"case": case.name, **describe(lens, split, resident, token_bytes, **model)}


def device_resident(cfg):
    """{geometry name: thread blocks of the paged decode kernel the current device holds at once}, from the
    occupancy API as ``attention.decode`` reads it (compiles the kernels)."""
    import cupy
    from cupy_backends.cuda.api import driver
    from .. import source
    from ..attention import decode
    sms = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["multiProcessorCount"]
    out = {}
    for name in GEOMETRIES:
        geo = geometry(cfg, name)
        fn = source.function(decode.FILE, decode.kernel_name(cfg, True, name))
        fn.max_dynamic_shared_size_bytes = geo.smem_bytes
        out[name] = sms * max(1, driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, geo.threads,
                                                                                   geo.smem_bytes))
    return out


def parser():
    ap = harness.parser("pagedrt.bench.partition", __doc__)
    ap.add_argument("--cases", default="var,skew", help=f"comma-separated, of {', '.join(BENCH_DECODE_CASES)}")
    ap.add_argument("--sms", type=int, default=H200_SMS, help="streaming multiprocessors (H200: 132)")
    ap.add_argument("--per-sm", type=int, default=PER_SM["standard"],
                    help="resident blocks per SM of the standard geometry (H200, fp16 tensor cores: 2)")
    ap.add_argument("--splits", type=int, default=None, help="force a split count (DecodePlan's num_splits)")
    ap.add_argument("--stream-tb-s", type=float, default=4.54, help="the read-only ceiling the model streams at")
    ap.add_argument("--start-us", type=float, default=1.0, help="the model's cost of a live block's start")
    ap.add_argument("--empty-us", type=float, default=0.2, help="the model's cost of an empty block")
    return ap


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    if min(args.sms, args.per_sm) < 1 or (args.splits is not None and args.splits < 1):
        ap.error("--sms, --per-sm and --splits must be at least 1")
    if args.stream_tb_s <= 0 or min(args.start_us, args.empty_us) < 0:
        ap.error("--stream-tb-s must be positive, --start-us and --empty-us not negative")
    names = harness.case_names(ap, args.cases, BENCH_DECODE_CASES)
    model = dict(stream_tb_s=args.stream_tb_s, start_us=args.start_us, empty_us=args.empty_us)
    rows = [partition(BENCH_DECODE_CASES[n], args.sms, {"standard": args.per_sm, "short": 2 * args.per_sm},
                      args.splits, **model) for n in names]
    text = (f"{args.sms} SMs x {args.per_sm} resident blocks (standard geometry; short: twice as many); model: "
            f"{args.stream_tb_s} TB/s shared by the blocks running at once, {args.start_us} us a live block's start, "
            f"{args.empty_us} us an empty block\n" + harness.format_table(COLUMNS, rows) + "\n" + LEGEND)
    print(text)
    if args.out:
        harness.write_record(args.out, harness.record("partition", {"device": "host model"}, rows, text))


if __name__ == "__main__":
    main()
