"""The demo workload: a seeded scheduler drives a real PagedKVCache, one ``cache.step()`` per engine step.

Requests arrive with prompts that begin with one of a few system prompts, so later
ones start holding blocks an earlier one filled (prefix hits, shared blocks). Prompts
are prefilled in chunks, the first with the arrival and the rest in later steps beside
other sequences' decode tokens; some sequences fork (parallel sampling: the child
shares its parent's blocks, and the first appends copy the shared tail block); those
that reach their length are freed, their named blocks kept cached. The cache grows
ahead of need and releases chunks left idle (``growth``), mapping between steps on
this thread (``background=False``): on a worker, when a chunk is ready would depend
on timing, and with it which blocks a step gets; this way the seeded run reaches the
same state every time.

A token's K/V is a function of its id, its position and the sum of the ids before it,
a stand-in for a model's (which depends on the token and on what came before it): a
prefix hit then reads exactly what this sequence would have written, and a block
shared by mistake would hold other values. Every step copies the step's copy-on-write
pairs, writes the new tokens' K/V through its slot mapping (``kernels.WritePlan``) and
computes decode attention through its block tables (``attention.DecodePlan``: the CUDA
kernel on a GPU, its float64 reference on the host) for the first and last layer, and
checks it against float64 attention over a contiguous copy of the same K/V; so the
check also proves that shared and cached blocks hold the right data.
"""

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Optional, Sequence, Union

import numpy as np

from . import attention, kernels
from .blocks import ceil_div, ranks
from .cache import PagedKVCache
from .layout import Layout
from .memory import select_backend
from .scheduler import Request, Scheduler, SchedulerConfig, Status
from .spec import KVSpec

PRESETS = {  # name: (layers, query heads, kv heads, head_dim)
    "llama2-7b": (32, 32, 32, 128),
    "llama2-70b": (80, 64, 8, 128),
    "llama3-8b": (32, 32, 8, 128),
    "tiny": (2, 4, 2, 64),
}
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}
DEMO_CHUNKS = 16     # the pool is cut into about this many chunks: growth to watch
RELEASE_AFTER = 8    # growth releases a chunk all free for this many steps
SYSTEM_PROMPTS = 3   # prompts begin with one of these
VOCAB = 32000        # token ids are drawn from [0, VOCAB)
ARRIVAL, FORK = 0.5, 0.2  # the chance, each step, of an arrival and of a fork
FREQUENCY = 100.0    # scale of the K/V's frequencies (radians per unit of a token's features)
_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


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


EVENTS = ("arrived", "forked", "finished", "prompt_tokens", "prefix_hit_tokens", "decode_tokens", "mixed_steps",
          "blocks_copied")


@dataclass
class DemoResult:
    cache: PagedKVCache
    checks: int = 0
    max_error: float = 0.0
    events: dict = field(default_factory=lambda: dict.fromkeys(EVENTS, 0))
    peak: dict = field(default_factory=lambda: {"mapped_bytes": 0, "token_bytes": 0, "contiguous_bytes": 0})

    @property
    def tolerance(self) -> float:
        """The largest relative attention error the checks allow for the cache's dtype (TOLERANCE)."""
        return TOLERANCE[self.cache.layout.dtype]

    def figures(self) -> Dict[str, Any]:
        """Fragmentation, sharing and growth figures now, and the run's peaks and events."""
        cache = self.cache
        stats, prefix, growth = cache.stats(), cache.prefix_stats(), cache.growth.stats()
        refs = np.asarray(cache.snapshot()["blocks"]["ref_counts"], np.int64)
        lay = cache.layout
        held_bytes = stats["held_blocks"] * lay.block_bytes
        contiguous = stats["sequences"] * cache.max_blocks_per_seq * lay.block_size * lay.bytes_per_token
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
            "shared_blocks": int((refs > 1).sum()), "cached_blocks": prefix["cached_blocks"],
            "evictable_blocks": prefix["evictable"], "evictions": prefix["evictions"],
            "chunks_ahead": growth["chunks_ahead"], "chunks_released": growth["chunks_released"],
            "sync_grows": growth["sync_grows"],
        }


