"""A randomized soak of ``PagedKVCache.step()`` on the host backend, against a model of its own.

The model knows every sequence's token ids and whether it is swapped out; nothing else. Every token's K/V is
written from the model alone (after the step's tier moves and copy-on-write copies, in order), as values that
name its position and a hash of every token up to it, so a block read back through a sequence's table shows
whether it holds that sequence's tokens. Steps mix arrivals with shared prefixes (prefix hits), chunked prompts
(``arrival_tokens``), forks, frees, swap-out and swap-in (forks sharing blocks included), offload and reload of
cached blocks (the host tier), growth (``release_after`` 1 to 64, background or not), in pools tight enough that
steps fail with ``PoolExhaustedError``/``HostTierExhaustedError`` (then the snapshot and the model must be as
before).

After every step: the sequences, lengths and swapped flags equal the model's; every block's reference count is
the number of table entries holding it; a block held by two sequences holds the same tokens for both; free and
cached-free blocks are not held. Every ``--check-every`` steps, every sequence's K/V read back equal the model's.

    python3 tools/soak.py --steps 1000000 --seed 1 --configs all --check-every 64

Exits 1 at the first broken invariant, printing the seed, config and step that reproduce it
(``--seed S --configs C --steps N+1``).
"""

import argparse
import functools
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedrt import PagedKVCache, kernels  # noqa: E402
from pagedrt.errors import HostTierExhaustedError, PagedRTError, PoolExhaustedError  # noqa: E402

BS, HEAD_DIM, MAX_SEQS = 8, 64, 16
MAX_SEQ_LEN = 12 * BS
MAX_STEP_TOKENS = MAX_SEQ_LEN + MAX_SEQS  # the cache's default: a step never holds more
FULL = (PoolExhaustedError, HostTierExhaustedError)  # a step that does not fit: nothing may change
CONFIGS = {  # name -> cache keywords: device blocks, host blocks, chunk blocks, growth
    "tight": dict(device=24, host=16, chunk=4, growth=None),
    "grow1": dict(device=32, host=16, chunk=2, growth=dict(release_after=1, background=False)),
    "growbg": dict(device=32, host=24, chunk=4, growth=dict(release_after=3, background=True)),
    "grow64": dict(device=48, host=8, chunk=4, growth=dict(release_after=64, low_blocks=2, high_blocks=4)),
}


class Broken(AssertionError):
    """An invariant that does not hold."""


def make_cache(config):
    """A host cache of one layer, one KV head, ``BS``-token blocks, sized by ``CONFIGS[config]``."""
    c = CONFIGS[config]
    return PagedKVCache(1, 1, HEAD_DIM, BS, "float32", max_tokens=c["device"] * BS, max_seqs=MAX_SEQS,
                        max_seq_len=MAX_SEQ_LEN, chunk_bytes=c["chunk"] * BS * HEAD_DIM * 4, backend="host",
                        host_tokens=c["host"] * BS, growth=c["growth"])


def chain(tokens):
    """float64 [n]: a hash of every token up to each position (exact in float32)."""
    return _chain(tuple(tokens))


@functools.lru_cache(maxsize=4096)
def _chain(tokens):
    h, out = 0, np.empty(len(tokens))
    for i, t in enumerate(tokens):
        h = (h * 1000003 + int(t) + 1) % (1 << 23)
        out[i] = h
    return out


def expected_kv(tokens, start, stop):
    """K and V [stop - start, 1, HEAD_DIM] of positions start..stop-1 of a sequence with ``tokens``."""
    n = stop - start
    k, v = np.zeros((n, 1, HEAD_DIM), np.float32), np.zeros((n, 1, HEAD_DIM), np.float32)
    k[:, 0, 0] = np.arange(start, stop) + 1
    k[:, 0, 1] = chain(tokens[:stop])[start:]
    v[:, 0, 0] = np.asarray(tokens[start:stop]) + 1
    v[:, 0, 1] = -k[:, 0, 1]
    return k, v


