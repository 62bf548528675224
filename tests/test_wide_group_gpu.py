"""Decode of wide groups (more than planner.WIDE_GROUP query heads a KV head) on the sm_90a prefill kernel, on a
device of compute capability 9.0 (skipped elsewhere), against the float64 reference.

A DecodePlan of such a group (fp16/bf16 planes, a positive scale, the plan's geometry; to 32 heads only when
the decode kernel's own plan would split it: planner.wide_kernel) runs
cuda_src/prefill_sm90.cu over one work item per sequence, split-K as planner.wide_split cuts it, merged in
the kernel: every dtype x head_dim (64, 128) x block size at groups 17, 24, 40 and 64, split or not and into more
segments than some sequences have keys; long sequences, a zero-length one, uneven lengths, lengths past the
plan's max_seq_len (the last segment runs on), a mixed step's decode rows; a caller's dirty
workspace whose counts the kernel leaves at zero, and a plan replayed in a CUDA graph. Inputs are fresh
random data, unowned slots hold NaN and outputs are poisoned (kernel_cases.Case, test_attention_gpu).
"""

import numpy as np
import pytest

from helpers import compile_all, to_host
from kernel_cases import Case, rel_error
from pagedrt.attention import DecodePlan, planner, prefill, prefill_sm90, reference, workspace_bytes
from pagedrt.kernels.configs import Config
from test_attention_gpu import OnDevice, arrival_counts, expected, poisoned, run_plan
import test_prefill_gpu as mixed

pytestmark = pytest.mark.gpu

TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2}
DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (64, 128)
WIDE = (17, 24, 40, 64)


@pytest.fixture(scope="module", autouse=True)
def hopper():
    import cupy
    if cupy.cuda.Device().compute_capability != prefill_sm90.SM90:
        pytest.skip("the sm_90a kernel needs compute capability 9.0")
    compile_all(prefill.instances([Config(d, h, 16, 24) for d in DTYPES for h in HEAD_DIMS], prefill_sm90.SM90))


def lengths(bs):
    return [1, bs - 1, bs, bs + 1, 1000]


def test_a_plan_takes_the_sm90a_kernel_past_16_heads_split_and_past_32_always():
    import cupy
    for group, lens, wide in ((16, [3000, 7], False), (17, [3000, 7], True), (17, [40, 7], False),
                              (32, [40, 7], False), (33, [40, 7], True), (64, [40, 7], True)):
        case = Case(Config("float16", 128, 16, group), lens, seed=group)
        dev = OnDevice(case)
        plan = DecodePlan(dev.q, dev.k, dev.table, dev.lens)
        assert (plan.split.geometry == planner.WGMMA) == wide, (group, lens)
        assert rel_error(run_plan(plan, dev, case), expected(case)) <= TOLERANCE["float16"], (group, lens)
    # a forced geometry, a scale of 0 or below, FP8 planes and float32 keep the decode kernel
    case = Case(Config("float16", 128, 16, 24), [40, 7], seed=1)
    dev = OnDevice(case)
    assert DecodePlan(dev.q, dev.k, dev.table, dev.lens, geometry="standard").split.geometry == "standard"
    assert DecodePlan(dev.q, dev.k, dev.table, dev.lens, scale=-0.1).split.geometry != planner.WGMMA
    fp8 = cupy.zeros(dev.k.shape, np.uint8)
    assert DecodePlan(dev.q, fp8, dev.table, dev.lens).split.geometry != planner.WGMMA
    case32 = Case(Config("float32", 128, 16, 24), [40, 7], seed=1)
    dev32 = OnDevice(case32)
    assert DecodePlan(dev32.q, dev32.k, dev32.table, dev32.lens).split.geometry != planner.WGMMA


@pytest.mark.parametrize("block_size", (8, 16, 128))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_wide_groups_match_the_reference_split_or_not(dtype, head_dim, block_size):
    failures = []
    for group in WIDE:
        cfg = Config(dtype, head_dim, block_size, group)
        kv_heads = 1 if group == 64 else 2
        case = Case(cfg, lengths(block_size), kv_heads=kv_heads, seed=group + head_dim + block_size)
        dev, ref = OnDevice(case), expected(case)
        for num_splits in (None, 1, 3, 40):  # 40: most segments of the short sequences hold no key
            plan = DecodePlan(dev.q, dev.k, dev.table, dev.lens, num_splits=num_splits)
            # to 32 heads the decode kernel runs what its own plan (a forced geometry keeps it) leaves unsplit
            own = DecodePlan(dev.q, dev.k, dev.table, dev.lens, num_splits=num_splits, geometry="standard")
            wide = group > planner.WIDE_UNSPLIT_GROUP or own.split.num_splits > 1
            assert (plan.split.geometry == planner.WGMMA) == wide, (group, num_splits)
            out = run_plan(plan, dev, case)
            for row in range(len(case.lens)):
                err = rel_error(out[row], ref[row])
                if not err <= TOLERANCE[dtype]:
                    failures.append(f"group {group} splits {num_splits} row {row}: {err:.2e}")
    assert not failures, "; ".join(failures)