@dataclass
class _Seq:
    """A live sequence's record as the workload sees it (the scheduler holds its place and target)."""
    pending: np.ndarray  # prompt ids not appended yet; empty once it decodes
    length: int = 0
    id_sum: int = 0      # the sum of its ids so far (the next token's K/V depends on it)
    history: dict = field(default_factory=dict)  # checked layer -> (k, v), [length, kv_heads, head_dim] float64


class _Values:
    """Every layer's K and V of tokens given by their features (:func:`features`).

    Each value is the cosine of a seeded random linear function of the two features:
    in [-1, 1], and unrelated between tokens whose features differ by more than about
    1 / FREQUENCY. Computed per layer on the pool's device, so the same features give
    the same bits whether a sequence writes them or the check recomputes them.
    """

    def __init__(self, config, xp, dtype):
        rng = np.random.default_rng([config.seed, 1])  # apart from the workload's draws
        shape = (2 * config.layers, config.kv_heads, config.head_dim)
        self.freq = xp.asarray(rng.standard_normal((2, *shape)) * FREQUENCY, np.float32)
        self.phase = xp.asarray(rng.uniform(0, 2 * np.pi, shape), np.float32)
        self.xp, self.dtype = xp, dtype

    def layer(self, x, layer):
        """K and V of ``layer`` for features ``x`` [n, 2] (on the device): [2, n, kv_heads, head_dim]."""
        planes = slice(2 * layer, 2 * layer + 2)
        a, b = self.freq[0, planes, None], self.freq[1, planes, None]
        angle = x[:, 0, None, None] * a + x[:, 1, None, None] * b + self.phase[planes, None]
        return self.xp.cos(angle).astype(self.dtype)


def features(ids: Union[np.ndarray, Sequence[int]], counts: Union[np.ndarray, Sequence[int]],
             lengths: Union[np.ndarray, Sequence[int]], sums: Union[np.ndarray, Sequence[int]]) -> np.ndarray:
    """Two features in [0, 1) per token, a hash of its id, its position and the sum of the ids before it.

    ``ids`` are the new tokens of sequences that hold ``lengths`` tokens whose ids sum
    to ``sums``, ``counts`` of them per sequence, one flat array. Returns float32 [n, 2].
    """
    ids, counts = np.asarray(ids, np.int64), np.asarray(counts, np.int64)
    total = np.concatenate([[0], np.cumsum(ids)])
    starts = np.cumsum(counts) - counts
    before = total[:-1] - np.repeat(total[starts], counts) + np.repeat(np.asarray(sums, np.int64), counts)
    position = np.repeat(np.asarray(lengths, np.int64), counts) + ranks(counts)
    key = _mix(_mix(_mix(before.astype(np.uint64)) + position.astype(np.uint64)) + ids.astype(np.uint64))
    bits = np.stack([_mix(key), _mix(~key)], axis=1) >> np.uint64(40)
    return bits.astype(np.float32) / np.float32(1 << 24)


def _mix(z):
    """splitmix64's finaliser over uint64 (wrapping): nearby inputs to unrelated outputs."""
    z = (z ^ (z >> np.uint64(30))) * _MIX[0]
    z = (z ^ (z >> np.uint64(27))) * _MIX[1]
    return z ^ (z >> np.uint64(31))


