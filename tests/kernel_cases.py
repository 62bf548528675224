"""Shared builders for the kernel tests: paged caches with scattered, NaN-poisoned blocks (decode and prefill
problems), and naive attention; caches whose tables or slots name blocks that are not mapped (what validation must
refuse)."""

import numpy as np
import pytest

from helpers import to_host


def np_dtype(name):
    """The NumPy dtype ``name``; a test of bfloat16 skips without the ml_dtypes package."""
    if name == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes", reason="bfloat16 needs the ml_dtypes package")
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class Case:
    """Host arrays of one decode problem over a block-major buffer.

    The buffer is [num_blocks, 2 (K/V), layers, kv_heads, block_size, head_dim], so a
    plane (one layer's K or V) has a block stride of 2*layers blocks. Every slot
    a sequence does not use (free blocks, the tail of its last block, the other
    layers) holds NaN: reading one poisons the output. Block ids are a random
    permutation of the pool.
    """

    def __init__(self, cfg, lens, kv_heads=2, layers=2, layer=1, seed=0, spare_blocks=3):
        rng = np.random.default_rng(seed)
        dt = np_dtype(cfg.dtype)
        bs, d = cfg.block_size, cfg.head_dim
        self.cfg, self.lens = cfg, np.asarray(lens, np.int32)
        used = [-(-int(n) // bs) for n in lens]
        self.width = max(used)
        num_blocks = sum(used) + spare_blocks
        self.buffer = np.full((num_blocks, 2, layers, kv_heads, bs, d), np.nan, np.float32).astype(dt)
        self.k, self.v = self.buffer[:, 0, layer], self.buffer[:, 1, layer]
        perm = rng.permutation(num_blocks).astype(np.int32)
        self.table = np.full((len(lens), self.width), -1, np.int32)
        start = 0
        for i, (n, nb) in enumerate(zip(lens, used)):
            self.table[i, :nb] = perm[start:start + nb]
            start += nb
            for plane in (self.k, self.v):
                data = rng.standard_normal((nb, kv_heads, bs, d), dtype=np.float32)
                data[-1, :, bs - (nb * bs - int(n)):] = np.nan
                plane[self.table[i, :nb]] = data.astype(dt)
        self.q = rng.standard_normal((len(lens), kv_heads * cfg.group, d), dtype=np.float32).astype(dt)

    def contiguous(self):
        """The same K/V as [batch, width, kv_heads, block_size, head_dim] (NaN past each sequence's blocks)."""
        out = []
        for plane in (self.k, self.v):
            dense = np.full((len(self.lens), self.width) + plane.shape[1:], np.nan, np.float32).astype(plane.dtype)
            for i, n in enumerate(self.lens):
                nb = -(-int(n) // self.cfg.block_size)
                dense[i, :nb] = plane[self.table[i, :nb]]
            out.append(dense)
        return out


class PrefillCase(Case):
    """A prefill problem over Case's planes: sequence b holds ``prefixes[b]`` cached tokens and ``new[b]`` new
    ones (KV length the sum, at least 1); q holds the new tokens' queries, sequence after sequence
    (``qo_indptr``; ``query_lens`` is the host copy a Step carries)."""

    def __init__(self, cfg, prefixes, new, kv_heads=2, seed=0, **kwargs):
        super().__init__(cfg, [p + n for p, n in zip(prefixes, new)], kv_heads=kv_heads, seed=seed, **kwargs)
        rng = np.random.default_rng(seed + 1)
        self.query_lens = np.asarray(new, np.int64)
        self.qo_indptr = np.concatenate([[0], np.cumsum(self.query_lens)]).astype(np.int32)
        shape = (int(self.qo_indptr[-1]), kv_heads * cfg.group, cfg.head_dim)
        self.q = rng.standard_normal(shape, dtype=np.float32).astype(self.q.dtype)


def naive_prefill(q, k, v, table, kv_lens, qo_indptr, scale, causal=True):
    """Per sequence, per query token, per head, key by key through the table: float64 softmax attention; causal:
    query i of a sequence's n sees keys 0..kv_len - n + i."""
    q_heads, d = q.shape[1:]
    group, bs = q_heads // k.shape[1], k.shape[2]
    out = np.zeros(q.shape)
    for b in range(table.shape[0]):
        first, end, n = int(qo_indptr[b]), int(qo_indptr[b + 1]), int(kv_lens[b])
        for i in range(end - first):
            seen = n - (end - first) + i + 1 if causal else n
            for h in range(q_heads):
                keys = np.array([k[table[b, t // bs], h // group, t % bs] for t in range(seen)], np.float64)
                vals = np.array([v[table[b, t // bs], h // group, t % bs] for t in range(seen)], np.float64)
                s = keys @ q[first + i, h].astype(np.float64) * scale
                w = np.exp(s - s.max())
                out[first + i, h] = w @ vals / w.sum()
    return out


def naive_attention(q, k, v, table, lens, scale):
    """Per sequence, per query head, token by token through the table: float64 softmax attention."""
    batch, q_heads, d = q.shape
    kv_heads, bs = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    out = np.empty((batch, q_heads, d))
    for i in range(batch):
        n = int(lens[i])
        for h in range(q_heads):
            kv = h // group
            keys = np.array([k[table[i, t // bs], kv, t % bs] for t in range(n)], np.float64)
            vals = np.array([v[table[i, t // bs], kv, t % bs] for t in range(n)], np.float64)
            s = keys @ q[i, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[i, h] = p @ vals / p.sum()
    return out


def rel_error(out, ref):
    """||out - ref|| / ||ref|| in float64."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


# --- blocks whose memory is not mapped ----------------------------------------------------------

class Reproducer:
    """The issue's cache: one layer, one KV head of 128, blocks of 16, 2^20 tokens reserved, 8 tokens appended
    to one sequence and written. ``last`` is the planes' last block id: in range, in a chunk never mapped."""

    def __init__(self, backend):
        from pagedrt.cache import PagedKVCache
        from pagedrt.kernels import write_kv
        self.cache = PagedKVCache(1, 1, 128, 16, "float16", max_tokens=1 << 20, backend=backend)
        xp = self.xp = self.cache.xp
        self.seq = self.cache.add_sequence()
        slots, _ = self.cache.append([self.seq], 8)
        self.slots = xp.asarray(slots)
        rng = np.random.default_rng(21)
        self.kv = xp.asarray(rng.standard_normal((8, 1, 128)).astype(np.float16))
        self.q = xp.asarray(rng.standard_normal((1, 4, 128)).astype(np.float16))
        self.k, self.v = self.cache.k(0), self.cache.v(0)
        write_kv(self.kv, self.kv, self.k, self.v, self.slots)
        self.table, self.lens = self.cache.block_tables([self.seq]).copy(), self.cache.seq_lens([self.seq]).copy()
        self.last = int(self.k.shape[0]) - 1

    def expected(self):
        """The sequence's attention, float64 (all 4 query heads use the one KV head)."""
        q, kv = np.asarray(to_host(self.q)[0], np.float64), np.asarray(to_host(self.kv)[:, 0], np.float64)
        s = q @ kv.T / np.sqrt(128)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        return (p / p.sum(axis=1, keepdims=True)) @ kv

    def decode_is_right(self):
        """A good decode through the cache's own table: runs, and matches :meth:`expected`."""
        from pagedrt.attention import paged_decode
        out = paged_decode(self.q, self.k, self.v, self.table, self.lens)
        return rel_error(to_host(out)[0], self.expected()) <= 2e-3


def stale_table(backend, before=None):
    """A table copied from ``block_tables([b, a])``, then ``free(b)`` and ``trim()``: row 0 names b's blocks,
    whose chunk is released. Chunks of one page, so a (one chunk's worth of blocks) and b hold different ones.
    ``before(cache, table, lens)`` runs before the free (the table is good then). Returns (cache, table, lens,
    b's slots)."""
    from pagedrt.cache import PagedKVCache
    from pagedrt.memory import select_backend
    chosen = select_backend(backend)  # the cache takes it over (and closes it with its pool)
    cache = PagedKVCache(1, 1, 128, 16, "float16", max_tokens=1 << 16, backend=chosen, chunk_bytes=chosen.page_bytes)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append([a], cache.layout.blocks_per_chunk * 16)
    slots_b, _ = cache.append([b], 20)
    table, lens = cache.block_tables([b, a]).copy(), cache.seq_lens([b, a]).copy()
    if before is not None:
        before(cache, table, lens)
    cache.free([b])
    assert cache.trim()
    return cache, table, lens, cache.xp.asarray(slots_b)


def check_closed_cache_refuses_decode(backend):
    """Decode over the planes of a closed cache: paged_decode (validated or not) and an earlier plan's run."""
    from pagedrt.attention import DecodePlan, paged_decode
    from pagedrt.errors import PoolClosedError
    r = Reproducer(backend)
    plan = DecodePlan(r.q, r.k, r.table, r.lens)
    r.cache.close()
    for call in (lambda: paged_decode(r.q, r.k, r.v, r.table, r.lens), lambda: plan.run(r.q, r.k, r.v),
                 lambda: paged_decode(r.q, r.k, r.v, r.table, r.lens, validate=False)):
        with pytest.raises(PoolClosedError, match="closed"):
            call()


def check_closed_cache_refuses_writes(backend):
    """Writes and copies into the planes of a closed cache: write_kv (validated or not), an earlier plan's run,
    copy_blocks."""
    from pagedrt.errors import PoolClosedError
    from pagedrt.kernels import WritePlan, copy_blocks, write_kv
    r = Reproducer(backend)
    plan = WritePlan(r.kv, r.k, r.slots)
    planes = r.cache.planes
    r.cache.close()
    for call in (lambda: write_kv(r.kv, r.kv, r.k, r.v, r.slots),
                 lambda: write_kv(r.kv, r.kv, r.k, r.v, r.slots, validate=False),
                 lambda: plan.run(r.kv, r.kv, r.k, r.v), lambda: copy_blocks(planes, r.xp.asarray([[0, 1]]))):
        with pytest.raises(PoolClosedError, match="closed"):
            call()


def check_stale_slots_refused(backend):
    """write_kv through b's slots after free(b) and trim() (see :func:`stale_table`)."""
    from pagedrt.errors import BlockTableError
    from pagedrt.kernels import write_kv
    cache, _, _, slots_b = stale_table(backend)
    kv = cache.xp.ones((len(slots_b), 1, 128), np.float16)
    with pytest.raises(BlockTableError, match=r"slot_mapping\[0\] = .*not mapped"):
        write_kv(kv, kv, cache.k(0), cache.v(0), slots_b)