class Model:
    """What the soak knows: each sequence's token ids, swapped or not, and the prompt rest of chunked ones."""

    def __init__(self):
        self.tokens, self.swapped, self.rest = {}, set(), {}

    def copy(self):
        m = Model()
        m.tokens = {s: list(t) for s, t in self.tokens.items()}
        m.swapped, m.rest = set(self.swapped), {s: list(r) for s, r in self.rest.items()}
        return m


def plan(rng, model, docs):
    """A random mixed step for ``model``: the keywords of ``cache.step()`` and the appended token ids."""
    live = sorted(model.tokens)
    frees = [s for s in live if rng.random() < 0.08]
    left = [s for s in live if s not in frees]
    resident = [s for s in left if s not in model.swapped]
    swap_out = [s for s in resident if rng.random() < 0.06]
    swap_in = [s for s in left if s in model.swapped and rng.random() < 0.3]
    room = MAX_SEQS - len(left)
    forks = [s for s in resident if s not in swap_out and rng.random() < 0.05][:room]
    arrivals = []
    for _ in range(min(int(rng.integers(0, 3)), room - len(forks))):
        doc = docs[rng.integers(len(docs))]
        cut = int(rng.integers(1, len(doc) + 1))
        arrivals.append(doc[:cut] + rng.integers(0, 50, rng.integers(0, 2 * BS)).tolist())
    chunk = None if not arrivals or rng.random() < 0.5 else int(rng.integers(1, 3 * BS))
    budget = MAX_STEP_TOKENS - sum(len(a) if chunk is None else min(chunk, len(a)) for a in arrivals)
    seqs, counts, ids = [], [], []
    for s in sorted(set(resident) - set(swap_out) | set(swap_in)):
        if rng.random() < 0.2:
            continue
        rest = model.rest.get(s)
        new = rest[:int(rng.integers(1, 2 * BS))] if rest else rng.integers(0, 50, rng.integers(1, 3)).tolist()
        if len(model.tokens[s]) + len(new) > MAX_SEQ_LEN or len(new) > budget:
            continue
        budget -= len(new)
        seqs.append(s), counts.append(len(new)), ids.extend(new)
    ids = None if rng.random() < 0.15 else np.array(ids, np.int64)  # without ids: nothing to cache
    return dict(seqs=seqs, counts=counts, token_ids=ids, arrivals=arrivals,
                arrival_tokens=chunk, forks=forks, frees=frees, swap_out=swap_out, swap_in=swap_in)


def apply(model, p, st):
    """The model after step ``p`` returned ``st``; the (handle, start) of every batch row's new tokens."""
    m = model.copy()
    for s in p["frees"]:
        del m.tokens[s]
        m.swapped.discard(s), m.rest.pop(s, None)
    for parent, child in zip(p["forks"], st.forked.tolist()):
        m.tokens[child] = list(model.tokens[parent])
    m.swapped = (m.swapped | set(p["swap_out"])) - set(p["swap_in"])
    rows = []
    ids = [0] * sum(p["counts"]) if p["token_ids"] is None else p["token_ids"].tolist()
    for s, n in zip(p["seqs"], p["counts"]):
        rows.append((s, len(m.tokens[s])))
        m.tokens[s] += ids[:n]
        if s in m.rest:
            m.rest[s] = m.rest[s][n:]
            if not m.rest[s]:
                del m.rest[s]
        ids = ids[n:]
    for prompt, s, cached in zip(p["arrivals"], st.arrived.tolist(), st.cached.tolist()):
        n = len(prompt) - cached if p["arrival_tokens"] is None else min(p["arrival_tokens"], len(prompt) - cached)
        rows.append((s, cached))
        m.tokens[s] = list(prompt[:cached + n])
        if cached + n < len(prompt):
            m.rest[s] = list(prompt[cached + n:])
    return m, rows


