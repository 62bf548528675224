"""The model runner tensor-parallel over a sharded cache gives the single runner's logits, step after step."""

import numpy as np
import pytest

import tiny_gguf
from pagedrt import PagedKVCache
from pagedrt.engine import loader
from pagedrt.engine.model import LlamaModel
from pagedrt.engine.parallel import AllReduce, TensorParallelModel, shard_weights
from pagedrt.errors import CommunicatorError, ShardError
from pagedrt.shard import ShardedKVCache
from helpers import to_host

SHAPE = dict(tiny_gguf.SHAPE, hidden=384, q_heads=6, kv_heads=2, ffn=256)  # head_dim 64, group 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-tp.gguf"
    tiny_gguf.write(path, shape=SHAPE, seed=3)
    return loader.load(path)


def devices_for(backend, shards):
    if backend == "host":
        return list(range(shards))
    import cupy
    return list(range(shards)) if cupy.cuda.runtime.getDeviceCount() >= shards else [0] * shards


def run(cache, forward, xp, prompts, chosen):
    """Logits of a prefill of ``prompts``, then three greedy decode steps of every sequence, then a fourth prompt
    arriving beside a decode step (a mixed step). The decode tokens are the first run's argmax, kept in
    ``chosen`` (a list, filled by the first run and replayed by the next), so both runs see the same tokens."""
    out = []
    step = cache.step(arrivals=prompts)
    ids = np.concatenate([np.asarray(p) for p in prompts])
    for i in range(3):
        logits = to_host(forward(step, xp.asarray(ids)))
        out.append(logits)
        if len(chosen) == i:
            chosen.append(np.argmax(logits, axis=1).astype(np.int64))
        ids = chosen[i]
        step = cache.step(counts=1, token_ids=ids)
    late = list(range(40, 61))
    step = cache.step(counts=1, token_ids=ids, arrivals=[late])
    out.append(to_host(forward(step, xp.asarray(np.concatenate([ids, late])))))
    return out


@pytest.mark.parametrize("shards", [2])
def test_tensor_parallel_logits_equal_the_single_runners(backend, model, shards):
    xp = np if backend == "host" else pytest.importorskip("cupy")
    dtype = "float16"  # the cache's; the host runs activations in float32
    c = model.config
    prompts = [list(range(5, 37)), list(range(100, 107))]
    common = dict(max_tokens=2048, max_seqs=8, backend=backend)
    with PagedKVCache(c.num_layers, c.kv_heads, c.head_dim, 16, dtype, **common) as whole:
        single = LlamaModel(model, whole, graphs=False)
        chosen = []
        want = run(whole, single.forward, xp, prompts, chosen)
    with ShardedKVCache(c.num_layers, c.kv_heads, c.head_dim, 16, dtype, devices=devices_for(backend, shards),
                        **common) as cache:
        got = run(cache, TensorParallelModel(model, cache).forward, xp, prompts, chosen)
    tol = 5e-4 if backend == "host" else 2e-2  # partial sums add in another order (in fp16 on a device)
    for a, b in zip(got, want):
        assert a.shape == b.shape and np.isfinite(b).all()
        assert np.abs(a - b).max() <= tol * np.abs(b).max()


def test_shard_weights_cut_heads_and_the_swiglu_width(model):
    c, w = model.config, model.weights
    parts, config = shard_weights(w, c, 2)
    d = c.head_dim
    assert (config.q_heads, config.kv_heads, config.ffn) == (3, 1, 128)
    layer = w.layers[0]
    q = np.concatenate([p.layers[0]["qkv"][:3 * d] for p in parts])  # weights are [out, in]: heads are rows
    k = np.concatenate([p.layers[0]["qkv"][3 * d:4 * d] for p in parts])
    v = np.concatenate([p.layers[0]["qkv"][4 * d:] for p in parts])
    assert np.array_equal(np.concatenate([q, k, v]), layer["qkv"])
    assert np.array_equal(np.concatenate([p.layers[0]["o"] for p in parts], axis=1), layer["o"])
    assert np.array_equal(np.concatenate([p.layers[0]["down"] for p in parts], axis=1), layer["down"])
    gate = np.concatenate([p.layers[0]["gate_up"][:128] for p in parts])
    up = np.concatenate([p.layers[0]["gate_up"][128:] for p in parts])
    assert np.array_equal(np.concatenate([gate, up]), layer["gate_up"])
    with pytest.raises(ShardError, match="multiple of 4"):
        shard_weights(w, c, 4)


def test_sums_over_the_wrong_ranks_are_named_errors(model):
    with pytest.raises(CommunicatorError, match="one rank a device"):
        AllReduce([0, 0, 1])
    reduce = AllReduce([0, 1], host=True)
    a, b = np.ones(4, np.float32), np.full(4, 2, np.float32)
    reduce([a, b])
    assert (a == 3).all() and (b == 3).all()
    with pytest.raises(CommunicatorError, match="3 arrays for a sum over 2 ranks"):
        reduce([a, b, a])
    c = model.config
    with ShardedKVCache(c.num_layers, c.kv_heads, c.head_dim, 16, "float16", devices=[0, 1], max_tokens=256,
                        backend="host") as cache:
        runner = TensorParallelModel(model, cache)
        step = cache.step(arrivals=[[1, 2, 3]])
        assert len(step.shards) == 2 and step.num_tokens == 3  # shard 0's step, every shard's in .shards
        with pytest.raises(ShardError, match="a step of 0 shards for a model of 2"):
            runner.forward(step.shards[0], np.array([1, 2, 3]))
        assert runner.forward(step, np.array([1, 2, 3])).shape == (1, c.vocab_size)


def test_the_engine_generates_tensor_parallel_as_it_does_on_one_cache(model, tmp_path_factory):
    """``Engine(devices=...)``: the same greedy completions, continuous batching and a shared prompt prefix
    included, from the sharded cache and the tensor-parallel runner; ``pagedrt generate --devices`` says so."""
    from click.testing import CliRunner
    from pagedrt.cli import main
    from pagedrt.engine import Engine, SamplingParams
    path = model.path
    prompts = ["The quick brown fox", "The quick brown fox jumps over the lazy dog.", "birds sing"]
    params = SamplingParams(max_tokens=12)
    runs = []
    for devices in (None, [0, 1]):
        with Engine(path, backend="host", max_seqs=8, kv_tokens=4096, devices=devices) as engine:
            runs.append([r.tokens[0].tolist() for r in engine.generate(prompts, params)])
            if devices:
                assert [s.kv_heads for s in engine.cache.shards] == [range(0, 1), range(1, 2)]
    assert runs[0] == runs[1] and all(len(t) == 12 for t in runs[0])
    cli = ["generate", "The dog", "--model", str(path), "--backend", "host", "--max-seqs", "4", "--max-tokens", "4"]
    result = CliRunner().invoke(main, cli + ["--devices", "0,1"])
    assert result.exit_code == 0, result.output
    assert "sharded over devices [0, 1], tensor-parallel" in result.stderr
    bad = CliRunner().invoke(main, cli + ["--devices", "0,x"])
    assert bad.exit_code != 0 and "is not a comma-separated list of device ordinals" in bad.output
    odd = CliRunner().invoke(main, cli + ["--devices", "0,1,2"])
    assert odd.exit_code != 0 and "multiple of the 3 shards" in odd.output and "Traceback" not in odd.output
