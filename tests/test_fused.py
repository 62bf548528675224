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
    assert fused.unsupported(SMOL, spec(), 90) is None
    assert fused.unsupported(SMOL, spec("bfloat16"), 80) is None
    assert "compute capability 75" in fused.unsupported(SMOL, spec(), 75)


@pytest.mark.parametrize("change,kv,why", [
    ({}, "float8_e4m3", "FP8"),
    ({"head_dim": 96, "hidden": 864}, None, "head_dim 96"),
    ({"hidden": 2048, "q_heads": 32}, None, "hidden 2048 is over 1536"),
    ({"ffn": 1540}, None, "multiple of 32"),
    ({"q_heads": 48, "kv_heads": 1, "head_dim": 64, "hidden": 1536}, None, "a group of 48"),
])
def test_other_models_and_caches_are_refused_with_a_reason(change, kv, why):
    config = replace(SMOL, **change)
    assert why in fused.unsupported(config, spec(kv_dtype=kv, head_dim=config.head_dim), 90)


def test_the_norm_instance_is_the_smallest_that_holds_the_row():
    for hidden in range(32, fused.MAX_HIDDEN + 1, 32):
        per = fused.norm_per(hidden)
        assert per in fused.NORM_PER and per * fused.THREADS >= hidden
        assert all(v * fused.THREADS < hidden for v in fused.NORM_PER if v < per)  # the smallest that fits


def test_shared_memory_grows_with_rows_and_fits_smollm2():
    sizes = [fused.smem_bytes(SMOL, rows) for rows in fused.ROWS]
    assert sizes == sorted(sizes) and sizes[-1] <= fused.SMEM_LIMIT


@pytest.mark.parametrize("head_dim", fused.HEAD_DIMS)
def test_the_widest_group_fits_its_warps_outputs_in_shared_memory(head_dim):
    """Attention's 8 warps each keep a slice of group x head_dim floats (over the K/V tiles, or a front that large):
    the widest group the kernel takes still fits."""
    group = fused.MAX_GROUP_DIMS // head_dim
    config = replace(SMOL, head_dim=head_dim, q_heads=group, kv_heads=1, hidden=fused.MAX_HIDDEN)
    slices, state = fused.WARPS * group * head_dim * 4, group * (head_dim + fused.TILE + 3) * 4
    assert fused.smem_bytes(config, fused.MAX_ROWS) >= slices + state
    assert fused.unsupported(config, spec(head_dim=head_dim), 90) is None
