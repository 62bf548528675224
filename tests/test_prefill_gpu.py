"""Prefill attention on the device against the float64 reference (needs a GPU; skipped otherwise).

Every input is fresh random data; every output is poisoned with NaN before a launch;
every slot a kernel must not read holds NaN (see kernel_cases.Case). The matrix: each
dtype x head_dim at block size 16, and block sizes 8, 32 and 128 at one dtype per
head_dim, each causal and not, each over four groups (1 and 4 with two KV heads, 8 and 48
with one: MQA, and a group that cuts the 64-row tiles mid-token) and one ragged batch
whose prefixes are 0, 1, block - 1, block, block + 1 and long, with rows of no query and
of one (at groups up to 8 the decode kernel takes the one-token rows). Mixed steps: decode
rows first, last, interleaved with prompt rows, alone and absent, at groups 1, 4, 8 and 12,
in each dtype and at block sizes 8, 16 and 128, split and in a CUDA graph. Every row is
compared on its own. All kernels are compiled up front (helpers.compile_all). A device of
compute capability 9.0 runs the prompt rows through the sm_90a kernel
(test_prefill_sm90_gpu.py checks it more widely, and the mma.sync kernel there too).
"""

import math

import numpy as np
import pytest

from helpers import compile_all, to_host
from kernel_cases import PrefillCase, rel_error
from pagedrt import PagedKVCache
from pagedrt.attention import PrefillPlan, decode, paged_prefill, prefill, reference, workspace_bytes
from pagedrt.errors import BlockTableError, LaunchArgumentError
from pagedrt.kernels import validate, write_kv
from pagedrt.kernels.configs import Config

pytestmark = pytest.mark.gpu

TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2}
BASE = Config("float16", 128, 16, 4)
CONFIGS = list(dict.fromkeys(
    [Config(d, h, 16, 4) for d in TOLERANCE for h in (64, 128, 256)]
    + [Config(d, h, b, 4) for b in (8, 32, 128) for d, h in (("bfloat16", 64), ("float16", 128),
                                                                   ("bfloat16", 256))]))
GROUPS = ((2, 1), (2, 4), (1, 8), (1, 48))  # (kv_heads, group)
MIXED_CONFIGS = [Config("bfloat16", 64, 8, 4), Config("float16", 128, 128, 4), Config("bfloat16", 256, 16, 4)]


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Every kernel of this module, compiled up front: the prefill kernel the device runs (the sm_90a one on
    compute capability 9.0, else the mma.sync one), and the (indexed) decode kernels a mixed step's decode rows
    run, in the standard geometry: these batches are too small for the short one."""
    import cupy
    mixed = [Config(c.dtype, c.head_dim, c.block_size, g) for c in CONFIGS for g in (1, 4, 8)]
    mixed += [Config("bfloat16", 256, 16, 8), Config("float16", 64, 128, 2)]  # test_long_prefixes_and_long_prompts
    names = [decode.kernel_name(c, True, "standard", indexed=True) for c in mixed]
    compile_all(prefill.instances(CONFIGS, cupy.cuda.Device().compute_capability), {decode.FILE: names},
                validate.instances())


def ragged(bs, long=300):
    """(prefix, new) per sequence: prefixes around a block, rows of no query and of one, tiles cut mid-token."""
    return [(0, 77), (1, 1), (bs - 1, 40), (5, 0), (bs, 3), (bs + 1, 70), (0, 1), (long, 130)]


def case_of(cfg, spec, **kwargs):
    return PrefillCase(cfg, [p for p, _ in spec], [n for _, n in spec], **kwargs)


class OnDevice:
    def __init__(self, case, layer=1):
        import cupy
        self.buffer = cupy.asarray(case.buffer)
        self.k, self.v = self.buffer[:, 0, layer], self.buffer[:, 1, layer]
        self.q, self.table, self.lens = cupy.asarray(case.q), cupy.asarray(case.table), cupy.asarray(case.lens)
        self.qo_indptr = cupy.asarray(case.qo_indptr)


def poisoned(shape, dtype):
    import cupy
    return cupy.asarray(np.full(shape, np.nan, np.float32).astype(dtype))


def expected(case, causal=True, k=None, v=None):
    """The float64 reference's output, kept in float64."""
    return reference.prefill(case.q.astype(np.float64), case.k if k is None else k, case.v if v is None else v,
                             case.table, case.lens, case.qo_indptr, causal=causal)


