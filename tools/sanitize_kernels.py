"""Run every kernel once on small data, for compute-sanitizer.

    compute-sanitizer --tool memcheck  python3 tools/sanitize_kernels.py
    compute-sanitizer --tool racecheck python3 tools/sanitize_kernels.py

Write (with padding slots), decode unsplit and split with the last segment's merge
(with empty segments), each in both geometries, the contiguous baseline, block copy, and
validation (a good table, then a bad one refused), on the base configuration. CuPy's
memory pool is switched off, so every array is its own exact-size allocation and a
read one element past it is an error memcheck reports. Each result is also checked
against its reference; exits non-zero on a mismatch.
"""

import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedrt import source  # noqa: E402
from pagedrt.attention import contiguous_decode, paged_decode, reference  # noqa: E402
from pagedrt.attention import decode, planner  # noqa: E402
from pagedrt.errors import BlockTableError  # noqa: E402
from pagedrt.kernels import copy_blocks, copy_blocks_reference, write_kv, write_kv_reference  # noqa: E402
from pagedrt.kernels import configs, copy, validate, write  # noqa: E402

KV_HEADS, GROUP, BLOCK, DIM = 2, 4, 16, 128
LENS = [1, 17, 100]


def rel_error(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def main():
    import cupy
    cupy.cuda.set_allocator(None)
    base = configs.Config("float16", DIM, BLOCK, GROUP)
    for part in (decode.instances([base]), write.instances([base]), copy.instances(), validate.instances()):
        for file, names in part.items():
            source.preload(file, names)  # one NVRTC call per file
    rng = np.random.default_rng(0)
    used = [-(-n // BLOCK) for n in LENS]
    num_blocks = sum(used) + 2
    perm = rng.permutation(num_blocks).astype(np.int32)
    table = np.zeros((len(LENS), max(used)), np.int32)
    slots = []
    for i, (n, nb) in enumerate(zip(LENS, used)):
        table[i, :nb] = perm[sum(used[:i]):sum(used[:i]) + nb]
        slots += [int(table[i, t // BLOCK]) * BLOCK + t % BLOCK for t in range(n)]
    slots = np.array(slots[:5] + [-1] + slots[5:] + [-1], np.int64)  # two padding slots
    k_new = rng.standard_normal((len(slots), KV_HEADS, DIM)).astype(np.float16)
    v_new = rng.standard_normal((len(slots), KV_HEADS, DIM)).astype(np.float16)
    host_k = np.zeros((num_blocks, KV_HEADS, BLOCK, DIM), np.float16)
    host_v = np.zeros_like(host_k)
    q = rng.standard_normal((len(LENS), KV_HEADS * GROUP, DIM)).astype(np.float16)
    lens = np.array(LENS, np.int32)
    k, v = cupy.asarray(host_k), cupy.asarray(host_v)
    d_table, d_lens, d_q = cupy.asarray(table), cupy.asarray(lens), cupy.asarray(q)
    failures = []

    def expect(name, ok):
        print(f"{'ok' if ok else 'MISMATCH'}: {name}")
        if not ok:
            failures.append(name)

    write_kv(cupy.asarray(k_new), cupy.asarray(v_new), k, v, cupy.asarray(slots))
    write_kv_reference(k_new, v_new, host_k, host_v, slots)
    same = lambda: np.array_equal(cupy.asnumpy(k), host_k) and np.array_equal(cupy.asnumpy(v), host_v)  # noqa: E731
    expect("write_kv (with padding slots)", same())

    ref = reference.paged_decode(q.astype(np.float64), host_k, host_v, table, lens, 1 / math.sqrt(DIM))
    for geometry_name in planner.GEOMETRIES:
        for splits, name in ((1, "paged_decode unsplit"),
                             (12, "paged_decode split, merged by the last segment, empty segments")):
            out = paged_decode(d_q, k, v, d_table, d_lens, num_splits=splits, geometry=geometry_name)
            expect(f"{name}, {geometry_name} geometry", rel_error(cupy.asnumpy(out), ref) <= 2e-3)

    dense = [np.stack([p[table[i]] for i in range(len(LENS))]) for p in (host_k, host_v)]
    out = contiguous_decode(d_q, cupy.asarray(dense[0]), cupy.asarray(dense[1]), d_lens)
    expect("contiguous_decode", rel_error(cupy.asnumpy(out), reference.contiguous_decode(
        q.astype(np.float64), *dense, lens)) <= 2e-3)

    pairs = np.array([[int(perm[0]), int(perm[-1])], [int(perm[1]), int(perm[-2])]])
    copy_blocks([k, v], cupy.asarray(pairs))
    copy_blocks_reference([host_k, host_v], pairs)
    expect("copy_blocks", same())

    bad = table.copy()
    bad[2, 1] = num_blocks
    try:
        paged_decode(d_q, k, v, cupy.asarray(bad), d_lens)
        expect("validation refuses a bad block id", False)
    except BlockTableError:
        expect("validation refuses a bad block id", True)
    cupy.cuda.Device().synchronize()
    print("all kernels ran" if not failures else f"{len(failures)} mismatches: {failures}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
