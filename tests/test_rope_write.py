"""Rotary embeddings fused with the K/V write on the host (pagedrt.engine.rope_write): the reference against a float64
rotation computed apart, for every dtype, FP8 planes, both placements and padding slots; the rotation's invariants;
one plan over several layers; and the plan's named errors, with nothing written."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rope_cases import Problem
from pagedrt import PagedKVCache
from pagedrt.engine.rope_write import RopeWritePlan, positions
from pagedrt.errors import BlockTableError, LaunchArgumentError, PoolClosedError, UnsupportedConfigError

SHAPES = {"one token": dict(query_lens=(1,), cached=(40,)), "ragged": {}}


def run(p, plan_layer=None):
    """Make the problem's plan (over the K plane of ``plan_layer``, default its own layer) and run its layer."""
    k, v = p.planes(p.buffer)
    RopeWritePlan(p.qkv, p.q, p.planes(p.buffer, plan_layer)[0], p.slots, p.qo_indptr, p.seq_lens, p.inv_freq).run(
        p.qkv, p.q, k, v, **p.scale_keywords())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("placement", ["plane", "block"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype, fp8_planes", [("float16", False), ("bfloat16", False), ("float32", False),
                                               ("float16", True), ("bfloat16", True)])
def test_reference_turns_q_and_k_and_writes_only_live_slots(dtype, fp8_planes, head_dim, placement, shape):
    p = Problem(dtype, fp8_planes, head_dim, placement=placement, **SHAPES[shape])
    run(p)
    p.check(p.q, p.buffer)


def test_reference_takes_the_host_models_float64_qkv():
    p = Problem("float16", qkv_dtype=np.float64)
    run(p)
    p.check(p.q, p.buffer)


def test_one_plan_runs_another_layers_planes():
    p = Problem("float16", placement="block", layers=3, layer=2)
    run(p, plan_layer=0)
    p.check(p.q, p.buffer)  # layer 2 written, layers 0 and 1 still poison


def test_positions_count_back_from_each_rows_length():
    p = Problem(query_lens=(3, 1, 4), cached=(0, 9, 2))
    assert positions(p.qo_indptr, p.seq_lens, len(p.slots)).tolist() == [0, 1, 2, 9, 2, 3, 4, 5]
    assert p.positions.tolist() == [0, 1, 2, 9, 2, 3, 4, 5]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 400), st.integers(0, 400), st.integers(1, 400), st.integers(0, 2 ** 32 - 1))
