"""Decode time by block size, and the paging overhead per case, from saved bench_decode results.

    python3 tools/block_size_table.py [--kernel v8] [benchmarks/results]

Reads ``h200-bench_decode.json`` (block 16, the standard run) and
``h200-bench_decode_block{8,32,64,128}.json`` (``python3 -m pagedrt.bench.decode --block-size B
--repeats 50 --out ...``), all measured on the H200 with the v4 kernel; with ``--kernel
v8``, ``h200-bench_decode_block{8,16,32,64,128}-v8.json`` instead. Prints the paged
kernel's time per case and block size, and its overhead against the contiguous baseline.
Records written by ``pagedrt.bench`` hold their rows under ``rows``; these older ones under ``cases``.
"""

import argparse
import json
from pathlib import Path

SIZES = (8, 16, 32, 64, 128)


def load(folder, kernel):
    runs = {}
    for size in SIZES:
        if kernel:
            name = f"h200-bench_decode_block{size}-{kernel}.json"
        else:
            name = "h200-bench_decode.json" if size == 16 else f"h200-bench_decode_block{size}.json"
        run = json.loads((folder / name).read_text())
        runs[size] = {c["case"]: c for c in run.get("rows", run.get("cases"))}
    return runs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", nargs="?", type=Path,
                    default=Path(__file__).resolve().parent.parent / "benchmarks" / "results")
    ap.add_argument("--kernel", choices=("v8",), help="the sweep of that kernel (default: the v4 sweep)")
    args = ap.parse_args()
    runs = load(args.folder, args.kernel)
    cases = list(runs[16])
    print("paged decode, microseconds (and % of the read-only ceiling of the same run), by block size")
    print(f"{'case':<9}" + "".join(f"{'B=' + str(s):>16}" for s in SIZES))
    for case in cases:
        cells = [f"{runs[s][case]['us']:7.1f} ({runs[s][case]['pct_stream']:4.1f}%)" for s in SIZES]
        print(f"{case:<9}" + "".join(f"{c:>16}" for c in cells))
    print("\npaging overhead: paged time / contiguous baseline time - 1, by block size")
    print(f"{'case':<9}" + "".join(f"{'B=' + str(s):>9}" for s in SIZES))
    for case in cases:
        print(f"{case:<9}" + "".join(f"{runs[s][case]['paging_overhead_pct']:+8.1f}%" for s in SIZES))


if __name__ == "__main__":
    main()
