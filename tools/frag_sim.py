"""Experiment: how much of a fixed KV budget holds tokens, contiguous reservation vs pagedrt's blocks.

    PYTHONPATH=. python3 tools/frag_sim.py [--seed 0] [--tiny] [--plot FILE.png]

Two seeded request traces (arrivals, prompt and output lengths; see ``TRACES``) are
replayed step by step against the same KV budget, a 1-D space of token slots:

- contiguous reservation (``contig-*``): on admission a request reserves one
  contiguous region, placed first-fit; freed regions become holes. The region is
  ``max_model_len`` tokens (``contig-max``: the seeds' "reserve the max length
  per request"), the final length rounded up to a power of two (``contig-pow2``),
  or exactly the final length (``contig-exact``: an oracle that knows it; the
  course seed's "even knowing the length, the reserved space sits idle").
- paged (``paged-B``): a real :class:`PagedKVCache` on the host backend (one
  layer: only token counts matter here) with blocks of B tokens and exactly the
  budget's blocks; prompts are appended on admission, one token per running
  sequence per step (``append(None, 1)``), sequences freed when done. When a step
  needs more blocks than are free, the latest admitted sequences are preempted
  (freed and queued again at the front, recomputed later: vLLM's default).

A step: arrivals join a FCFS queue; every running request gains one token (paged:
after preempting, if the free blocks do not suffice); finished requests leave; the
queue head is admitted while it fits (contiguous: a hole as large as its region;
paged: free blocks for its tokens and the next one), bringing its prompt (after a
preemption, all it held) and gaining tokens from the next step; the state is
sampled. A sample taken while a request waits splits the budget into

- used: slots holding tokens;
- internal waste: reserved or held but empty (the region's unused tail, or the
  empty slots of each sequence's last block);
- external waste: free space while the queue head waits although the free total
  would hold it, i.e. free space in holes too small for it (fragmentation);
- idle: other free space (the free total is too small for the queue head).

Means are over the steps in which a request waited (memory was the limit). The
paged rows also check, every step, from the allocator's own block table, that no
sequence holds more than B - 1 empty slots and that no block leaks.
"""

import argparse
import bisect
from collections import deque
from dataclasses import dataclass

import numpy as np

from pagedrt.blocks.util import ceil_div
from pagedrt.cache import PagedKVCache

BLOCK_SIZES = (8, 16, 32, 64, 128)
# trace -> (prompt median, prompt sigma, output median, output sigma, arrivals per step), lognormal lengths
TRACES = {
    "long": (256, 1.0, 192, 1.0, 1.0),
    "short": (16, 0.7, 40, 0.8, 20.0),
}
FULL = dict(budget=65536, max_model_len=4096, requests={"long": 3000, "short": 6000})
TINY = dict(budget=8192, max_model_len=1024, requests={"long": 200, "short": 400})
LEGEND = """\
  used/held: share of the reserved (contig) or held (paged) slots that hold tokens
  used, intern, extern, idle: shares of the budget (they add up to 100%)
  batch, max: mean and largest number of running requests
  frag-delayed: requests that waited at the queue head while the free total would have held them
  preempted: sequences freed to make room for others' tokens (recomputed later, at no cost in steps)
  steps: decode steps until the last request finished
  empty slots/seq: mean and max over running sequences and all steps (contig: rest of the region;
    paged: empty slots of the sequence's blocks, read from the block table)"""
CHUNK_BYTES = 256 << 10  # per plane: 2048 tokens of the 1-layer shape below, 64 mappings for FULL


@dataclass
class Trace:
    name: str
    arrival: np.ndarray  # step of arrival, non-decreasing
    prompt: np.ndarray   # tokens
    output: np.ndarray   # tokens to generate, >= 1

    @property
    def final(self):
        return self.prompt + self.output


def make_trace(name, n, max_model_len, rng):
    """``n`` requests with lognormal prompt and output lengths (long-tailed), capped at ``max_model_len``."""
    p_med, p_sigma, o_med, o_sigma, rate = TRACES[name]
    arrival = np.floor(np.cumsum(rng.exponential(1 / rate, n))).astype(np.int64)
    prompt = np.clip(np.rint(rng.lognormal(np.log(p_med), p_sigma, n)), 1, max_model_len - 1).astype(np.int64)
    output = np.clip(np.rint(rng.lognormal(np.log(o_med), o_sigma, n)), 1, max_model_len - prompt).astype(np.int64)
    return Trace(name, arrival, prompt, output)


class FirstFit:
    """A 1-D space of ``size`` slots: regions placed at the lowest hole that holds them."""

    def __init__(self, size):
        self.size = size
        self.starts = []  # sorted
        self.length = {}  # start -> region size

    def alloc(self, n):
        end = 0
        for i, s in enumerate(self.starts):
            if s - end >= n:
                break
            end = s + self.length[s]
        else:
            i = len(self.starts)
            if self.size - end < n:
                return None
        self.starts.insert(i, end)
        self.length[end] = n
        return end

    def free(self, start):
        del self.starts[bisect.bisect_left(self.starts, start)]
        del self.length[start]