def test_long_and_uneven_sequences_split_by_the_plan():
    cfg = Config("bfloat16", 128, 16, 32)
    case = Case(cfg, [32768, 3, 9000, 130], seed=3)
    dev, ref = OnDevice(case), expected(case)
    for hints in ({}, dict(mean_seq_len=float(np.mean(case.lens)))):
        plan = DecodePlan(dev.q, dev.k, dev.table, dev.lens, **hints)
        assert plan.split.num_splits > 1 and plan.split.segment_tokens % 128 == 0
        out = run_plan(plan, dev, case)
        for row in range(len(case.lens)):
            assert rel_error(out[row], ref[row]) <= TOLERANCE[cfg.dtype], (hints, row)


def test_lengths_past_the_plans_hint_run_on_in_the_last_segment():
    """max_seq_len sizes the split only: a plan cut for shorter sequences still attends every key, its last
    segment running on to the end (as the decode kernel's)."""
    cfg = Config("float16", 128, 16, 24)
    case = Case(cfg, [9000, 40, 3000], seed=21)
    dev, ref = OnDevice(case), expected(case)
    for hints in (dict(max_seq_len=1024), dict(max_seq_len=2048, num_splits=3), dict(max_seq_len=1100)):
        plan = DecodePlan(dev.q, dev.k, dev.table, dev.lens, **hints)
        assert plan.split.geometry == planner.WGMMA
        assert plan.split.num_splits * plan.split.segment_tokens < 9000  # the hint's cut ends before the longest
        out = run_plan(plan, dev, case)
        for row in range(len(case.lens)):
            assert rel_error(out[row], ref[row]) <= TOLERANCE[cfg.dtype], (hints, row)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_mixed_steps_decode_rows_run_split_beside_its_prompt(dtype):
    """A PrefillPlan's one-token rows at a wide group take the same path, split (long rows beside short ones and
    a prompt chunk), the prompt on the unsplit kernel beside them; causal and not."""
    cfg = Config(dtype, 128, 16, 32)
    case = mixed.case_of(cfg, [(6000, 1), (0, 200), (17, 1), (9000, 1), (300, 40), (0, 1)], kv_heads=2, seed=4)
    dev = mixed.OnDevice(case)
    for causal in (True, False):
        bad = mixed.row_errors(mixed.run(dev, case, causal), mixed.expected(case, causal), case)
        assert not bad, (causal, bad)


def test_an_empty_sequence_attends_to_nothing_and_gets_zeros():
    import cupy
    cfg = Config("float16", 128, 16, 40)
    case = Case(cfg, [300, 5, 2000], seed=9)
    dev = OnDevice(case)
    case.lens[1] = 0
    dev.lens = cupy.asarray(case.lens)
    for num_splits in (1, 4):  # not validated: validation refuses a length of 0
        out = run_plan(DecodePlan(dev.q, dev.k, dev.table, dev.lens, num_splits=num_splits, validate=False), dev,
                       case)
        assert not out[1].any()
        for row in (0, 2):
            want = reference.paged_decode(case.q[row:row + 1].astype(np.float64), case.k, case.v,
                                          case.table[row:row + 1], case.lens[row:row + 1])
            assert rel_error(out[row], want[0]) <= TOLERANCE[cfg.dtype]


def test_a_dirty_caller_workspace_serves_plan_after_plan_and_its_counts_reset():
    """The kernel merges only live segments and leaves every arrival count at zero, over a caller's workspace
    full of NaN partials, plan after plan of different split counts."""
    import cupy
    cfg = Config("float16", 64, 32, 48)
    case = Case(cfg, [1, 5000, 17, 300], kv_heads=1, seed=5)
    dev = OnDevice(case)
    batch, q_heads, head_dim = case.q.shape
    workspace = cupy.full(workspace_bytes(batch, q_heads, head_dim, 64), 0xFF, np.uint8)
    for n in (16, 64, 5):
        counts = arrival_counts(workspace, batch, q_heads, head_dim, n)
        partials = workspace[:planner.workspace_layout(batch, q_heads, head_dim, n)[2]]
        plan = DecodePlan(dev.q, dev.k, dev.table, dev.lens, num_splits=n, workspace=workspace)
        assert plan.split.geometry == planner.WGMMA
        for _ in range(3):
            assert not counts.any()
            partials.fill(0xFF)  # NaN in every partial o, m and l
            assert rel_error(run_plan(plan, dev, case), expected(case)) <= TOLERANCE[cfg.dtype]
        assert not counts.any()


def test_a_split_wide_plan_replays_in_a_cuda_graph():
    import cupy
    cfg = Config("bfloat16", 128, 16, 24)
    case = Case(cfg, [6000, 40, 2500], seed=13)
    dev = OnDevice(case)
    stream = cupy.cuda.Stream(non_blocking=True)
    out = poisoned(case.q.shape, case.q.dtype)
    with stream:
        plan = DecodePlan(dev.q, dev.k, dev.table, dev.lens)
        assert plan.split.num_splits > 1
        plan.run(dev.q, dev.k, dev.v, out)  # compile and warm up outside the capture
        stream.begin_capture()
        plan.run(dev.q, dev.k, dev.v, out)
        graph = stream.end_capture()
        for seed in (1, 2):
            q = np.random.default_rng(seed).standard_normal(case.q.shape, dtype=np.float32).astype(case.q.dtype)
            dev.q[...] = cupy.asarray(q)
            out.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            case.q = q
            assert rel_error(to_host(out), expected(case)) <= TOLERANCE[cfg.dtype]
