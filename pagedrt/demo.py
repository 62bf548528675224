"""The demo workload: sequences arrive, grow, fork and finish over a real PagedKVCache.

Every step writes K/V through the slot mapping (``kernels.write_kv``) and computes
decode attention through the block tables (``attention.paged_decode``: the CUDA
kernel on a GPU, its float64 reference on the host) for the first and last layer, and
checks it against float64 attention over a contiguous copy of the same K/V.
"""

from dataclasses import dataclass, field

import numpy as np

from . import attention, kernels
from .cache import PagedKVCache
from .layout import Layout
from .memory import select_backend

PRESETS = {  # name: (layers, query heads, kv heads, head_dim)
    "llama2-7b": (32, 32, 32, 128),
    "llama2-70b": (80, 64, 8, 128),
    "llama3-8b": (32, 32, 8, 128),
    "tiny": (2, 4, 2, 64),
}
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}
DEMO_CHUNKS = 16


@dataclass
class DemoConfig:
    layers: int = 32
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "float16"
    block_size: int = 16
    placement: str = "plane"
    steps: int = 48
    max_seqs: int = 8
    max_prompt: int = 256
    max_tokens: int = 8192
    seed: int = 0
    backend: str = "auto"


@dataclass
class DemoResult:
    cache: PagedKVCache
    checks: int = 0
    max_error: float = 0.0
    events: dict = field(default_factory=lambda: {"arrived": 0, "forked": 0, "finished": 0, "decode_tokens": 0,
                                                  "chunks_released": 0})
    peak: dict = field(default_factory=lambda: {"mapped_bytes": 0, "token_bytes": 0, "contiguous_bytes": 0})

    @property
    def tolerance(self):
        return TOLERANCE[self.cache.layout.dtype]

    def figures(self):
        """Fragmentation figures now, and at the peak of the run."""
        stats = self.cache.stats()
        lay = self.cache.layout
        held_bytes = stats["held_blocks"] * lay.block_bytes
        contiguous = stats["sequences"] * self.cache.max_blocks_per_seq * lay.block_size * lay.bytes_per_token
        return {
            **stats,
            "held_bytes": held_bytes,
            "utilisation_of_mapped": stats["token_bytes"] / stats["mapped_bytes"] if stats["mapped_bytes"] else 0.0,
            "utilisation_of_held": stats["token_bytes"] / held_bytes if held_bytes else 0.0,
            "contiguous_bytes": contiguous,
            "peak_mapped_bytes": self.peak["mapped_bytes"],
            "peak_token_bytes": self.peak["token_bytes"],
            "peak_contiguous_bytes": self.peak["contiguous_bytes"],
            "max_error": self.max_error, "tolerance": self.tolerance, "checks": self.checks,
            **self.events,
        }