def write(cache, model, st, rows):
    """The step's copies in order, then every new token's K/V from the model."""
    if len(st.swaps):  # each is a no-op for none, after its checks
        kernels.swap_blocks(cache.planes, st.swaps)
    if len(st.copies):
        kernels.copy_blocks(cache.planes, st.copies)
    if not st.num_tokens:
        return
    ks, vs = zip(*(expected_kv(model.tokens[s], start, len(model.tokens[s])) for s, start in rows))
    kernels.write_kv(np.concatenate(ks), np.concatenate(vs), cache.k(0), cache.v(0),
                     np.ascontiguousarray(st.slot_mapping))


def check_state(snap, model):
    """The cheap invariants, from a snapshot: sequences, lengths, swapped flags, reference counts, sharing."""
    seqs = {s["seq"]: s for s in snap["sequences"]}
    if set(seqs) != set(model.tokens):
        raise Broken(f"sequences {sorted(seqs)} != the model's {sorted(model.tokens)}")
    b = snap["blocks"]
    refs = np.array(b["ref_counts"] + [0] * (b["max_blocks"] - len(b["ref_counts"])), np.int64)
    holders, owner = np.zeros(b["max_blocks"], np.int64), {}
    for s, rec in seqs.items():
        tokens = model.tokens[s]
        if rec["length"] != len(tokens) or rec["swapped"] != (s in model.swapped):
            raise Broken(f"sequence {s}: length {rec['length']}, swapped {rec['swapped']}; the model has "
                         f"{len(tokens)}, {s in model.swapped}")
        if len(rec["blocks"]) != -(-len(tokens) // BS):
            raise Broken(f"sequence {s} holds {len(rec['blocks'])} blocks for {len(tokens)} tokens")
        np.add.at(holders, np.array(rec["blocks"], np.int64), 1)
        hashes = chain(tokens)
        for j, blk in enumerate(rec["blocks"]):
            filled = min(BS, len(tokens) - j * BS)
            other = owner.setdefault(blk, (s, j, filled, hashes[j * BS + filled - 1]))
            if other[0] != s:
                both = min(filled, other[2]) - 1
                if other[1] != j or (chain(model.tokens[other[0]])[j * BS + both] != hashes[j * BS + both]):
                    raise Broken(f"block {blk} is held by sequences {other[0]} and {s} with different tokens")
    if (refs != holders).any():
        bad = np.flatnonzero(refs != holders)[:5].tolist()
        raise Broken(f"blocks {bad}: ref counts {refs[bad].tolist()} != table entries {holders[bad].tolist()}")
    bpc = b["blocks_per_chunk"]
    held = np.add.reduceat(holders > 0, np.arange(0, b["max_blocks"], bpc))
    cached = np.zeros(b["max_blocks"], bool)
    cached[b["cached"]] = True
    cached_free = np.add.reduceat(cached & (holders == 0), np.arange(0, b["max_blocks"], bpc))
    mapped = np.array(b["chunk_mapped"])
    total = np.array(b["free_in_chunk"]) + held + cached_free
    if (total[mapped] != bpc).any() or held[~mapped].any():
        raise Broken(f"chunks {np.flatnonzero(mapped & (total != bpc)).tolist()}: free + held + cached-free "
                     f"blocks != {bpc} (a free block held, or one lost)")


def check_kv(cache, model):
    """Every sequence's K/V read through its block table equal the model's."""
    seqs = sorted(model.tokens)
    if not seqs:
        return
    tables = cache.block_tables(seqs)
    k, v = cache.k(0), cache.v(0)
    for s, row in zip(seqs, tables):
        n = len(model.tokens[s])
        blocks = np.asarray(row[:-(-n // BS)], np.int64)
        got_k = k[blocks][:, 0].reshape(-1, HEAD_DIM)[:n]
        got_v = v[blocks][:, 0].reshape(-1, HEAD_DIM)[:n]
        want_k, want_v = expected_kv(model.tokens[s], 0, n)
        if not (np.array_equal(got_k, want_k[:, 0]) and np.array_equal(got_v, want_v[:, 0])):
            pos = int(np.flatnonzero((got_k != want_k[:, 0]).any(1) | (got_v != want_v[:, 0]).any(1))[0])
            raise Broken(f"sequence {s}: K/V of position {pos} read back {got_k[pos, :2]}, want {want_k[pos, 0, :2]}")


def without_time(snap):
    return {key: value for key, value in snap.items() if key != "time"}


class Soak:
    """One cache, its model and its random stream; :meth:`step` runs one step and checks it."""

    def __init__(self, config, seed):
        self.rng = np.random.default_rng(seed)
        self.cache, self.model = make_cache(config), Model()
        self.docs = [self.rng.integers(0, 50, self.rng.integers(BS, 5 * BS)).tolist() for _ in range(6)]
        self.failed_steps = 0
        self.last = without_time(self.cache.snapshot())

    def step(self, full_check):
        p = plan(self.rng, self.model, self.docs)
        try:
            st = self.cache.step(**p)
        except FULL:
            self.failed_steps += 1
            if without_time(self.cache.snapshot()) != self.last:
                raise Broken("a step that raised changed the snapshot") from None
            self.relieve()
            return
        except PagedRTError as exc:  # the plan is valid by construction: any other refusal is a bug
            raise Broken(f"a valid step raised {type(exc).__name__}: {exc}") from None
        self.model, rows = apply(self.model, p, st)
        try:
            write(self.cache, self.model, st, rows)
        except PagedRTError as exc:
            raise Broken(f"the step's own copies or slots were refused: {type(exc).__name__}: {exc}") from None
        self.check()
        if full_check:
            check_kv(self.cache, self.model)

    def check(self):
        """The cheap invariants; the snapshot is kept as the state before the next step (writes do not change it)."""
        snap = self.cache.snapshot()
        check_state(snap, self.model)
        self.last = without_time(snap)

    def relieve(self):
        """After a step that did not fit, as a scheduler would: free the longest sequence (with what it shared)."""
        if self.model.tokens:
            s = max(self.model.tokens, key=lambda s: len(self.model.tokens[s]))
            self.cache.step([], frees=[s])
            del self.model.tokens[s]
            self.model.swapped.discard(s), self.model.rest.pop(s, None)
            self.check()


def run(config, seed, steps, check_every, report=None):
    """Run ``steps`` steps; returns (steps done, failed steps). Raises :class:`Broken` with where it broke."""
    soak = Soak(config, seed)
    try:
        for i in range(steps):
            try:
                soak.step(full_check=(i + 1) % check_every == 0)
            except Broken as exc:
                raise Broken(f"config {config}, seed {seed}, step {i}: {exc} (reproduce: --configs {config} "
                             f"--seed {seed} --steps {i + 1} --check-every 1)") from exc
            if report is not None and (i + 1) % 10000 == 0:
                report(i + 1, soak.failed_steps)
        check_kv(soak.cache, soak.model)
    finally:
        soak.cache.close()
    return steps, soak.failed_steps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100000, help="steps per (config, seed)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--configs", default="all", help=f"comma-separated of {', '.join(CONFIGS)}, or all")
    ap.add_argument("--check-every", type=int, default=64, help="read every sequence's K/V back every N steps")
    args = ap.parse_args(argv)
    configs = list(CONFIGS) if args.configs == "all" else args.configs.split(",")
    t0, done, failed = time.perf_counter(), 0, 0
    for config in configs:
        def report(n, f):
            rate = (done + n) / (time.perf_counter() - t0)
            print(f"{config} seed {args.seed}: {n} steps, {f} did not fit; {rate:.0f} steps/s, 0 broken", flush=True)
        try:
            n, f = run(config, args.seed, args.steps, args.check_every, report)
        except Broken as exc:
            print(f"BROKEN: {exc}", flush=True)
            return 1
        done, failed = done + n, failed + f
    dt = time.perf_counter() - t0
    print(f"done: {done} steps ({failed} did not fit) in {dt:.0f} s, {done / dt:.0f} steps/s, "
          f"full checks every {args.check_every}, 0 broken", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
