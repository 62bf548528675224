"""A step is all or nothing against any exception raised inside it, an interrupt (Ctrl-C) included.

The sweep runs one mixed step once, recording every line pagedrt executes, then for each such point rebuilds
the same cache, raises KeyboardInterrupt there (``sys.settrace``, at a bytecode boundary as a signal handler
would) and asserts that the interrupt came out, that the step either completed or left the snapshot as it was,
that no block is held twice, and that the cache goes on working (a next step, K/V read back) and closes. Public
API only, against the independent model of ``tools/soak.py``. Every file of ``pagedrt/`` is swept, the backends'
included (``memory/host.py``: an interrupt there must be undone by the pool like any other failure). Also: random SIGALRM interrupts, the reproducers
of ``shared/repro/`` (beside the checkout) (issue 35), and caches dropped without ``close()``.
"""

import importlib.util
import os
import signal
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from pagedrt import PagedKVCache, kernels
from pagedrt.errors import ConcurrentUseError, PagedRTError
from pagedrt.memory import find_pool

ROOT = Path(__file__).resolve().parent.parent
PAGEDRT = str(ROOT / "pagedrt") + os.sep
_spec = importlib.util.spec_from_file_location("tools_soak", ROOT / "tools" / "soak.py")
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)
BS = soak.BS


def normal(snap):
    """A snapshot without what differs between two caches in the same state: time, addresses, memfd inodes."""
    pool = dict(snap["pool"], base=None, chunks=[{k: v for k, v in r.items() if k not in ("va_start", "va_end",
                                                                                          "handle")}
                                                 for r in snap["pool"]["chunks"]])
    return {**soak.without_time(snap), "pool": pool}


def run_step(cache, model, p):
    """``cache.step(**p)``, its copies and writes made from the model; the model after it."""
    st = cache.step(**p)
    model, rows = soak.apply(model, p, st)
    soak.write(cache, model, st, rows)
    return model, st, rows


def plan(seqs=(), counts=1, arrivals=(), arrival_tokens=None, forks=(), frees=(), swap_out=(), swap_in=(),
         with_ids=True):
    """The keywords of ``cache.step()``; the new tokens' ids 0, 1, 2, ... (``with_ids``) or none given."""
    seqs = list(seqs)
    counts = [counts] * len(seqs) if isinstance(counts, int) else list(counts)
    ids = np.arange(sum(counts), dtype=np.int64) % 50 if with_ids else None
    return dict(seqs=seqs, counts=counts, token_ids=ids, arrivals=[list(a) for a in arrivals],
                arrival_tokens=arrival_tokens, forks=list(forks), frees=list(frees), swap_out=list(swap_out),
                swap_in=list(swap_in))


def scenario_repro():
    """repro_ctrl_c_mid_step_corrupts_allocator.py's cache and step: frees, forks, arrivals, appends."""
    c = PagedKVCache(1, 1, 64, BS, "float32", max_tokens=32 * BS, max_seqs=16, max_seq_len=16 * BS,
                     chunk_bytes=4 * BS * 64 * 4, backend="host", host_tokens=16 * BS)
    m = soak.Model()
    m, st, _ = run_step(c, m, plan(arrivals=[range(20), range(100, 116)]))
    a, b = st.arrived.tolist()
    m, st, _ = run_step(c, m, plan(forks=[a]))
    cc = int(st.forked[0])
    return c, m, plan([a, b], [3, 9], arrivals=[range(20), range(3000, 3040)], frees=[cc], forks=[b])


def scenario_swaps(growth):
    """A step with every kind of change: a free, a fork, a prefix hit, a chunked arrival, a swap-out of a
    sequence sharing blocks, a swap-in, appends, and a chunk mapped (by the step, or ahead by growth)."""
    c = PagedKVCache(1, 1, 64, BS, "float32", max_tokens=32 * BS, max_seqs=16, max_seq_len=16 * BS,
                     chunk_bytes=2 * BS * 64 * 4, backend="host", host_tokens=16 * BS, growth=growth)
    m = soak.Model()
    m, st, _ = run_step(c, m, plan(arrivals=[range(20), range(100, 124), range(200, 210)]))
    a, b, d = st.arrived.tolist()
    m, st, _ = run_step(c, m, plan([a], forks=[b]))
    e = int(st.forked[0])
    m, _, _ = run_step(c, m, plan([e], 5, swap_out=[d]))
    return c, m, plan([a, e], [2, 9], arrivals=[range(20), range(300, 340)], arrival_tokens=12, forks=[a],
                      frees=[b], swap_out=[e], swap_in=[d])


