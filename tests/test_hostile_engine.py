"""Hostile model files, prompts and paths (issue 35, item 4): each ends in one named error, never a traceback, a
hang or garbage generated silently. The reproducers of /work/shared/repro (GGUF metadata of the wrong type or out
of range, a quadratic tokenizer, prompts that are not UTF-8, special files as --batch or --model, a wheel path
ignored, --watch nan, --snapshot into a missing directory) are tests here, and so is a fuzz over every metadata
field the engine reads."""

import heapq
import math
import os

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st

import tiny_gguf

gguf = pytest.importorskip("gguf", reason="the engine reads GGUF with the gguf package: pip install 'pagedrt[model]'")

from pagedrt.cli import main  # noqa: E402
from pagedrt.engine import Engine, SamplingParams, loader  # noqa: E402
from pagedrt.engine.tokenizer import Tokenizer, merge  # noqa: E402
from pagedrt.errors import InvalidPromptError, RequestError  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    tiny_gguf.write(path)
    return path


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
    with pytest.raises(RequestError, match="at least 101 tokens, more than the 100"):
        tokenizer.encode(text, bos=False, limit=100)


def test_a_limit_stops_encoding_at_the_first_piece_past_it(tokenizer):
    text = "fox " * 50  # short in bytes for 100 tokens: the bound from bytes cannot refuse it
    ids = tokenizer.encode(text, bos=False)
    assert tokenizer.encode(text, bos=False, limit=ids.size).tolist() == ids.tolist()
    with pytest.raises(RequestError, match=f"more than the {ids.size - 1} it may have"):
        tokenizer.encode(text, bos=False, limit=ids.size - 1)


def test_the_engine_refuses_a_prompt_not_utf8_or_too_long_by_name(tiny):
    with Engine(tiny, backend="host", max_seqs=2, kv_tokens=1024) as engine:
        with pytest.raises(InvalidPromptError):
            engine.generate(["a\ud800b"], SamplingParams(max_tokens=2))
        with pytest.raises(RequestError, match="more than the 511"):
            engine.generate(["the" * 33_333], SamplingParams(max_tokens=2))
        assert engine.generate(["the fox"], SamplingParams(max_tokens=2))[0].tokens[0].size == 2
