"""A cache sharded by KV heads: one set of tables, one pool a shard, attention per shard equal to the whole cache's."""

import contextlib
import json

import numpy as np
import pytest

from pagedrt import PagedKVCache
from pagedrt.attention import paged_decode
from pagedrt.errors import (InvalidTokenCountError, PoolClosedError, SequenceFullError, ShardError,
                            UnsupportedConfigError)
from pagedrt.kernels import copy_blocks, write_kv
from pagedrt.shard import ShardedKVCache
from pagedrt.snapshot import validate_snapshot
from helpers import to_host

LAYERS, KV_HEADS, GROUP, DIM, BS = 2, 4, 2, 64, 16


def devices_for(backend, shards):
    """Shards on one device where there is one GPU (device 0 repeated), else on devices 0..shards-1."""
    if backend == "host":
        return list(range(shards))
    import cupy
    return list(range(shards)) if cupy.cuda.runtime.getDeviceCount() >= shards else [0] * shards


def run_steps(cache, rng, xp):
    """Arrivals, a fork (copy-on-write), decode steps and a free, writing random K/V through each step's slots
    (copying the copy-on-write pairs first): returns the last step(s) and the K/V written per token, by the
    cache's heads, so a sharded and a whole cache can be given the same tokens."""
    sharded = isinstance(cache, ShardedKVCache)
    prompts = [rng.integers(0, 1000, n).tolist() for n in (37, 5, 60)]
    plan = [dict(arrivals=prompts), dict(forks=[0]), dict(), dict(frees=[1]), dict()]
    for decisions in plan:
        steps = cache.step(**decisions)
        steps = steps.shards if sharded else (steps,)
        n = steps[0].num_tokens
        kv = rng.standard_normal((LAYERS, 2, n, KV_HEADS, DIM)).astype(np.float16)
        for s, step in enumerate(steps):
            shard = cache.shards[s] if sharded else None
            heads = shard.kv_heads if sharded else range(KV_HEADS)
            planes = shard.planes if sharded else cache.planes
            with shard.device_context() if sharded else contextlib.nullcontext():
                if len(step.copies):
                    copy_blocks(planes, step.copies)
                for layer in range(LAYERS):
                    k = xp.asarray(np.ascontiguousarray(kv[layer, 0][:, heads.start:heads.stop]))
                    v = xp.asarray(np.ascontiguousarray(kv[layer, 1][:, heads.start:heads.stop]))
                    write_kv(k, v, planes[2 * layer], planes[2 * layer + 1], step.slot_mapping)
    return steps


def attend(cache, steps, q, xp, layer):
    """Decode attention of the last step's batch over ``layer``, whole or shard by shard (outputs joined)."""
    if not isinstance(cache, ShardedKVCache):
        (step,) = steps
        return to_host(paged_decode(xp.asarray(q), cache.k(layer), cache.v(layer), step.block_tables, step.seq_lens,
                                    num_splits=1))
    parts = []
    for shard, step in zip(cache.shards, steps):
        with shard.device_context():
            heads = shard.q_heads(GROUP)
            part = xp.asarray(np.ascontiguousarray(q[:, heads.start:heads.stop]))
            out = paged_decode(part, shard.k(layer), shard.v(layer), step.block_tables, step.seq_lens, num_splits=1)
            parts.append(to_host(out))
    return np.concatenate(parts, axis=1)


def xp_of(backend):
    if backend == "host":
        return np
    import cupy
    return cupy


