"""The engine on the host backend: loading and refusing GGUF files, the tokenizer, and the generate loop (continuous
batching, parallel samples by fork and copy-on-write, prefix caching, chunked prefill, named errors), on the tiny
random-weight model of tests/tiny_gguf.py."""

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import tiny_gguf

gguf = pytest.importorskip("gguf", reason="the engine reads GGUF with the gguf package: pip install 'pagedrt[model]'")

from pagedrt.engine import Engine, SamplingParams, loader  # noqa: E402
from pagedrt.engine.tokenizer import Tokenizer  # noqa: E402
from pagedrt.errors import InvalidTokenIdsError, ModelFileError, RequestError, UnsupportedModelError  # noqa: E402

COMMON = "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs into the "


@pytest.fixture(scope="module")
def engine(tiny):
    with Engine(tiny, backend="host", max_seqs=16, kv_tokens=1 << 14) as e:
        yield e


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return Tokenizer(loader.load(tiny).vocab)


# --- loading -------------------------------------------------------------------------------------------------


def test_loader_reads_the_configuration_and_fuses_the_weights(tiny):
    m = loader.load(tiny)
    c, s = m.config, tiny_gguf.SHAPE
    assert (c.num_layers, c.hidden, c.q_heads, c.kv_heads, c.head_dim, c.ffn) == (
        s["layers"], s["hidden"], s["q_heads"], s["kv_heads"], 64, s["ffn"])
    layer = m.weights.layers[0]
    assert layer["qkv"].shape == ((c.q_heads + 2 * c.kv_heads) * c.head_dim, c.hidden)
    assert layer["gate_up"].shape == (2 * c.ffn, c.hidden) and layer["down"].shape == (c.hidden, c.ffn)
    assert m.weights.output is m.weights.embedding  # tied: no output.weight in the file
    assert m.vocab.eos in m.vocab.stop and m.vocab.chat_template


def test_quantized_weights_dequantise_as_gguf_says(tmp_path):
    from gguf.quants import dequantize
    path = tmp_path / "q.gguf"
    tiny_gguf.write(path, quantized=True)
    m = loader.load(path)
    reader = gguf.GGUFReader(path)
    q = next(t for t in reader.tensors if t.name == "blk.1.attn_q.weight")
    assert q.tensor_type == gguf.GGMLQuantizationType.Q4_1
    block = q.data[0, :20]  # Q4_1: fp16 scale d, fp16 minimum m, 16 bytes of two 4-bit values each
    d, low = (float(x) for x in block[:4].view(np.float16))
    nibbles = np.concatenate([block[4:] & 0x0F, block[4:] >> 4]).astype(np.float32)
    np.testing.assert_allclose(m.weights.layers[1]["qkv"][0, :32], d * nibbles + low, rtol=1e-6)
    np.testing.assert_array_equal(dequantize(q.data, q.tensor_type)[:, :], m.weights.layers[1]["qkv"][:192])