def row_errors(out, ref, case):
    """[(row, prefix, queries, relative error)] of the sequences whose error is over tolerance (or not finite)."""
    bad = []
    for b in range(len(case.lens)):
        first, end = int(case.qo_indptr[b]), int(case.qo_indptr[b + 1])
        if end > first:
            err = rel_error(out[first:end], ref[first:end])
            if not err <= TOLERANCE[case.cfg.dtype]:
                bad.append((b, int(case.lens[b]) - (end - first), end - first, float(err)))
    return bad


def run(dev, case, causal=True, **kwargs):
    out = poisoned(case.q.shape, case.q.dtype)
    assert paged_prefill(dev.q, dev.k, dev.v, dev.table, dev.lens, dev.qo_indptr, out=out, causal=causal,
                         query_lens=case.query_lens, **kwargs) is out
    return to_host(out)


# --- results against the reference -----------------------------------------------------------------

@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_prefill_matches_the_reference_row_by_row(cfg, causal):
    failures = []
    for kv_heads, group in GROUPS:
        case = case_of(Config(cfg.dtype, cfg.head_dim, cfg.block_size, group), ragged(cfg.block_size),
                       kv_heads=kv_heads, seed=cfg.head_dim + cfg.block_size + group)
        bad = row_errors(run(OnDevice(case), case, causal), expected(case, causal), case)
        failures += [f"group {group}: row {b} prefix {p} queries {n}: error {e:.2e}" for b, p, n, e in bad]
    assert not failures, "; ".join(failures)


@pytest.mark.parametrize("cfg", [BASE, Config("bfloat16", 256, 16, 8), Config("float16", 64, 128, 2),
                                 Config("float16", 128, 16, 64), Config("bfloat16", 64, 32, 17)], ids=str)
def test_long_prefixes_and_long_prompts(cfg):
    case = case_of(cfg, [(4000, 300), (0, 1000), (2500, 1)], kv_heads=1, seed=3)
    bad = row_errors(run(OnDevice(case), case), expected(case), case)
    assert not bad, bad


def test_queries_without_a_query_row_and_the_scale():
    """A batch whose rows all have no queries launches nothing; a given scale is used."""
    case = case_of(BASE, [(5, 0), (20, 0)])
    dev = OnDevice(case)
    assert run(dev, case).shape == (0, 8, 128)
    case = case_of(BASE, [(7, 9), (0, 33)], seed=9)
    ref = reference.prefill(case.q.astype(np.float64), case.k, case.v, case.table, case.lens, case.qo_indptr, 0.3)
    assert not row_errors(run(OnDevice(case), case, scale=0.3), ref, case)


# --- plans -----------------------------------------------------------------------------------------

def replay_twice(stream, plan, dev, planes, outs, refs, case, scales=None):
    """Capture the plan's runs over every layer's planes on ``stream`` (current), then launch the graph twice,
    the outputs poisoned before each launch and compared with the layers' references after it. ``scales``: FP8
    planes' keyword arguments of each layer's run (k_scale, v_scale)."""
    stream.synchronize()
    stream.begin_capture()
    for (k, v), out, extra in zip(planes, outs, scales or [{}] * len(planes)):
        plan.run(dev.q, k, v, out=out, **extra)
    graph = stream.end_capture()
    for _ in range(2):
        for out in outs:
            out.fill(np.nan)
        graph.launch(stream)
        stream.synchronize()
        for out, ref in zip(outs, refs):
            assert not row_errors(to_host(out), ref, case)