@pytest.mark.parametrize("shards", [2, 4])
def test_sharded_attention_equals_the_whole_caches(backend, shards):
    """The same steps and tokens into a whole cache and a sharded one: every shard's step holds the same tables,
    and attention run shard by shard on its heads, joined, is the whole cache's, bit for bit."""
    xp = xp_of(backend)
    with PagedKVCache(LAYERS, KV_HEADS, DIM, BS, max_tokens=4096, max_seqs=8, backend=backend) as whole, \
            ShardedKVCache(LAYERS, KV_HEADS, DIM, BS, devices=devices_for(backend, shards), max_tokens=4096,
                           max_seqs=8, backend=backend) as sharded:
        assert [s.kv_heads for s in sharded.shards] == [range(i * KV_HEADS // shards, (i + 1) * KV_HEADS // shards)
                                                         for i in range(shards)]
        last_whole = run_steps(whole, np.random.default_rng(5), xp)
        last = run_steps(sharded, np.random.default_rng(5), xp)
        assert len(last) == shards
        for step in last[1:]:  # each shard's device arrays say what shard 0's say
            for name in ("slot_mapping", "block_tables", "seq_lens", "qo_indptr"):
                assert np.array_equal(to_host(getattr(step, name)), to_host(getattr(last[0], name))), name
        assert np.array_equal(to_host(last[0].seq_lens), to_host(last_whole[0].seq_lens))
        q = np.random.default_rng(9).standard_normal((last[0].seqs.size, KV_HEADS * GROUP, DIM)).astype(np.float16)
        for layer in range(LAYERS):
            want = attend(whole, last_whole, q, xp, layer)
            assert np.isfinite(want.astype(np.float32)).all()
            assert np.array_equal(attend(sharded, last, q, xp, layer), want)


def test_translate_names_the_shard_and_device_and_reaches_the_written_values():
    with ShardedKVCache(LAYERS, KV_HEADS, DIM, BS, devices=[3, 7], max_tokens=2048, max_seqs=4,
                        backend="host") as cache:
        step = cache.step(arrivals=[list(range(40))])
        rng = np.random.default_rng(1)
        k = rng.standard_normal((40, KV_HEADS, DIM)).astype(np.float16)
        for shard in cache.shards:
            heads = shard.kv_heads
            part = np.ascontiguousarray(k[:, heads.start:heads.stop])
            write_kv(part, part, shard.k(1), shard.v(1),
                     step.slot_mapping)
        seq = int(step.arrived[0])
        for head in range(KV_HEADS):
            t = cache.translate(seq, 33, layer=1, kv="k", head=head)
            shard = cache.shards[head // 2]
            assert (t.shard, t.device, t.kv_head) == (shard.index, shard.device, head)
            assert shard.pool.base <= t.virtual_address < shard.pool.base + shard.pool.max_bytes
            local = shard.k(1)[t.block_id, head - shard.kv_heads.start, t.slot]
            assert local.ctypes.data == t.virtual_address and np.array_equal(local, k[33, head])
            assert t.as_dict()["device"] == shard.device
        with pytest.raises(UnsupportedConfigError, match="heads are 0..3"):
            cache.translate(seq, 0, head=4)


def test_each_shards_snapshot_is_a_valid_snapshot_naming_its_device_and_heads():
    with ShardedKVCache(LAYERS, KV_HEADS, DIM, BS, devices=[0, 1], max_tokens=2048, max_seqs=4,
                        backend="host") as cache:
        cache.step(arrivals=[list(range(20)), list(range(5))])
        snaps = [cache.snapshot(s) for s in range(2)]
        for s, snap in enumerate(snaps):
            validate_snapshot(snap)
            assert snap["shard"] == {"index": s, "of": 2, "device": s, "kv_heads": [2 * s, 2 * s + 2],
                                     "num_kv_heads": KV_HEADS}
            assert snap["layout"]["num_kv_heads"] == 2 and snap["pool"]["base"] == cache.shards[s].pool.base
        assert snaps[0]["sequences"] == snaps[1]["sequences"]  # one set of tables
        assert all(c["state"] == "mapped" for snap in snaps for c in snap["pool"]["chunks"])  # mapped whole
        with pytest.raises(ShardError, match="0..1"):
            cache.snapshot(2)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(devices=[0, 1, 2]), ShardError, "multiple of the 3 shards"),
    (dict(devices=[]), ShardError, "one or more device ordinals"),
    (dict(devices="01"), ShardError, "a sequence of device ordinals"),
    (dict(devices=[0, -1]), ShardError, "one or more device ordinals"),
    (dict(devices=[0, 1], backend=object()), UnsupportedConfigError, "one backend per device"),
    (dict(devices=[0, 1], kv_dtype="float8_e4m3", kv_scales=np.ones((LAYERS, 2, 2))), UnsupportedConfigError,
     "kv_scales must have shape"),
])
def test_shards_that_do_not_fit_are_named_errors(kwargs, error, match):
    kwargs = {"max_tokens": 1024, "backend": "host", **kwargs}
    with pytest.raises(error, match=match):
        ShardedKVCache(LAYERS, KV_HEADS, DIM, BS, **kwargs)


