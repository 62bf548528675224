"""Hostile input to the cache's public API: a named error, and nothing changed.

Each test here is a reproducer of a way bad input once crashed the process or left
the cache half-changed; the property test at the end drives the whole API with
hostile arguments mixed into valid operations.
"""

import numpy as np
import pytest

from pagedrt.cache import PagedKVCache
from pagedrt.errors import InvalidTokenCountError, PagedRTError, SequenceFullError
from test_cache import frozen

INT_DTYPES = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)


def tiny_cache():
    """8 blocks of 16 tokens in one chunk; rows of 8 blocks."""
    return PagedKVCache(1, 1, 64, 16, "float32", max_tokens=128, backend="host")


# --- 1: token counts that overflow int32 (or int64) ------------------------------------------

@pytest.mark.parametrize("seqs,counts", [
    ("a", 2**31 - 1), ("a", np.int32(2**31 - 1)), (None, 2**31 - 1), (["a"], [2**63 - 1]),
    ("a", 2**31), ("a", 2**64), ("a", np.uint64(2**64 - 1)), (["a"], np.array([2**63], np.uint64)),
    (["a"], [2**64]), ("a", 129), (None, [2**31 - 1, 1]),
])
def test_huge_token_counts_change_nothing(seqs, counts):
    with tiny_cache() as c:
        a = c.add_sequence()
        c.append(a, 3)
        c.fork(a)  # a and its fork share block 0
        seqs = {"a": a, None: None}[seqs] if not isinstance(seqs, list) else [a]
        before = frozen(c)
        if isinstance(counts, list) and counts[0] >= 2**64:  # no integer dtype holds it
            with pytest.raises(InvalidTokenCountError):
                c.append(seqs, counts)
            with pytest.raises(InvalidTokenCountError):
                c.can_append(seqs, counts)
        else:
            with pytest.raises(SequenceFullError, match="a block-table row holds 8 blocks"):
                c.append(seqs, counts)
            assert c.can_append(seqs, counts) is False
        assert frozen(c) == before
        assert c.stats()["free_blocks"] == 7 and c.allocator.ref_count[0] == 2
        fresh = c.add_sequence()
        c.append(fresh, 1)
        assert c.tables.blocks(fresh)[0] != 0  # the shared block is not handed out again


# --- 4: empty handle lists are no calls ---------------------------------------------------------

def test_empty_handle_lists_do_nothing():
    with tiny_cache() as c:
        a = c.add_sequence()
        c.append(a, 3)
        before = frozen(c)
        slots, copies = c.append([], 1)
        assert slots.size == 0 and copies.shape == (0, 2)
        assert c.append(np.array([], np.int64), [])[0].size == 0
        c.free([])
        assert c.can_append([], 5) is True
        assert c.block_tables([]).shape == (0, c.max_blocks_per_seq) and c.seq_lens([]).shape == (0,)
        assert frozen(c) == before
