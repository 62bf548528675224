"""What the one-launch decode step (pagedrt.engine.fused) takes, decided without a GPU: the models and caches it
runs, named reasons for the others, and the shapes its kernel instances are chosen by."""

from dataclasses import replace

import pytest

from pagedrt.bench.generate import SMOLLM2
from pagedrt.engine import fused
from pagedrt.engine.config import ModelConfig
from pagedrt.spec import KVSpec

SMOL = ModelConfig(**SMOLLM2)


def spec(dtype="float16", kv_dtype=None, head_dim=64):
    return KVSpec.build(30, 3, head_dim, 16, dtype, kv_dtype)


def test_smollm2_runs_fused_in_fp16_and_bf16():
    pytest.importorskip("ml_dtypes", reason="bfloat16 is ml_dtypes'")
    assert fused.unsupported(SMOL, spec(), 90, 227 << 10) is None
    assert fused.unsupported(SMOL, spec("bfloat16"), 80, 99 << 10) is None
    assert "compute capability 75" in fused.unsupported(SMOL, spec(), 75, 64 << 10)


@pytest.mark.parametrize("change,kv,why", [
    ({}, "float8_e4m3", "FP8"),
    ({"head_dim": 96, "hidden": 864}, None, "head_dim 96"),
    ({"hidden": 2048, "q_heads": 32}, None, "hidden 2048 is over 1536"),
    ({"ffn": 1540}, None, "multiple of 32"),
    ({"q_heads": 48, "kv_heads": 1, "head_dim": 64, "hidden": 1536}, None, "a group of 48"),
])
def test_other_models_and_caches_are_refused_with_a_reason(change, kv, why):
    config = replace(SMOL, **change)
    assert why in fused.unsupported(config, spec(kv_dtype=kv, head_dim=config.head_dim), 90, 227 << 10)


def test_the_norm_instance_is_the_smallest_that_holds_the_row():
    for hidden in range(32, fused.MAX_HIDDEN + 1, 32):
        per = fused.norm_per(hidden)
        assert per in fused.NORM_PER and per * fused.THREADS >= hidden
        assert all(v * fused.THREADS < hidden for v in fused.NORM_PER if v < per)  # the smallest that fits


def test_shared_memory_grows_with_rows_and_fits_smollm2():
    sizes = [fused.smem_bytes(SMOL, rows) for rows in fused.ROWS]
    assert sizes == sorted(sizes) and sizes[-1] <= 99 << 10  # what every device of compute capability 8.x allows


@pytest.mark.parametrize("head_dim", fused.HEAD_DIMS)
def test_the_widest_group_fits_its_warps_outputs_in_shared_memory(head_dim):
    """Attention's 8 warps each keep a slice of group x head_dim floats (over the K/V tiles, or a front that large):
    the widest group the kernel takes still fits."""
    group = fused.MAX_GROUP_DIMS // head_dim
    config = replace(SMOL, head_dim=head_dim, q_heads=group, kv_heads=1, hidden=fused.MAX_HIDDEN)
    slices, state = fused.WARPS * group * head_dim * 4, group * (head_dim + fused.TILE + 3) * 4
    assert fused.smem_bytes(config, fused.MAX_ROWS) >= slices + state
    assert fused.unsupported(config, spec(head_dim=head_dim), 90, 227 << 10) is None


H200 = (132, 90, 227 << 10)  # SMs, compute capability, shared memory a block may opt in to


def test_smollm2_stages_every_phase_on_an_h200():
    """q/k/v (60 tiles), o (36), gate/up (192: two on block 0) and down (36): one tile a block each but gate/up's
    two, rows padded to 576 + 32 (q/k/v, o, gate/up) and 1536 + 32 (down) elements, two bytes each; then the 30
    layers' four pointers."""
    mask, size = fused.staging(SMOL, 2, *H200)
    assert mask == 0b1111
    assert size == 2 * 16 * (608 + 608 + 2 * 608 + 1568) + 30 * 4 * 8


def test_nothing_is_staged_before_compute_capability_9():
    assert fused.staging(SMOL, 2, 108, 80, 163 << 10) == (0, 0)


@pytest.mark.parametrize("ffn", [320, 1536, 4096, 5376])
@pytest.mark.parametrize("grid", [16, 66, 132])
def test_staged_weights_fit_beside_the_rest_and_leave_no_phase_that_would_fit(ffn, grid):
    """Phases are staged in order while they fit: what is staged fits beside the phases' own shared memory, and a
    phase left out would not have fitted."""
    config = replace(SMOL, ffn=ffn)
    sms, capability, limit = H200
    mask, size = fused.staging(config, 2, grid, capability, limit)
    rest = fused.smem_bytes(config, fused.MAX_ROWS) + config.num_layers * 4 * 8
    w = config.q_heads * config.head_dim
    ks = (config.hidden, w, config.hidden, config.ffn)
    tiles = (-(-(w + 2 * config.kv_heads * config.head_dim) // 16), -(-config.hidden // 16), -(-config.ffn // 8),
             -(-config.hidden // 16))
    sizes = [-(-t // grid) * 16 * fused.staged_stride(k) * 2 for k, t in zip(ks, tiles)]
    staged = sum(s for p, s in enumerate(sizes) if mask >> p & 1)
    assert size == (staged + config.num_layers * 4 * 8 if mask else 0)
    assert rest + staged <= limit
    for p, s in enumerate(sizes):
        if not mask >> p & 1:
            assert rest + sum(sizes[q] for q in range(p) if mask >> q & 1) + s > limit