class Contiguous:
    """Each request reserves ``reserve[r]`` contiguous slots for its whole life."""

    def __init__(self, name, budget, reserve):
        self.name, self.budget, self.reserve = name, budget, reserve
        self.space = FirstFit(budget)
        self.start = {}
        self.held = 0

    def need(self, r, length):
        return int(self.reserve[r])

    def free_slots(self):
        return self.budget - self.held

    def admit(self, r, length):
        start = self.space.alloc(int(self.reserve[r]))
        if start is None:
            return False
        self.start[r] = start
        self.held += int(self.reserve[r])
        return True

    def step(self, running):
        """One token for every running request: it always fits in its region."""
        return running, running[:0]

    def release(self, finished):
        for r in finished:
            self.space.free(self.start.pop(int(r)))
        self.held -= int(self.reserve[finished].sum())

    def tail_waste(self, running, length):
        return self.reserve[running] - length[running]

    def close(self):
        pass


class Paged:
    """A real PagedKVCache holding exactly ``budget // block_size`` blocks."""

    def __init__(self, budget, block_size, max_model_len, n_requests):
        self.name, self.budget, self.bs = f"paged-{block_size}", budget, block_size
        self.cache = PagedKVCache(1, 1, 64, block_size, "float16", max_tokens=budget,
                                  max_seqs=budget // block_size, max_seq_len=max_model_len,
                                  chunk_bytes=CHUNK_BYTES, backend="host")
        self.alloc, self.tables = self.cache.allocator, self.cache.tables
        if self.alloc.max_blocks * block_size != budget:
            raise ValueError(f"budget {budget} is not a whole number of {CHUNK_BYTES}-byte chunks of blocks")
        self.seq = np.full(n_requests, -1, np.int64)  # request -> sequence handle

    @property
    def held(self):
        return self.alloc.num_held * self.bs

    def need(self, r, length):
        return ceil_div(int(length[r]) + 1, self.bs) * self.bs  # its tokens and the next one

    def free_slots(self):
        return (self.alloc.max_blocks - self.alloc.num_held) * self.bs

    def admit(self, r, length):
        if self.need(r, length) > self.free_slots():
            return False
        self.seq[r] = self.cache.add_sequence()
        self.cache.append([self.seq[r]], [int(length[r])])
        return True

    def step(self, running):
        """Append one token to every sequence, preempting the latest admitted until the blocks suffice."""
        lens = self.tables.lens
        starts_block = (lens[self.seq[running]] % self.bs) == 0
        need, keep = int(starts_block.sum()), running.size
        free = self.alloc.max_blocks - self.alloc.num_held
        while need > free:
            keep -= 1
            s = self.seq[running[keep]]
            free += ceil_div(int(lens[s]), self.bs)
            need -= int(starts_block[keep])
            self.cache.free([s])
        self.cache.append(None, 1)
        return running[:keep], running[keep:]

    def release(self, finished):
        if finished.size:
            self.cache.free(self.seq[finished])

    def tail_waste(self, running, length):
        """Empty slots per running sequence, from the block table; checks lengths and that no block leaks."""
        rows = self.seq[running]
        lens = self.tables.lens[rows]
        if not np.array_equal(lens, length[running]):
            raise AssertionError("the cache's lengths differ from the simulation's")
        blocks = (self.tables.table[rows] >= 0).sum(axis=1)
        if int(blocks.sum()) != self.alloc.num_held:
            raise AssertionError(f"{self.alloc.num_held} blocks held but {int(blocks.sum())} in the tables")
        return blocks * self.bs - lens

    def close(self):
        self.cache.close()


