"""Byte-level BPE (GPT-2's scheme), built from a GGUF file's vocabulary and merges, as llama.cpp tokenizes.

Encoding: the special tokens' texts (control and user-defined tokens) are cut out
first when ``special`` is set; each other fragment is split by the model's
pre-tokenizer (regular expressions named by ``tokenizer.ggml.pre``); each piece's
UTF-8 bytes are written as GPT-2's printable stand-ins (:func:`byte_alphabet`) and
merged pairwise, the pair of highest priority (earliest in the merges) first,
leftmost first among equals, until no pair in the merges is left. Decoding maps the
stand-ins back to bytes.

A piece is merged in O(n log n) of its length: a heap of its adjacent pairs' ranks
over a linked list of its symbols, stale pairs skipped as they come up (as llama.cpp
does), so a long piece without spaces costs no more than as many short ones. A text
is checked before it is split: it must be valid Unicode (a lone surrogate, as a
non-UTF-8 command line gives, is an :class:`~pagedrt.errors.InvalidPromptError`),
and with a ``limit`` no longer than that many tokens could hold, counted from its
bytes and the longest token's.

Python's ``re`` has no ``\\p{L}`` or ``\\p{N}``: :func:`category_class` builds those
character classes from :mod:`unicodedata` once per process. Pieces and their
merged tokens are cached, so a text is tokenized in a loop over its pieces, not its
characters.
"""

import functools
import heapq
import re
import sys
import unicodedata
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import InvalidPromptError, RequestError, UnsupportedModelError
from .loader import Vocabulary

CONTROL, USER_DEFINED = 3, 4

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\pL+| ?\pN+| ?[^\s\pL\pN]+|\s+(?!\S)|\s+"
LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\pL\pN]?\pL+|\pN{1,3}"
          r"| ?[^\s\pL\pN]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the expressions applied in turn, each splitting the pieces the last one left
PRE_TOKENIZERS = {"gpt2": (GPT2,), "smollm": (r"\pN", GPT2), "llama-bpe": (LLAMA3,), "llama3": (LLAMA3,)}


@functools.lru_cache(maxsize=None)
def byte_alphabet() -> Dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves, the others are
    shifted past 255 in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shift = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shift)
            shift += 1
    return table


@functools.lru_cache(maxsize=None)
def category_class(letter: str) -> str:
    """The body of a ``re`` character class matching every code point of Unicode general category ``letter``
    (``"L"``: letters, ``"N"``: numbers), as ranges."""
    ranges, start, last = [], None, None
    for cp in range(sys.maxunicode + 1):
        if unicodedata.category(chr(cp))[0] == letter:
            if start is None:
                start = cp
            last = cp
        elif start is not None:
            ranges.append((start, last))
            start = None
    if start is not None:
        ranges.append((start, last))
    escape = lambda cp: f"\\U{cp:08x}"  # noqa: E731
    return "".join(escape(a) if a == b else f"{escape(a)}-{escape(b)}" for a, b in ranges)


def compile_pattern(expression: str) -> re.Pattern[str]:
    """``expression`` with ``\\pL`` and ``\\pN`` written out for ``re``, in and out of brackets."""
    letters, numbers = category_class("L"), category_class("N")
    out, inside, i = [], False, 0
    while i < len(expression):
        c = expression[i]
        if c == "\\" and expression[i + 1] == "p":
            body = letters if expression[i + 2] == "L" else numbers
            out.append(body if inside else f"[{body}]")
            i += 3
            continue
        if c == "\\":
            out.append(expression[i:i + 2])
            i += 2
            continue
        if c == "[" and not inside:
            inside = True
        elif c == "]" and inside:
            inside = False
        out.append(c)
        i += 1
    return re.compile("".join(out))