class _Workload:
    """The seeded workload: the requests and forks it asks for, each step's decisions (its scheduler's), and
    the contiguous K/V of the checked layers per sequence."""

    def __init__(self, config, cache):
        c = self.c = config
        self.cache, self.xp = cache, cache.xp
        self.rng = np.random.default_rng(c.seed)
        self.layers = sorted({0, c.layers - 1})
        self.values = _Values(c, self.xp, cache.dtype)
        low, high = max(1, c.max_prompt // 4), max(2, c.max_prompt // 2)
        self.system = [self.rng.integers(VOCAB, size=int(self.rng.integers(low, high))) for _ in range(SYSTEM_PROMPTS)]
        policy = SchedulerConfig(c.max_seqs, c.block_size, step_tokens=c.max_prompt + c.max_seqs,
                                 first_chunk=max(1, c.max_prompt // 4))  # a prompt prefilled over several steps
        self.scheduler = Scheduler(policy, cache)
        self.limit = cache.max_blocks_per_seq * c.block_size
        self.empty = np.zeros((0, c.kv_heads, c.head_dim))
        self.seqs = {}  # handle -> _Seq, in arrival order

    def prompt(self):
        """A system prompt, then a user part of lognormal length: at most max_prompt tokens in all, where
        the system prompt leaves room."""
        system = self.system[int(self.rng.integers(SYSTEM_PROMPTS))]
        user = min(self.c.max_prompt - system.size, self.rng.lognormal(np.log(self.c.max_prompt / 4), 0.8))
        return np.concatenate([system, self.rng.integers(VOCAB, size=max(1, int(user)))])

    def plan(self):
        """This step's decisions (:class:`~pagedrt.scheduler.Scheduler`'s: max_prompt + max_seqs tokens a step,
        an arrival's first chunk a quarter of max_prompt): the sequences that reached their target are freed,
        every other one appends one sampled token or its next prompt chunk. Then, drawn here: a fork of a random
        decoding sequence (a parallel sample asked for late) and an arrival, each made if the scheduler finds
        room; an arrival it does not admit now goes away. Returns the plan and its decoding rows' tokens.
        """
        c, rng = self.c, self.rng
        plan = self.scheduler.begin()
        sampled = rng.integers(VOCAB, size=len(plan.staying))
        decoding = [s for s in plan.staying if s.status is Status.DECODE]
        if decoding and plan.rows < c.max_seqs and rng.random() < FORK:
            parent = decoding[int(rng.integers(len(decoding)))]
            self.scheduler.fork(plan, parent, min(self.limit, parent.target + int(rng.integers(0, 16))))
        if plan.budget and plan.rows < c.max_seqs and rng.random() < ARRIVAL:
            prompt = self.prompt()
            target = min(self.limit, prompt.size + int(rng.integers(4, max(5, c.steps // 2))))
            self.scheduler.add(Request(prompt, target - prompt.size))
        self.scheduler.admit(plan)
        self.scheduler.withdraw()
        return plan, sampled[[s.status is Status.DECODE for s in plan.staying]]

    def step(self, events):
        """Plan a step and make it (``cache.step()``), write its K/V and check attention; returns the errors.

        The sequences' records follow the step's order: the freed go, the children copy
        their parents as they were before this step's tokens, the arrivals take the
        cached prefix the step found for them (its K/V computed here, not written), then
        every row of the batch takes its new tokens.
        """
        plan, decode_ids = self.plan()
        args = plan.cache_args(decode_ids)
        step = self.cache.step(**args)
        self.scheduler.update(plan, step)
        for s in plan.frees:
            del self.seqs[s.handle]
        for child, (parent, _, _) in zip(step.forked.tolist(), plan.forks):
            self.seqs[child] = replace(self.seqs[parent.handle], history=dict(self.seqs[parent.handle].history))
        prompts, cached = args["arrivals"], step.cached
        arrived = [_Seq(prompt, history={layer: (self.empty, self.empty) for layer in self.layers})
                   for prompt in prompts]
        if cached.any():  # the K/V the cached blocks hold: what these sequences would have written
            hit = np.concatenate([p[:n] for p, n in zip(prompts, cached.tolist())])
            x = self.xp.asarray(features(hit, cached, np.zeros_like(cached), np.zeros_like(cached)))
            self.extend(arrived, hit, cached, {layer: _host64(self.values.layer(x, layer)) for layer in self.layers})
        self.seqs.update(zip(step.arrived.tolist(), arrived))
        batch = [self.seqs[s] for s in step.seqs.tolist()]
        ids = np.concatenate([args["token_ids"]] + [q.pending[:n] for q, n in zip(arrived, plan.arrival_tokens)])
        prefill = np.array([q.pending.size > 0 for q in batch], bool)
        self.extend(batch, ids, step.query_lens, self.write(step, ids, batch))
        for seq in self.scheduler.running.values():
            if self.seqs[seq.handle].length >= seq.target:
                self.scheduler.finish(seq)
        n_prompt = int(step.query_lens[prefill].sum())
        for key, value in (("arrived", len(prompts)), ("forked", step.forked.size), ("finished", len(plan.frees)),
                           ("prompt_tokens", n_prompt), ("prefix_hit_tokens", int(cached.sum())),
                           ("decode_tokens", step.num_tokens - n_prompt),
                           ("mixed_steps", int(prefill.any() and not prefill.all())),
                           ("blocks_copied", len(step.copies))):
            events[key] += value
        return self.check(step)

    def write(self, step, ids, batch):
        """Copy the step's copy-on-write pairs, then write every layer's K/V of its new tokens through its slot
        mapping; returns the checked layers' K/V ({layer: [2, n, kv_heads, head_dim] float64})."""
        kernels.copy_blocks(self.cache.planes, step.copies)
        if not step.num_tokens:
            return {}
        x = self.xp.asarray(features(ids, step.query_lens, [q.length for q in batch], [q.id_sum for q in batch]))
        checked, write = {}, None
        for layer in range(self.c.layers):
            kv = self.values.layer(x, layer)
            if write is None:  # the slots checked once
                write = kernels.WritePlan(kv[0], self.cache.k(0), step.slot_mapping)
            write.run(kv[0], kv[1], self.cache.k(layer), self.cache.v(layer))
            if layer in self.layers:
                checked[layer] = _host64(kv)
        return checked

    @staticmethod
    def extend(seqs, ids, counts, checked):
        """Each of ``seqs`` takes its ``counts`` of the new ``ids`` and its share of their checked K/V."""
        bounds = np.cumsum(counts)[:-1]
        for layer, kv in checked.items():
            for q, k, v in zip(seqs, np.split(kv[0], bounds), np.split(kv[1], bounds)):
                old_k, old_v = q.history[layer]
                q.history[layer] = (np.concatenate([old_k, k]), np.concatenate([old_v, v]))
        for q, new in zip(seqs, np.split(ids, bounds)):
            q.length += new.size
            q.id_sum += int(new.sum())
            q.pending = q.pending[new.size:]

    def check(self, step):
        """Decode attention of the step's batch through its block tables, checked layers, against float64
        attention over contiguous K/V."""
        seqs = step.seqs.tolist()
        if not seqs:
            return []
        c, xp = self.c, self.xp
        q = self.rng.standard_normal((len(seqs), c.q_heads, c.head_dim), dtype=np.float32).astype(self.cache.dtype)
        q_dev = xp.asarray(q)
        plan = attention.DecodePlan(q_dev, self.cache.k(0), step.block_tables, step.seq_lens,
                                    block_mask=self.cache.block_mask())
        errors = []
        for layer in self.layers:
            out = _host64(plan.run(q_dev, self.cache.k(layer), self.cache.v(layer)))
            for i, seq in enumerate(seqs):
                k, v = self.seqs[seq].history[layer]
                ref = attention64(_host64(q[i]), k, v)
                errors.append(np.linalg.norm(out[i] - ref) / np.linalg.norm(ref))
        return errors


def attention64(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Decode attention in float64 over contiguous K/V: q [Hq, D], k/v [n, Hkv, D] -> [Hq, D]."""
    kv_heads, dim = k.shape[1], q.shape[-1]
    q = q.reshape(kv_heads, -1, dim)  # the query heads of each KV head, as np.repeat(k, group, axis=1) pairs them
    scores = np.einsum("kgd,nkd->kgn", q, k) / np.sqrt(dim)
    p = np.exp(scores - scores.max(axis=2, keepdims=True))
    return np.einsum("kgn,nkd->kgd", p / p.sum(axis=2, keepdims=True), v).reshape(-1, dim)


def _host64(a):
    return (a.get() if hasattr(a, "get") else np.asarray(a)).astype(np.float64)


def run_demo(config: DemoConfig, progress: Optional[Callable[[int], Any]] = None) -> DemoResult:
    """Run the workload, one ``cache.step()`` per step; ``progress(n)`` is called after each step.
    Returns a DemoResult (cache open)."""
    c = config
    backend = select_backend(c.backend)
    spec = KVSpec.build(c.layers, c.kv_heads, c.head_dim, c.block_size, c.dtype, placement=c.placement)
    full = Layout.plan(spec, backend.page_bytes, ceil_div(c.max_tokens, c.block_size))
    plane_bytes, step = full.pool_bytes // full.num_planes, full.chunk_step
    chunk = step * max(1, plane_bytes // (DEMO_CHUNKS * step))  # about DEMO_CHUNKS chunks: growth to watch
    cache = PagedKVCache(c.layers, c.kv_heads, c.head_dim, c.block_size, c.dtype, max_tokens=c.max_tokens,
                         max_seqs=c.max_seqs, max_seq_len=c.max_prompt + c.steps + 16,
                         max_step_tokens=c.max_prompt + c.max_seqs, placement=c.placement, chunk_bytes=chunk,
                         backend=backend, growth={"release_after": RELEASE_AFTER, "background": False})
    result = DemoResult(cache)
    work = _Workload(c, cache)
    for _ in range(c.steps):
        errors = work.step(result.events)
        if errors:
            result.checks += len(errors)
            result.max_error = max(result.max_error, max(errors))
        stats = cache.stats()
        contiguous = stats["sequences"] * cache.max_blocks_per_seq * c.block_size * cache.layout.bytes_per_token
        for key, value in (("mapped_bytes", stats["mapped_bytes"]), ("token_bytes", stats["token_bytes"]),
                           ("contiguous_bytes", contiguous)):
            result.peak[key] = max(result.peak[key], value)
        if progress:
            progress(1)
    return result


# The demo's bounds: beyond them its cache could not be reserved, its K/V not be held, or no prompt fit.
MAX_LAYERS, MAX_KV_HEADS, MAX_TOKENS, MAX_STEPS, MAX_SEQS = 256, 128, 1 << 24, 100_000, 1024
MAX_DEMO_BYTES = 1 << 40       # the demo cache's reservation (virtual address space)
MAX_DEMO_STEP_BYTES = 4 << 30  # the float32 K/V of a step's prompt tokens, every layer, that a demo step computes
DEMO_MAX_PROMPT = 256          # the longest prompt, and the most prompt tokens one demo step appends
MIN_DECODE = 4                 # the fewest tokens a demo sequence decodes after its prompt (_Workload.plan)


def shortest_request(max_prompt: int = DEMO_MAX_PROMPT) -> int:
    """The fewest tokens a demo request can need: the shortest system prompt, one user token, MIN_DECODE."""
    return max(1, max_prompt // 4) + 1 + MIN_DECODE


def make_config(preset: str, layers: Optional[int] = None, q_heads: Optional[int] = None,
                kv_heads: Optional[int] = None, head_dim: Optional[int] = None, **rest: Any) -> DemoConfig:
    """The :class:`DemoConfig` of ``preset`` (a PRESETS name) with the given overrides; ``rest``: DemoConfig's
    other fields but ``max_prompt``. Raises UnsupportedConfigError, saying which bound, beyond the demo's."""
    from .errors import UnsupportedConfigError
    from .supported import GROUPS
    given = [p if v is None else v for v, p in zip((layers, q_heads, kv_heads, head_dim), PRESETS[preset])]
    c = DemoConfig(*given, max_prompt=DEMO_MAX_PROMPT, **rest)
    model = f"{c.layers} layers, {c.kv_heads} KV heads x {c.head_dim}"
    token_values = 2 * c.layers * c.kv_heads * c.head_dim
    reserved = ceil_div(c.max_tokens, c.block_size) * c.block_size * token_values * (4 if c.dtype == "float32" else 2)
    need = shortest_request(c.max_prompt)
    for bad, why in (
            (c.q_heads % c.kv_heads, f"--kv-heads {c.kv_heads} must divide --q-heads {c.q_heads} (query heads share "
                                     f"KV heads)"),
            (c.q_heads % c.kv_heads == 0 and c.q_heads // c.kv_heads not in GROUPS,
             f"{c.q_heads // c.kv_heads} query heads per KV head: the kernels support {GROUPS[0]} to {GROUPS[-1]}"),
            (c.max_prompt * token_values * 4 > MAX_DEMO_STEP_BYTES,
             f"a demo step computes the K/V of up to {c.max_prompt} prompt tokens, {c.max_prompt * token_values * 4} "
             f"bytes in float32 for {model}; at most {MAX_DEMO_STEP_BYTES >> 30} GiB: use fewer layers, KV heads or "
             f"a smaller head_dim"),
            (reserved > MAX_DEMO_BYTES,
             f"--max-tokens {c.max_tokens} for {model}, {c.dtype} would reserve {reserved} bytes; the demo reserves "
             f"at most {MAX_DEMO_BYTES >> 30} GiB: ask for fewer tokens"),
            (ceil_div(c.max_tokens, c.block_size) < ceil_div(need, c.block_size),
             f"--max-tokens {c.max_tokens} holds no demo request: the shortest needs {need} tokens "
             f"({ceil_div(need, c.block_size)} blocks of {c.block_size}); ask for more tokens")):
        if bad:
            raise UnsupportedConfigError(why)
    return c
