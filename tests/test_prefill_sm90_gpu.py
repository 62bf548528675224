"""The sm_90a prefill kernel (cuda_src/prefill_sm90.cu) against the float64 reference, on a device of compute
capability 9.0 (skipped elsewhere).

A plan there picks the sm_90a kernel; this module checks that, then the whole matrix:
every dtype x head_dim x block size, causal and not, each over groups 1, 4 and 8 (two KV
heads) and 48 (MQA: one KV head, a group that cuts the 128-row tiles mid-token), on the
ragged batch of test_prefill_gpu (prefixes 0, 1, block - 1, block, block + 1 and long;
rows of no query and of one: at groups up to 8 the decode kernel takes those), plus one
long prompt beside long prefixes, so that key tiles wrap the stage ring many times; lengths around a half tile,
where a consumer's last tile takes half its keys.
Inputs are fresh random data, unowned slots hold NaN and outputs are poisoned before each
launch (test_prefill_gpu's helpers). The mma.sync kernel, which every other GPU (and a
scale of 0 or below) runs, is checked here too, by a plan that is told the device is not
9.0. A plan over more units than SMs, run again and replayed in a CUDA graph, checks that the kernel's unit
queue is back at zero after each launch.

Over FP8 planes (the sm_90a kernel's FP8 twin): the same ragged matrix at head_dim 64 and 128, each q dtype,
block size, causal and not, over the dequantised values (the planes are the fp16 cases' values quantised with
random scales per KV head; unowned slots hold the NaN code); long prompts beside long prefixes; a plan over
more units than SMs run over two layers of different scales, then replayed in a CUDA graph; a mixed step (its
decode rows on decode_fp8) run and replayed; and the mma.sync twin for a scale of 0 or below.
"""

import numpy as np
import pytest

from helpers import compile_all, to_host
from kernel_cases import PrefillCase
from pagedrt import fp8
from pagedrt.attention import PrefillPlan, decode, planner, prefill, prefill_sm90, reference
from pagedrt.errors import LaunchArgumentError
from pagedrt.kernels.configs import FP8, Config
from test_prefill_gpu import OnDevice, case_of, expected, poisoned, ragged, replay_twice, row_errors, run

pytestmark = pytest.mark.gpu

DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (64, 128, 256)
BLOCK_SIZES = (8, 16, 32, 64, 128)
GROUPS = ((2, 1), (2, 4), (2, 8), (1, 48))  # (kv_heads, group)
FALLBACK_CONFIGS = [Config("float16", 128, 16, 4), Config("bfloat16", 256, 32, 8), Config("float16", 64, 128, 1),
                    Config("bfloat16", 128, 32, 4)]  # the mma.sync kernel's tests here (the last: scale <= 0)
FP8_HEAD_DIMS = (64, 128)
FP8_GROUPS = (1, 4, 8, 48)  # GROUPS' groups: their one-token rows run on decode_fp8


@pytest.fixture(scope="module", autouse=True)
def hopper():
    """Skip unless the device is compute capability 9.0; then compile the module's kernels up front: the sm_90a
    prefill, the mma.sync one of the fallback tests, and the (indexed) decode kernels that the one-token rows at
    groups up to 8 run."""
    import cupy
    if cupy.cuda.Device().compute_capability != prefill_sm90.SM90:
        pytest.skip("the sm_90a kernel needs compute capability 9.0")
    configs = [Config(d, h, b, g) for d in DTYPES for h in HEAD_DIMS for b in BLOCK_SIZES for g in (1, 4, 8)]
    names = [decode.kernel_name(c, True, "standard", indexed=True) for c in configs]
    fallback = {prefill.FILE: [prefill.kernel_name(c) for c in FALLBACK_CONFIGS]
                + [prefill.kernel_name(Config("float16", 128, 16, 4, FP8))]}
    fp8_configs = [Config(d, h, b, g, FP8) for d in DTYPES for h in FP8_HEAD_DIMS for b in BLOCK_SIZES
                   for g in FP8_GROUPS]
    names += [decode.kernel_name(c, True, "standard", indexed=True) for c in fp8_configs]
    compile_all(prefill.instances(configs + fp8_configs, prefill_sm90.SM90), fallback, {decode.FILE: names})