def test_scores_depend_only_on_the_distance_and_pairs_keep_their_length(m, n, shift, seed):
    """RoPE's point: q at position m against k at position n scores as at m + shift against n + shift."""
    x = np.random.default_rng(seed).standard_normal((2, 3 * 64)).astype(np.float32)
    scores = []
    for offset in (0, shift):
        p = Problem("float32", head_dim=64, query_lens=(1, 1), cached=(m + offset, n + offset), q_heads=1,
                    kv_heads=1, pad=10)
        p.qkv[...] = x
        run(p)
        k_plane, _ = p.planes(p.buffer)
        k = k_plane[p.slots[1] // 16, 0, p.slots[1] % 16].astype(np.float64)
        q = p.q[0, 0].astype(np.float64)
        for turned, raw in ((q, x[0, :64]), (k, x[1, 64:128])):
            pairs = lambda a: np.hypot(a[0::2], a[1::2])  # noqa: E731
            np.testing.assert_allclose(pairs(turned), pairs(raw.astype(np.float64)), rtol=1e-5, atol=1e-6)
        scores.append(q @ k)
    bound = 3e-4 * np.linalg.norm(x[0, :64]) * np.linalg.norm(x[1, 64:128])
    assert abs(scores[0] - scores[1]) <= bound


def _refused(p, error, words, build=None, run_args=None):
    """Expect the plan (``build``: its arguments changed) or its run (``run_args`` changed) to raise ``error``
    matching ``words``, with q and the buffer unchanged."""
    k, v = p.planes(p.buffer)
    plan_args = dict(qkv=p.qkv, q=p.q, k_cache=k, slot_mapping=p.slots, qo_indptr=p.qo_indptr, seq_lens=p.seq_lens,
                     inv_freq=p.inv_freq)
    args = dict(qkv=p.qkv, q=p.q, k_cache=k, v_cache=v, **p.scale_keywords())
    q_before, buffer_before = p.q.copy(), p.buffer.copy()
    with pytest.raises(error, match=words):
        if build is not None:
            RopeWritePlan(**{**plan_args, **build(p)})
        else:
            RopeWritePlan(**plan_args).run(**{**args, **run_args(p, k, v)})
    assert np.array_equal(p.q, q_before, equal_nan=True) and np.array_equal(p.buffer, buffer_before, equal_nan=True)


def _other_plane(p, dtype):
    return np.zeros(p.planes(p.buffer)[0].shape, dtype)


@pytest.mark.parametrize("build, error, words", [
    (lambda p: dict(qkv=np.ascontiguousarray(p.qkv[:, 64:])), LaunchArgumentError, r"qkv must be \[76, 1024\]"),
    (lambda p: dict(qkv=p.qkv[:, ::2]), LaunchArgumentError, "C-contiguous"),
    (lambda p: dict(q=np.zeros((76, 4, 64), np.float16)), LaunchArgumentError, "head_dim 128"),
    (lambda p: dict(k_cache=_other_plane(p, np.float32)), LaunchArgumentError, "their dtype float32"),
    (lambda p: dict(slot_mapping=p.slots.astype(np.int32)), LaunchArgumentError, "int64"),
    (lambda p: dict(slot_mapping=p.slots[:-1]), LaunchArgumentError, "one slot per token"),
    (lambda p: dict(qo_indptr=p.qo_indptr[:-1]), LaunchArgumentError, "one offset more"),
    (lambda p: dict(seq_lens=p.seq_lens.astype(np.int64)), LaunchArgumentError, "seq_lens must be int32"),
    (lambda p: dict(inv_freq=p.inv_freq[:32].copy()), LaunchArgumentError, r"inv_freq must be .* float32 \[64\]"),
    (lambda p: dict(inv_freq=p.inv_freq.tolist()), LaunchArgumentError, "NumPy or CuPy"),
    (lambda p: dict(slot_mapping=np.where(p.slots == p.slots[3], 10 ** 6, p.slots)), BlockTableError,
     r"slot_mapping\[3\] = 1000000 is past the cache"),
    (lambda p: dict(slot_mapping=np.where(p.slots == p.slots[4], p.slots[3], p.slots)), BlockTableError,
     "slot_mapping"),
])
def test_plan_refuses_bad_arguments_and_writes_nothing(build, error, words):
    _refused(Problem("float16"), error, words, build=build)


def test_plan_refuses_a_head_dim_the_kernels_do_not_cover():
    p = Problem("float16", head_dim=48)
    _refused(p, UnsupportedConfigError, "head_dim", build=lambda p: {})


@pytest.mark.parametrize("fp8_planes, change, words", [
    (False, lambda p, k, v: dict(q=p.q[:-1]), r"q must be C-contiguous float16 of shape \(76, 4, 128\)"),
    (False, lambda p, k, v: dict(qkv=p.qkv.astype(np.float32)), "qkv must be C-contiguous float16"),
    (False, lambda p, k, v: dict(v_cache=v[:-1]), "must match the plan's K plane"),
    (False, lambda p, k, v: dict(k_cache=k.tolist()), "NumPy or CuPy arrays, not a mix"),
    (False, lambda p, k, v: dict(k_scale=p.inv_freq[:2].copy(), v_scale=p.inv_freq[:2].copy()), "FP8"),
    (True, lambda p, k, v: dict(k_scale=None), "need k_scale"),
    (True, lambda p, k, v: dict(v_scale=p.scales[1][:1].copy()), r"v_scale must be .* shape \(2,\)"),
])
def test_run_refuses_arrays_unlike_the_plans_and_writes_nothing(fp8_planes, change, words):
    _refused(Problem("float16", fp8_planes), LaunchArgumentError, words, run_args=change)


def test_run_refuses_the_planes_of_a_closed_cache():
    cache = PagedKVCache(1, 2, 64, 16, "float16", max_tokens=1024, backend="host")
    slots = cache.append([cache.add_sequence()], 3)[0]
    qkv = np.ones((3, 8 * 64), np.float16)
    q = np.zeros((3, 4, 64), np.float16)
    inv = np.ones(32, np.float32)
    plan = RopeWritePlan(qkv, q, cache.k(0), slots, np.array([0, 3], np.int32), np.array([3], np.int32), inv)
    k, v = cache.k(0), cache.v(0)
    cache.close()
    with pytest.raises(PoolClosedError):
        plan.run(qkv, q, k, v)
    assert not q.any()
