r"""Run every kernel once on small data, for compute-sanitizer.

    compute-sanitizer --tool memcheck --report-api-errors no python3 tools/sanitize_kernels.py
    compute-sanitizer --tool racecheck python3 tools/sanitize_kernels.py

(``--report-api-errors no``: cuda-python resolves its driver entry points with
``cuGetProcAddress``, and the ones this driver lacks come back as invalid-value API
errors that memcheck would count; pagedrt checks its own driver calls itself.)

Write (with padding slots), the fused rotary embeddings + write (padding slots too; FP8 planes on 8.9 or
later), the one-launch decode step of a small model against the layered step, the fused-epilogue GEMMs (under
programmatic dependent launch on 9.0), decode unsplit and split with the last segment's merge (with empty segments), each in both geometries,
both again over FP8 K/V (compute capability 8.9 or later; prefill too, causal and not: on 9.0 the sm_90a kernel's
FP8 twin), the contiguous
baseline, prefill (causal and not, over a ragged batch with a one-token row; on compute capability 9.0 both
the sm_90a kernel and the mma.sync one, and an sm_90a plan run twice), mixed steps (decode rows split, around a prompt chunk and after it),
block copy, and validation (a good table, then a bad one refused), on the base configuration; decode at groups
wider than 8 (24 and 40 on tensor cores, 13 on CUDA cores, 40 over FP8 K/V; 24 and 40 also on the sm_90a
prefill kernel, split and not, on compute capability 9.0), and a write and a split decode under programmatic
dependent launch (compute capability 9.0). Then the refusals of blocks whose memory is not mapped, on a
``PagedKVCache(backend="cuda")``: decode, write and copy naming the planes' last block (in a chunk never
mapped), a slot given twice and the planes of a closed cache, each refused, with good launches after them (the
CUDA context survived). CuPy's memory pool is switched off, so every array is its own exact-size allocation
and a read one element past it is an error memcheck reports. Each result is also checked against its
reference; exits non-zero on a mismatch. Everything the script and the launchers hold on the device is
released before it exits, so the leak check finds nothing:

    compute-sanitizer --tool memcheck --report-api-errors no --leak-check full --show-backtrace device \
        python3 tools/sanitize_kernels.py

(``--show-backtrace device``: to print a host backtrace the tool takes references to
the Python frames on the stack at each allocation and never drops them, so every
array made in a function stays alive and is reported as leaked; without host
backtraces the same run reports 0 bytes in 0 allocations.)
"""

import gc
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedrt import source  # noqa: E402
from pagedrt.attention import PrefillPlan, contiguous_decode, paged_decode, paged_prefill, reference  # noqa: E402
from pagedrt.attention import decode, planner, prefill, prefill_sm90  # noqa: E402
from pagedrt.cache import PagedKVCache  # noqa: E402
from pagedrt.engine import rope_write  # noqa: E402
from pagedrt.errors import BlockTableError, PoolClosedError  # noqa: E402
from pagedrt.kernels import copy_blocks, copy_blocks_reference, release_buffers  # noqa: E402
from pagedrt.kernels import write_kv, write_kv_reference  # noqa: E402
from pagedrt.kernels import configs, copy, validate, write  # noqa: E402
from pagedrt.kernels.launch import dependent_launches  # noqa: E402

KV_HEADS, GROUP, BLOCK, DIM = 2, 4, 16, 128
LENS = [1, 17, 100]
QUERIES = [1, 5, 70]  # prefill: the last QUERIES[b] of sequence b's LENS[b] tokens are its queries


