"""The host tier: swap-out and swap-in, preemption through the step, offload of the prefix cache, attention over
host-tier blocks, and the named errors that change nothing."""

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pagedrt import attention, kernels
from pagedrt.cache import PagedKVCache
from pagedrt.errors import (HostOutOfMemoryError, HostTierExhaustedError, PagedRTError, PoolExhaustedError,
                            SwapStateError, UnknownSequenceError, UnsupportedConfigError)
from pagedrt.memory import host
from pagedrt.render import chunk_table, pool_map
from helpers import to_host
from test_cache import check_allocator, frozen, machine_test

LAYERS, HEADS, DIM, BS, GROUP = 4, 4, 128, 16, 4  # group 4: the decode kernel the swap benchmark runs
MiB = 1 << 20
CHUNK_BLOCKS = 2 * MiB // (HEADS * BS * DIM * 2)  # 128 blocks (2048 tokens) in one 2 MiB chunk per plane


def swap_cache(backend, device_tokens=CHUNK_BLOCKS * BS, host_tokens=CHUNK_BLOCKS * BS, chunk_blocks=CHUNK_BLOCKS,
               **more):
    """By default one allocator chunk of device blocks and one of host-tier blocks, the same on both backends."""
    return PagedKVCache(LAYERS, HEADS, DIM, BS, "float16", max_tokens=device_tokens, host_tokens=host_tokens,
                        chunk_bytes=chunk_blocks * 2 * MiB // CHUNK_BLOCKS, backend=backend, max_seqs=8,
                        max_seq_len=CHUNK_BLOCKS * BS, **more)


def kv_values(tokens, positions):
    """The K/V this file writes for tokens at positions, [n, planes, heads, dim] float16: a function of both, so
    what a sequence should hold is known, and a block recomputed or found cached holds the same."""
    t, p = np.asarray(tokens, np.float64)[:, None], np.asarray(positions, np.float64)[:, None]
    inner = np.arange(2 * LAYERS * HEADS * DIM, dtype=np.float64)
    return np.sin(t * 0.37 + p * 0.011 + inner * 0.013).astype(np.float16).reshape(-1, 2 * LAYERS, HEADS, DIM)


def run_copies(cache, step):
    """What an engine does before writing a step's tokens: the tier copies in order, then copy-on-write."""
    kernels.swap_blocks(cache.planes, step.swaps)
    kernels.copy_blocks(cache.planes, step.copies)


def write_step(cache, step, tokens):
    """Write every new token of ``step`` through its slots, from the sequences' token lists."""
    lens = to_host(step.seq_lens).astype(np.int64)
    ids, pos = [], []
    for seq, n, length in zip(step.seqs.tolist(), step.query_lens.tolist(), lens.tolist()):
        ids += tokens[seq][length - n:length]
        pos += range(length - n, length)
    if not ids:
        return
    write_values(cache, kv_values(ids, pos), step.slot_mapping)


def write_values(cache, values, slots):
    """Write values [n, planes, heads, dim] into every plane at the slots."""
    planes = cache.xp.asarray(np.ascontiguousarray(values.transpose(1, 0, 2, 3)))
    for layer in range(LAYERS):
        kernels.write_kv(planes[2 * layer], planes[2 * layer + 1], cache.k(layer), cache.v(layer),
                         cache.xp.asarray(slots))


def expected_attention(q, keys, values, scale):
    """float64 attention of one query [q_heads, dim] over keys, values [n, kv_heads, dim] (GQA)."""
    k = np.repeat(keys.astype(np.float64), GROUP, axis=1)
    v = np.repeat(values.astype(np.float64), GROUP, axis=1)
    scores = np.einsum("hd,nhd->hn", q.astype(np.float64), k) * scale
    weights = np.exp(scores - scores.max(axis=1, keepdims=True))
    return np.einsum("hn,nhd->hd", weights / weights.sum(axis=1, keepdims=True), v)