def split(text: str, patterns: Iterable[re.Pattern[str]]) -> List[str]:
    """``text`` cut by each compiled pattern in turn: every match of a pattern in a piece becomes a piece, and so
    does what lies between matches (as llama.cpp splits)."""
    pieces = [text]
    for pattern in patterns:
        out = []
        for piece in pieces:
            end = 0
            for m in pattern.finditer(piece):
                if m.start() > end:
                    out.append(piece[end:m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                end = m.end()
            if end < len(piece):
                out.append(piece[end:])
        pieces = out
    return pieces


class Tokenizer:
    """Byte-level BPE over a :class:`~pagedrt.engine.loader.Vocabulary`."""

    def __init__(self, vocab: Vocabulary) -> None:
        if vocab.model != "gpt2":
            raise UnsupportedModelError(f"tokenizer model {vocab.model!r} (tokenizer.ggml.model) is not supported: "
                                        "the engine tokenizes byte-level BPE (\"gpt2\")")
        if vocab.pre not in PRE_TOKENIZERS:
            raise UnsupportedModelError(f"pre-tokenizer {vocab.pre!r} (tokenizer.ggml.pre) is not supported: "
                                        f"{', '.join(sorted(PRE_TOKENIZERS))}")
        self.vocab = vocab
        self.ids = {t: i for i, t in enumerate(vocab.tokens)}
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(vocab.merges)}
        self.patterns = [compile_pattern(e) for e in PRE_TOKENIZERS[vocab.pre]]
        alphabet = byte_alphabet()
        self.encode_bytes = [alphabet[b] for b in range(256)]
        self.decode_chars = {c: b for b, c in alphabet.items()}
        special = [i for i, t in enumerate(vocab.token_types) if t in (CONTROL, USER_DEFINED) and vocab.tokens[i]]
        self.special = np.zeros(len(vocab.tokens), bool)
        self.special[special] = True
        texts = sorted((vocab.tokens[i] for i in special), key=len, reverse=True)
        self.special_split = re.compile("(" + "|".join(map(re.escape, texts)) + ")") if texts else None
        # token id -> its bytes (control tokens decode to nothing unless asked for)
        self.token_bytes = [self._bytes(i) for i in range(len(vocab.tokens))]
        # the most bytes of text one token stands for: a text of n bytes is at least n / longest tokens
        self.longest = max([len(b) for b in self.token_bytes] + [len(t.encode()) for t in texts] + [1])
        self._piece = functools.lru_cache(maxsize=1 << 16)(self._bpe)

    @property
    def bos(self) -> int:
        """The begin-of-sequence token's id."""
        return self.vocab.bos

    @property
    def stop(self) -> Tuple[int, ...]:
        """The token ids that end a generation: eos, and end-of-turn or end-of-message where the model names them."""
        return self.vocab.stop

    def _bytes(self, i):
        text = self.vocab.tokens[i]
        if self.vocab.token_types[i] == USER_DEFINED:
            return text.encode()
        if self.vocab.token_types[i] == CONTROL:
            return b""
        try:
            return bytes(self.decode_chars[c] for c in text)
        except KeyError:  # not byte-level text: written as is
            return text.encode()

    def encode(self, text: str, *, special: bool = False, bos: Optional[bool] = None,
               limit: Optional[int] = None) -> np.ndarray:
        """Token ids of ``text`` (int64, 1-D). ``special``: special tokens' texts become those tokens; ``bos``:
        put the begin-of-sequence token first (default: as the model's metadata says); ``limit``: refuse (a
        RequestError) a text of more tokens than this, before splitting it when its length in bytes says so.

        Raises InvalidPromptError when ``text`` is not valid Unicode (lone surrogates)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        try:
            size = len(text.encode())
        except UnicodeEncodeError as exc:
            raise InvalidPromptError(f"the text is not valid Unicode: {text[exc.start]!r} at character {exc.start} is "
                                     "a lone surrogate (bytes that were not UTF-8?): give UTF-8 text") from None
        ids = [self.bos] if (self.vocab.add_bos if bos is None else bos) else []
        if limit is not None:
            self._refuse_past(limit, len(ids) - (-size // self.longest))
        fragments = self.special_split.split(text) if special and self.special_split else [text]
        for k, fragment in enumerate(fragments):
            if k % 2:  # a special token's text (split keeps the separators at odd places)
                ids.append(self.ids[fragment])
            elif fragment:
                for piece in self.pieces(fragment):
                    ids.extend(self._piece(piece))
                    if limit is not None:
                        self._refuse_past(limit, len(ids))
        return np.array(ids, np.int64)

    @staticmethod
    def _refuse_past(limit, fewest):
        if fewest > limit:
            raise RequestError(f"the text has at least {fewest} tokens, but at most {limit} fit: shorten it")

    def pieces(self, text: str) -> List[str]:
        """The pre-tokenizer's pieces of ``text``."""
        return split(text, self.patterns)

    def _bpe(self, piece):
        """The token ids of one piece: its bytes' stand-ins merged pair by pair, best-ranked and leftmost first."""
        parts = [self.encode_bytes[b] for b in piece.encode()]
        out = []
        for p in merge(parts, self.ranks):
            i = self.ids.get(p)
            if i is None:  # a merged piece the vocabulary lacks: its single bytes
                out.extend(self._byte(c) for c in p)
            else:
                out.append(i)
        return tuple(out)

    def _byte(self, c):
        """The token of byte stand-in ``c``; InvalidPromptError when the vocabulary has none (SmolLM2's lacks some
        control characters' bytes)."""
        i = self.ids.get(c)
        if i is None:
            raise InvalidPromptError(f"the text holds byte {self.decode_chars[c]:#04x}, which the model's vocabulary "
                                     "has no token for: leave it out")
        return i

    def decode(self, ids: Iterable[int], *, special: bool = False) -> str:
        """The text of ``ids`` (invalid UTF-8 replaced); ``special``: control tokens as their texts."""
        return self.decode_bytes(ids, special=special).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int], *, special: bool = False) -> bytes:
        """The bytes ``ids`` stand for (control tokens for none); ``special``: control tokens as their texts."""
        tokens = self.vocab.tokens
        return b"".join(tokens[i].encode() if special and self.special[i] else self.token_bytes[i]
                        for i in map(int, ids))