def test_missing_truncated_and_foreign_files_are_named_errors(tiny, tmp_path):
    with pytest.raises(ModelFileError, match="does not exist"):
        loader.load(tmp_path / "nothing.gguf")
    data = tiny.read_bytes()
    for name, body in (("cut.gguf", data[:len(data) // 2]), ("junk.gguf", b"not a gguf file" * 100),
                       ("empty.gguf", b"")):
        (tmp_path / name).write_bytes(body)
        with pytest.raises(ModelFileError):
            loader.load(tmp_path / name)


def rewrite(src, dst, **changes):
    """A copy of GGUF ``src`` with metadata fields changed (``key=value``; None drops the field)."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), changes.pop("general.architecture", "llama"))
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = changes.get(key, f.contents())
        if value is None:
            continue
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, vtype)
    for t in r.tensors:
        data = np.array(t.data)
        w.add_tensor(t.name, data) if t.tensor_type == gguf.GGMLQuantizationType.F32 else \
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("changes, match", [
    ({"general.architecture": "gpt2"}, "architecture 'gpt2'"),
    ({"llama.attention.head_count_kv": 2}, "heads"),
    ({"llama.rope.dimension_count": 32}, "rotary embeddings over 32"),
    ({"tokenizer.ggml.model": "llama"}, "tokenizer model 'llama'"),
    ({"tokenizer.ggml.pre": "qwen2"}, "pre-tokenizer 'qwen2'"),
    ({"llama.block_count": None}, "no 'llama.block_count'"),
    ({"llama.block_count": 3}, "no tensor 'blk.2"),
])
def test_models_the_engine_cannot_run_are_refused(tiny, tmp_path, changes, match):
    path = rewrite(tiny, tmp_path / "changed.gguf", **changes)
    if "tokenizer" in match or "pre-tokenizer" in match:
        with pytest.raises(UnsupportedModelError, match=match):
            Tokenizer(loader.load(path).vocab)
        return
    with pytest.raises(UnsupportedModelError, match=match):
        loader.load(path)


# --- the tokenizer ----------------------------------------------------------------------------------------------


TEXT = st.lists(st.sampled_from(list("abcdefghij ABC   \n\t01239.,;'!?-éü日本語🙂\u00a0\u2003")
                                + ["'s", "'ll", "<|im_end|>", "the", " fox"]), max_size=40).map("".join)


@settings(max_examples=200, deadline=None)
@given(TEXT)
def test_decode_inverts_encode(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.decode(tokenizer.encode(text, special=True), special=True) == text


def test_special_tokens_are_cut_out_only_when_asked(tokenizer):
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>", special=True)
    assert ids[0] == 1 and ids[-1] == 2
    assert 1 not in tokenizer.encode("<|im_start|>user").tolist()
    assert tokenizer.decode(ids) == "user\nhi"  # control tokens decode to nothing unless asked


def test_digits_split_one_by_one(tokenizer):
    pieces = tokenizer.pieces("In 2024, 365 trees")
    assert pieces == ["In", " ", "2", "0", "2", "4", ",", " ", "3", "6", "5", " trees"]


# --- generation ---------------------------------------------------------------------------------------------------


def greedy(engine, prompts, max_tokens=16, **kwargs):
    return [r.tokens[0].tolist() for r in engine.generate(prompts, SamplingParams(max_tokens=max_tokens), **kwargs)]


def test_batched_generation_equals_one_at_a_time(engine):
    prompts = [COMMON + "woods.", "Paging the cache: blocks, tables, slots.", "What's the name of the cat?"]
    alone = [greedy(engine, [p])[0] for p in prompts]
    assert greedy(engine, prompts) == alone
    assert engine.stats.max_batch >= 2


def test_chunked_prefill_equals_whole_prompts(tiny, engine):
    prompts = [COMMON * 3, "Paging the cache"]
    whole = greedy(engine, prompts)
    with Engine(tiny, backend="host", max_seqs=16, kv_tokens=1 << 14, step_tokens=24) as small:
        assert greedy(small, prompts) == whole
        assert small.stats.prefill_steps > 2


def test_parallel_greedy_samples_share_the_prompt_and_agree(engine, tmp_path):
    """n greedy samples fork one prompt: each child shares its blocks and copies the partly filled last one on
    write; all of them must generate what one sample does."""
    one = greedy(engine, [COMMON + "woods."], 12)[0]
    snap = tmp_path / "snap.json"
    result = engine.generate([COMMON + "woods."], SamplingParams(max_tokens=12, n=3), snapshot=snap)[0]
    assert [t.tolist() for t in result.tokens] == [one] * 3
    state = json.loads(snap.read_text())
    refs = np.asarray(state["blocks"]["ref_counts"])
    assert len(state["sequences"]) == 3 and (refs == 3).sum() >= 2  # the prompt's full blocks, held by all three


def test_sampling_is_seeded_and_per_sample(engine):
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=7, n=3)
    a = engine.generate(["The dog"], p)[0]
    b = engine.generate(["The dog"], p)[0]
    assert [t.tolist() for t in a.tokens] == [t.tolist() for t in b.tokens]
    assert len({tuple(t.tolist()) for t in a.tokens}) > 1  # three streams, not one
    c = engine.generate(["The dog"], SamplingParams(max_tokens=10, temperature=1.0, seed=8, n=3))[0]
    assert [t.tolist() for t in c.tokens] != [t.tolist() for t in a.tokens]


def forward_prompt(engine, tokens, decode):
    """The logits of a fresh sequence's prompt (one prefill step), then of ``decode`` greedy steps, through
    cache.step() and the model's forward pass; and the sequence's handle."""
    step = engine.cache.step(arrivals=[tokens])
    handle = int(step.arrived[0])
    logits = [np.array(engine.model.forward(step, np.asarray(tokens)))]
    for _ in range(decode):
        token = np.array([int(np.argmax(logits[-1][0]))])
        step = engine.cache.step(np.array([handle]), np.array([1]), token)
        logits.append(np.array(engine.model.forward(step, token)))
    return np.concatenate(logits), handle


def test_an_fp8_kv_cache_quantises_what_fp16_stores_and_attends_over_it(tiny, tokenizer):
    """The same prompt through an fp16 cache and an FP8 one (scales 1): the first layer's K and V, computed
    before any attention, are stored as the e4m3 quantisation of what the fp16 cache holds, bit for bit; the
    logits of the prefill and of decode steps stay within a few percent of fp16's (and differ from them: the
    FP8 planes are what attention read: 5.0% on this model, against garbage for a broken path)."""
    from pagedrt import fp8
    tokens = np.asarray(tokenizer.encode(COMMON + "woods."), np.int64)
    runs = {}
    for kv_dtype in ("float16", "float8_e4m3"):
        with Engine(tiny, backend="host", max_seqs=4, kv_tokens=1 << 12, kv_dtype=kv_dtype) as e:
            assert e.cache.kv_dtype == kv_dtype
            logits, handle = forward_prompt(e, tokens, decode=3)
            table = e.cache.block_tables([handle])[0]
            n = int(e.cache.lengths([handle])[0])
            slots = [(int(table[t // 16]), t % 16) for t in range(n)]
            planes = [np.stack([np.asarray(plane)[b, :, s] for b, s in slots])
                      for plane in (e.cache.k(0), e.cache.v(0))]
            runs[kv_dtype] = logits, planes
    (logits16, planes16), (logits8, planes8) = runs["float16"], runs["float8_e4m3"]
    ones = np.ones(planes16[0].shape[1], np.float32)
    for fp16_plane, fp8_plane in zip(planes16, planes8):
        assert np.array_equal(fp8_plane, fp8.quantise(fp16_plane, ones))
    error = np.linalg.norm(logits8 - logits16) / np.linalg.norm(logits16)
    assert 0 < error < 0.1, error


@pytest.mark.parametrize("kv_dtype", ["int8", 3, "float32"])
def test_a_kv_dtype_the_cache_cannot_store_is_a_named_error(tiny, kv_dtype):
    from pagedrt.errors import UnsupportedConfigError
    with pytest.raises(UnsupportedConfigError, match="K/V|kv_dtype"):
        Engine(tiny, backend="host", max_seqs=2, kv_tokens=1 << 10, kv_dtype=kv_dtype)


def test_top_p_keeps_the_most_likely_tokens():
    from pagedrt.engine.sampler import sample
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    draws = np.linspace(0, 0.999, 50)
    picked = sample(logits, np.zeros(50, np.int64), np.ones(50), np.full(50, 0.7), draws)
    assert set(picked.tolist()) == {0, 1}  # 0.5 + 0.3 reach 0.7
    assert (picked == 0).mean() == pytest.approx(0.5 / 0.8, abs=0.05)
    assert sample(logits, [0], [0.0], [1.0], [0.3]).tolist() == [0]


def test_a_prompt_sharing_a_system_prompt_finds_it_cached(tiny):
    with Engine(tiny, backend="host", max_seqs=16, kv_tokens=1 << 14) as fresh:
        first, second = fresh.generate([COMMON + "woods.", COMMON + "house."], SamplingParams(max_tokens=8))
        assert first.cached_tokens == 0 and second.cached_tokens >= 32
        hit = second.tokens[0].tolist()
    with Engine(tiny, backend="host", max_seqs=16, kv_tokens=1 << 14) as other:
        assert greedy(other, [COMMON + "house."], 8)[0] == hit  # the same tokens as computing it all


def test_prompts_sharing_a_first_block_wait_one_step_then_arrive_together(tiny):
    with Engine(tiny, backend="host", max_seqs=16, kv_tokens=1 << 14) as fresh:
        results = fresh.generate([COMMON + f"{i} woods." for i in range(5)], SamplingParams(max_tokens=4))
        assert [r.cached_tokens > 0 for r in results] == [False] + [True] * 4
        assert fresh.stats.prefill_steps == 2  # the first prompt alone, then the four others at once


def test_the_stop_token_ends_a_sample(tiny):
    with Engine(tiny, backend="host", max_seqs=4, kv_tokens=1 << 12) as e:
        e.stop_tokens = np.arange(e.config.vocab_size)  # every token stops
        r = e.generate(["The dog"], SamplingParams(max_tokens=8))[0]
    assert r.finish_reasons == ["stop"] and r.tokens[0].size == 0


@pytest.mark.parametrize("prompt, params, match", [
    ("", SamplingParams(), "empty"),
    ([], SamplingParams(), "empty"),
    ("The dog " * 300, SamplingParams(), "at most 512"),
    ("The dog", SamplingParams(max_tokens=600), "at most 512"),
    ("The dog", SamplingParams(n=64), "at most 16 sequences"),
])
def test_requests_the_cache_cannot_serve_are_refused(engine, prompt, params, match):
    with pytest.raises(RequestError, match=match):
        engine.generate([prompt], params)


@pytest.mark.parametrize("prompt", [["a"], None, [1.5], [1.0, 2.0], [[1, 2], [3, 4]], [[1], [2, 3]], [-1], [339],
                                    [True], 7, [2**70]])
def test_prompt_ids_that_are_not_a_flat_list_of_ids_in_the_vocabulary_are_refused(engine, prompt):
    """Checked before anything runs: floats are refused, not truncated, and nothing is left waiting."""
    steps = engine.stats.steps
    with pytest.raises(InvalidTokenIdsError, match=r"flat list of ints in \[0, 339\)"):
        engine.generate([[1, 2, 3], prompt], SamplingParams(max_tokens=2))
    assert engine.stats.steps == steps and engine.scheduler.idle and engine.cache.stats()["sequences"] == 0


# Generations of the engine before the scheduler was a module of its own (commit 64106fb), on a cache tight
# enough that prompts are chunked, rows and blocks bound admission, and prefixes are found cached.
PROMPTS = [COMMON + "woods.", "Paging the cache: blocks, tables, slots.", COMMON * 2 + "house.",
           "What's the name of the cat?", COMMON + "river, and then", "The dog"]
PARAMS = [SamplingParams(max_tokens=12, n=3), SamplingParams(max_tokens=20), SamplingParams(max_tokens=9, n=2),
          SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=3, n=4), SamplingParams(max_tokens=5),
          SamplingParams(max_tokens=30, n=2, temperature=1.0, seed=1)]
BEFORE = [([[152] + [33] * 11] * 3, 0), ([[231] * 5 + [147] + [1] * 14], 0), ([[152, 149, 96, 175] + [33] * 5] * 2, 48),
          ([[330, 65, 39, 228, 49, 255, 212, 135, 158, 30, 144, 11, 44, 274, 212, 144],
            [72, 144, 126, 14, 152, 180, 169, 83, 325, 215, 159, 323, 304, 50, 50, 256],
            [85, 152, 174, 100, 212, 5, 290, 282, 241, 119, 81, 147, 323, 38, 214, 256],
            [196, 305, 232, 193, 18, 325, 278, 204, 211, 223, 79, 327, 5, 225, 232, 325]], 0),
          ([[234, 152, 149, 96, 96]], 48),
          ([[172, 154, 263, 189, 49, 168, 208, 66, 137, 38, 155, 160, 42, 303, 173, 106, 131, 162, 68, 237, 73, 136,
             305, 138, 91, 108, 102, 218, 216, 319],
            [294, 277, 33, 184, 278, 154, 234, 76, 14, 325, 323, 319, 119, 186, 215, 37, 147, 274, 122, 234, 194, 280,
             35, 160, 96, 25, 16, 27, 131, 143]], 0)]


@pytest.mark.parametrize("sizes", [dict(max_seqs=16, kv_tokens=1 << 14),
                                   dict(max_seqs=6, kv_tokens=640, step_tokens=40),
                                   dict(max_seqs=4, kv_tokens=1 << 12, step_tokens=32)])
def test_generations_are_those_of_the_engine_before_the_scheduler_module(tiny, sizes):
    with Engine(tiny, backend="host", **sizes) as e:
        results = e.generate(PROMPTS, PARAMS)
        assert [([t.tolist() for t in r.tokens], r.cached_tokens) for r in results] == BEFORE
        if sizes["max_seqs"] < 16:  # the tight caches: chunked prompts, a full batch
            assert e.stats.prefill_steps > 4 and e.stats.max_batch == sizes["max_seqs"]


def test_rows_are_kept_for_the_samples_of_a_prompt_still_prefilling(tiny):
    """Four samples of a prompt prefilled over several steps take every row once it ends: a request behind it
    waits for a row instead of taking one of theirs (the block table would overflow at the fork)."""
    with Engine(tiny, backend="host", max_seqs=4, kv_tokens=1 << 12, step_tokens=16) as e:
        many, one = e.generate([COMMON, "The dog"], [SamplingParams(max_tokens=4, n=4), SamplingParams(max_tokens=4)])
        assert len(many.tokens) == 4 and len(one.tokens) == 1 and e.stats.max_batch == 4
    assert [t.tolist() for t in many.tokens] == [greedy_alone(tiny, COMMON, 4)] * 4
    assert one.tokens[0].tolist() == greedy_alone(tiny, "The dog", 4)


def test_a_generate_that_raises_midway_frees_its_sequences(engine):
    expected = greedy(engine, [COMMON + "woods.", "The dog"])

    def hook(request, sample, token):
        if request == 1:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        engine.generate([COMMON + "woods.", "The dog"], SamplingParams(max_tokens=16, n=2), on_token=hook)
    assert engine.scheduler.idle and engine.cache.stats()["sequences"] == 0
    assert greedy(engine, [COMMON + "woods.", "The dog"]) == expected


def greedy_alone(tiny, prompt, max_tokens):
    with Engine(tiny, backend="host", max_seqs=2, kv_tokens=1 << 12) as e:
        return greedy(e, [prompt], max_tokens)[0]


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(n=0), dict(temperature=-1.0), dict(top_p=0.0),
                                    dict(top_p=1.5), dict(seed=-1), dict(temperature=float("nan"))])
def test_sampling_parameters_out_of_range_are_refused(kwargs):
    with pytest.raises(RequestError):
        SamplingParams(**kwargs)
