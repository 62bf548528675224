"""The prefix cache: hits share blocks, never the whole prompt, no share on a hash collision, LRU eviction,
bad token ids change nothing, and the views show cached blocks."""

import numpy as np
import pytest

from pagedrt.blocks import prefix
from pagedrt.errors import InvalidTokenIdsError, PoolExhaustedError
from pagedrt.render import pool_map
from test_cache import BS, check_allocator, frozen, small_cache
from test_cli import run

PROMPT = np.arange(100, 100 + 3 * BS + 5)  # three full blocks and five tokens


def prefill(cache, prompt):
    """A sequence for ``prompt``: cached blocks shared, the rest appended with its ids."""
    seq = cache.add_sequence(prompt)
    cache.append(seq, len(prompt) - cache.length(seq), token_ids=prompt[cache.length(seq):])
    return seq


def test_chain_hash_is_stable_and_chained():
    block = np.arange(BS, dtype=np.int32)
    assert prefix.chain_hash(prefix.ROOT, block) == prefix.chain_hash(0, block.copy())
    assert prefix.chain_hash(1, block) != prefix.chain_hash(prefix.ROOT, block)
    assert 0 <= prefix.chain_hash(prefix.ROOT, block) < 1 << 64


def test_a_hit_shares_blocks_and_sets_the_length():
    with small_cache() as c:
        a = prefill(c, PROMPT)
        assert c.num_cached_blocks == 3 and c.prefix_stats()["hit_tokens"] == 0
        b = c.add_sequence(np.concatenate([PROMPT[:2 * BS + 1], [7, 7]]))
        assert c.length(b) == 2 * BS
        assert np.array_equal(c.tables.blocks(b), c.tables.blocks(a)[:2])
        assert c.allocator.ref_count[c.tables.blocks(a)].tolist() == [2, 2, 1, 1]
        stats = c.prefix_stats()
        assert (stats["lookups"], stats["hit_blocks"], stats["hit_tokens"]) == (2, 2, 2 * BS)
        assert stats["queried_tokens"] == PROMPT.size + 2 * BS + 3
        slots, copies = c.append(b, 3, token_ids=[1, 2, 3])  # a full shared block is never written
        assert copies.size == 0 and not np.isin(slots // BS, c.tables.blocks(a)).any()
        child = c.fork(b)  # a fork of a cached sequence shares its blocks, cached ones too
        assert c.allocator.ref_count[c.tables.blocks(a)[0]] == 3 and c.translate(child, 0).cached
        assert not c.translate(b, 2 * BS).cached
        check_allocator(c)


def test_never_the_whole_prompt():
    with small_cache() as c:
        prefill(c, PROMPT[:3 * BS])
        b = c.add_sequence(PROMPT[:3 * BS])  # all three blocks cached: the last token is left to compute
        assert c.length(b) == 2 * BS
        assert c.length(c.add_sequence(PROMPT[:3 * BS + 1])) == 3 * BS
        assert c.length(c.add_sequence(PROMPT[:1])) == 0 and c.length(c.add_sequence([])) == 0


def test_a_hash_collision_never_shares_wrong_data(monkeypatch):
    monkeypatch.setattr(prefix, "chain_hash", lambda parent, tokens: 42)  # every block has one name
    with small_cache() as c:
        a = prefill(c, PROMPT)
        assert c.num_cached_blocks == 1  # the name is taken: later blocks stay unnamed
        other = PROMPT.copy()
        other[3] += 1
        b = c.add_sequence(other)
        assert c.length(b) == 0
        assert c.length(c.add_sequence(PROMPT)) == BS  # the tokens match: a hit
        check_allocator(c)
        assert c.tables.blocks(a)[0] in c.snapshot()["blocks"]["cached"]


def test_without_token_ids_nothing_is_cached():
    with small_cache() as c:
        a = c.add_sequence()
        c.append(a, BS + 3)
        c.append(a, BS, token_ids=np.arange(BS))  # ids from here on, but the earlier ones are unknown
        assert c.num_cached_blocks == 0
        b = prefill(c, PROMPT[:BS])
        c.append(None, 1)  # a decode step without ids: b caches nothing after it
        c.append(b, 2 * BS, token_ids=np.arange(2 * BS))
        assert c.num_cached_blocks == 1


def test_decode_steps_with_ids_fill_and_cache_blocks():
    with small_cache() as c:
        _, b = prefill(c, PROMPT[:BS - 1]), prefill(c, PROMPT[:BS - 2])
        c.append(None, 1, token_ids=[PROMPT[BS - 1], PROMPT[BS - 2]])
        assert c.num_cached_blocks == 1
        c.append([b], 1, token_ids=[PROMPT[BS - 1]])
        assert c.num_cached_blocks == 1  # the same tokens: the name is taken, b's block stays unnamed
        assert c.length(c.add_sequence(PROMPT[:BS + 1])) == BS
        check_allocator(c)


def test_finished_blocks_stay_cached_and_are_evicted_least_recently_used_first():
    with small_cache(max_tokens=8 * BS) as c:  # two chunks of four blocks
        c.allocator.grow(2)
        a = prefill(c, PROMPT[:2 * BS])
        b = prefill(c, PROMPT[:2 * BS] + 1000)
        blocks_a, blocks_b = c.tables.blocks(a), c.tables.blocks(b)
        keep = prefill(c, PROMPT[:BS - 1] + 2000)  # a partly filled block in the other chunk
        c.free(a)
        c.free(b)
        assert list(c.allocator.evictable) == [blocks_a[1], blocks_a[0], blocks_b[1], blocks_b[0]]
        assert c.num_available_blocks == 7 and c.stats()["free_blocks"] == 3
        assert c.trim() == []  # chunks holding cached blocks stay mapped
        d = c.add_sequence()
        c.append(d, 4 * BS)  # three free blocks, then the oldest cached one: a's tail
        assert c.prefix_stats()["evictions"] == 1 and blocks_a[1] in c.tables.blocks(d)
        assert c.length(c.add_sequence(PROMPT[:2 * BS])) == BS  # a's first block is still cached
        assert c.length(c.add_sequence(PROMPT[:2 * BS] + 1000)) == BS and c.length(keep) == BS - 1
        assert c.allocator.chunk_mapped.sum() == 2  # evicted before growing
        check_allocator(c)
        with pytest.raises(PoolExhaustedError):
            c.append(d, 3 * BS)
        check_allocator(c)


@pytest.mark.parametrize("call", [
    lambda c, s: c.append(s, 3, token_ids=[1, 2]),                  # too few
    lambda c, s: c.append(s, 3, token_ids=[1, 2, 3, 4]),            # too many
    lambda c, s: c.append([s, s + 1], [1, 1], token_ids=[1, 2, 3]),
    lambda c, s: c.append(s, 2, token_ids=[1.0, 2.0]),
    lambda c, s: c.append(s, 2, token_ids=[[1, 2]]),
    lambda c, s: c.append(s, 2, token_ids=[1, -1]),
    lambda c, s: c.append(s, 2, token_ids=[1, 2**31]),
    lambda c, s: c.append(s, 2, token_ids=[1, "a"]),
    lambda c, s: c.append(s, 1, token_ids=7),
    lambda c, s: c.append(None, 1, token_ids=[1]),                  # two live sequences
    lambda c, s: c.add_sequence(prefix=[[1, 2]]),
    lambda c, s: c.add_sequence(prefix=np.array([1, 2**40])),
    lambda c, s: c.add_sequence(prefix=[True, False]),
    lambda c, s: c.add_sequence(prefix="abc"),
])
def test_bad_token_ids_are_a_named_error_and_change_nothing(call):
    with small_cache() as c:
        s = prefill(c, PROMPT)
        c.append(c.add_sequence(), 2)
        before, stats = frozen(c), c.prefix_stats()
        with pytest.raises(InvalidTokenIdsError):
            call(c, s)
        assert frozen(c) == before and c.prefix_stats() == stats


def test_the_pool_map_and_translate_show_cached_blocks(tmp_path):
    with small_cache() as c:
        a = prefill(c, PROMPT)
        c.free(a)
        held = prefill(c, PROMPT[:2 * BS])
        snap = c.snapshot()
        c.write_snapshot(tmp_path / "s.json")
        assert c.translate(held, 0).cached
    lines = pool_map(snap)
    assert "+: cached, held by no sequence (evictable)" in lines[1]
    assert lines[2].endswith("[a++a]")  # held: its hit and its own block; the cached-free ones between
    out = run("map", tmp_path / "s.json", "--no-color")
    assert "+: cached" in out and "+" in out.split("]")[0].split("[")[-1]
    out = run("translate", held, 0, tmp_path / "s.json", "--no-color")
    assert "is in the prefix cache" in out
