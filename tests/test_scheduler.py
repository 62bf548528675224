"""The scheduling policy (pagedrt/scheduler.py) driving a real host cache without a model: random requests with
parallel samples, chunked prompts and shared first blocks run to the end; no step runs out of blocks or rows or
past its prompt budget, prompts advance in arrival order, and every request ends with its ``n`` samples."""

import numpy as np
from hypothesis import given, settings, strategies as st

from pagedrt.cache import PagedKVCache
from pagedrt.scheduler import Request, Scheduler, SchedulerConfig, Status

BS = 8
SYSTEM = np.arange(1, 2 * BS + 1)  # a first block several prompts share

requests_st = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(1, 3), st.booleans()),
                       min_size=1, max_size=12)


def make_cache(max_seqs, blocks, step_tokens):
    return PagedKVCache(1, 1, 64, BS, "float32", max_tokens=blocks * BS, max_seqs=max_seqs, max_seq_len=96,
                        max_step_tokens=step_tokens + max_seqs, backend="host")


def run(scheduler, cache, requests, step_tokens):
    """Every request to its end: a decoding sequence appends a token a step and finishes at its target.
    Returns the samples finished per request and the steps run."""
    done = {id(r): 0 for r in requests}
    for r in requests:
        scheduler.add(r)
    steps = 0
    while not scheduler.idle:
        plan = scheduler.schedule()
        prefilling = [s for s in plan.staying if s.status is Status.PREFILL]
        chunked = {id(s): int(c) for s, c, d in zip(plan.seqs, plan.counts, plan.decoding) if not d}
        fed = [chunked.get(id(s), 0) == s.request.prompt.size - s.prefilled for s in prefilling]
        assert all(all(fed[:i]) for i, s in enumerate(prefilling) if id(s) in chunked)  # in arrival order
        step = cache.step(**plan.cache_args(np.zeros(int(plan.decoding.sum()), np.int64)))
        decode = int(plan.decoding.sum())
        assert step.num_tokens - decode <= max(0, step_tokens - decode)  # decode tokens first, prompts in the rest
        scheduler.update(plan, step)
        for seq in scheduler.running.values():
            length = int(cache.lengths([seq.handle])[0])
            assert seq.status is not Status.PREFILL or length == seq.prefilled
            if seq.status is Status.DECODE and length >= seq.target:
                scheduler.finish(seq)
                done[id(seq.request)] += 1
        steps += 1
        assert steps < 10_000
    return done, steps


@settings(max_examples=40, deadline=None)
@given(requests_st, st.integers(0, 4), st.integers(0, 24), st.integers(1, 48))
def test_every_request_runs_to_its_end_within_the_cache(spec, more_rows, more_blocks, step_tokens):
    requests = [Request(np.concatenate([SYSTEM, np.full(size, i + 100)]) if shared else np.full(size, i + 100),
                        max_tokens, n) for i, (size, max_tokens, n, shared) in enumerate(spec)]
    max_seqs = max(r.n for r in requests) + more_rows
    blocks = max(r.n * -(-r.target // BS) for r in requests) + more_blocks
    with make_cache(max_seqs, blocks, step_tokens) as cache:
        scheduler = Scheduler(SchedulerConfig(max_seqs, BS, step_tokens), cache)
        done, _ = run(scheduler, cache, requests, step_tokens)
        assert [done[id(r)] for r in requests] == [r.n for r in requests]
        assert cache.stats()["sequences"] == 0


def test_a_fork_the_cache_has_no_room_for_is_not_made():
    with make_cache(2, 64, 8) as cache:
        scheduler = Scheduler(SchedulerConfig(2, BS, 8), cache)
        scheduler.add(Request(np.arange(6), 8))
        plan = scheduler.schedule()
        scheduler.update(plan, cache.step(**plan.cache_args([])))
        (parent,) = scheduler.running.values()
        plan = scheduler.begin()
        assert not scheduler.fork(plan, parent, 10**4)  # more blocks than the cache has
        assert scheduler.fork(plan, parent, 14) and plan.rows == 2
        assert not scheduler.fork(plan, parent, 14)  # no row left
        assert [p for p, _, _ in plan.forks] == [parent]


def test_prompts_sharing_a_first_block_wait_a_step_to_find_it_cached():
    with make_cache(4, 64, 64) as cache:
        scheduler = Scheduler(SchedulerConfig(4, BS, 64), cache)
        for tail in (10, 11, 12):
            scheduler.add(Request(np.concatenate([SYSTEM, [tail]]), 2))
        plan = scheduler.schedule()
        assert len(plan.arrivals) == 1
        scheduler.update(plan, cache.step(**plan.cache_args([])))
        plan = scheduler.schedule()
        assert len(plan.arrivals) == 2
        scheduler.update(plan, cache.step(**plan.cache_args(np.zeros(1, np.int64))))
        assert [r.cached_tokens for r in plan.arrivals] == [SYSTEM.size] * 2


def test_blocks_are_kept_for_the_samples_of_a_prompt_still_prefilling():
    """Two samples of a prompt prefilled over three steps will need 8 of the 10 blocks; a request that needs 5
    may not arrive beside the prompt's last chunk, but only once the samples have ended."""
    many, one = Request(np.arange(20), 20, n=2), Request(np.arange(100, 101), 39)
    with make_cache(4, 10, 8) as cache:
        assert cache.layout.max_blocks == 10
        scheduler = Scheduler(SchedulerConfig(4, BS, 8), cache)
        done, steps = run(scheduler, cache, [many, one], 8)  # running out of blocks would raise
        assert done == {id(many): 2, id(one): 1} and steps > 20 + 39


def test_the_first_blocks_remembered_stay_bounded_while_the_scheduler_is_never_idle():
    """A server that is never idle (a long request runs throughout) admits many distinct prompts: the first blocks
    it remembers from earlier steps stay at most max_seqs, and every request still ends."""
    with make_cache(2, 64, 16) as cache:
        scheduler = Scheduler(SchedulerConfig(2, BS, 16), cache)
        requests = [Request(np.arange(1, BS + 2), 80)]
        requests += [Request(np.arange(BS + 1) + 100 * (i + 1), 1) for i in range(30)]
        for r in requests:
            scheduler.add(r)
        remembered = 0
        while not scheduler.idle:
            plan = scheduler.schedule()
            scheduler.update(plan, cache.step(**plan.cache_args(np.zeros(int(plan.decoding.sum()), np.int64))))
            for seq in list(scheduler.running.values()):
                if seq.status is Status.DECODE and int(cache.lengths([seq.handle])[0]) >= seq.target:
                    scheduler.finish(seq)
            remembered = max(remembered, len(scheduler._firsts))
            assert len(scheduler._firsts) <= 2
        assert remembered == 2 and not scheduler.waiting