def merge(parts: Sequence[str], ranks: Dict[Tuple[str, str], int]) -> List[str]:
    """``parts`` (strs) merged as BPE does: while any adjacent pair is in ``ranks`` (pair -> rank), the pair of
    the lowest rank, leftmost among equals, becomes one part. Returns the parts left, in order.

    A heap of (rank, left, right, right's end) over a linked list of the parts (each known by where it starts,
    which merging keeps): a pair is pushed when it becomes adjacent and skipped when it comes up stale (its left
    part merged away, or either part grown), so n parts take O(n log n), not O(n^2)."""
    n = len(parts)
    text = list(parts)
    after = list(range(1, n + 1))        # part i -> the next live part (n: none)
    before = list(range(-1, n - 1))     # part i -> the previous live part (-1: none)
    live = [True] * n
    rank, push, pop = ranks.get, heapq.heappush, heapq.heappop
    heap = [(r, i, i + 1, i + 2) for i, r in enumerate(map(rank, zip(text, text[1:]))) if r is not None]
    heapq.heapify(heap)
    while heap:
        _, left, right, end = pop(heap)
        if not live[left] or after[left] != right or after[right] != end:
            continue  # stale: the pair was merged away or a part of it changed
        text[left] += text[right]
        live[right] = False
        after[left] = end
        if end < n:  # the merged part and the one after it
            before[end] = left
            r = rank((text[left], text[end]))
            if r is not None:
                push(heap, (r, left, end, after[end]))
        previous = before[left]
        if previous >= 0:  # the one before it and the merged part
            r = rank((text[previous], text[left]))
            if r is not None:
                push(heap, (r, previous, left, end))
    return [t for t, alive in zip(text, live) if alive]
