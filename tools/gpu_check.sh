#!/usr/bin/env bash
# The GPU checks of a change, in one call on a machine with a CUDA GPU, from the source tree:
# the GPU test suite, memcheck, its leak check and racecheck over tools/sanitize_kernels.py, the demo
# on the CUDA backend, and the decode benchmark. Full logs go to OUT; a short summary is printed last.
#
#     bash tools/gpu_check.sh OUT [decode benchmark options, e.g. --cases b8,big]
set -u
out=${1:?usage: bash tools/gpu_check.sh OUT [decode benchmark options]}
shift
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

python3 -m pytest -q -m gpu -p no:cacheprovider tests/ >"$out/pytest-gpu.log" 2>&1
{
    compute-sanitizer --tool memcheck --report-api-errors no python3 tools/sanitize_kernels.py
    compute-sanitizer --tool memcheck --report-api-errors no --leak-check full --show-backtrace device \
        python3 tools/sanitize_kernels.py
    compute-sanitizer --tool racecheck python3 tools/sanitize_kernels.py
} >"$out/sanitizers.txt" 2>&1
python3 -m pagedrt demo --backend cuda --no-color >"$out/demo.txt" 2>&1
python3 -m pagedrt.bench.decode --out "$out/bench-decode.json" "$@" >"$out/bench-decode.txt" 2>&1

echo "== GPU tests";  tail -n 1 "$out/pytest-gpu.log"
echo "== sanitizers"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY|mismatch|all kernels ran" "$out/sanitizers.txt"
echo "== demo";       grep -E "attention" "$out/demo.txt" | tail -n 1
echo "== decode";     tail -n 14 "$out/bench-decode.txt"