def test_fp8_scales_are_cut_by_heads():
    scales = np.arange(1, 1 + LAYERS * 2 * KV_HEADS, dtype=np.float32).reshape(LAYERS, 2, KV_HEADS) / 64
    with ShardedKVCache(LAYERS, KV_HEADS, DIM, BS, devices=[0, 1], max_tokens=1024, backend="host",
                        kv_dtype="float8_e4m3", kv_scales=scales) as cache:
        for shard in cache.shards:
            heads = slice(shard.kv_heads.start, shard.kv_heads.stop)
            assert np.array_equal(shard.k_scale(1), scales[1, 0, heads])
            assert np.array_equal(shard.v_scale(0), scales[0, 1, heads])
            assert shard.k(0).dtype == np.uint8


def test_a_bad_step_changes_nothing_and_a_closed_cache_refuses():
    with ShardedKVCache(LAYERS, KV_HEADS, DIM, BS, devices=[0, 1], max_tokens=1024, max_seqs=4, max_seq_len=64,
                        backend="host") as cache:
        cache.step(arrivals=[list(range(30))])
        before = [cache.snapshot(s) for s in range(2)]
        for bad in (dict(counts=-1), dict(counts=100)):
            with pytest.raises((InvalidTokenCountError, SequenceFullError)):
                cache.step(**bad)
        after = [cache.snapshot(s) for s in range(2)]
        for b, a in zip(before, after):
            b.pop("time"), a.pop("time")
            assert a == b
    for call in (lambda: cache.step(), lambda: cache.translate(0, 0), lambda: cache.snapshot(0),
                 lambda: cache.shards[1].k(0), lambda: cache.add_sequence()):
        with pytest.raises(PoolClosedError):
            call()
    cache.close()  # idempotent


def test_the_cli_shows_which_device_a_shard_snapshot_is_and_translates_the_caches_heads(tmp_path):
    from click.testing import CliRunner
    from pagedrt.cli import main
    with ShardedKVCache(LAYERS, KV_HEADS, DIM, BS, devices=[0, 5], max_tokens=2048, max_seqs=4,
                        backend="host") as cache:
        step = cache.step(arrivals=[list(range(40))])
        seq = int(step.arrived[0])
        want = cache.translate(seq, 33, layer=1, kv="v", head=3)
        path = tmp_path / "shard1.json"
        cache.write_snapshot(path, shard=1)
    runner = CliRunner()
    shown = runner.invoke(main, ["inspect", str(path), "--no-color"])
    assert shown.exit_code == 0 and "shard  1 of 2, on device 5: KV heads 2..3 of 4" in shown.output
    tr = runner.invoke(main, ["translate", str(seq), "33", str(path), "--layer", "1", "--kv", "v", "--head", "3",
                              "--json"])
    assert tr.exit_code == 0, tr.output
    got = json.loads(tr.output)
    assert (got["shard"], got["device"], got["kv_head"], got["virtual_address"]) == (1, 5, 3, want.virtual_address)
    text = runner.invoke(main, ["translate", str(seq), "33", str(path), "--head", "2", "--no-color"]).output
    assert "kv head 2 is shard 1's, on device 5" in text
    wrong = runner.invoke(main, ["translate", str(seq), "33", str(path), "--head", "1"])
    assert wrong.exit_code != 0 and "shard 1 (device 5) holds KV heads 2..3 of 4" in wrong.output
    snap = json.loads(path.read_text())
    snap["shard"]["kv_heads"] = [0, 2]  # not shard 1's heads
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(snap))
    refused = runner.invoke(main, ["inspect", str(bad)])
    assert refused.exit_code != 0 and "shard.kv_heads" in refused.output