def simulate(policy, trace):
    """Replay ``trace`` against ``policy``; returns the row of figures (see the module docstring)."""
    n = trace.prompt.size
    length = trace.prompt.copy()  # tokens in the cache now, or to prefill on (re)admission
    left = trace.output.copy()    # tokens still to generate
    queue, running = deque(), np.empty(0, np.int64)
    frag_delayed = np.zeros(n, bool)
    # summed over the steps in which a request waited: slots holding tokens, empty slots of
    # reservations (from the tables), slots held, free and external (free while the head would fit)
    sums = dict.fromkeys(("used", "internal", "held", "free", "external"), 0)
    batch_sum = waiting_steps = max_batch = preemptions = done = arrived = 0
    waste_sum = waste_count = waste_max = 0
    t = 0
    while done < n:
        if not queue and not running.size:
            t = max(t, int(trace.arrival[arrived]))
        while arrived < n and trace.arrival[arrived] <= t:
            queue.append(arrived)
            arrived += 1
        running, preempted = policy.step(running)
        for r in preempted[::-1]:
            queue.appendleft(int(r))
        preemptions += preempted.size
        length[running] += 1
        left[running] -= 1
        finished = running[left[running] == 0]
        policy.release(finished)
        running = running[left[running] > 0]
        done += finished.size
        admitted = []
        while queue and policy.admit(queue[0], length):
            admitted.append(queue.popleft())
        running = np.concatenate([running, np.array(admitted, np.int64)])

        waste = policy.tail_waste(running, length)
        if waste.size:
            waste_sum, waste_count = waste_sum + int(waste.sum()), waste_count + waste.size
            waste_max = max(waste_max, int(waste.max()))
        max_batch = max(max_batch, running.size)
        if queue:
            free, head = policy.free_slots(), queue[0]
            external = free if free >= policy.need(head, length) else 0
            frag_delayed[head] |= external > 0
            for key, value in (("used", int(length[running].sum())), ("internal", int(waste.sum())),
                               ("held", policy.held), ("free", free), ("external", external)):
                sums[key] += value
            batch_sum += running.size
            waiting_steps += 1

        t += 1
    policy.close()
    budget = waiting_steps * policy.budget
    return {
        "policy": policy.name, "steps": t, "waiting_steps": waiting_steps, "budget": policy.budget,
        "sums": sums, "util": sums["used"] / sums["held"] if sums["held"] else float("nan"),
        "used": sums["used"] / budget, "internal": sums["internal"] / budget,
        "external": sums["external"] / budget, "idle": (sums["free"] - sums["external"]) / budget,
        "mean_batch": batch_sum / waiting_steps if waiting_steps else float("nan"), "max_batch": max_batch,
        "frag_delayed": int(frag_delayed.sum()), "preemptions": preemptions,
        "mean_tail": waste_sum / waste_count, "max_tail": waste_max,
    }


def run_trace(trace, budget, max_model_len):
    """The rows of every policy for one trace."""
    pow2 = 1 << np.ceil(np.log2(trace.final)).astype(np.int64)
    policies = [
        Contiguous("contig-max", budget, np.full(trace.final.size, max_model_len)),
        Contiguous("contig-pow2", budget, np.minimum(pow2, max_model_len)),
        Contiguous("contig-exact", budget, trace.final),
    ]
    rows = [simulate(p, trace) for p in policies]
    for bs in BLOCK_SIZES:
        rows.append(simulate(Paged(budget, bs, max_model_len, trace.final.size), trace))
    return rows


def describe(trace, max_model_len):
    p_med, p_sigma, o_med, o_sigma, rate = TRACES[trace.name]
    lines = [f"trace {trace.name}: {trace.prompt.size} requests, Poisson arrivals {rate:g}/step; "
             f"prompt lognormal(median {p_med}, sigma {p_sigma}), output lognormal(median {o_med}, "
             f"sigma {o_sigma}), final length capped at max_model_len {max_model_len}"]
    for label, x in (("prompt", trace.prompt), ("output", trace.output), ("final", trace.final)):
        lines.append(f"  {label:>6}: mean {x.mean():7.1f}  p50 {np.median(x):6.0f}  "
                     f"p99 {np.percentile(x, 99):6.0f}  max {x.max():5d}")
    return "\n".join(lines)


def format_rows(rows):
    head = (f"{'policy':<12} | {'used/held':>9} | {'used':>6} {'intern':>6} {'extern':>6} {'idle':>6} | "
            f"{'batch':>6} {'max':>5} | {'frag-delayed':>12} {'preempted':>9} | {'steps':>6} | "
            f"{'empty slots/seq':>15}")
    out = [head, "-" * len(head)]
    for r in rows:
        out.append(f"{r['policy']:<12} | {r['util']:>9.1%} | {r['used']:>6.1%} {r['internal']:>6.1%} "
                   f"{r['external']:>6.1%} {r['idle']:>6.1%} | {r['mean_batch']:>6.1f} {r['max_batch']:>5} | "
                   f"{r['frag_delayed']:>12} {r['preemptions']:>9} | {r['steps']:>6} | "
                   f"{r['mean_tail']:>7.1f} {r['max_tail']:>7}")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="a small budget and trace (the tests' size)")
    ap.add_argument("--plot", help="also draw the used share against block size here (a PNG; matplotlib)")
    args = ap.parse_args(argv)
    size = TINY if args.tiny else FULL
    rng = np.random.default_rng(args.seed)
    print(f"KV budget {size['budget']} token slots, seed {args.seed}; means over the steps in which a request waited.")
    print(LEGEND)
    results = {}
    for name in TRACES:
        trace = make_trace(name, size["requests"][name], size["max_model_len"], rng)
        rows = run_trace(trace, size["budget"], size["max_model_len"])
        print()
        print(describe(trace, size["max_model_len"]))
        print(format_rows(rows))
        results[name] = {"trace": trace, "rows": rows}
    if args.plot:
        from pagedrt.bench.plots import draw_fragmentation
        draw_fragmentation({name: r["rows"] for name, r in results.items()}, args.plot)
    return results


if __name__ == "__main__":
    main()
