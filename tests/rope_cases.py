"""One step's rotary embeddings + K/V write (pagedrt.engine.rope_write), built for the host and GPU tests: a ragged
batch, its slots over scattered blocks (some padding), planes in a poisoned plane- or block-major buffer, and the
float64 expectation computed apart from the reference (each pair as a complex number times e^(i angle))."""

import numpy as np

from kernel_cases import np_dtype
from pagedrt import fp8

POISON_BITS = 0x7F  # an FP8 NaN: what an FP8 buffer holds where nothing was written
ULP = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -22}  # a value's relative step, with margin


class Problem:
    """Host arrays of one step: ``qkv``, ``q``, the buffer and its planes of ``layer``, ``slots``, ``qo_indptr``,
    ``seq_lens``, ``inv_freq`` (and ``scales`` over FP8 planes).

    ``placement`` "plane": the buffer is [2, layers, blocks, kv_heads, block_size, head_dim] (a plane's block
    stride is one block); "block": [blocks, 2, layers, ...] (2 x layers blocks). Row b has ``cached[b]`` tokens
    before the step and ``query_lens[b]`` new ones; every ``pad``-th token's slot is padding (-1).
    """

    def __init__(self, dtype="float16", fp8_planes=False, head_dim=128, block_size=16, query_lens=(1, 5, 70),
                 cached=(40, 0, 3), q_heads=4, kv_heads=2, placement="plane", layers=2, layer=1, pad=7, seed=0,
                 qkv_dtype=None):
        rng = np.random.default_rng(seed)
        self.dtype, self.fp8, self.layer, self.placement = np_dtype(dtype), fp8_planes, layer, placement
        self.q_heads, self.kv_heads, self.head_dim, self.block_size = q_heads, kv_heads, head_dim, block_size
        query_lens, cached = np.asarray(query_lens), np.asarray(cached)
        self.seq_lens = (cached + query_lens).astype(np.int32)
        self.qo_indptr = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
        n = int(self.qo_indptr[-1])
        used = [-(-int(s) // block_size) for s in self.seq_lens]
        num_blocks = sum(used) + 3
        ids = rng.permutation(num_blocks)
        positions, slots = [], []
        for b, (length, count) in enumerate(zip(self.seq_lens, query_lens)):
            table = ids[sum(used[:b]):sum(used[:b + 1])]
            pos = np.arange(int(length) - int(count), int(length))
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        self.positions = np.concatenate(positions)
        self.slots = np.concatenate(slots).astype(np.int64)
        self.slots[pad - 1::pad] = -1
        self.qkv = rng.standard_normal((n, (q_heads + 2 * kv_heads) * head_dim)).astype(qkv_dtype or self.dtype)
        self.q = np.full((n, q_heads, head_dim), np.nan, self.dtype)
        self.inv_freq = (10000.0 ** -(np.arange(0, head_dim, 2) / head_dim)).astype(np.float32)
        inner = (kv_heads, block_size, head_dim)
        shape = (2, layers, num_blocks) + inner if placement == "plane" else (num_blocks, 2, layers) + inner
        self.buffer = (np.full(shape, POISON_BITS, np.uint8) if fp8_planes
                       else np.full(shape, np.nan, np.float32).astype(self.dtype))
        self.scales = [rng.uniform(0.02, 0.04, kv_heads).astype(np.float32) for _ in "kv"] if fp8_planes else None

    def planes(self, buffer, layer=None):
        """The K and V planes of ``layer`` (default: the problem's) in ``buffer`` (this problem's buffer, or a
        device copy)."""
        layer = self.layer if layer is None else layer
        if self.placement == "plane":
            return buffer[0, layer], buffer[1, layer]
        return buffer[:, 0, layer], buffer[:, 1, layer]

    def scale_keywords(self, xp=np):
        return {} if self.scales is None else {"k_scale": xp.asarray(self.scales[0]),
                                                "v_scale": xp.asarray(self.scales[1])}

    def expected(self):
        """float64 q [n, q_heads, d], k and v [n, kv_heads, d]: pair i of q's and k's heads turned by the float32
        angle position * inv_freq[i]."""
        n, d, qh, kvh = len(self.slots), self.head_dim, self.q_heads, self.kv_heads
        x = self.qkv.astype(np.float64).reshape(n, qh + 2 * kvh, d)
        angle = (self.positions.astype(np.float32)[:, None] * self.inv_freq[None, :]).astype(np.float64)
        turned = (x[:, :qh + kvh, 0::2] + 1j * x[:, :qh + kvh, 1::2]) * np.exp(1j * angle)[:, None, :]
        rotated = np.empty((n, qh + kvh, d))
        rotated[..., 0::2], rotated[..., 1::2] = turned.real, turned.imag
        return rotated[:, :qh], rotated[:, qh:], x[:, qh + kvh:]

    def tolerance(self, expected, rotated):
        """What a stored value may differ from ``expected`` by: a step of the dtype (FP8: of e4m3, with the
        subnormals' absolute step), and float32 arithmetic on the pair's inputs (``rotated``: the values had
        their pairs' magnitude)."""
        mag = np.abs(expected)
        pair = np.repeat(np.hypot(expected[..., 0::2], expected[..., 1::2]), 2, axis=-1) if rotated else mag
        return ULP[self.dtype.name] * mag + 1e-6 * pair

    def check(self, q, buffer):
        """Assert that ``q`` and ``buffer`` (host arrays) hold what the step should leave: q rotated, each live
        token's k rotated and v in its slot, every other byte of the buffer still poison."""
        eq, ek, ev = self.expected()
        assert np.all(np.abs(q.astype(np.float64) - eq) <= self.tolerance(eq, True))
        k_plane, v_plane = self.planes(buffer)
        live = self.slots >= 0
        blocks, offsets = np.divmod(self.slots[live], self.block_size)
        for plane, want, rotated, s in ((k_plane, ek, True, 0), (v_plane, ev, False, 1)):
            got, want = plane[blocks, :, offsets, :], want[live]
            if self.fp8:
                got = fp8.VALUES[got] * self.scales[s][:, None].astype(np.float64)
                step = 2.0 ** -4 + 2 * ULP[self.dtype.name]  # e4m3's half step, after the rounding to dtype
                bound = step * np.abs(want) + 2.0 ** -10 * self.scales[s][:, None] + 1e-6
            else:
                got = got.astype(np.float64)
                bound = self.tolerance(want, rotated)
            assert np.all(np.abs(got - want) <= bound)
        written = np.zeros(buffer.shape, bool)
        for plane in self.planes(written):
            plane[blocks, :, offsets, :] = True
        rest = buffer[~written]
        assert np.all(rest == POISON_BITS) if self.fp8 else np.isnan(rest.astype(np.float32)).all()
