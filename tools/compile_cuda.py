"""Compile every file in cuda_src/ with nvcc (CI's compile check), printing ptxas' resource report.

    python3 tools/compile_cuda.py --arch sm_90
"""

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

CUDA_SRC = Path(__file__).resolve().parent.parent / "cuda_src"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90")
    args = ap.parse_args()
    failed = 0
    sources = sorted(CUDA_SRC.glob("*.cu")) + sorted(CUDA_SRC.glob("*.cuh"))
    with tempfile.TemporaryDirectory() as tmp:
        for src in sources:
            unit = Path(tmp) / (src.stem + "_check.cu")
            unit.write_text(f'#include "{src.name}"\n')
            cmd = ["nvcc", f"-arch={args.arch}", "-std=c++17", f"-I{CUDA_SRC}", "-Xptxas", "-v",
                   "-c", str(unit), "-o", str(Path(tmp) / (src.stem + ".o"))]
            run = subprocess.run(cmd, capture_output=True, text=True)
            print(f"== {src.name}: {'ok' if run.returncode == 0 else 'FAILED'}")
            print(run.stdout + run.stderr, end="")
            failed += run.returncode != 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
