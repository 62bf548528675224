"""The demo workload on the host backend: it drives the cache through cache.step() and its check catches bad data."""

import numpy as np
import pytest

from helpers import needs_ml_dtypes
from pagedrt import kernels
from pagedrt.cache import PagedKVCache
from pagedrt.demo import DemoConfig, features, run_demo

TINY = dict(layers=2, q_heads=4, kv_heads=2, head_dim=64, backend="host")


def demo(**config):
    result = run_demo(DemoConfig(**(TINY | config)))
    figures = result.figures()
    result.cache.close()
    return figures


def test_the_demo_exercises_every_part_of_a_step():
    f = demo()
    for key in ("arrived", "forked", "finished", "prompt_tokens", "prefix_hit_tokens", "decode_tokens", "mixed_steps",
                "blocks_copied", "shared_blocks", "cached_blocks", "chunks_ahead"):
        assert f[key] > 0, key
    assert f["checks"] > 0 and f["max_error"] <= f["tolerance"]


@pytest.mark.parametrize("config", [dict(max_tokens=1), dict(max_tokens=300, steps=200), dict(max_seqs=1),
                                    dict(block_size=128), dict(placement="block", dtype="float32"),
                                    pytest.param(dict(dtype="bfloat16", seed=3), marks=needs_ml_dtypes),
                                    dict(steps=1)])
def test_the_demo_fits_its_cache_and_checks_out(config):
    f = demo(**config)  # a step that ran out of blocks would raise PoolExhaustedError
    assert f["max_error"] <= f["tolerance"]


def test_a_seeded_run_reaches_the_same_state():
    states = []
    for _ in range(2):
        with run_demo(DemoConfig(**TINY, seed=5)).cache as cache:
            snap = cache.snapshot()
            states.append((snap["sequences"], snap["blocks"], cache.growth.stats()))
    assert states[0] == states[1]


def test_a_token_has_the_same_kv_in_one_chunk_or_after_a_prefix():
    ids = np.random.default_rng(0).integers(32000, size=40)
    whole = features(ids, [40], [0], [0])
    split = features(ids, [24, 16], [0, 24], [0, int(ids[:24].sum())])  # a cached prefix of 24, then the rest
    assert np.array_equal(whole, split)
    other = features(ids[24:], [16], [24], [int(ids[:24].sum()) + 1])  # the same tokens after another prefix
    assert (other != whole[24:]).all()


def test_the_check_catches_a_copy_not_made(monkeypatch):
    monkeypatch.setattr(kernels, "copy_blocks", lambda planes, pairs: None)
    f = demo()
    assert f["blocks_copied"] > 0 and f["max_error"] > f["tolerance"]


def test_the_check_catches_a_cached_block_with_other_data(monkeypatch):
    step = PagedKVCache.step

    def spoil_hits(cache, *args, **kwargs):  # zero the first cached block an arrival starts with
        result = step(cache, *args, **kwargs)
        for seq, cached in zip(result.arrived.tolist(), result.cached.tolist()):
            if cached:
                cache.k(0)[cache.block_tables([seq])[0, 0]] = 0
        return result
    monkeypatch.setattr(PagedKVCache, "step", spoil_hits)
    f = demo()
    assert f["prefix_hit_tokens"] > 0 and f["max_error"] > f["tolerance"]
