"""The prefix cache on a seeded trace: hit rate, blocks saved, evictions, and the host cost of lookups.

    python3 -m pagedrt.bench.prefix [--backend auto|cuda|host] [--steps 400] [--seed 0] [--capacity 24576]

The trace: a few system prompts (500-2000 tokens) shared by every conversation;
conversations of one to four turns, each turn's prompt re-sending the whole
history (system prompt, earlier questions and replies) and a new question; a new
conversation arrives on about one step in three and a conversation's next turn a
few steps after its reply ends. Each step admits what fits (the scheduler keeps
blocks back for running replies), prefills the admitted prompts (``add_sequence``
with the prompt, then the uncached rest appended with its token ids), decodes one
token for every running sequence (with its id) and frees the finished ones. The
pool (``--capacity`` tokens) is small enough that finished conversations' blocks
are evicted. Only the bookkeeping runs: no K/V is written.

It prints the hit rate (prompt tokens found cached / prompt tokens), the blocks
saved (cached blocks shared instead of computed), evictions, and host
microseconds per step: the lookups (``add_sequence`` with a prompt; steps with at
least one), the prefill appends with ids, and the decode append with ids.
"""

import time

import numpy as np

from .. import PagedKVCache
from . import harness

BLOCK, VOCAB = 16, 32000
COLUMNS = (
    harness.Column("what", "", width=34, left=True),
    harness.Column("value", "value", "{}", 12),
)


class Conversation:
    def __init__(self, rng, system):
        self.rng, self.history, self.turns = rng, system, int(rng.integers(1, 5))

    def next_prompt(self):
        question = self.rng.integers(0, VOCAB, int(self.rng.integers(20, 200)))
        self.history = np.concatenate([self.history, question])
        self.turns -= 1
        return self.history, int(self.rng.integers(20, 150))


def percentiles(times):
    us = np.array(times) * 1e6
    return (float(np.median(us)), float(np.percentile(us, 99))) if us.size else (0.0, 0.0)


def run(steps, seed, capacity, backend="host", max_running=32):
    """The trace's figures as a dict."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, VOCAB, int(n)) for n in rng.integers(500, 2001, 4)]
    waiting, later, running = [], [], {}  # (conversation, prompt, reply); (step, conversation); seq -> state
    lookup_t, prefill_t, decode_t = [], [], []
    prompt_tokens = held_peak = unshared_peak = 0
    with PagedKVCache(2, 2, 64, BLOCK, "float16", max_tokens=capacity, max_seqs=max_running,
                      max_seq_len=16384, backend=backend) as cache:
        for step in range(steps):
            if rng.random() < 0.35:
                conv = Conversation(rng, systems[int(rng.integers(len(systems)))])
                waiting.append((conv, *conv.next_prompt()))
            for item in [x for x in later if x[0] <= step]:
                later.remove(item)
                waiting.append((item[1], *item[1].next_prompt()))
            reserve = sum(-(-(s["left"] + 1) // BLOCK) for s in running.values())
            t_lookup = t_prefill = 0.0
            while waiting and len(running) < max_running:
                conv, prompt, reply = waiting[0]
                need = -(-(prompt.size + reply) // BLOCK)
                if cache.num_available_blocks - reserve < need:
                    break
                waiting.pop(0)
                t = time.perf_counter()
                seq = cache.add_sequence(prompt)
                t_lookup += time.perf_counter() - t
                cached = cache.length(seq)
                t = time.perf_counter()
                cache.append(seq, prompt.size - cached, token_ids=prompt[cached:])
                t_prefill += time.perf_counter() - t
                prompt_tokens += prompt.size
                reserve += need
                running[seq] = {"conv": conv, "left": reply}
            if t_lookup:
                lookup_t.append(t_lookup)
                prefill_t.append(t_prefill)
            if running:
                seqs = sorted(running)
                ids = rng.integers(0, VOCAB, len(seqs))
                t = time.perf_counter()
                cache.append(seqs, 1, token_ids=ids)
                decode_t.append(time.perf_counter() - t)
                done = []
                for seq, token in zip(seqs, ids):
                    state = running[seq]
                    state["conv"].history = np.append(state["conv"].history, token)
                    state["left"] -= 1
                    if state["left"] == 0:
                        done.append(seq)
                stats = cache.stats()
                held_peak = max(held_peak, stats["held_blocks"])
                unshared_peak = max(unshared_peak, sum(-(-cache.length(s) // BLOCK) for s in seqs))
                if done:
                    cache.free(done)
                    for seq in done:
                        conv = running.pop(seq)["conv"]
                        if conv.turns:
                            later.append((step + int(rng.integers(1, 20)), conv))
        ps = cache.prefix_stats()
        backend = cache.pool.backend
        max_blocks = cache.allocator.max_blocks
    (lk_med, lk_p99), (pf_med, pf_p99), (dc_med, dc_p99) = (percentiles(t) for t in (lookup_t, prefill_t,
                                                                                    decode_t))
    return {"backend": backend, "steps": steps, "pool_blocks": max_blocks, "requests": ps["lookups"],
            "prompt_tokens": prompt_tokens, "hit_tokens": ps["hit_tokens"],
            "hit_rate": ps["hit_tokens"] / max(prompt_tokens, 1), "blocks_saved": ps["hit_blocks"],
            "evictions": ps["evictions"], "cached_blocks_at_end": ps["cached_blocks"],
            "peak_held_blocks": held_peak, "peak_unshared_blocks": unshared_peak,
            "lookup_steps": len(lookup_t), "lookup_median_us": lk_med, "lookup_p99_us": lk_p99,
            "prefill_median_us": pf_med, "prefill_p99_us": pf_p99,
            "decode_median_us": dc_med, "decode_p99_us": dc_p99}


def parser():
    ap = harness.parser("pagedrt.bench.prefix", __doc__, backend=True)
    ap.add_argument("--steps", type=int, default=400, help="steps of the trace")
    ap.add_argument("--seed", type=int, default=0, help="the trace's seed")
    ap.add_argument("--capacity", type=int, default=24576, help="the pool's capacity in tokens")
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    result = run(args.steps, args.seed, args.capacity, args.backend)
    formats = {"hit_rate": "{:.3f}"}
    rows = [{"what": key, "value": formats.get(key, "{:.1f}" if isinstance(v, float) else "{}").format(v)}
            for key, v in result.items() if key != "backend"]
    harness.publish("prefix", args.out, {"backend": result["backend"]}, [result],
                    harness.format_table(COLUMNS, rows) + f"\nus: host time per step; backend: {result['backend']}",
                    steps=args.steps, seed=args.seed, capacity=args.capacity)


if __name__ == "__main__":
    main()
