"""Compile every file in cuda_src/ with nvcc (CI's compile check), printing ptxas' resource report.

    python3 tools/compile_cuda.py --arch sm_90

A .cu file is compiled as the launchers hand it to NVRTC (local includes inlined,
``pagedrt.source.text``) together with every template instance the
launchers name for the representative configurations (:func:`instances`),
so template code is really compiled. Instances are spread over several translation
units compiled in parallel. Headers are compiled on their own. A file that
``pagedrt.source.ARCHES`` ties to one target (the sm_90a prefill) is compiled for that
target whatever ``--arch`` says, as NVRTC compiles it, and so is a header only it includes. Prints registers,
stack and spills per kernel; any compile error, or a kernel whose wgmmas ptxas serialises (warning C7511: short of
registers for the wgmma pipeline, a silent loss of speed), exits non-zero.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pagedrt.attention import decode, prefill  # noqa: E402
from pagedrt import kernels  # noqa: E402
from pagedrt.engine import fused, layer_gemm, ops, rope_write  # noqa: E402
from pagedrt.source import ARCHES, CUDA_SRC, text  # noqa: E402

PER_UNIT = 12  # instances per translation unit
NVCC_OPTIONS = ("-std=c++17", "-ftz=true")  # as CuPy compiles RawModules with NVRTC (it adds -ftz=true)


def instances():
    """{cuda_src file: name expressions} of every launcher: pagedrt.kernels', pagedrt.attention's (decode with
    its indexed variant, and prefill) and the engine's (pagedrt.engine.ops, .rope_write, .fused and .layer_gemm)."""
    return {**kernels.instances(), **decode.instances(indexed=(False, True)), **prefill.instances(), **ops.instances(),
            **rope_write.instances(), **fused.instances(), **layer_gemm.instances()}


def units(tmp):
    """(label, path, target or None for --arch) of every translation unit to compile."""
    names = instances()
    out = []
    for src in sorted(CUDA_SRC.glob("*.cu")):
        body = text(src.name)
        listed = names.get(src.name, ())
        chunks = [listed[i:i + PER_UNIT] for i in range(0, len(listed), PER_UNIT)] or [()]
        for i, chunk in enumerate(chunks):
            unit = tmp / f"{src.stem}_{i}.cu"
            refs = "".join(f"    (void*)&{name},\n" for name in chunk)
            unit.write_text(body + (f"\nvoid* pagedrt_instances[] = {{\n{refs}}};\n" if chunk else ""))
            out.append((f"{src.name} [{len(chunk)} instances]" if chunk else src.name, unit, ARCHES.get(src.name)))
    for header in sorted(CUDA_SRC.glob("*.cuh")):
        unit = tmp / f"{header.stem}_header.cu"
        unit.write_text(f'#include "{header.name}"\n')
        out.append((header.name, unit, None))
    return out


def compile_unit(arch, path, target=None):
    """nvcc on one unit for ``--arch``, or for ``target`` (an ARCHES entry, e.g. sm_90a) when given."""
    flags = [f"-gencode=arch={target.replace('sm_', 'compute_')},code={target}"] if target else [f"-arch={arch}"]
    cmd = ["nvcc", *flags, *NVCC_OPTIONS, f"-I{CUDA_SRC}", "-Xptxas", "-v", "-c", str(path),
           "-o", str(path.with_suffix(".o"))]
    run = subprocess.run(cmd, capture_output=True, text=True)
    return run.returncode, run.stdout + run.stderr


def resources(log):
    """[(kernel, registers, stack, spill stores, spill loads)] from a ptxas -v log."""
    rows, current, frame = [], None, None
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            current = m.group(1)
        elif m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
            frame = tuple(int(x) for x in m.groups())
        elif (m := re.search(r"Used (\d+) registers", line)) and current:
            rows.append((current, int(m.group(1)), *(frame or (0, 0, 0))))
            current, frame = None, None
    return rows


def serialised(log):
    """Kernels of a ptxas log whose wgmma instructions ptxas serialised (C7511)."""
    return re.findall(r"\(C7511\).*? in the function '(\w+)'", log)


def demangle(names):
    tool = shutil.which("cu++filt") or shutil.which("c++filt")
    if not tool or not names:
        return list(names)
    run = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True)
    out = run.stdout.splitlines()
    return out if run.returncode == 0 and len(out) == len(names) else list(names)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90")
    args = ap.parse_args()
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        todo = units(Path(tmp))
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            results = list(pool.map(lambda u: compile_unit(args.arch, u[1], u[2]), todo))
    flagged, slow = [], []
    for (label, _, _), (rc, log) in zip(todo, results):
        print(f"== {label}: {'ok' if rc == 0 else 'FAILED'}")
        failed += rc != 0
        if rc != 0:
            print(log, end="")
            continue
        rows = resources(log)
        for name, (_, regs, stack, stores, loads) in zip(demangle([r[0] for r in rows]), rows):
            print(f"  {regs:4d} regs  {stack:5d} B stack  {stores:5d}/{loads:<5d} B spill st/ld  {name}")
            if stack or stores or loads:
                flagged.append(name)
        for name in demangle(serialised(log)):
            print(f"  wgmma serialised (ptxas C7511)  {name}")
            slow.append(name)
    print(f"{len(todo) - failed}/{len(todo)} units compiled; "
          + (f"{len(flagged)} kernels use stack or spill: {flagged}" if flagged else "no stack frames, no spills")
          + (f"; {len(slow)} kernels' wgmmas serialised: {slow}" if slow else ""))
    sys.exit(1 if failed or slow else 0)


if __name__ == "__main__":
    main()