def test_plan_runs_every_layer_and_replays_in_a_cuda_graph():
    """One plan (validated, without query_lens: it reads qo_indptr back), run per layer; then a plan made
    before capture, its runs over both layers captured and the graph launched twice."""
    import cupy
    case = case_of(BASE, ragged(16), seed=13)
    case.buffer[:, :, 0] = (case.buffer[:, :, 1].astype(np.float32) * -0.5).astype(case.buffer.dtype)
    dev = OnDevice(case)
    planes = [(dev.buffer[:, 0, layer], dev.buffer[:, 1, layer]) for layer in (0, 1)]
    refs = [expected(case, True, case.buffer[:, 0, layer], case.buffer[:, 1, layer]) for layer in (0, 1)]
    plan = PrefillPlan(dev.q, planes[0][0], dev.table, dev.lens, dev.qo_indptr)
    for (k, v), ref in zip(planes, refs):
        out = poisoned(case.q.shape, case.q.dtype)
        assert plan.run(dev.q, k, v, out=out) is out
        assert not row_errors(to_host(out), ref, case)
    outs = [poisoned(case.q.shape, case.q.dtype) for _ in planes]
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        plan = PrefillPlan(dev.q, planes[0][0], dev.table, dev.lens, dev.qo_indptr, query_lens=case.query_lens,
                           validate=False)
        replay_twice(stream, plan, dev, planes, outs, refs, case)


# --- validation on the device -----------------------------------------------------------------------

def test_device_validation_refuses_and_leaves_out_untouched():
    import cupy
    case = case_of(BASE, [(0, 5), (3, 2), (20, 7)], seed=2)
    dev = OnDevice(case)
    sentinel = np.full(case.q.shape, 7, case.q.dtype)
    out = cupy.asarray(sentinel)
    lens = case.lens.copy()
    lens[1] = 1
    with pytest.raises(BlockTableError, match=r"kv_lens\[1\] = 1 is less than the row's 2") as info:
        paged_prefill(dev.q, dev.k, dev.v, dev.table, cupy.asarray(lens), dev.qo_indptr, out=out)
    assert (info.value.row, info.value.length) == (1, 1)
    table = case.table.copy()
    table[2, 1] = len(case.k)
    with pytest.raises(BlockTableError, match=r"block_tables\[2, 1\]"):
        paged_prefill(dev.q, dev.k, dev.v, cupy.asarray(table), dev.lens, dev.qo_indptr, out=out)
    with pytest.raises(LaunchArgumentError, match="query_lens sum to"):
        paged_prefill(dev.q, dev.k, dev.v, dev.table, dev.lens, dev.qo_indptr, out=out,
                      query_lens=np.array([5, 3, 6]))
    with pytest.raises(LaunchArgumentError, match="decreases"):
        paged_prefill(dev.q, dev.k, dev.v, dev.table, dev.lens, cupy.asarray([0, 5, 4, 14], np.int32), out=out)
    assert np.array_equal(to_host(out), sentinel)


def test_a_cuda_cache_step_then_write_kv_then_the_plan():
    """The documented call sequence on the CUDA backend: a chunk of a prompt beside another's decode token."""
    import cupy
    rng = np.random.default_rng(4)
    with PagedKVCache(1, 2, 128, 16, "float16", max_tokens=1 << 14, backend="cuda") as cache:
        for make in (lambda: cache.step(arrivals=[np.arange(1000, 1100)]),  # one step at a time: a step's
                     lambda: cache.step(arrivals=[np.arange(300)], arrival_tokens=[200])):  # arrays hold till the next
            step = make()
            k_new, v_new = (cupy.asarray(x) for x in rng.standard_normal((2, step.num_tokens, 2, 128))
                            .astype(np.float16))
            write_kv(k_new, v_new, cache.k(0), cache.v(0), step.slot_mapping)
        q = cupy.asarray(rng.standard_normal((step.num_tokens, 8, 128)).astype(np.float16))
        out = PrefillPlan(q, cache.k(0), step.block_tables, step.seq_lens, step.qo_indptr,
                          query_lens=step.query_lens).run(q, cache.k(0), cache.v(0))
        host = [to_host(x) for x in (q, cache.k(0), cache.v(0), step.block_tables, step.seq_lens, step.qo_indptr)]
        ref = reference.prefill(host[0].astype(np.float64), *host[1:], 1 / math.sqrt(128))
        assert to_host(step.seq_lens).tolist() == [101, 200]
        assert rel_error(to_host(out), ref) <= TOLERANCE["float16"]


# --- mixed steps: the decode kernel takes the one-token rows --------------------------------------------

def placements(bs):
    """(prefix, new) per sequence: decode rows (one new token after bs - 1, bs and 300 cached ones) beside a
    prompt and a chunk after cached tokens, placed as an engine may batch them."""
    d, p = [(bs - 1, 1), (bs, 1), (300, 1)], [(0, 70), (bs + 1, 40)]
    return {"decodes first": d + p, "decodes last": p + d, "interleaved": [d[0], p[0], d[1], (5, 0), p[1], d[2]],
            "all decodes": d, "no decodes": p}