def rel_error(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def main():
    import cupy
    cupy.cuda.set_allocator(None)
    failures = run()
    cupy.cuda.Device().synchronize()
    gc.collect()  # every array of the runs is gone; then what the launchers and CuPy hold
    release_buffers()
    cupy.get_default_pinned_memory_pool().free_all_blocks()
    cupy.get_default_memory_pool().free_all_blocks()
    print("all kernels ran" if not failures else f"{len(failures)} mismatches: {failures}")
    return 1 if failures else 0


def run():
    """Every kernel and refusal; returns the names of the checks that failed."""
    import cupy
    base = configs.Config("float16", DIM, BLOCK, GROUP)
    capability = cupy.cuda.Device().compute_capability
    fp8_cfg = configs.Config("float16", DIM, BLOCK, GROUP, configs.FP8) if capability >= "89" else None
    hopper = capability == prefill_sm90.SM90  # then both prefill kernels run
    for part in (decode.instances([base]), decode.instances([base], paged=(True,), indexed=(True,)),
                 decode.instances([configs.Config(d, DIM, BLOCK, g) for d, g in WIDE], paged=(True,)),
                 prefill.instances([base], None if hopper else capability), write.instances([base]), copy.instances(),
                 validate.instances(), rope_write.instances([base]), *(() if fp8_cfg is None else (
                     decode.instances([fp8_cfg, configs.Config("float16", DIM, BLOCK, 40, configs.FP8)],
                                      paged=(True,)), write.instances([fp8_cfg]), rope_write.instances([fp8_cfg]),
                     prefill.instances([fp8_cfg], capability),
                     decode.instances([fp8_cfg], paged=(True,), indexed=(True,))))):
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

    refusals(expect)

    write_kv(cupy.asarray(k_new), cupy.asarray(v_new), k, v, cupy.asarray(slots))
    write_kv_reference(k_new, v_new, host_k, host_v, slots)
    same = lambda: np.array_equal(cupy.asnumpy(k), host_k) and np.array_equal(cupy.asnumpy(v), host_v)  # noqa: E731
    expect("write_kv (with padding slots)", same())
    rope_writes(expect, rng, slots, num_blocks, fp8_cfg is not None)
    fused_steps(expect, rng)
    layer_gemms(expect, rng)

    ref = reference.paged_decode(q.astype(np.float64), host_k, host_v, table, lens, 1 / math.sqrt(DIM))
    for geometry_name in planner.GEOMETRIES:
        for splits, name in ((1, "paged_decode unsplit"),
                             (12, "paged_decode split, merged by the last segment, empty segments")):
            out = paged_decode(d_q, k, v, d_table, d_lens, num_splits=splits, geometry=geometry_name)
            expect(f"{name}, {geometry_name} geometry", rel_error(cupy.asnumpy(out), ref) <= 2e-3)

    if fp8_cfg is not None:  # FP8 K/V: written quantised, then decoded unsplit and split in both geometries
        scales = [rng.uniform(0.01, 0.05, KV_HEADS).astype(np.float32) for _ in range(2)]
        d_scales = [cupy.asarray(s) for s in scales]
        host_k8, host_v8 = (np.zeros(host_k.shape, np.uint8) for _ in range(2))
        k8, v8 = cupy.asarray(host_k8), cupy.asarray(host_v8)
        write_kv(cupy.asarray(k_new), cupy.asarray(v_new), k8, v8, cupy.asarray(slots), k_scale=d_scales[0],
                 v_scale=d_scales[1])
        write_kv_reference(k_new, v_new, host_k8, host_v8, slots, k_scale=scales[0], v_scale=scales[1])
        expect("write_kv FP8 (bit for bit)", np.array_equal(cupy.asnumpy(k8), host_k8)
               and np.array_equal(cupy.asnumpy(v8), host_v8))
        ref = reference.paged_decode(q.astype(np.float64), host_k8, host_v8, table, lens, 1 / math.sqrt(DIM),
                                     k_scale=scales[0], v_scale=scales[1])
        for geometry_name in planner.GEOMETRIES:
            for splits in (1, 12):
                out = paged_decode(d_q, k8, v8, d_table, d_lens, num_splits=splits, geometry=geometry_name,
                                   k_scale=d_scales[0], v_scale=d_scales[1])
                expect(f"paged_decode FP8, {splits} splits, {geometry_name} geometry",
                       rel_error(cupy.asnumpy(out), ref) <= 2e-3)
        qo = np.concatenate([[0], np.cumsum(QUERIES)]).astype(np.int32)
        pq = rng.standard_normal((int(qo[-1]), KV_HEADS * GROUP, DIM)).astype(np.float16)
        for causal in (True, False):
            out = paged_prefill(cupy.asarray(pq), k8, v8, d_table, d_lens, cupy.asarray(qo), causal=causal,
                                k_scale=d_scales[0], v_scale=d_scales[1])
            ref = reference.prefill(pq.astype(np.float64), host_k8, host_v8, table, lens, qo, causal=causal,
                                    k_scale=scales[0], v_scale=scales[1])
            expect(f"paged_prefill FP8, {'causal' if causal else 'not causal'}",
                   rel_error(cupy.asnumpy(out), ref) <= 2e-3)

    dense = [np.stack([p[table[i]] for i in range(len(LENS))]) for p in (host_k, host_v)]
    out = contiguous_decode(d_q, cupy.asarray(dense[0]), cupy.asarray(dense[1]), d_lens)
    expect("contiguous_decode", rel_error(cupy.asnumpy(out), reference.contiguous_decode(
        q.astype(np.float64), *dense, lens)) <= 2e-3)

    qo = np.concatenate([[0], np.cumsum(QUERIES)]).astype(np.int32)
    pq = rng.standard_normal((int(qo[-1]), KV_HEADS * GROUP, DIM)).astype(np.float16)
    chosen = prefill_sm90.runs_on
    for sm90 in (True, False) if hopper else (False,):  # on 9.0 also the mma.sync kernel the other GPUs run
        prefill_sm90.runs_on = lambda device_id, sm90=sm90: sm90
        for causal in (True, False):
            out = paged_prefill(cupy.asarray(pq), k, v, d_table, d_lens, cupy.asarray(qo), causal=causal)
            ref = reference.prefill(pq.astype(np.float64), host_k, host_v, table, lens, qo, causal=causal)
            expect(f"paged_prefill ({'sm_90a' if sm90 else 'mma.sync'}), {'causal' if causal else 'not causal'}",
                   rel_error(cupy.asnumpy(out), ref) <= 2e-3)
    prefill_sm90.runs_on = chosen
    if hopper:  # one plan run twice: the second launch finds the sm_90a kernel's unit queue reset by the first
        plan = PrefillPlan(cupy.asarray(pq), k, d_table, d_lens, cupy.asarray(qo), query_lens=np.asarray(QUERIES))
        ref = reference.prefill(pq.astype(np.float64), host_k, host_v, table, lens, qo)
        for run in (1, 2):
            out = plan.run(cupy.asarray(pq), k, v)
            expect(f"PrefillPlan (sm_90a) run {run}", rel_error(cupy.asnumpy(out), ref) <= 2e-3)
        del plan

    mixed(expect, rng)
    wide_groups(expect, rng, fp8_cfg is not None)
    if capability >= "90":
        dependent(expect, k, v, d_table, d_lens, d_q, k_new, v_new, slots)

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
    return failures


def rope_writes(expect, rng, slots, num_blocks, fp8):
    """The fused rotary embeddings + K/V write of len(slots) tokens (padding among them) into fp16 planes and,
    with ``fp8``, e4m3 ones, against its host reference."""
    import cupy
    n, q_heads = len(slots), KV_HEADS * GROUP
    qkv = rng.standard_normal((n, (q_heads + 2 * KV_HEADS) * DIM)).astype(np.float16)
    inv_freq = (10000.0 ** -(np.arange(0, DIM, 2) / DIM)).astype(np.float32)
    step = (slots, np.array([0, n], np.int32), np.array([n + 5], np.int32), inv_freq)
    for kv_dtype in (np.float16, np.uint8) if fp8 else (np.float16,):
        host = [np.zeros((num_blocks, KV_HEADS, BLOCK, DIM), kv_dtype) for _ in "kv"]
        scales = [rng.uniform(0.02, 0.04, KV_HEADS).astype(np.float32) for _ in "kv"]
        extra = dict(k_scale=scales[0], v_scale=scales[1]) if kv_dtype == np.uint8 else {}
        host_q = np.zeros((n, q_heads, DIM), np.float16)
        dev, dev_q = [cupy.asarray(p) for p in host], cupy.asarray(host_q)
        rope_write.RopeWritePlan(qkv, host_q, host[0], *step).run(qkv, host_q, *host, **extra)
        plan = rope_write.RopeWritePlan(cupy.asarray(qkv), dev_q, dev[0], *(cupy.asarray(a) for a in step))
        plan.run(cupy.asarray(qkv), dev_q, *dev, **{key: cupy.asarray(a) for key, a in extra.items()})
        planes_ok = all((np.mean(cupy.asnumpy(d) != h) < 0.01) if kv_dtype == np.uint8
                        else rel_error(cupy.asnumpy(d), h) <= 1e-3 for d, h in zip(dev, host))
        expect(f"rope_write into {np.dtype(kv_dtype).name} planes (with padding slots)",
               rel_error(cupy.asnumpy(dev_q), host_q) <= 1e-3 and planes_ok)


WIDE = (("float16", 24), ("float16", 40), ("float32", 13))  # two and four m16 tiles of heads; CUDA-core chunks


def fused_steps(expect, rng):
    """The one-launch decode step (pagedrt.engine.fused) of a 2-layer random model against the layered step, over
    three sequences of LENS tokens."""
    import cupy
    from pagedrt.engine.config import ModelConfig
    from pagedrt.engine.loader import GGUFModel, Weights
    from pagedrt.engine.model import LlamaModel
    c = ModelConfig(name="sanitize", num_layers=2, hidden=384, ffn=256, q_heads=6, kv_heads=2, head_dim=64,
                    vocab_size=301, context_length=1024, rope_theta=10000.0, rope_scale=1.0, rms_eps=1e-5)
    mat = lambda o, i: (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)  # noqa: E731
    layers = [{"attn_norm": np.ones(c.hidden, np.float32), "ffn_norm": np.ones(c.hidden, np.float32),
               "qkv": mat((c.q_heads + 2 * c.kv_heads) * c.head_dim, c.hidden), "o": mat(c.hidden, c.hidden),
               "gate_up": mat(2 * c.ffn, c.hidden), "down": mat(c.hidden, c.ffn)} for _ in range(c.num_layers)]
    embedding = mat(c.vocab_size, c.hidden)
    gguf = GGUFModel("sanitize", c, None, Weights(embedding, embedding, np.ones(c.hidden, np.float32), layers))
    prompts = [rng.integers(0, c.vocab_size, n) for n in LENS]
    tokens = np.array([1, 2, 3])
    logits = []
    for fused in (True, False):
        with PagedKVCache(c.num_layers, c.kv_heads, c.head_dim, BLOCK, "float16", max_tokens=1024, max_seqs=4,
                          backend="cuda") as cache:
            model = LlamaModel(gguf, cache, graphs=False, fused=fused)
            with model.stream:
                model.forward(cache.step([], arrivals=prompts), cupy.asarray(np.concatenate(prompts)))
                out = model.forward(cache.step(None, 1, tokens), cupy.asarray(tokens))
                logits.append(cupy.asnumpy(out))
            cupy.cuda.get_current_stream().synchronize()
            del model
    expect("the fused decode step against the layered one", rel_error(logits[0], logits[1]) <= 2e-2)


def layer_gemms(expect, rng):
    """The fused-epilogue GEMMs (pagedrt.engine.layer_gemm), fp16, at SmolLM2-135M's shapes, 37 rows (no tile's
    multiple) and 200 (another table entry each), against their references."""
    import cupy
    from pagedrt.engine import layer_gemm as lg
    for m in (37, 200):
        x = rng.standard_normal((m, 576)).astype(np.float32)
        g = np.ones(576, np.float32)
        for name, rows, n in (("norm_gemm", 960, 960), ("norm_gemm_silu", 3072, 1536)):
            w = (rng.standard_normal((rows, 576)) / 24).astype(np.float16)
            fn = getattr(lg, name)
            ref = fn(x, g, w, np.empty((m, n), np.float16), 1e-5)
            out = fn(cupy.asarray(x), cupy.asarray(g), cupy.asarray(w), cupy.empty((m, n), np.float16), 1e-5)
            expect(f"layer_gemm {name} ({m} rows)", rel_error(cupy.asnumpy(out), ref) <= 2e-3)
        for k in (576, 1536):
            a = rng.standard_normal((m, k)).astype(np.float16)
            w = (rng.standard_normal((576, k)) / np.sqrt(k)).astype(np.float16)
            residual = x.copy()
            added = cupy.asnumpy(lg.gemm_add(cupy.asarray(a), cupy.asarray(w), cupy.asarray(residual))) - residual
            expect(f"layer_gemm gemm_add ({m} rows, k {k})",
                   rel_error(added, lg.gemm_add(a, w, residual.copy()) - residual) <= 2e-3)
        # the QKV GEMM with the rotary embeddings + K/V write as its epilogue: a decode step of m rows (one slot in
        # five padding) over SmolLM2's heads, against norm_gemm then RopeWritePlan.run, byte for byte
        w = (rng.standard_normal((960, 576)) / 24).astype(np.float16)
        blocks = -(-m * 100 // 16)
        slots = rng.permutation(blocks * 16)[:m].astype(np.int64)
        slots[::5] = -1
        lens = rng.integers(1, 100, m).astype(np.int32)
        step = [cupy.asarray(a) for a in (slots, np.arange(m + 1, dtype=np.int32), lens,
                                          (10000.0 ** -(np.arange(0, 64, 2) / 64)).astype(np.float32))]
        qkv = cupy.empty((m, 960), np.float16)
        outs = []
        for fused in (True, False):
            q, k, v = cupy.zeros((m, 9, 64), np.float16), *(cupy.zeros((blocks, 3, 16, 64), np.float16) for _ in "kv")
            plan = rope_write.RopeWritePlan(qkv, q, k, *step)
            if fused:
                lg.norm_gemm_rope_write(cupy.asarray(x), cupy.asarray(g), cupy.asarray(w), plan, q, k, v, 1e-5)
            else:
                plan.run(lg.norm_gemm(cupy.asarray(x), cupy.asarray(g), cupy.asarray(w), qkv, 1e-5), q, k, v)
            outs.append(b"".join(cupy.asnumpy(a).tobytes() for a in (q, k, v)))
        expect(f"layer_gemm norm_gemm_rope_write ({m} rows), as norm_gemm then rope_write", outs[0] == outs[1])


def wide_groups(expect, rng, fp8):
    """Decode at groups wider than 8: unsplit and split, in both geometries, on tensor cores (24, 40: two and
    four m16 tiles, the last padded), on CUDA cores (13: chunks of one head) and, with FP8, over FP8 K/V (40);
    then in the plan's geometry, which on compute capability 9.0 runs 24 and 40 on the sm_90a prefill kernel
    (split-K merged in the kernel)."""
    import cupy
    lens = np.array([1, 17, 300], np.int32)
    used = [-(-int(n) // BLOCK) for n in lens]
    ids = rng.permutation(sum(used)).astype(np.int32)
    table = np.zeros((3, max(used)), np.int32)
    for i, nb in enumerate(used):
        table[i, :nb] = ids[sum(used[:i]):sum(used[:i]) + nb]
    d_table, d_lens = cupy.asarray(table), cupy.asarray(lens)
    runs = [(dtype, group, None) for dtype, group in WIDE] + ([("float16", 40, configs.FP8)] if fp8 else [])
    for dtype, group, kv_dtype in runs:
        shape = (sum(used), KV_HEADS, BLOCK, DIM)
        if kv_dtype:
            planes = [rng.integers(0, 126, shape).astype(np.uint8) for _ in "kv"]  # finite e4m3 bytes
            scales = [rng.uniform(0.5, 1.0, KV_HEADS).astype(np.float32) for _ in "kv"]
            extra = dict(k_scale=cupy.asarray(scales[0]), v_scale=cupy.asarray(scales[1]))
            ref_extra = dict(k_scale=scales[0], v_scale=scales[1])
        else:
            planes = [rng.standard_normal(shape).astype(dtype) for _ in "kv"]
            extra, ref_extra = {}, {}
        q = rng.standard_normal((3, KV_HEADS * group, DIM)).astype(dtype)
        ref = reference.paged_decode(q.astype(np.float64), *planes, table, lens, 1 / math.sqrt(DIM), **ref_extra)
        k, v = (cupy.asarray(x) for x in planes)
        for geometry_name in (*planner.GEOMETRIES, None):  # None: the plan's (past 16 heads on 9.0: wgmma)
            for splits in (1, 12):
                out = paged_decode(cupy.asarray(q), k, v, d_table, d_lens, num_splits=splits, geometry=geometry_name,
                                   **extra)
                expect(f"paged_decode group {group} {kv_dtype or dtype}, {splits} splits, "
                       f"{geometry_name or 'chosen'} geometry",
                       rel_error(cupy.asnumpy(out), ref) <= (1e-5 if dtype == "float32" else 2e-3))


def dependent(expect, k, v, d_table, d_lens, d_q, k_new, v_new, slots):
    """A write and a split decode launched with programmatic dependent launch, against plain launches."""
    import cupy
    plain = paged_decode(d_q, k, v, d_table, d_lens, num_splits=4)
    with dependent_launches():
        write_kv(cupy.asarray(k_new), cupy.asarray(v_new), k, v, cupy.asarray(slots))  # the same values again
        out = paged_decode(d_q, k, v, d_table, d_lens, num_splits=4)
    expect("write_kv and paged_decode with programmatic dependent launch", bool(cupy.array_equal(out, plain)))


def mixed(expect, rng):
    """Mixed steps: two decode rows long enough to be split, around a prompt chunk, then the same rows reordered
    so that the decode rows come last."""
    import cupy
    lens, queries = np.array([1100, 40, 1500], np.int32), np.array([1, 20, 1])
    used = [-(-int(n) // BLOCK) for n in lens]
    planes = [rng.standard_normal((sum(used) + 1, KV_HEADS, BLOCK, DIM)).astype(np.float16) for _ in "kv"]
    ids = rng.permutation(sum(used) + 1).astype(np.int32)
    table = np.zeros((3, max(used)), np.int32)
    for i, nb in enumerate(used):
        table[i, :nb] = ids[sum(used[:i]):sum(used[:i]) + nb]
    k, v = (cupy.asarray(x) for x in planes)
    for order, placement in (([0, 1, 2], "around a prompt chunk"), ([1, 0, 2], "last")):
        qo = np.concatenate([[0], np.cumsum(queries[order])]).astype(np.int32)
        q = rng.standard_normal((int(qo[-1]), KV_HEADS * GROUP, DIM)).astype(np.float16)
        out = paged_prefill(cupy.asarray(q), k, v, cupy.asarray(table[order]), cupy.asarray(lens[order]),
                            cupy.asarray(qo), query_lens=queries[order])
        ref = reference.prefill(q.astype(np.float64), *planes, table[order], lens[order], qo)
        expect(f"paged_prefill, a mixed step with its decode rows {placement}",
               rel_error(cupy.asnumpy(out), ref) <= 2e-3)


def refused(expect, name, error, call):
    """Expect ``call`` to raise ``error`` (had it run, memcheck would report the access)."""
    try:
        call()
    except error as exc:
        expect(f"{name}: {type(exc).__name__}", True)
    else:
        expect(f"{name}: refused", False)


def refusals(expect):
    """Unmapped blocks, a duplicate slot and a closed cache on the CUDA backend: each call is refused, and good
    launches follow."""
    import cupy
    cache = PagedKVCache(1, 1, DIM, BLOCK, "float16", max_tokens=1 << 20, backend="cuda")
    seq = cache.add_sequence()
    slots = cupy.asarray(cache.append([seq], 8)[0])
    rng = np.random.default_rng(21)
    kv = rng.standard_normal((8, 1, DIM)).astype(np.float16)
    q = rng.standard_normal((1, GROUP, DIM)).astype(np.float16)
    d_kv, d_q, k, v = cupy.asarray(kv), cupy.asarray(q), cache.k(0), cache.v(0)
    write_kv(d_kv, d_kv, k, v, slots)
    table, lens = cache.block_tables([seq]).copy(), cache.seq_lens([seq]).copy()
    held, last = int(table[0, 0]), int(k.shape[0]) - 1
    refused(expect, "paged_decode over a block in a chunk never mapped", BlockTableError,
            lambda: paged_decode(d_q, k, v, cupy.asarray([[held, last]], np.int32), cupy.asarray([20], np.int32)))
    refused(expect, "write_kv into a block in a chunk never mapped", BlockTableError,
            lambda: write_kv(d_kv[:1], d_kv[:1], k, v, cupy.asarray([last * BLOCK], np.int64)))
    refused(expect, "copy_blocks into a block in a chunk never mapped", BlockTableError,
            lambda: copy_blocks(cache.planes, cupy.asarray([[held, last]])))
    refused(expect, "write_kv with a slot given twice", BlockTableError,
            lambda: write_kv(d_kv[:2], d_kv[:2], k, v, cupy.asarray([int(slots[0])] * 2, np.int64)))
    out = paged_decode(d_q, k, v, table, lens)
    ref = reference.attend(q.astype(np.float64), kv.astype(np.float64).transpose(1, 0, 2),
                           kv.astype(np.float64).transpose(1, 0, 2), 1 / math.sqrt(DIM))
    expect("paged_decode after the refusals (the context survived)", rel_error(cupy.asnumpy(out), ref) <= 2e-3)
    cache.close()
    refused(expect, "paged_decode over the planes of a closed cache", PoolClosedError,
            lambda: paged_decode(d_q, k, v, table, lens))
    refused(expect, "write_kv into the planes of a closed cache", PoolClosedError,
            lambda: write_kv(d_kv, d_kv, k, v, slots))


if __name__ == "__main__":
    sys.exit(main())
