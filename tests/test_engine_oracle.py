"""The engine against an independent implementation of the same model on the same weights: llama.cpp (through
llama-cpp-python, the ``oracle`` extra). On the host backend.

llama.cpp multiplies quantized (Q4_1, Q8_0) weights by activations it quantizes to 8 bits itself, along paths
that depend on the CPU (AVX2, AVX-512 and others round differently), which moves its logits by a few tenths of
their spread; the engine dequantizes the weights once and multiplies in float32. No bound on that difference
tests pagedrt, so llama.cpp runs on a float32 copy of each file (every tensor dequantized by the gguf package,
as the engine's loader does): both then compute the same arithmetic, with float16 K/V, on every CPU.

Tolerances (logits; the models' logits have a spread, std, of about 1 (tiny) and 4 (SmolLM2)): after each
prompt and after prompt + continuation, max |engine - llama.cpp| <= tol = 0.01 + 0.01 * std. At each of the
32 greedy steps, llama.cpp's logit of the engine's token is within 2 * tol of its best: what logits that
agree within tol allow (a near-tie may flip; anything else is a wrong token). The printed count is the steps
where both chose the same token.
Measured: max |diff| 0.0012-0.0017 (tiny), 0.009-0.018 (SmolLM2, std 4-8).
"""

import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import tiny_gguf

gguf = pytest.importorskip("gguf", reason="the engine reads GGUF with the gguf package: pip install 'pagedrt[model]'")
llama_cpp = pytest.importorskip("llama_cpp", reason="the oracle is llama.cpp: pip install 'pagedrt[oracle]'")

from pagedrt.engine import Engine, SamplingParams, fetch, loader  # noqa: E402
from pagedrt.engine.tokenizer import Tokenizer  # noqa: E402

STEPS = 32
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Explain paging in operating systems in one paragraph.", "List three prime numbers and say why."]
TINY_PROMPTS = ["The old fox lives in the house;", "In 2024 the man planted 365 trees, then",
                "What's the name of the cat? It's"]


def dequantized_copy(src, dst):
    """``src`` with every tensor dequantized to float32 (the metadata as it is)."""
    from gguf.quants import dequantize
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = 0 if key == "general.file_type" else f.contents()
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, f.types[0])
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(dequantize(t.data, t.tensor_type), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def oracle(path):
    return llama_cpp.Llama(str(path), n_ctx=1024, n_batch=1024, logits_all=True, verbose=False, n_threads=2)


def run_both(path, oracle_path, prompts, chat):
    """(engine's greedy continuations, engine's last-token logits after each prompt and after prompt +
    continuation, llama.cpp's logits over prompt + continuation, the prompts' ids)."""
    with Engine(path, backend="host", max_seqs=8, kv_tokens=1 << 13) as engine:
        engine.stop_tokens = np.zeros(0, np.int64)  # generate all STEPS tokens
        prompt_ids = [engine.encode_prompt(p, chat=chat) for p in prompts]
        results = engine.generate(prompt_ids, SamplingParams(max_tokens=STEPS))
        tokens = [r.tokens[0] for r in results]
        logits = []
        for ids in (prompt_ids, [np.concatenate([p, t]) for p, t in zip(prompt_ids, tokens)]):
            step = engine.cache.step([], arrivals=ids)  # the prefix cache holds every full block: start past them
            new = np.concatenate([i[c:] for i, c in zip(ids, step.cached)])
            logits.append(engine.model.forward(step, new).copy())
            engine.cache.free(step.arrived.tolist())
    llm = oracle(oracle_path)
    scores = []
    for p, t in zip(prompt_ids, tokens):
        llm.reset()
        llm.eval(np.concatenate([p, t]).tolist())
        scores.append(np.array(llm.scores[:p.size + t.size]))
    return tokens, logits, scores, prompt_ids


def check(path, oracle_path, prompts, *, chat):
    tokens, logits, scores, prompt_ids = run_both(path, oracle_path, prompts, chat)
    for i, (p, t, s) in enumerate(zip(prompt_ids, tokens, scores)):
        ours = np.stack([logits[0][i], logits[1][i]])
        theirs = np.stack([s[p.size - 1], s[-1]])
        diff, tol = ours - theirs, 0.01 + 0.01 * theirs.std()
        steps = s[p.size - 1:-1]                        # llama.cpp's logits where the engine chose t
        chosen = np.take_along_axis(steps, t[:, None], 1)[:, 0]
        gap = steps.max(1) - chosen                     # 0 where llama.cpp chose t too
        print(f"{os.path.basename(path)} vs {os.path.basename(oracle_path)}, prompt {i}: max |diff| "
              f"{np.abs(diff).max():.4f}, std {theirs.std():.2f}; greedy agrees at {np.sum(gap == 0)} of {STEPS} "
              f"steps, largest gap {gap.max():.4f}")
        assert np.abs(diff).max() <= tol
        assert np.all(gap <= 2 * (0.01 + 0.01 * steps.std(1)))


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("oracle")
    tiny_gguf.write(d / "f32.gguf")
    tiny_gguf.write(d / "q4.gguf", quantized=True)
    return d / "f32.gguf", d / "q4.gguf", dequantized_copy(d / "q4.gguf", d / "q4-as-f32.gguf")


def test_tiny_model_equals_llama_cpp(tiny_files):
    f32, _, _ = tiny_files
    check(f32, f32, TINY_PROMPTS, chat=False)


def test_tiny_quantized_model_equals_llama_cpp(tiny_files):
    _, q4, q4_as_f32 = tiny_files
    check(q4, q4_as_f32, TINY_PROMPTS, chat=False)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(list("abcdefghij ABC   \n\t01239.,;'!?-éü日本語🙂\u00a0")
                                + ["'s", "'ll", "the", " fox"]), max_size=40).map("".join))
def test_tokenizer_equals_llama_cpp(tiny_vocab, text):
    tokenizer, llm = tiny_vocab
    assert tokenizer.encode(text).tolist() == llm.tokenize(text.encode(), add_bos=False, special=False)


@pytest.fixture(scope="module")
def tiny_vocab(tiny_files):
    f32 = tiny_files[0]
    return Tokenizer(loader.load(f32).vocab), llama_cpp.Llama(str(f32), vocab_only=True, verbose=False)


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    path = fetch.default_path()
    if not path.is_file():
        pytest.skip(f"the model file is not at {path}: `pagedrt generate` fetches it")
    return path, dequantized_copy(path, tmp_path_factory.mktemp("real") / "f32.gguf")


def test_real_model_equals_llama_cpp(real):
    path, as_f32 = real
    check(path, as_f32, PROMPTS, chat=True)


def test_real_tokenizer_equals_llama_cpp(real):
    tokenizer = Tokenizer(loader.read_vocabulary(loader.open_gguf(real[0]).fields))
    llm = llama_cpp.Llama(str(real[0]), vocab_only=True, verbose=False)
    for text in ["Hello world! The year 2024 was   great.\n\nWhat's next? naïve café 日本語 🙂",
                 "<|im_start|>user\nhi<|im_end|>", "  leading spaces\ttabs\r\n and 12345 digits", "don't I'll we've"]:
        for special in (False, True):
            assert tokenizer.encode(text, special=special).tolist() == llm.tokenize(text.encode(), add_bos=False,
                                                                                    special=special)
