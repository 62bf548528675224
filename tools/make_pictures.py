"""Regenerate the docs' pictures, or time the pool picture on large synthetic snapshots.

    python3 tools/make_pictures.py            # docs/img/*.png and benchmarks/img/*.png (matplotlib: the plot extra)
    python3 tools/make_pictures.py --measure  # seconds and bytes of an SVG and a PNG of 100,000 and 1,000,000 blocks

The pictures: the pool of a seeded demo (host backend, ``pagedrt map --png``); the canonical benchmark
records of ``benchmarks/results/`` drawn as their ``--plot`` would (``pagedrt.bench.plots``); and
``tools/frag_sim.py``'s fragmentation by block size (its full run, about 25 s). A synthetic snapshot
(:func:`synthetic_snapshot`) is made from NumPy alone, seeded, and passes ``validate_snapshot``: device chunks
mapped, released and never mapped, a host tier holding a swapped-out sequence, forked sequences sharing
blocks, cached-free blocks.
"""

import argparse
import contextlib
import importlib.util
import io
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pagedrt.layout import Layout  # noqa: E402
from pagedrt.spec import KVSpec  # noqa: E402
from pagedrt.snapshot import SNAPSHOT_SCHEMA, SNAPSHOT_VERSION, validate_snapshot  # noqa: E402

BLOCK_SIZE, BLOCKS_PER_CHUNK, PAGE = 16, 64, 4096
PLOTS = {  # picture -> the canonical record it draws (benchmarks/results/README.md)
    "decode.png": "h200-bench_decode-package.json",
    "decode-fp8.png": "h200-bench_decode-fp8.json",
    "prefill.png": "h200-bench_prefill.json",
    "generate.png": "h200-bench_generate.json",
    "pool.png": "h200-bench_pool.json",
}


def _layout(num_blocks, host_blocks):
    """One layer, one KV head of 64, block-major: 4 KiB a block, 64 blocks a chunk."""
    spec = KVSpec.build(1, 1, 64, BLOCK_SIZE, "float16", placement="block")
    return Layout.plan(spec, PAGE, num_blocks, BLOCKS_PER_CHUNK * PAGE, host_blocks)


def _records(lay, base, state):
    """pool.chunks for allocator chunks in ``state`` (0 never mapped, 1 released, 2 mapped)."""
    host_from = lay.chunks_per_plane - lay.host_chunks
    return [{"chunk": k, "va_start": base + k * lay.chunk_bytes, "va_end": base + (k + 1) * lay.chunk_bytes,
             "offset": k * lay.chunk_bytes, "size": lay.chunk_bytes, "handle": k + 1 if s == 2 else None,
             "state": "mapped" if s == 2 else "released", "access": "rw" if s == 2 else "none",
             "location": "host" if k >= host_from else "device", "location_id": None, "devices": []}
            for k, s in enumerate(state.tolist()) if s]


