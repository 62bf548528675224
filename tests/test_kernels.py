"""The K/V write and block copy references, their launcher checks, configurations and sources (host path,
runs in CI). Attention: test_attention.py."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_cases import (Case, Reproducer, check_closed_cache_refuses_writes, check_stale_slots_refused,  # noqa: F401
                          naive_attention, rel_error)
from pagedrt import Pool, source
from pagedrt.attention import paged_decode
from pagedrt.errors import BlockTableError, LaunchArgumentError, UnsupportedConfigError
from pagedrt.kernels import WritePlan, copy_blocks, instances, write_kv
from pagedrt.kernels import configs
from pagedrt.kernels.configs import BASE, Config
from pagedrt.kernels.validate import Spans


# --- write and copy references -------------------------------------------------------------------

def test_write_reference_round_trips_through_the_slots_and_skips_padding():
    case = Case(Config("float16", 96, 16, 1), [1], spare_blocks=8)
    rng = np.random.default_rng(5)
    num_blocks, kv_heads = case.k.shape[:2]
    slots = rng.permutation(num_blocks * 16)[:40].astype(np.int64)
    slots[[3, 17]] = -1
    k = rng.standard_normal((40, kv_heads, 96)).astype(np.float16)
    v = rng.standard_normal((40, kv_heads, 96)).astype(np.float16)
    before = case.buffer.copy()
    write_kv(k, v, case.k, case.v, slots)
    for plane, src in ((case.k, k), (case.v, v)):
        for t, s in enumerate(slots):
            if s >= 0:
                assert np.array_equal(plane[s // 16, :, s % 16], src[t])
    written = np.zeros(case.buffer.shape, bool)
    for s in slots[slots >= 0]:
        written[s // 16, :, 1, :, s % 16] = True
    assert np.array_equal(case.buffer[~written], before[~written], equal_nan=True)


def test_write_then_decode_equals_naive_attention():
    cfg = Config("float32", 64, 8, 2)
    case = Case(cfg, [20, 3])
    rng = np.random.default_rng(9)
    n = 20
    k = rng.standard_normal((n, 2, 64)).astype(np.float32)
    v = rng.standard_normal((n, 2, 64)).astype(np.float32)
    table_row = case.table[0]
    slots = (table_row[np.arange(n) // 8].astype(np.int64) * 8 + np.arange(n) % 8)
    write_kv(k, v, case.k, case.v, slots)
    out = paged_decode(case.q, case.k, case.v, case.table, case.lens)
    ref = naive_attention(case.q, case.k, case.v, case.table, case.lens, 1 / 8)
    assert rel_error(out, ref) < 1e-6
    assert np.allclose(case.k[table_row[0], :, 3], k[3])


def test_copy_reference_copies_every_plane():
    buf = np.random.default_rng(2).standard_normal((10, 2, 3, 2, 8, 64)).astype(np.float32)
    planes = [buf[:, kv, layer] for kv in range(2) for layer in range(3)]
    before = buf.copy()
    copy_blocks(planes, [[1, 7], [2, 0], [1, 9]])
    for src, dst in ((1, 7), (2, 0), (1, 9)):
        assert np.array_equal(buf[dst], before[src])
    untouched = [b for b in range(10) if b not in (7, 0, 9)]
    assert np.array_equal(buf[untouched], before[untouched])
    copy_blocks(planes, np.zeros((0, 2), np.int64))
    assert np.array_equal(buf[untouched], before[untouched])


# --- launcher checks ------------------------------------------------------------------------

def test_write_checks():
    case = Case(BASE, [1], spare_blocks=2)
    n = len(case.k) * 16
    k = np.ones((3, 2, 128), np.float16)
    before = case.buffer.copy()
    with pytest.raises(BlockTableError, match=rf"slot_mapping\[1\] = {n}"):
        write_kv(k, k, case.k, case.v, np.array([0, n, n + 5], np.int64))
    with pytest.raises(LaunchArgumentError, match="int64"):
        write_kv(k, k, case.k, case.v, np.zeros(3, np.int32))
    with pytest.raises(LaunchArgumentError, match="one slot per token"):
        write_kv(k, k, case.k, case.v, np.zeros(2, np.int64))
    with pytest.raises(LaunchArgumentError, match="to match the cache"):
        write_kv(k[:, :1].copy(), k[:, :1].copy(), case.k, case.v, np.zeros(3, np.int64))
    with pytest.raises(LaunchArgumentError, match="same shape"):
        write_kv(k, k[:2], case.k, case.v, np.arange(3, dtype=np.int64))
    assert np.array_equal(case.buffer, before, equal_nan=True)


def test_write_plan_runs_each_layer_as_write_kv_does():
    case = Case(BASE, [40], spare_blocks=2)
    rng = np.random.default_rng(9)
    slots = np.array([5, -1, 17, 3 * 16 + 2], np.int64)
    new = [[rng.standard_normal((4, 2, 128)).astype(np.float16) for _ in range(2)] for _ in range(2)]
    plan = WritePlan(new[0][0], case.buffer[:, 0, 0], slots)
    expected = case.buffer.copy()
    for layer, (k, v) in enumerate(new):
        write_kv(k, v, expected[:, 0, layer], expected[:, 1, layer], slots)
        plan.run(k, v, case.buffer[:, 0, layer], case.buffer[:, 1, layer])
        assert np.array_equal(case.buffer, expected, equal_nan=True)
    assert np.array_equal(case.buffer[3, 1, 1, :, 2], new[1][1][3])


@pytest.mark.parametrize("mutate, words", [
    (lambda c, k: dict(v=k.tolist()), "NumPy or CuPy"),
    (lambda c, k: dict(v=k[:2]), "same shape"),
    (lambda c, k: dict(k=k.astype(np.float32)), "same shape"),
    (lambda c, k: dict(k_cache=c.k.copy()), "must match the plan's K plane"),
    (lambda c, k: dict(v_cache=c.v[:-1]), "same shape and block stride"),
])
def test_write_plan_run_refuses_arrays_unlike_the_plans(mutate, words):
    case = Case(BASE, [40], spare_blocks=2)
    k = np.ones((3, 2, 128), np.float16)
    plan = WritePlan(k, case.k, np.array([0, 1, 2], np.int64))
    before = case.buffer.copy()
    args = dict(k=k, v=k, k_cache=case.k, v_cache=case.v)
    args.update(mutate(case, k))
    with pytest.raises(LaunchArgumentError, match=words):
        plan.run(**args)
    assert np.array_equal(case.buffer, before, equal_nan=True)


def test_copy_checks():
    buf = np.zeros((6, 2, 2, 8, 64), np.float16)
    planes = [buf[:, 0], buf[:, 1]]
    for pairs, error, words in (([[0, 6]], BlockTableError, r"pairs\[0\] = \(0, 6\)"),
                                ([[0, 1], [2, 1]], LaunchArgumentError, "same destination"),
                                ([[0, 1], [1, 2]], LaunchArgumentError, "block 1 is both"),
                                ([[0.5, 1]], LaunchArgumentError, "integers"),
                                ([0, 1], LaunchArgumentError, r"\[n, 2\]")):
        with pytest.raises(error, match=words):
            copy_blocks(planes, pairs)
    with pytest.raises(LaunchArgumentError, match="share both"):
        copy_blocks([buf[:, 0], np.zeros((6, 2, 8, 64), np.float16)], [[0, 1]])
    with pytest.raises(LaunchArgumentError, match="empty"):
        copy_blocks([], [[0, 1]])


# --- sources and configurations -----------------------------------------------------------

def test_sweep_covers_every_value_of_every_axis():
    sweep = configs.sweep()
    assert sweep[0] == BASE and len(set(sweep)) == len(sweep)
    assert {c.dtype for c in sweep} == set(configs.CUDA_TYPES)
    assert {c.head_dim for c in sweep} == set(configs.HEAD_DIMS)
    assert {c.block_size for c in sweep} == set(configs.BLOCK_SIZES)
    assert {c.group for c in sweep} == set(configs.SWEEP_GROUPS) <= set(configs.GROUPS)
    for d in configs.CUDA_TYPES:
        for h in configs.HEAD_DIMS:
            for g in (8, 64):  # the heaviest groups, for every dtype x head_dim
                assert Config(d, h, 16, g) in sweep


def test_source_text_inlines_local_headers_once():
    code = source.text("decode.cu")
    assert '#include "' not in code and "#pragma once" not in code
    assert code.count("struct Vec16") == 1 and "#include <cuda_fp16.h>" in code


def test_instances_name_the_kernels_of_writes_copies_and_checks():
    names = instances()
    assert set(names) == {"write.cu", "copy.cu", "validate.cu"}
    for cfg in configs.sweep():
        assert f"pagedrt::write_kv<{cfg.cuda_type}, {cfg.head_dim}, {cfg.block_size}>" in names["write.cu"]


def test_unsupported_configs_name_the_value():
    for kw, words in ((dict(head_dim=48), "head_dim=48"), (dict(block_size=24), "block_size=24"),
                      (dict(group=65), "group"), (dict(dtype=np.float64), "float64")):
        args = dict(dtype=np.float16, head_dim=128, block_size=16, group=4)
        args.update(kw)
        with pytest.raises(UnsupportedConfigError, match=words):
            configs.config(**args)


# --- blocks whose memory is not mapped, closed pools, duplicate slots ---------------------------
# Before these checks each call below wrote or read unmapped memory: a segfault that killed the test process.

def test_write_and_copy_refuse_a_block_in_a_chunk_never_mapped():
    r = Reproducer("host")
    slot = r.last * 16
    with pytest.raises(BlockTableError, match=rf"slot_mapping\[1\] = {slot} is in block {r.last}, .*not mapped") \
            as info:
        write_kv(r.kv[:2], r.kv[:2], r.k, r.v, np.array([3, slot], np.int64))
    assert (info.value.token, info.value.slot) == (1, slot)
    held = int(r.table[0, 0])
    with pytest.raises(BlockTableError, match=rf"pairs\[1\] = \({held}, {r.last}\) names block {r.last}, .*not mapped"):
        copy_blocks(r.cache.planes, np.array([[held, 5], [held, r.last]]))
    assert not r.k[5].any()  # refused before anything was copied
    copy_blocks(r.cache.planes, np.array([[held, 5]]))
    assert np.array_equal(r.k[5], r.k[held])
    assert r.decode_is_right()


def test_write_refuses_slots_of_a_sequence_freed_and_trimmed():
    check_stale_slots_refused("host")


def test_planes_of_a_closed_cache_are_refused():
    check_closed_cache_refuses_writes("host")


def test_write_refuses_a_slot_given_twice():
    case = Case(BASE, [1], spare_blocks=2)
    k = np.ones((4, 2, 128), np.float16)
    before = case.buffer.copy()
    with pytest.raises(BlockTableError, match=r"slot_mapping\[3\] = 7 repeats slot_mapping\[1\]") as info:
        write_kv(k, k, case.k, case.v, np.array([9, 7, -1, 7], np.int64))
    assert (info.value.token, info.value.slot, info.value.first_token) == (3, 7, 1)
    assert np.array_equal(case.buffer, before, equal_nan=True)
    write_kv(k, k, case.k, case.v, np.array([9, -1, -1, 7], np.int64))  # padding may repeat
    with pytest.raises(BlockTableError, match="repeats"):  # NumPy inputs are always checked
        write_kv(k, k, case.k, case.v, np.array([7, 7, -1, -1], np.int64), validate=False)


CHUNK = 2 << 20


@settings(max_examples=60, deadline=None)
@given(mapped=st.lists(st.booleans(), min_size=12, max_size=12),
       stride_blocks=st.sampled_from([1, 2, 3, 32, 1024]),
       ids=st.lists(st.integers(0, 700), min_size=1, max_size=12))
def test_unusable_blocks_are_those_over_a_hole(mapped, stride_blocks, ids):
    """Spans.unusable (a whole-range test first, then per id) against the mask read chunk by chunk."""
    block = 2048  # [1, 16, 64] float16
    with Pool(12 * CHUNK, CHUNK, backend="host") as pool:
        chunks = [c for c, m in enumerate(mapped) if m]
        if chunks:
            pool.map(chunks)
        stride = block * stride_blocks
        offsets = (0, 5 * CHUNK + 4096)
        n = (pool.num_chunks * CHUNK - offsets[1] - block) // stride + 1  # blocks each plane holds
        planes = [pool.view(o, (n, 1, 16, 64), np.float16, strides=(stride, 2048, 128, 2), allow_holes=True)
                  for o in offsets]
        spans = Spans(planes, stride, block)
        ids = [i % n for i in ids]
        got = spans.unusable(np.array(ids, np.int64))

        def bad(i):
            for o in offsets:
                lo, hi = o + i * stride, o + i * stride + block
                if not all(mapped[c] for c in range(lo // CHUNK, (hi - 1) // CHUNK + 1)):
                    return True
            return False
        assert got.tolist() == [bad(i) for i in ids]
