"""Shared builders for the kernel tests: paged caches with scattered, NaN-poisoned blocks, and naive attention."""

import numpy as np


def np_dtype(name):
    if name == "bfloat16":
        import ml_dtypes
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