def test_the_plan_picks_the_sm90a_kernel():
    case = case_of(Config("float16", 128, 16, 4), [(3, 20)])
    dev = OnDevice(case)
    plan = PrefillPlan(dev.q, dev.k, dev.table, dev.lens, dev.qo_indptr, query_lens=case.query_lens)
    assert plan.kernel == prefill_sm90.kernel_name(case.cfg) and plan.kernel.startswith("pagedrt::prefill_sm90<")


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_sm90_matches_the_reference_row_by_row(dtype, head_dim, block_size, causal):
    failures = []
    for kv_heads, group in GROUPS:
        cfg = Config(dtype, head_dim, block_size, group)
        case = case_of(cfg, ragged(block_size), kv_heads=kv_heads, seed=head_dim + block_size + group)
        bad = row_errors(run(OnDevice(case), case, causal), expected(case, causal), case)
        failures += [f"group {group}: row {b} prefix {p} queries {n}: error {e:.2e}" for b, p, n, e in bad]
    assert not failures, "; ".join(failures)


@pytest.mark.parametrize("cfg", [Config("float16", 128, 16, 4), Config("bfloat16", 64, 8, 8),
                                 Config("float16", 256, 128, 1)], ids=str)
def test_sm90_long_prompts_wrap_the_stage_ring(cfg):
    case = PrefillCase(cfg, [3000, 0, 700], [900, 1500, 1], kv_heads=2, seed=5)
    for causal in (True, False):
        assert not row_errors(run(OnDevice(case), case, causal), expected(case, causal), case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", (64, 128))
def test_last_tiles_of_half_their_keys_or_fewer_attend_as_the_reference(dtype, head_dim):
    """A unit's last key tile (128 keys) is a Half one for a consumer none of whose rows sees past its first 64
    keys: lengths that leave 1, 63, 64, 65, 127 and 128 keys in the last tile, one tile and more, prompts whose
    causal diagonals fall either side of the half for one consumer and not the other (group 1: 64 tokens a
    consumer; group 4: 16), causal and not."""
    failures = []
    for group in (1, 4):
        cfg = Config(dtype, head_dim, 16, group)
        spec = [(128 + r - 40, 40) for r in (1, 63, 64, 65, 127, 128)] + [(0, r) for r in (2, 63, 64, 65, 127, 128)]
        spec += [(0, 192), (0, 200), (100, 60)]
        case = case_of(cfg, spec, kv_heads=2, seed=head_dim + group)
        for causal in (True, False):
            bad = row_errors(run(OnDevice(case), case, causal), expected(case, causal), case)
            failures += [f"group {group} causal {causal}: row {b} prefix {p} queries {n}: error {e:.2e}"
                         for b, p, n, e in bad]
    assert not failures, "; ".join(failures)


def test_the_unit_queue_is_ready_again_for_each_run_and_graph_replay():
    """More (item, KV head) units than SMs, so blocks claim units from the queue: every run of one plan, plain or
    replayed from a CUDA graph, attends every row (a queue left past zero would skip units: NaN rows)."""
    import cupy
    cfg = Config("float16", 128, 16, 4)
    case = PrefillCase(cfg, [0, 400, 2000, 0], [900, 500, 200, 40], kv_heads=4, seed=17)
    dev, ref = OnDevice(case), expected(case)
    plan = PrefillPlan(dev.q, dev.k, dev.table, dev.lens, dev.qo_indptr, query_lens=case.query_lens)
    assert plan.kernel == prefill_sm90.kernel_name(cfg)
    units = len(planner.prefill_items(case.query_lens, cfg.group, planner.SM90_TILE_M)) * 4  # 4 KV heads
    assert units > cupy.cuda.Device().attributes["MultiProcessorCount"]
    for _ in range(3):
        out = poisoned(case.q.shape, case.q.dtype)
        plan.run(dev.q, dev.k, dev.v, out=out)
        assert not row_errors(to_host(out), ref, case)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        replay_twice(stream, plan, dev, [(dev.k, dev.v)], [poisoned(case.q.shape, case.q.dtype)], [ref], case)


@pytest.mark.parametrize("share", [None, 1e-9], ids=["its share", "one SM"])
def test_a_mixed_steps_prompt_runs_on_the_sms_the_planner_gives_it(share, monkeypatch):
    """Beside decode rows the prompt's persistent grid takes mixed_prompt_blocks' SMs (one at the least, its
    units at the most), and every row, prompt and decode, still matches the reference, run after run and
    replayed in a CUDA graph."""
    import cupy
    if share is not None:
        monkeypatch.setattr(planner, "MIXED_PROMPT_SHARE", share)
    cfg = Config("float16", 128, 16, 4)
    case = PrefillCase(cfg, [0, 3000, 500, 2047, 9], [1500, 1, 1, 1, 900], kv_heads=2, seed=23)
    dev, ref = OnDevice(case), expected(case)
    stream = cupy.cuda.Stream(non_blocking=True)  # the decode rows split: the plan runs on the stream it is made on
    with stream:
        plan = PrefillPlan(dev.q, dev.k, dev.table, dev.lens, dev.qo_indptr, query_lens=case.query_lens)
        sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        units = len(planner.prefill_items(case.query_lens, 4, planner.SM90_TILE_M, skip=[1, 2, 3])) * 2
        assert units > sms  # the prompt's blocks claim units from the queue
        grid = plan._prefill.grid
        assert grid == (planner.mixed_prompt_blocks(sms),) and (share is None) == (grid[0] > 1)
        for _ in range(2):
            out = poisoned(case.q.shape, case.q.dtype)
            plan.run(dev.q, dev.k, dev.v, out=out)
            assert not row_errors(to_host(out), ref, case)
        replay_twice(stream, plan, dev, [(dev.k, dev.v)], [poisoned(case.q.shape, case.q.dtype)], [ref], case)


def test_a_scale_of_zero_or_below_takes_the_mma_sync_kernel():
    """The sm_90a kernel takes the max over unscaled scores (the scale folded into exp2), so it needs scale > 0."""
    cfg = FALLBACK_CONFIGS[-1]
    case = case_of(cfg, ragged(32), seed=7)
    dev = OnDevice(case)
    for scale in (-0.2, 0.0):
        plan = PrefillPlan(dev.q, dev.k, dev.table, dev.lens, dev.qo_indptr, query_lens=case.query_lens, scale=scale)
        assert plan.kernel == prefill.kernel_name(cfg)
        out = poisoned(case.q.shape, case.q.dtype)
        plan.run(dev.q, dev.k, dev.v, out)
        ref = reference.prefill(case.q.astype(np.float64), case.k, case.v, case.table, case.lens, case.qo_indptr,
                                scale)
        assert not row_errors(out.get(), ref, case)


@pytest.mark.parametrize("cfg", FALLBACK_CONFIGS, ids=str)
def test_the_mma_sync_kernel_still_runs_where_the_device_is_not_9_0(cfg, monkeypatch):
    monkeypatch.setattr(prefill_sm90, "runs_on", lambda device_id: False)
    case = case_of(cfg, ragged(cfg.block_size), seed=11)
    dev = OnDevice(case)
    plan = PrefillPlan(dev.q, dev.k, dev.table, dev.lens, dev.qo_indptr, query_lens=case.query_lens)
    assert plan.kernel == prefill.kernel_name(cfg)
    out = poisoned(case.q.shape, case.q.dtype)
    plan.run(dev.q, dev.k, dev.v, out)
    assert not row_errors(out.get(), expected(case), case)
    assert np.isfinite(out.get().astype(np.float32)).all()


# --- FP8 K/V: the FP8 twin ----------------------------------------------------------------------------------

class Fp8Case:
    """A PrefillCase's values quantised to e4m3 (K and V of each layer with random scales per KV head; the NaN of
    unowned slots becomes the NaN code), on the host and on the device: planes of both layers of the block-major
    buffer (a block stride of 2 x layers blocks; layer 0 holds layer 1's values times -0.5), and the reference
    over the dequantised values."""

    def __init__(self, cfg, spec, kv_heads=2, seed=0):
        import cupy
        self.case = case = (PrefillCase(cfg, *spec, kv_heads=kv_heads, seed=seed) if isinstance(spec, tuple)
                            else case_of(cfg, spec, kv_heads=kv_heads, seed=seed))
        case.buffer[:, :, 0] = (case.buffer[:, :, 1].astype(np.float32) * -0.5).astype(case.buffer.dtype)  # layer 0
        rng = np.random.default_rng(seed + 2)
        # [layers, K/V, KV heads]: each layer and plane its own scales
        self.scales = rng.uniform(0.01, 0.05, (case.buffer.shape[2], 2, kv_heads)).astype(np.float32)
        # buffer [blocks, K/V, layers, KV heads, block, dim]: fp8.quantise wants the KV heads next to last
        self.buffer = np.stack([np.stack([fp8.quantise(case.buffer[:, i, layer].swapaxes(1, 2), self.scales[layer, i])
                                          .swapaxes(1, 2) for layer in range(case.buffer.shape[2])], 1)
                                for i in (0, 1)], 1)
        self.q, self.table, self.lens, self.qo_indptr, self.dev_buffer, self.dev_scales = (
            cupy.asarray(a) for a in (case.q, case.table, case.lens, case.qo_indptr, self.buffer, self.scales))

    def planes(self, layer=1):
        """The device's (k, v, k_scale, v_scale) of ``layer``."""
        return (self.dev_buffer[:, 0, layer], self.dev_buffer[:, 1, layer], self.dev_scales[layer, 0],
                self.dev_scales[layer, 1])

    def expected(self, causal=True, layer=1, scale=None):
        c = self.case
        return reference.prefill(c.q.astype(np.float64), self.buffer[:, 0, layer], self.buffer[:, 1, layer], c.table,
                                 c.lens, c.qo_indptr, scale, causal, k_scale=self.scales[layer, 0],
                                 v_scale=self.scales[layer, 1])

    def plan(self, causal=True, **kwargs):
        return PrefillPlan(self.q, self.planes()[0], self.table, self.lens, self.qo_indptr,
                           query_lens=self.case.query_lens, causal=causal, **kwargs)

    def replay_twice(self, stream, plan, refs):
        """test_prefill_gpu.replay_twice over layers 0 and 1 with their scales; ``refs``: their references."""
        planes = [self.planes(layer) for layer in (0, 1)]
        replay_twice(stream, plan, self, [p[:2] for p in planes], [poisoned(self.case.q.shape, self.case.q.dtype)
                     for _ in planes], refs, self.case, [dict(k_scale=p[2], v_scale=p[3]) for p in planes])

    def run(self, plan, layer=1):
        """One run of ``plan`` over ``layer``'s planes into a NaN-poisoned out; the host copy of out."""
        k, v, k_scale, v_scale = self.planes(layer)
        out = poisoned(self.case.q.shape, self.case.q.dtype)
        assert plan.run(self.q, k, v, out, k_scale=k_scale, v_scale=v_scale) is out
        return to_host(out)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_dim", FP8_HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_fp8_matches_the_reference_on_dequantised_values_row_by_row(dtype, head_dim, block_size, causal):
    failures = []
    for kv_heads, group in GROUPS:
        cfg = Config(dtype, head_dim, block_size, group)
        f = Fp8Case(cfg, ragged(block_size), kv_heads=kv_heads, seed=head_dim + block_size + group)
        plan = f.plan(causal)
        assert plan.kernel == prefill_sm90.kernel_name(Config(dtype, head_dim, block_size, group, FP8))
        assert plan.kernel.startswith("pagedrt::prefill_sm90_fp8<")
        bad = row_errors(f.run(plan), f.expected(causal), f.case)
        failures += [f"group {group}: row {b} prefix {p} queries {n}: error {e:.2e}" for b, p, n, e in bad]
    assert not failures, "; ".join(failures)


@pytest.mark.parametrize("cfg", [Config("float16", 128, 16, 4), Config("bfloat16", 64, 8, 8),
                                 Config("bfloat16", 128, 128, 1)], ids=str)
def test_fp8_long_prompts_wrap_the_stage_and_staging_rings(cfg):
    f = Fp8Case(cfg, ([3000, 0, 700], [900, 1500, 1]), seed=5)
    for causal in (True, False):
        assert not row_errors(f.run(f.plan(causal)), f.expected(causal), f.case)


def test_fp8_layers_of_their_own_scales_run_again_and_replay_in_a_cuda_graph():
    """More units than SMs (blocks claim units from the queue), two layers of different values and scales: every
    run, plain and replayed from a CUDA graph, matches its layer's reference. A run without the scales is refused
    and leaves out as it was."""
    import cupy
    cfg = Config("bfloat16", 128, 16, 4)
    f = Fp8Case(cfg, ([0, 400, 2000, 0], [900, 500, 200, 40]), kv_heads=4, seed=17)
    units = len(planner.prefill_items(f.case.query_lens, cfg.group, planner.SM90_TILE_M)) * 4  # 4 KV heads
    assert units > cupy.cuda.Device().attributes["MultiProcessorCount"]
    assert not np.array_equal(f.scales[0], f.scales[1])
    refs = [f.expected(layer=layer) for layer in (0, 1)]
    plan = f.plan()
    for _ in range(2):
        for layer in (0, 1):
            assert not row_errors(f.run(plan, layer), refs[layer], f.case)
    k, v, k_scale, _ = f.planes()
    out = poisoned(f.case.q.shape, f.case.q.dtype)
    with pytest.raises(LaunchArgumentError, match="need v_scale"):
        plan.run(f.q, k, v, out, k_scale=k_scale)
    assert np.isnan(to_host(out).astype(np.float32)).all()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        f.replay_twice(stream, f.plan(), refs)


@pytest.mark.parametrize("cfg", [Config("float16", 128, 16, 4), Config("bfloat16", 64, 32, 8)], ids=str)
def test_fp8_mixed_steps_prompt_rows_take_the_twin_beside_decode_fp8(cfg):
    """The prompt rows on the FP8 twin over mixed_prompt_blocks' SMs, the one-token rows on decode_fp8 beside
    them; every row matches the reference, run after run and replayed in a CUDA graph."""
    import cupy
    f = Fp8Case(cfg, ([0, 3000, 500, 2047, 9], [1500, 1, 1, 1, 900]), seed=23)
    refs = [f.expected(layer=layer) for layer in (0, 1)]
    stream = cupy.cuda.Stream(non_blocking=True)  # the plan runs on the stream it is made on
    with stream:
        plan = f.plan()
        assert plan.decode_rows.tolist() == [1, 2, 3]
        assert plan.kernel == prefill_sm90.kernel_name(Config(cfg.dtype, cfg.head_dim, cfg.block_size, cfg.group, FP8))
        sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        assert plan._prefill.grid == (min(planner.mixed_prompt_blocks(sms), len(plan._items) * 2),)
        for layer in (1, 0, 1):
            assert not row_errors(f.run(plan, layer), refs[layer], f.case)
        f.replay_twice(stream, plan, refs)


def test_fp8_a_scale_of_zero_or_below_takes_the_mma_sync_twin():
    f = Fp8Case(Config("float16", 128, 16, 4), ragged(16), seed=7)
    for scale in (-0.2, 0.0):
        plan = f.plan(scale=scale)
        assert plan.kernel == prefill.kernel_name(Config("float16", 128, 16, 4, FP8))
        assert not row_errors(f.run(plan), f.expected(scale=scale), f.case)