def mixed_errors(cfg, spec, kv_heads, causal=True, seed=0, **kwargs):
    """Run a mixed step once (validated, NaN-poisoned out) and return (decode rows, rows over tolerance)."""
    case = case_of(cfg, spec, kv_heads=kv_heads, seed=seed)
    dev = OnDevice(case)
    plan = PrefillPlan(dev.q, dev.k, dev.table, dev.lens, dev.qo_indptr, query_lens=case.query_lens, causal=causal,
                       **kwargs)
    out = poisoned(case.q.shape, case.q.dtype)
    assert plan.run(dev.q, dev.k, dev.v, out=out) is out
    return plan.decode_rows.tolist(), row_errors(to_host(out), expected(case, causal), case)


@pytest.mark.parametrize("placement", list(placements(16)))
@pytest.mark.parametrize("kv_heads, group", [(2, 1), (2, 4), (1, 8), (1, 12)])
def test_mixed_steps_match_the_reference_row_by_row(placement, kv_heads, group):
    """Decode rows wherever they sit, at every group (12: the decode kernel's m16 tile of heads, its upper half
    in use)."""
    spec = placements(16)[placement]
    rows, bad = mixed_errors(Config("float16", 128, 16, group), spec, kv_heads, seed=group)
    assert rows == [b for b, (_, n) in enumerate(spec) if n == 1]
    assert not bad, bad


@pytest.mark.parametrize("cfg", MIXED_CONFIGS, ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_mixed_steps_in_each_dtype_and_block_size(cfg, causal):
    failures = []
    for placement in ("interleaved", "decodes last"):
        for kv_heads, group in ((2, 4), (1, 8)):
            _, bad = mixed_errors(Config(cfg.dtype, cfg.head_dim, cfg.block_size, group),
                                  placements(cfg.block_size)[placement], kv_heads, causal, seed=group)
            failures += [f"{placement}, group {group}: {b}" for b in bad]
    assert not failures, "; ".join(failures)


@pytest.mark.parametrize("placement", ["interleaved", "decodes last", "all decodes"])
def test_split_decode_rows_over_a_callers_workspace_in_a_cuda_graph(placement):
    """Long decode rows split (partials in the caller's workspace, merged by the last segment), the plan made
    before capture on the capturing stream, its runs over two layers captured and replayed twice."""
    import cupy
    spec = {"interleaved": [(4000, 1), (0, 90), (2999, 1)], "decodes last": [(0, 90), (4000, 1), (2999, 1)],
            "all decodes": [(4000, 1), (2999, 1)]}[placement]
    case = case_of(BASE, spec, kv_heads=2, seed=21)
    case.buffer[:, :, 0] = (case.buffer[:, :, 1].astype(np.float32) * -0.5).astype(case.buffer.dtype)
    dev = OnDevice(case)
    planes = [(dev.buffer[:, 0, layer], dev.buffer[:, 1, layer]) for layer in (0, 1)]
    refs = [expected(case, True, case.buffer[:, 0, layer], case.buffer[:, 1, layer]) for layer in (0, 1)]
    workspace = cupy.empty(workspace_bytes(2, 8, 128, 64), np.uint8)
    outs = [poisoned(case.q.shape, case.q.dtype) for _ in planes]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        plan = PrefillPlan(dev.q, planes[0][0], dev.table, dev.lens, dev.qo_indptr, query_lens=case.query_lens,
                           workspace=workspace)
        assert plan._decode.launch.grid[2] > 1  # the decode rows are split
        replay_twice(stream, plan, dev, planes, outs, refs, case)
    with pytest.raises(LaunchArgumentError, match="stream it was made on"):
        plan.run(dev.q, *planes[0])  # the current stream is not the plan's
    with pytest.raises(LaunchArgumentError, match="workspace holds 16 bytes"):
        PrefillPlan(dev.q, planes[0][0], dev.table, dev.lens, dev.qo_indptr, workspace=workspace[:16])
    own = PrefillPlan(dev.q, planes[0][0], dev.table, dev.lens, dev.qo_indptr)  # a split workspace of its own
    assert not row_errors(to_host(own.run(dev.q, *planes[1])), refs[1], case)