class _Workload:
    """Seeded arrivals, lengths, forks and finishes; keeps contiguous K/V of the checked layers."""

    def __init__(self, config, cache):
        self.c, self.cache = config, cache
        self.rng = np.random.default_rng(config.seed)
        self.xp = cache.xp
        self.layers = sorted({0, config.layers - 1})
        self.history = {}   # seq -> {layer: (k [n, H, D], v [n, H, D])} in float64
        self.target = {}    # seq -> length at which it finishes

    def random_kv(self, n):
        """Fresh random K and V for n tokens of every layer: [2 * layers, n, kv_heads, head_dim]."""
        c = self.c
        shape = (2 * c.layers, n, c.kv_heads, c.head_dim)
        if self.xp is np:
            return self.rng.standard_normal(shape, dtype=np.float32).astype(self.cache.dtype)
        return self.xp.random.default_rng(int(self.rng.integers(2**31))).standard_normal(
            shape, dtype=self.xp.float32).astype(self.cache.dtype)

    def write(self, seqs, counts, slots, copies):
        kernels.copy_blocks(self.cache.planes, copies)
        kv = self.random_kv(slots.size)
        write = kernels.WritePlan(kv[0], self.cache.k(0), self.xp.asarray(slots))  # the slots checked once
        for layer in range(self.c.layers):
            write.run(kv[2 * layer], kv[2 * layer + 1], self.cache.k(layer), self.cache.v(layer))
        bounds = np.cumsum(counts)[:-1]
        for layer in self.layers:
            k = np.split(_host64(kv[2 * layer]), bounds)
            v = np.split(_host64(kv[2 * layer + 1]), bounds)
            for i, seq in enumerate(seqs):
                old_k, old_v = self.history[seq][layer]
                self.history[seq][layer] = (np.concatenate([old_k, k[i]]), np.concatenate([old_v, v[i]]))

    def arrive(self):
        if len(self.history) >= self.c.max_seqs or self.rng.random() > 0.5:
            return 0
        prompt = int(min(self.c.max_prompt, max(1, self.rng.lognormal(np.log(self.c.max_prompt / 4), 0.8))))
        limit = self.cache.max_blocks_per_seq * self.c.block_size
        if self.cache.num_available_blocks < -(-prompt // self.c.block_size) + len(self.history):
            return 0  # room for the prompt, and a decode step's new block for every sequence
        seq = self.cache.add_sequence()
        empty = np.zeros((0, self.c.kv_heads, self.c.head_dim))
        self.history[seq] = {layer: (empty, empty) for layer in self.layers}
        self.target[seq] = min(limit, prompt + int(self.rng.integers(8, 4 * self.c.steps)))
        slots, copies = self.cache.append(seq, prompt)
        self.write([seq], [prompt], slots, copies)
        return 1

    def fork(self):
        if not self.history or len(self.history) >= self.c.max_seqs or self.rng.random() > 0.1:
            return 0
        parent = int(self.rng.choice(sorted(self.history)))
        child = self.cache.fork(parent)
        self.history[child] = dict(self.history[parent])
        self.target[child] = self.target[parent] + int(self.rng.integers(0, 16))
        return 1

    def decode(self):
        seqs = self.cache.sequences
        if not seqs or not self.cache.can_append(None, 1):
            return 0
        slots, copies = self.cache.append(None, 1)
        self.write(seqs, [1] * len(seqs), slots, copies)
        return len(seqs)

    def check(self):
        """Paged decode attention of the checked layers against float64 attention over contiguous K/V."""
        seqs = self.cache.sequences
        if not seqs:
            return []
        c, xp = self.c, self.xp
        q = self.rng.standard_normal((len(seqs), c.q_heads, c.head_dim), dtype=np.float32).astype(self.cache.dtype)
        tables, lens = self.cache.block_tables(seqs), self.cache.seq_lens(seqs)
        errors = []
        q_dev = xp.asarray(q)
        plan = attention.DecodePlan(q_dev, self.cache.k(0), tables, lens, block_mask=self.cache.block_mask())
        for layer in self.layers:
            out = _host64(plan.run(q_dev, self.cache.k(layer), self.cache.v(layer)))
            for i, seq in enumerate(seqs):
                k, v = self.history[seq][layer]
                ref = attention64(_host64(q[i]), k, v)
                errors.append(np.linalg.norm(out[i] - ref) / np.linalg.norm(ref))
        return errors

    def finish(self):
        done = [s for s in self.cache.sequences if self.cache.length(s) >= self.target[s]]
        if done:
            self.cache.free(done)
            for s in done:
                del self.history[s], self.target[s]
        return len(done)


def attention64(q, k, v):
    """Decode attention in float64 over contiguous K/V: q [Hq, D], k/v [n, Hkv, D] -> [Hq, D]."""
    kv_heads, dim = k.shape[1], q.shape[-1]
    q = q.reshape(kv_heads, -1, dim)  # the query heads of each KV head, as np.repeat(k, group, axis=1) pairs them
    scores = np.einsum("kgd,nkd->kgn", q, k) / np.sqrt(dim)
    p = np.exp(scores - scores.max(axis=2, keepdims=True))
    return np.einsum("kgn,nkd->kgd", p / p.sum(axis=2, keepdims=True), v).reshape(-1, dim)


def _host64(a):
    return (a.get() if hasattr(a, "get") else np.asarray(a)).astype(np.float64)


def run_demo(config, progress=None):
    """Run the workload; ``progress(n)`` is called after each step. Returns a DemoResult (cache open)."""
    c = config
    backend = select_backend(c.backend)
    full = Layout.plan(c.layers, c.kv_heads, c.head_dim, c.block_size, c.dtype, c.placement, backend.page_bytes,
                       -(-c.max_tokens // c.block_size))
    plane_bytes, step = full.pool_bytes // full.num_planes, full.chunk_step
    chunk = step * max(1, plane_bytes // (DEMO_CHUNKS * step))  # about DEMO_CHUNKS chunks: growth to watch
    cache = PagedKVCache(c.layers, c.kv_heads, c.head_dim, c.block_size, c.dtype, max_tokens=c.max_tokens,
                         max_seqs=c.max_seqs, max_seq_len=c.max_prompt + 4 * c.steps + 16,
                         placement=c.placement, chunk_bytes=chunk, backend=backend)
    result = DemoResult(cache)
    work = _Workload(c, cache)
    for _ in range(c.steps):
        result.events["arrived"] += work.arrive()
        result.events["forked"] += work.fork()
        result.events["decode_tokens"] += work.decode()
        errors = work.check()
        if errors:
            result.checks += len(errors)
            result.max_error = max(result.max_error, max(errors))
        stats = cache.stats()
        contiguous = stats["sequences"] * cache.max_blocks_per_seq * c.block_size * cache.layout.bytes_per_token
        for key, value in (("mapped_bytes", stats["mapped_bytes"]), ("token_bytes", stats["token_bytes"]),
                           ("contiguous_bytes", contiguous)):
            result.peak[key] = max(result.peak[key], value)
        finished = work.finish()
        if finished:
            result.events["finished"] += finished
            result.events["chunks_released"] += len(cache.trim())
        if progress:
            progress(1)
    return result
