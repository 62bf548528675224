"""A decode step over every layer of a 32-layer model: placement, Python launches vs a CUDA graph.

    PYTHONPATH=. python3 tools/bench_layers.py [--cases b32,big,long-1] [--repeats 20] [--chunk-mib 64]

The standard decode shape (fp16, 32 query heads, 8 KV heads, head_dim 128, block
16) with 32 layers, in a real PagedKVCache, placed

- plane-major: one region of the range per layer and K/V (consecutive blocks of
  a layer are 32 KiB apart: 64 to a 2 MiB page), or
- block-major: a block holds every layer's K and V (2 MiB), so consecutive
  blocks of one layer are 2 MiB apart: each in its own page.

Block tables are a seeded random permutation of the cache's blocks (the same for
every layer: a block id names the same tokens in every layer). Per case and
placement: the GPU time of one step (32 layers' paged_decode, validate=False)
launched from Python, the same step as one DecodePlan run per layer, and the
first replayed as a CUDA graph (CUDA events, median), the host time to launch
the 32 layers either way, and the bandwidth per layer against a
read-only streaming ceiling measured in the same run.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedrt.cache import PagedKVCache  # noqa: E402
from pagedrt import source  # noqa: E402
from pagedrt.kernels import DecodePlan, paged_decode  # noqa: E402
from timing import event_seconds  # noqa: E402  (tools/timing.py)

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 32, 8, 128, 16
CASES = {"long-1": (1, 32768), "b8": (8, 8192), "b32": (32, 4096), "b64": (64, 2048), "b128": (128, 1024),
         "b256": (256, 512), "big": (64, 8192)}
MiB = 1 << 20


def stream_ceiling(cp, nbytes=4 << 30):
    """Read-only streaming bandwidth (bytes/s) of the benchmark kernel in cuda_src/bench.cu."""
    src = cp.ones(nbytes, np.uint8)
    read = source.function("bench.cu", "pagedrt::stream_read")
    sms = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["multiProcessorCount"]
    sink = cp.zeros(1, np.uint32)
    return nbytes / event_seconds(cp, lambda: read((sms * 8,), (256,), (src, np.int64(nbytes // 16), np.uint32(1),
                                                                       sink)), 10)


def fill_random(cp, plane):
    """Fill a plane with random fp16 values by tiling one random buffer (fast for tens of GiB)."""
    tile = cp.random.default_rng(0).standard_normal((256,) + plane.shape[1:], dtype=np.float32).astype(plane.dtype)
    for lo in range(0, plane.shape[0], 256):
        n = min(256, plane.shape[0] - lo)
        plane[lo:lo + n] = tile[:n]


def run(cp, case, placement, chunk, repeats):
    batch, length = CASES[case]
    per_seq = -(-length // BLOCK)
    num_blocks = batch * per_seq
    with PagedKVCache(LAYERS, KV_HEADS, HEAD_DIM, BLOCK, "float16", max_tokens=num_blocks * BLOCK,
                      max_seqs=batch, max_seq_len=length, placement=placement, chunk_bytes=chunk,
                      backend="cuda") as cache:
        cache.allocator.grow(cache.allocator.num_chunks)
        perm = np.random.default_rng(1).permutation(num_blocks).astype(np.int32)
        table = cp.asarray(perm.reshape(batch, per_seq))
        lens = cp.full(batch, length, np.int32)
        planes = [cache.k(layer)[:num_blocks] for layer in range(LAYERS)], \
                 [cache.v(layer)[:num_blocks] for layer in range(LAYERS)]
        for plane in planes[0] + planes[1]:
            fill_random(cp, plane)
        q = cp.random.default_rng(2).standard_normal((LAYERS, batch, Q_HEADS, HEAD_DIM), dtype=np.float32)
        q = q.astype(np.float16)
        out = cp.empty_like(q)

        def step():
            for layer in range(LAYERS):
                paged_decode(q[layer], planes[0][layer], planes[1][layer], table, lens, out=out[layer],
                             validate=False)

        def planned_step():
            plan = DecodePlan(q[0], planes[0][0], table, lens, validate=False)
            for layer in range(LAYERS):
                plan.run(q[layer], planes[0][layer], planes[1][layer], out=out[layer])

        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            step()  # compile, plan and workspace on this stream before capture
            stream.synchronize()
            launch_us = {}
            for name, fn in (("plain", step), ("planned", planned_step)):
                times = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t)
                    stream.synchronize()
                launch_us[name] = statistics.median(times) * 1e6
            plain_ms = 1e3 * event_seconds(cp, step, repeats)
            planned_ms = 1e3 * event_seconds(cp, planned_step, repeats)
            stream.begin_capture()
            step()
            graph = stream.end_capture()
            graph_ms = 1e3 * event_seconds(cp, lambda: graph.launch(stream), repeats)
        kv_bytes = 2 * batch * length * KV_HEADS * HEAD_DIM * 2
        moved = LAYERS * (kv_bytes + 2 * batch * Q_HEADS * HEAD_DIM * 2)
        return {"plain_ms": plain_ms, "planned_ms": planned_ms, "graph_ms": graph_ms,
                "launch_us": launch_us["plain"], "planned_launch_us": launch_us["planned"],
                "graph_bw": moved / (graph_ms * 1e-3), "chunk_mib": cache.pool.chunk_bytes // MiB,
                "block_stride": cache.layout.block_stride_bytes}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="b32,big,long-1")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--chunk-mib", type=int, default=64, help="physical chunk size (per plane when plane-major)")
    args = ap.parse_args()
    import cupy as cp
    ceiling = stream_ceiling(cp)
    print(f"stream ceiling {ceiling / 1e12:.2f} TB/s; {LAYERS} layers, fp16, 32/8 heads x 128, block 16")
    head = (f"{'case':<7} {'placement':<9} {'stride':>9} {'chunk':>6} | {'launched ms':>11} {'planned ms':>10} "
            f"{'graph ms':>9} {'launch us':>9} {'planned us':>10} | {'TB/s':>5} {'%strm':>6}")
    print(head + "\n" + "-" * len(head))
    for case in args.cases.split(","):
        for placement in ("plane", "block"):
            r = run(cp, case, placement, args.chunk_mib * MiB, args.repeats)
            print(f"{case:<7} {placement:<9} {r['block_stride']:>9} {r['chunk_mib']:>4}Mi | {r['plain_ms']:>11.3f} "
                  f"{r['planned_ms']:>10.3f} {r['graph_ms']:>9.3f} {r['launch_us']:>9.0f} "
                  f"{r['planned_launch_us']:>10.0f} | {r['graph_bw'] / 1e12:>5.2f} "
                  f"{100 * r['graph_bw'] / ceiling:>6.1f}")
            cp.get_default_memory_pool().free_all_blocks()
    print("launched: 32 paged_decode calls from Python per step; planned: one DecodePlan per step, run for "
          "each layer;\ngraph: the launched step captured once and replayed; launch us, planned us: host time "
          "to issue one step;\nTB/s and %strm: the graph's K/V + q + out bytes per second")


if __name__ == "__main__":
    main()