SCENARIOS = {"repro": scenario_repro, "swaps": lambda: scenario_swaps(None),
             "growth": lambda: scenario_swaps(dict(background=False, low_blocks=4, high_blocks=8))}


class Interrupt:
    """A tracer for pagedrt's lines: records each (file, line) in order of first occurrence, or raises
    KeyboardInterrupt at the first occurrence of ``at``."""

    def __init__(self, at=None):
        self.at, self.points, self.fired = at, {}, False

    def __call__(self, frame, event, arg):
        if not frame.f_code.co_filename.startswith(PAGEDRT):
            return None
        if event == "line":
            point = (frame.f_code.co_filename, frame.f_lineno)
            self.points.setdefault(point, None)
            if point == self.at:
                sys.settrace(None)
                self.fired = True
                raise KeyboardInterrupt
        return self

    def run(self, call):
        sys.settrace(self)
        try:
            return call()
        finally:
            sys.settrace(None)


def closes(cache):
    """Whether ``cache.close()`` returns, on this thread (the one that was interrupted: the cache's lock is
    reentrant, so a hold left by an interrupt at its release cannot lock out the thread that used the cache); a
    hang fails the test after 60 s (SIGALRM) rather than the run."""

    def hung(signum, frame):
        raise TimeoutError("cache.close() did not return in 60 s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        cache.close()
    except Exception as exc:
        print("close() raised", repr(exc))
        return False
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return True


def still_usable(cache, model):
    """The cache's invariants hold and it goes on: a step for every resident sequence and a new prompt."""
    soak.check_state(cache.snapshot(), model)
    soak.check_kv(cache, model)
    resident = [s for s in sorted(model.tokens) if s not in model.swapped]
    before = normal(cache.snapshot())
    try:
        model, _, _ = run_step(cache, model, plan(resident, 1, arrivals=[range(7000, 7011)]))
    except soak.FULL:  # a full cache refuses it, changing nothing; with the longest sequence freed it fits
        assert normal(cache.snapshot()) == before
        longest = max(resident, key=lambda s: len(model.tokens[s]))
        resident.remove(longest)
        model, _, _ = run_step(cache, model, plan(resident, 1, arrivals=[range(7000, 7011)], frees=[longest]))
    soak.check_state(cache.snapshot(), model)
    soak.check_kv(cache, model)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_an_interrupt_at_any_line_of_a_step_leaves_it_done_or_undone(name):
    cache, model, p = SCENARIOS[name]()
    before = normal(cache.snapshot())
    tracer = Interrupt()
    st = tracer.run(lambda: cache.step(**p))
    done_model, rows = soak.apply(model, p, st)
    soak.write(cache, done_model, st, rows)
    done = normal(cache.snapshot())
    still_usable(cache, done_model)
    assert closes(cache)
    assert done != before
    failures = []
    for at in tracer.points:
        cache, model, p = SCENARIOS[name]()
        hit = Interrupt(at)
        where = f"{os.path.relpath(at[0], ROOT)}:{at[1]}"
        try:
            hit.run(lambda: cache.step(**p))
            failures.append(f"{where}: the step returned (interrupt fired: {hit.fired})")
            continue
        except KeyboardInterrupt:
            assert hit.fired
        except BaseException as exc:  # the interrupt must come out as itself
            failures.append(f"{where}: {type(exc).__name__} came out instead of KeyboardInterrupt: {exc}"[:300])
            closes(cache)
            continue
        try:
            after = normal(cache.snapshot())
            if after == done:  # completed, but the caller never got the Step: make the clean run's copies
                soak.write(cache, done_model, st, rows)
                model = done_model
            elif after != before:
                raise soak.Broken("a partial step: the snapshot is neither the one before nor the step's")
            still_usable(cache, model)
        except (soak.Broken, PagedRTError) as exc:
            failures.append(f"{where}: {type(exc).__name__}: {exc}"[:300])
        if not closes(cache):
            failures.append(f"{where}: close() raises or hangs")
    assert not failures, f"{len(failures)} of {len(tracer.points)} points:\n" + "\n".join(failures)


def test_random_sigalrm_interrupts_never_leave_the_lock_taken_or_a_partial_step():
    rng = np.random.default_rng(7)
    cache, model, _ = scenario_swaps(None)
    seq = min(s for s in model.tokens if s not in model.swapped)
    interrupted = 0

    def alarm(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, alarm)
    try:
        for _ in range(300):
            if len(model.tokens[seq]) >= 15 * BS:
                model, _, _ = run_step(cache, model, plan(frees=[seq], arrivals=[range(9000, 9004)]))
                seq = max(model.tokens)
            before, p = normal(cache.snapshot()), plan([seq], 1)
            try:
                signal.setitimer(signal.ITIMER_REAL, float(rng.uniform(0, 4e-4)))
                st = cache.step(**p)
                signal.setitimer(signal.ITIMER_REAL, 0)
            except KeyboardInterrupt:
                signal.setitimer(signal.ITIMER_REAL, 0)
                interrupted += 1
                assert normal(cache.snapshot()) == before or cache.length(seq) == len(model.tokens[seq]) + 1
                if cache.length(seq) == len(model.tokens[seq]):
                    continue
                st = None
            model, rows = soak.apply(model, p, st) if st is not None else (model, None)
            if st is None:  # done without its Step: write the new token where its table says
                model.tokens[seq].append(0)
                row = cache.block_tables([seq])[0]
                pos = len(model.tokens[seq]) - 1
                slot = np.array([int(row[pos // BS]) * BS + pos % BS], np.int64)
                k, v = soak.expected_kv(model.tokens[seq], pos, pos + 1)
                kernels.write_kv(k, v, cache.k(0), cache.v(0), slot)
            else:
                soak.write(cache, model, st, rows)
            soak.check_state(cache.snapshot(), model)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert interrupted > 0
    soak.check_kv(cache, model)
    assert closes(cache)


def test_an_interrupt_at_each_of_a_steps_first_lines_leaves_the_cache_unlocked():
    """repro_ctrl_c_leaves_lock_taken.py: Ctrl-C between the lock's acquire and its try."""
    for at in range(1, 8):
        cache = PagedKVCache(1, 1, 64, 8, "float32", max_tokens=512, backend="host")
        cache.step(arrivals=[np.arange(10)])
        counter = Interrupt()
        counter.run(lambda: cache.step())
        cache.close()
        cache = PagedKVCache(1, 1, 64, 8, "float32", max_tokens=512, backend="host")
        cache.step(arrivals=[np.arange(10)])
        with pytest.raises(KeyboardInterrupt):
            Interrupt(list(counter.points)[at - 1]).run(lambda: cache.step())
        try:
            cache.step()
            assert len(cache.sequences) == 1
        except ConcurrentUseError as exc:
            pytest.fail(f"interrupt at line {at} of the step left the lock taken: {exc}")
        assert closes(cache)


def test_an_interrupt_while_a_chunk_is_mapped_gives_its_places_back_and_close_returns():
    """repro_ctrl_c_during_grow_hangs_close.py, at every line of the pool a step runs to map a chunk."""
    pool_file = str(ROOT / "pagedrt" / "memory" / "pool.py")

    def make():
        c = PagedKVCache(1, 1, 64, 8, "float32", max_tokens=8 * 64, chunk_bytes=4096, backend="host")
        c.step(arrivals=[np.arange(8)])
        return c

    cache = make()
    tracer = Interrupt()
    tracer.run(lambda: cache.step(arrivals=[np.arange(40) + 100]))
    cache.close()
    points = [p for p in tracer.points if p[0] == pool_file]
    assert points
    for at in points:
        cache = make()
        before = cache.pool.mappings()
        with pytest.raises(KeyboardInterrupt):
            Interrupt(at).run(lambda: cache.step(arrivals=[np.arange(40) + 100]))
        assert cache.pool.mappings() == before, f"pool.py:{at[1]}"
        cache.step(arrivals=[np.arange(40) + 100])  # the places are free to map again
        assert closes(cache), f"pool.py:{at[1]}: close() hangs"


def swap_scene():
    """repro_step_swap_out_in_partial.py's cache: A swapped out, B (its fork, with a private third block) and F
    (five blocks) resident; one device block left."""
    c = PagedKVCache(1, 1, 64, BS, "float32", max_tokens=8 * BS, max_seqs=8, max_seq_len=8 * BS,
                     chunk_bytes=8 * BS * 64 * 4, backend="host", host_tokens=8 * BS)
    m = soak.Model()
    m, st, _ = run_step(c, m, plan(arrivals=[range(16)]))
    a = int(st.arrived[0])
    m, st, _ = run_step(c, m, plan(forks=[a]))
    b = int(st.forked[0])
    m, _, _ = run_step(c, m, plan([b], 8))
    m, _, _ = run_step(c, m, plan(swap_out=[a]))
    m, _, _ = run_step(c, m, plan(arrivals=[range(1000, 1040)]))
    return c, m, a, b


def test_swap_out_and_in_of_sequences_sharing_blocks_is_all_or_nothing():
    """repro_step_swap_out_in_partial.py: swap_out=[B], swap_in=[A] sharing blocks, with an arrival that does
    not fit."""
    cache, model, a, b = swap_scene()
    before = normal(cache.snapshot())
    p = plan(swap_out=[b], swap_in=[a], arrivals=[range(5000, 5024)])
    try:
        model, _, _ = run_step(cache, model, p)
    except PagedRTError:
        assert normal(cache.snapshot()) == before
    soak.check_state(cache.snapshot(), model)
    soak.check_kv(cache, model)
    still_usable(cache, model)


def append(cache, model, seq, n):
    """``cache.append(seq, n)`` (the building block, which does not tick growth), its K/V written."""
    slots, copies = cache.append(seq, n, token_ids=np.arange(n) % 50)
    kernels.copy_blocks(cache.planes, copies)
    start = len(model.tokens[seq])
    model.tokens[seq] += (np.arange(n) % 50).tolist()
    k, v = soak.expected_kv(model.tokens[seq], start, start + n)
    kernels.write_kv(k, v, cache.k(0), cache.v(0), np.ascontiguousarray(slots, np.int64))


@pytest.mark.parametrize("case", ["release_after_1", "append_after_70_idle_ticks"])
def test_growth_never_releases_the_chunk_a_steps_own_swap_out_reads(case):
    """repro_growth_releases_swap_source.py: growth's tick at the end of the step released the swap's source."""
    growth = dict(release_after=1 if case == "release_after_1" else 64, low_blocks=0, high_blocks=1,
                  background=False)
    cache = PagedKVCache(1, 1, 64, BS, "float32", max_tokens=16 * BS, chunk_bytes=2 * BS * 64 * 4, backend="host",
                         host_tokens=8 * BS, growth=growth)
    model = soak.Model()
    if case == "release_after_1":
        a, f = cache.add_sequence(), cache.add_sequence()
        model.tokens.update({a: [], f: []})
        model, _, _ = run_step(cache, model, plan([a], 2 * BS, with_ids=False))  # a: blocks 0-1 (chunk 0)
        model, _, _ = run_step(cache, model, plan([f], BS, with_ids=False))      # f: block 2 (chunk 1)
    else:
        f, g = cache.add_sequence(), cache.add_sequence()
        model.tokens.update({f: [], g: []})
        model, _, _ = run_step(cache, model, plan([f], 2 * BS))
        model, _, _ = run_step(cache, model, plan([g], 2 * BS))
        model, _, _ = run_step(cache, model, plan(frees=[g]))  # chunk 1 empty...
        for _ in range(70):
            model, _, _ = run_step(cache, model, plan())  # ...for 70 ticks, kept mapped (spare blocks are low)
        a = cache.add_sequence()
        model.tokens[a] = []
        append(cache, model, a, 2 * BS)  # a takes chunk 1's blocks; no tick
        h = cache.add_sequence()
        model.tokens[h] = []
        append(cache, model, h, BS)  # another chunk mapped, one spare block
    model, _, _ = run_step(cache, model, plan(swap_out=[a]))  # its copies must be possible, and made
    soak.check_state(cache.snapshot(), model)
    soak.check_kv(cache, model)
    assert closes(cache)


def chunk_mappings():
    """This process's mappings of pagedrt chunks (memfds), by /proc/self/maps."""
    with open("/proc/self/maps") as f:
        return sum("pagedrt-chunk" in line for line in f)


@pytest.mark.parametrize("growth", [None, dict(background=False), dict(background=True)])
def test_caches_dropped_without_close_release_their_mappings_at_once(growth):
    """Issue 35, 5: a dropped cache is reclaimed when its last reference goes, not by the cycle collector."""
    import gc
    start = chunk_mappings()
    gc.disable()
    try:
        for i in range(200):
            cache = PagedKVCache(1, 1, 64, BS, "float32", max_tokens=64 * BS, chunk_bytes=2 * BS * 64 * 4,
                                 backend="host", host_tokens=4 * BS, growth=growth)
            cache.step(arrivals=[np.arange(3 * BS + i % 5)])
            base = cache.pool.base
            assert chunk_mappings() > start
            del cache
            for worker in [t for t in threading.enumerate() if t.name == "pagedrt-growth"]:
                worker.join(60)  # it ends once the growth is gone, dropping the pool it was mapping for
                assert not worker.is_alive(), f"cache {i}: its growth's worker outlived it"
            assert find_pool(base) is None, f"cache {i}: its pool outlived the last reference"
            assert chunk_mappings() == start, f"cache {i}: its chunks are still mapped"
    finally:
        gc.enable()