def check_attention(cache, seqs, tokens, rng):
    """Every layer's decode attention of ``seqs`` (through their block tables, whichever tier holds the blocks)
    against the float64 reference over the K/V they should hold."""
    q = rng.standard_normal((len(seqs), HEADS * GROUP, DIM)).astype(np.float16)
    plan = attention.DecodePlan(cache.xp.asarray(q), cache.k(0), cache.block_tables(seqs), cache.seq_lens(seqs))
    for layer in range(LAYERS):
        out = to_host(plan.run(cache.xp.asarray(q), cache.k(layer), cache.v(layer)))
        for i, seq in enumerate(seqs):
            kv = kv_values(tokens[seq], range(len(tokens[seq])))
            want = expected_attention(q[i], kv[:, 2 * layer], kv[:, 2 * layer + 1], DIM ** -0.5)
            assert np.allclose(out[i], want, atol=4e-3, rtol=1e-2), (seq, layer, np.abs(out[i] - want).max())


def held_kv(cache, seq):
    """A sequence's K/V read through its block table, [len, planes, heads, dim]."""
    n = cache.length(seq)
    row = to_host(cache.block_tables([seq]))[0]
    pos = np.arange(n)
    blocks, within = cache.xp.asarray(row[pos // BS]), cache.xp.asarray(pos % BS)
    return np.stack([to_host(plane[blocks, :, within, :]) for plane in cache.planes], axis=1)


# --- the must-show: fill the device, preempt by swap and by recompute, resume, attention checked -----------------

def test_preempt_by_swap_and_by_recompute_then_resume(backend):
    rng = np.random.default_rng(0)
    with swap_cache(backend) as cache:
        prompts = [rng.integers(0, 1000, 400) for _ in range(4)]
        step = cache.step(arrivals=prompts)
        tokens = {seq: list(p) for seq, p in zip(step.arrived.tolist(), prompts)}
        run_copies(cache, step)
        write_step(cache, step, tokens)
        running = sorted(tokens)
        while cache.can_append(running, 8):  # decode (8 tokens a step) until the device tier is full
            ids = rng.integers(0, 1000, 8 * len(running))
            for i, seq in enumerate(running):
                tokens[seq] += ids[8 * i:8 * i + 8].tolist()
            step = cache.step(running, 8, token_ids=ids)
            run_copies(cache, step)
            write_step(cache, step, tokens)
        check_attention(cache, running, tokens, rng)
        assert cache.num_available_blocks < len(running)
        a, b, c, d = running
        held_by_a = cache.tables.blocks(a)

        # preempt: a by swap, b by recompute (freed; its full blocks stay cached); c and d go on
        step = cache.step([c, d], 1, token_ids=[7, 8], swap_out=[a], frees=[b])
        tokens[c].append(7)
        tokens[d].append(8)
        out = step.swaps[:held_by_a.size]  # the swap-out's copies first, then offloads of evicted cached blocks
        assert np.array_equal(out[:, 0], held_by_a) and np.array_equal(cache.tables.blocks(a), out[:, 1])
        assert (step.swaps[:, 1] >= cache.allocator.device_blocks).all()  # every copy goes to the host tier
        run_copies(cache, step)
        write_step(cache, step, tokens)
        assert cache.swapped == [a] and (cache.tables.blocks(a) >= cache.allocator.device_blocks).all()
        check_allocator(cache)
        check_attention(cache, [a, c, d], tokens, rng)  # a is read where it is: in the host tier
        recompute = tokens.pop(b)
        for _ in range(40):  # c and d take the room a and b left; evicted cached blocks are offloaded
            ids = rng.integers(0, 1000, 2)
            tokens[c].append(int(ids[0]))
            tokens[d].append(int(ids[1]))
            step = cache.step(token_ids=ids)  # None: every live sequence not swapped out
            assert step.seqs.tolist() == [c, d]
            run_copies(cache, step)
            write_step(cache, step, tokens)
        check_attention(cache, [c, d], tokens, rng)

        # d finishes; a swaps in; b arrives again with its tokens so far and recomputes what is not cached
        step = cache.step([c], 1, token_ids=[9], frees=[d], swap_in=[a], arrivals=[np.array(recompute)])
        tokens[c].append(9)
        tokens.pop(d)
        b = int(step.arrived[0])
        tokens[b] = recompute
        assert step.cached[0] > 0 and cache.swapped == []
        run_copies(cache, step)
        write_step(cache, step, tokens)
        assert (cache.tables.blocks(a) < cache.allocator.device_blocks).all()
        check_allocator(cache)
        for _ in range(3):
            running = cache.sequences
            ids = rng.integers(0, 1000, len(running))
            for seq, token in zip(running, ids.tolist()):
                tokens[seq].append(token)
            step = cache.step(token_ids=ids)
            run_copies(cache, step)
            write_step(cache, step, tokens)
            check_attention(cache, running, tokens, rng)
            for seq in running:
                assert np.array_equal(held_kv(cache, seq), kv_values(tokens[seq], range(len(tokens[seq]))))
        check_allocator(cache)


# --- swap-out and swap-in by themselves -------------------------------------------------------------------------

def fill(cache, seq, n, rng):
    """Append ``n`` tokens of random K/V to ``seq``; return them [n, planes, heads, dim]."""
    slots, copies = cache.append(seq, n)
    kernels.copy_blocks(cache.planes, copies)
    values = rng.standard_normal((n, 2 * LAYERS, HEADS, DIM)).astype(np.float16)
    write_values(cache, values, slots)
    return values


def test_a_round_trip_is_bit_identical_and_frees_device_blocks(backend):
    rng = np.random.default_rng(1)
    with swap_cache(backend) as cache:
        a, b = cache.add_sequence(), cache.add_sequence()
        data = {a: fill(cache, a, 300, rng), b: fill(cache, b, 77, rng)}
        before = cache.num_available_blocks
        pairs = cache.swap_out([a])
        kernels.swap_blocks(cache.planes, pairs)
        assert cache.num_available_blocks == before + pairs.shape[0] == before + -(-300 // BS)
        assert cache.stats()["host_held_blocks"] == pairs.shape[0] and cache.swapped == [a]
        assert np.array_equal(held_kv(cache, a), data[a])  # read through the host tier's pointers
        c = cache.add_sequence()  # reuses a's device blocks and overwrites them
        fill(cache, c, 300, rng)
        assert np.intersect1d(cache.tables.blocks(c), pairs[:, 0]).size
        pairs = cache.swap_in([a])
        kernels.swap_blocks(cache.planes, pairs)
        assert (pairs[:, 0] >= cache.allocator.device_blocks).all() and cache.swapped == []
        for seq in (a, b):
            assert np.array_equal(held_kv(cache, seq), data[seq])
        assert cache.stats()["host_held_blocks"] == 0
        check_allocator(cache)


def test_blocks_move_once_every_holder_is_swapped_out():
    rng = np.random.default_rng(2)
    with swap_cache("host") as cache:
        a = cache.add_sequence()
        fill(cache, a, 5 * BS, rng)
        b = cache.fork(a)
        fill(cache, b, BS, rng)
        assert cache.swap_out([b]).shape == (1, 2)  # only b's own block: a keeps the shared five on the device
        shared = cache.tables.blocks(a)
        assert np.array_equal(cache.tables.blocks(b)[:5], shared)
        pairs = cache.swap_out([a])  # now every holder is out: the shared blocks move, both rows follow
        kernels.swap_blocks(cache.planes, pairs)
        assert np.array_equal(pairs[:, 0], shared)
        assert np.array_equal(cache.tables.blocks(a), cache.tables.blocks(b)[:5]) and cache.tables.blocks(a).min() \
            >= cache.allocator.device_blocks
        assert (cache.allocator.ref_count[cache.tables.blocks(a)] == 2).all()
        kernels.swap_blocks(cache.planes, cache.swap_in([b]))  # b's host blocks come back; a's row follows
        assert cache.swapped == [a] and (cache.tables.blocks(a) < cache.allocator.device_blocks).all()
        check_allocator(cache)


def test_a_swapped_out_sequence_decodes_over_its_host_blocks():
    rng = np.random.default_rng(3)
    with swap_cache("host") as cache:
        a = cache.add_sequence()
        fill(cache, a, 3 * BS + 5, rng)
        kernels.swap_blocks(cache.planes, cache.swap_out([a]))
        assert cache.block_mask()[cache.tables.blocks(a)].all()  # host-tier blocks are usable
        fill(cache, a, 20, rng)  # its partly filled host block first, then a device block
        row = cache.tables.blocks(a)
        assert (row[:4] >= cache.allocator.device_blocks).all() and row[4] < cache.allocator.device_blocks
        tokens = {a: None}
        kv = held_kv(cache, a)
        q = rng.standard_normal((1, HEADS * GROUP, DIM)).astype(np.float16)
        plan = attention.DecodePlan(q, cache.k(0), cache.block_tables([a]), cache.seq_lens([a]))
        out = plan.run(q, cache.k(1), cache.v(1))
        assert np.allclose(out[0], expected_attention(q[0], kv[:, 2], kv[:, 3], DIM ** -0.5), atol=4e-3)
        assert tokens


# --- the prefix cache offloads what it would evict, and a later hit brings it back --------------------------------

def test_evicted_cached_blocks_are_offloaded_and_reloaded_on_a_hit():
    rng = np.random.default_rng(4)
    with swap_cache("host") as cache:
        prompt = rng.integers(0, 1000, 100 * BS + 3)
        step = cache.step(arrivals=[prompt])
        tokens = {int(step.arrived[0]): prompt.tolist()}
        write_step(cache, step, tokens)
        first = int(step.arrived[0])
        cache.step(frees=[first])  # its 100 full blocks stay cached-free, 28 blocks free
        other = rng.integers(1000, 2000, 38 * BS)
        step = cache.step(arrivals=[other])  # 38 blocks: 10 cached ones evicted, to the host
        assert cache.prefix_stats()["offloads"] == 10 == step.swaps.shape[0]
        assert (step.swaps[:, 1] >= cache.allocator.device_blocks).all()
        tokens[int(step.arrived[0])] = other.tolist()
        run_copies(cache, step)
        write_step(cache, step, tokens)
        cache.step(frees=[int(step.arrived[0])])
        again = cache.add_sequence(prompt)  # a building block: stops at the first offloaded block
        assert cache.length(again) == 90 * BS
        cache.free(again)
        step = cache.step(arrivals=[prompt])  # the step brings them back
        assert step.cached.tolist() == [100 * BS] and cache.prefix_stats()["reloads"] == 10
        reloaded = step.swaps[step.swaps[:, 0] >= cache.allocator.device_blocks]
        assert reloaded.shape == (10, 2)
        seq = int(step.arrived[0])
        tokens[seq] = prompt.tolist()
        run_copies(cache, step)
        write_step(cache, step, tokens)
        assert (cache.tables.blocks(seq) < cache.allocator.device_blocks).all()
        assert np.array_equal(held_kv(cache, seq), kv_values(prompt, range(prompt.size)))
        check_allocator(cache)


# --- named errors, nothing half-done -----------------------------------------------------------------------------

def test_bad_swaps_are_named_errors_and_change_nothing():
    rng = np.random.default_rng(5)
    with swap_cache("host", device_tokens=24 * BS, host_tokens=8 * BS, chunk_blocks=8) as cache:
        a, b, c = (cache.add_sequence() for _ in range(3))
        fill(cache, a, 6 * BS, rng)
        fill(cache, b, 5 * BS, rng)
        fill(cache, c, BS, rng)
        kernels.swap_blocks(cache.planes, cache.swap_out([c]))
        before = frozen(cache)
        cases = [
            (HostTierExhaustedError, "asked for 11 host-tier blocks", lambda: cache.swap_out([a, b])),
            (HostTierExhaustedError, "asked for 11 host-tier blocks", lambda: cache.step(swap_out=[a, b])),
            (SwapStateError, "already swapped out", lambda: cache.swap_out([c])),
            (SwapStateError, "not swapped out", lambda: cache.swap_in([a])),
            (SwapStateError, "not swapped out", lambda: cache.step(swap_in=[a])),
            (SwapStateError, "forked but swapped out", lambda: cache.fork(c)),
            (SwapStateError, "forked but swapped out", lambda: cache.step(forks=[a], swap_out=[a])),
            (SwapStateError, "not swapped out", lambda: cache.step(swap_out=[a], swap_in=[a])),
            (UnknownSequenceError, "swapped and freed", lambda: cache.step(frees=[c], swap_in=[c])),
            (UnknownSequenceError, "does not exist", lambda: cache.swap_out([7])),
        ]
        for error, message, action in cases:
            with pytest.raises(error, match=message):
                action()
            assert frozen(cache) == before
        assert not cache.can_swap_out([a, b]) and cache.can_swap_out([a]) and cache.can_swap_in([c])
        fill(cache, b, 13 * BS, rng)  # the device's 24 blocks are all held now
        before = frozen(cache)
        with pytest.raises(PoolExhaustedError, match="asked for 1 blocks"):
            cache.swap_in([c])
        assert frozen(cache) == before and not cache.can_swap_in([c])
        pairs = cache.step([b], 0, swap_out=[a], swap_in=[c]).swaps  # a's room makes c's swap-in fit
        assert pairs.shape == (7, 2) and cache.swapped == [a]
        check_allocator(cache)


def test_host_capacity_arguments():
    for bad in ({"host_tokens": 0}, {"host_tokens": 1.5}, {"host_tokens": 16, "host_bytes": 1 << 20}):
        with pytest.raises(UnsupportedConfigError):
            swap_cache("host", **{"host_tokens": None, **bad})
    with swap_cache("host", host_tokens=1) as cache:  # rounded up to a whole chunk
        assert cache.allocator.host_blocks == CHUNK_BLOCKS
    with swap_cache("host", host_tokens=None) as cache:
        assert cache.allocator.host_blocks == 0 and cache.stats()["host_blocks"] == 0
        a = cache.add_sequence()
        cache.append(a, 3)
        with pytest.raises(HostTierExhaustedError, match="of 0"):
            cache.swap_out([a])


def memfd_maps(name):
    with open("/proc/self/maps") as f:
        return sum(f"/memfd:{name} " in line for line in f)


def test_out_of_pinned_memory_at_creation_leaves_nothing(monkeypatch):
    real = host.HostBackend.create
    calls = []

    def create(self, size, location="device"):
        if location == "host":
            calls.append(size)
            if len(calls) == 5:
                raise HostOutOfMemoryError("injected: pinned memory refused")
        return real(self, size, location)
    monkeypatch.setattr(host.HostBackend, "create", create)
    before = memfd_maps("pagedrt-chunk-host"), memfd_maps("pagedrt-chunk")
    with pytest.raises(HostOutOfMemoryError, match="injected"):
        swap_cache("host")
    assert (memfd_maps("pagedrt-chunk-host"), memfd_maps("pagedrt-chunk")) == before


# --- what the views say -----------------------------------------------------------------------------------------

def test_mappings_snapshot_and_map_say_where_chunks_live():
    rng = np.random.default_rng(6)
    with swap_cache("host") as cache:
        a = cache.add_sequence()
        fill(cache, a, 2 * BS, rng)
        kernels.swap_blocks(cache.planes, cache.swap_out([a]))
        records = cache.pool.mappings()
        host_places = {p * 2 + 1 for p in range(2 * LAYERS)}
        assert {r.chunk for r in records if r.location == "host"} == host_places
        assert {r.location for r in records} == {"device", "host"} and all(r.location_id is None for r in records)
        assert memfd_maps("pagedrt-chunk-host") >= len(host_places)
        snap = cache.snapshot()
        assert snap["sequences"] == [{"seq": a, "length": 2 * BS, "blocks": cache.tables.blocks(a).tolist(),
                                      "swapped": True}]
        table = "\n".join(chunk_table(snap))
        assert "host" in table and "device" in table
        assert any("host" in line for line in pool_map(snap))
        tr = cache.translate(a, 0)
        assert tr.location == "host" and tr.block_id >= cache.allocator.device_blocks


# --- swap_blocks: in order, runs coalesced ---------------------------------------------------------------------

def test_swap_blocks_copies_in_the_order_given():
    planes = [np.arange(8 * 2 * 4 * 16, dtype=np.float32).reshape(8, 2, 4, 16) + 1000 * p for p in range(3)]
    old = [p.copy() for p in planes]
    kernels.swap_blocks(planes, [[0, 5], [5, 6], [1, 2], [2, 3]])  # later pairs read what earlier ones wrote
    for p, o in zip(planes, old):
        assert np.array_equal(p[[5, 6, 2, 3]], o[[0, 0, 1, 1]]) and np.array_equal(p[[0, 1, 4, 7]], o[[0, 1, 4, 7]])
    runs = kernels.copy._runs(np.array([[0, 10], [1, 11], [2, 12], [7, 3], [8, 4], [4, 5], [5, 6]]))
    assert runs.tolist() == [[0, 10, 3], [7, 3, 2], [4, 5, 1], [5, 6, 1]]  # 4->5, 5->6 overlap: split


@pytest.mark.gpu
def test_swap_blocks_on_the_device_matches_the_reference():
    import cupy
    rng = np.random.default_rng(7)
    with swap_cache("cuda", placement="block") as cache:
        a = cache.add_sequence()
        data = fill(cache, a, 200, rng)
        stream = cupy.cuda.Stream(non_blocking=True)
        kernels.swap_blocks(cache.planes, cache.swap_out([a]), stream)  # block-major: one copy per run
        stream.synchronize()
        assert np.array_equal(held_kv(cache, a), data)
        kernels.swap_blocks(cache.planes, cache.swap_in([a]), stream)
        stream.synchronize()
        assert np.array_equal(held_kv(cache, a), data)


# --- random steps with swaps: all or nothing ---------------------------------------------------------------------

class SwapStepMachine(RuleBasedStateMachine):
    """Random steps mixing swaps, frees, forks, prefix-sharing arrivals and appends on a small cache whose host tier
    fills: each step succeeds with the allocator consistent, or raises a named error and changes nothing."""

    def __init__(self):
        super().__init__()
        self.cache = swap_cache("host", device_tokens=24 * BS, host_tokens=8 * BS, chunk_blocks=4)
        self.rng = np.random.default_rng(0)

    def teardown(self):
        self.cache.close()

    def pick(self, picks, pool):
        return sorted({pool[p % len(pool)] for p in picks}) if pool else []

    @rule(picks=st.lists(st.integers(0, 20), max_size=3), outs=st.lists(st.integers(0, 20), max_size=2),
          ins=st.lists(st.integers(0, 20), max_size=2), frees=st.lists(st.integers(0, 20), max_size=2),
          forks=st.lists(st.integers(0, 20), max_size=1), arrivals=st.integers(0, 2), count=st.integers(0, 2 * BS))
    def step(self, picks, outs, ins, frees, forks, arrivals, count):
        c = self.cache
        device = [s for s in c.sequences if s not in c.swapped]
        seqs = self.pick(picks, c.sequences)
        prompts = [np.concatenate([np.arange(int(self.rng.integers(0, 3)) * BS), self.rng.integers(0, 9, 1 + BS)])
                   for _ in range(arrivals)]
        before = frozen(c)
        try:
            step = c.step(seqs, count, token_ids=self.rng.integers(0, 9, count * len(seqs)), arrivals=prompts,
                          swap_out=self.pick(outs, device), swap_in=self.pick(ins, c.swapped),
                          frees=self.pick(frees, c.sequences), forks=self.pick(forks, device))
        except PagedRTError:
            assert frozen(c) == before
            return
        kernels.swap_blocks(c.planes, step.swaps)
        kernels.copy_blocks(c.planes, step.copies)

    @invariant()
    def consistent(self):
        check_allocator(self.cache)


TestSwapSteps = machine_test(SwapStepMachine, 40, 25)