def _sequences(rng, free_ids, host_ids, mean_blocks):
    """Sequences over ``free_ids`` (shuffled device blocks) about 70% full, every fifth a fork sharing its
    parent's first half; the first swapped out onto ``host_ids``. Returns [(blocks, length, swapped)], blocks
    used."""
    seqs, used = [], 0
    while used < 0.7 * free_ids.size:
        n = int(np.clip(rng.lognormal(np.log(mean_blocks), 0.8), 1, 4 * mean_blocks))
        if seqs and len(seqs) % 5 == 0:
            parent = seqs[-1][0]
            shared = parent[:max(1, len(parent) // 2)]
            own = free_ids[used:used + n]
            seqs.append((np.concatenate((shared, own)), False))
        else:
            own = free_ids[used:used + n]
            seqs.append((own, False))
        used += own.size
    if host_ids.size:  # first, so that a picture's block tables show it
        seqs.insert(0, (host_ids[:max(1, host_ids.size // 2)], True))
    out = []
    for ids, swapped in seqs:
        length = (ids.size - 1) * BLOCK_SIZE + int(rng.integers(1, BLOCK_SIZE + 1))
        out.append((ids, length, swapped))
    return out, used


def synthetic_snapshot(num_blocks, seed=0, host_blocks=None):
    """A valid snapshot of ``num_blocks`` device blocks (and a host tier of ``host_blocks``, default 2%).

    Parameters
    ----------
    num_blocks : int
        Device blocks of the reserved range (rounded up to whole chunks of 64).
    seed : int
        NumPy seed of the chunk states, sequence lengths and block order.
    host_blocks : int or None
        Blocks of the host tier; None: 2% of ``num_blocks``.

    Returns
    -------
    dict
        A snapshot (docs/SNAPSHOT.md) that ``validate_snapshot`` accepts.
    """
    rng = np.random.default_rng(seed)
    lay = _layout(num_blocks, num_blocks // 50 if host_blocks is None else host_blocks)
    n, bpc, base = lay.chunks_per_plane, lay.blocks_per_chunk, 1 << 40
    device = n - lay.host_chunks
    state = np.zeros(n, np.int8)
    state[:int(device * 0.85)] = 2  # the grown part; a few chunks of it released, the last 15% never mapped
    state[rng.choice(int(device * 0.85), int(device * 0.04), replace=False)] = 1
    state[device:] = 2
    mapped = state == 2
    device_ids = (np.flatnonzero(mapped[:device])[:, None] * bpc + np.arange(bpc)).reshape(-1)
    host_ids = np.arange(device * bpc, n * bpc)
    seqs, used = _sequences(rng, rng.permutation(device_ids), host_ids, mean_blocks=max(2, num_blocks // 2000))
    frontier = (int(np.flatnonzero(mapped).max()) + 1) * bpc  # ref_counts end with the highest mapped chunk
    refs = np.bincount(np.concatenate([s[0] for s in seqs]), minlength=frontier)
    idle = np.flatnonzero((refs == 0) & np.repeat(mapped, bpc)[:frontier])
    cached = np.sort(np.concatenate((rng.choice(idle, idle.size // 10, replace=False),
                                     np.flatnonzero(refs > 1)[::3])))
    cached_free = np.bincount(cached[refs[cached] == 0] // bpc, minlength=n)
    held_in_chunk = np.bincount(np.flatnonzero(refs) // bpc, minlength=n)
    free_in_chunk = np.where(mapped, bpc - held_in_chunk - cached_free, 0)
    return {
        "schema": SNAPSHOT_SCHEMA, "version": SNAPSHOT_VERSION, "time": 0.0, "layout": asdict(lay),
        "pool": {"backend": "host", "base": base, "max_bytes": lay.pool_bytes, "chunk_bytes": lay.chunk_bytes,
                 "page_bytes": PAGE, "num_chunks": n, "chunks": _records(lay, base, state)},
        "blocks": {"blocks_per_chunk": bpc, "num_planes": 1, "num_chunks": n, "max_blocks": n * bpc,
                   "free": int(free_in_chunk.sum()), "held": int((refs > 0).sum()),
                   "chunk_mapped": mapped.tolist(), "free_in_chunk": free_in_chunk.tolist(),
                   "ref_counts": refs.tolist(), "cached": cached.tolist()},
        "sequences": [{"seq": i, "length": length, "blocks": ids.tolist(), "swapped": swapped}
                      for i, (ids, length, swapped) in enumerate(seqs)],
        "max_seqs": len(seqs), "max_blocks_per_seq": max(ids.size for ids, _, _ in seqs),
    }


def demo_snapshot():
    """The final snapshot of a seeded demo on the host backend (the tiny preset, 48 steps)."""
    from pagedrt.demo import DemoConfig, run_demo
    config = DemoConfig(2, 4, 2, 64, "float16", 16, "plane", 48, 8, 256, 4096, 0, "host")
    with run_demo(config).cache as cache:
        return cache.snapshot()


def measure():
    """Print seconds and bytes of the SVG and PNG of synthetic snapshots of 100,000 and 1,000,000 blocks."""
    from pagedrt.picture import picture, svg, write_png
    out = Path("/tmp") / "pagedrt-pictures"
    out.mkdir(exist_ok=True)
    for blocks in (100_000, 1_000_000):
        snap = validate_snapshot(synthetic_snapshot(blocks))
        start = time.perf_counter()
        text = svg(picture(snap))
        svg_s = time.perf_counter() - start
        start = time.perf_counter()
        write_png(picture(snap), out / f"{blocks}.png")
        png_s = time.perf_counter() - start
        print(f"{blocks:>9,} blocks, {len(snap['sequences']):,} sequences, {len(json.dumps(snap)) / 2**20:.1f} MiB "
              f"of JSON: SVG {svg_s:.2f} s, {len(text.encode()) / 1024:.0f} KiB; PNG {png_s:.2f} s, "
              f"{(out / f'{blocks}.png').stat().st_size / 1024:.0f} KiB")


def fragmentation(path):
    """tools/frag_sim.py's full run (seed 0), drawn at ``path``; its tables are not printed."""
    spec = importlib.util.spec_from_file_location("frag_sim", ROOT / "tools" / "frag_sim.py")
    frag = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(frag)
    with contextlib.redirect_stdout(io.StringIO()):
        frag.main(["--plot", str(path)])


def make_all():
    from pagedrt.bench import plots
    from pagedrt.picture import picture, write_png
    docs, bench = ROOT / "docs" / "img", ROOT / "benchmarks" / "img"
    docs.mkdir(exist_ok=True)
    bench.mkdir(exist_ok=True)
    write_png(picture(validate_snapshot(demo_snapshot())), docs / "pool-demo.png", dpi=64)
    for name, record in PLOTS.items():
        plots.draw(json.loads((ROOT / "benchmarks" / "results" / record).read_text()), bench / name)
    fragmentation(docs / "fragmentation.png")
    for path in sorted(list(docs.glob("*.png")) + list(bench.glob("*.png"))):
        print(f"{path.relative_to(ROOT)}: {path.stat().st_size / 1024:.0f} KiB")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measure", action="store_true", help="time the pool picture of 100,000 and 1,000,000 blocks")
    args = ap.parse_args()
    measure() if args.measure else make_all()


if __name__ == "__main__":
    main()
