"""Read a Llama-family GGUF file: its configuration, its tokenizer's data and its weights, dequantised once.

The ``gguf`` package (llama.cpp's own reader, NumPy only) maps the file and parses
its metadata; :func:`gguf.quants.dequantize` turns every tensor type it knows
(F32, F16, BF16, Q4_0 ... Q8_0, the K-quants) into float32 rows. A weight
is returned as GGUF stores it, ``[out, in]`` (``ne`` = [in, out]) C-contiguous, so a
layer is ``x @ w.T`` and each output's weights are one contiguous row; the attention's Q, K and V are
concatenated into one matrix and the feed-forward's gate and up into another, so
each is one GEMM. GGUF's Llama Q and K weights are permuted by its converter so
that rotary embeddings rotate adjacent pairs (llama.cpp's "normal" RoPE), which
is how :mod:`pagedrt.engine.ops` applies them.

Errors: a missing or unreadable file, one that is not a regular file, truncated or
not GGUF, or whose tensors' data is not where their types and shapes put it
(misaligned, overlapping, or of another size than declared: F32 data typed F16),
is a :class:`~pagedrt.errors.ModelFileError`; a file the engine cannot run (another
architecture, metadata of the wrong type or out of range, a missing tensor, one of
the wrong shape or an unknown one, weights that are NaN or infinite) an
:class:`~pagedrt.errors.UnsupportedModelError`. Both name the field or tensor.
The data's layout is checked as llama.cpp checks it (each tensor where the last
one's padded data ends); NaN and infinity once per tensor as it is dequantised.
"""

import os
from dataclasses import dataclass
from typing import Any, Dict, Union

import numpy as np

from ..errors import ModelFileError, UnsupportedModelError
from .config import MAX_VOCAB, ModelConfig, field, read_config

LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                 "ffn_down")
INTEGER_TYPES = ("I8", "I16", "I32", "I64")  # tensor types that hold no weights
TOKEN_TYPES = (1, 6)                         # normal ... byte (the range of tokenizer.ggml.token_type)


@dataclass(frozen=True)
class Vocabulary:
    """The tokenizer's data from the file's metadata (``tokenizer.ggml.*``)."""

    model: str            # "gpt2": byte-level BPE
    pre: str              # the pre-tokenizer's name ("smollm", "gpt2", "llama-bpe" ...)
    tokens: list          # token id -> its text (byte-level, as GPT-2 writes bytes)
    token_types: np.ndarray  # 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    merges: list          # "a b" pairs, highest priority first
    bos: int
    eos: int
    stop: tuple           # token ids that end a generation (eos, and end-of-turn/message when named)
    add_bos: bool
    chat_template: str


@dataclass
class Weights:
    """A model's weights as float32 NumPy arrays: per layer a dict, and the globals."""

    embedding: np.ndarray  # [vocab, hidden]
    output: np.ndarray     # [vocab, hidden] (the embedding itself when tied)
    output_norm: np.ndarray
    layers: list           # dicts, weights [out, in]: attn_norm, qkv [q+2kv, hidden], o [hidden, hidden],
    #                        ffn_norm, gate_up [2 ffn, hidden], down [hidden, ffn]


@dataclass
class GGUFModel:
    path: str
    config: ModelConfig
    vocab: Vocabulary
    weights: Weights


def open_gguf(path: Union[str, os.PathLike]) -> Any:
    """A :class:`gguf.GGUFReader` over ``path``; ModelFileError when it is missing, not a regular file (a FIFO,
    a device, a directory), unreadable or not GGUF."""
    try:
        import gguf
    except ImportError:
        raise UnsupportedModelError("reading GGUF files needs the gguf package: pip install 'pagedrt[model]'") from None
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ModelFileError(f"model file {path} does not exist")
    if not os.path.isfile(path):
        raise ModelFileError(f"model file {path} is not a regular file")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError, OSError, EOFError, OverflowError) as exc:
        raise ModelFileError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc}): it may be "
                             "truncated or corrupt; fetch it again") from None


def read_vocabulary(fields: Dict[str, Any]) -> Vocabulary:
    """The :class:`Vocabulary` of a GGUF file's metadata, every field checked (:func:`~.config.field`)."""
    key = "tokenizer.ggml."
    tokens = field(fields, key + "tokens", "str list")
    n = len(tokens)
    if not 1 <= n <= MAX_VOCAB:
        raise UnsupportedModelError(f"metadata '{key}tokens' holds {n} tokens: 1 to {MAX_VOCAB}")
    types = np.asarray(field(fields, key + "token_type", "int list", [1] * n, low=TOKEN_TYPES[0],
                             high=TOKEN_TYPES[1]), np.int32)
    if types.size != n:
        raise UnsupportedModelError(f"metadata '{key}token_type' has {types.size} types for the {n} tokens of "
                                    f"'{key}tokens'")
    merges = field(fields, key + "merges", "str list", [])
    bad = next((i for i, m in enumerate(merges) if m.find(" ", 1) < 1), None)
    if bad is not None:
        raise UnsupportedModelError(f"metadata '{key}merges' [{bad}] = {merges[bad][:40]!r} is not two tokens "
                                    "and a space")
    bos, eos = (field(fields, f"{key}{k}_token_id", "int", low=0, high=n - 1) for k in ("bos", "eos"))
    ends = (field(fields, f"{key}{k}_token_id", "int", None, low=0, high=n - 1) for k in ("eot", "eom"))
    return Vocabulary(model=field(fields, key + "model", "str"), pre=field(fields, key + "pre", "str", "default"),
                      tokens=tokens, token_types=types, merges=merges, bos=bos, eos=eos,
                      stop=tuple(dict.fromkeys(i for i in (eos, *ends) if i is not None)),
                      add_bos=field(fields, key + "add_bos_token", "bool", True),
                      chat_template=field(fields, "tokenizer.chat_template", "str", ""))


def check_layout(reader: Any, size: int) -> None:
    """Refuse (ModelFileError, naming the tensor) tensor data that is not where its type and shape put it:
    each tensor at the alignment, where the one before it ends (padded), the last one ending the file
    (``size`` bytes). A tensor typed F16 over F32 data, or at a shifted offset, fails here."""
    alignment = field(reader.fields, "general.alignment", "int", 32, low=1, high=1 << 16)
    if alignment & (alignment - 1):
        raise ModelFileError(f"metadata 'general.alignment' = {alignment} is not a power of two")
    expected = 0
    for t in reader.tensors:
        offset = t.data_offset - reader.data_offset
        if offset % alignment:
            raise ModelFileError(f"tensor {t.name}'s data starts at byte {offset}, not a multiple of the file's "
                                 f"alignment {alignment}: the file is corrupt")
        if offset != expected:
            raise ModelFileError(f"tensor {t.name}'s data starts at byte {offset}, not {expected} where the tensor "
                                 "before it ends: its offset or the one before it is corrupt, or that tensor's data "
                                 "is of another type or shape than declared")
        expected += -(-int(t.n_bytes) // alignment) * alignment
    if size > reader.data_offset + expected:
        raise ModelFileError(f"the file has {size - reader.data_offset - expected} bytes past its last tensor's "
                             "data: a tensor's data is of another type or shape than declared, or the file is "
                             "corrupt")


def load(path: Union[str, os.PathLike]) -> GGUFModel:
    """The :class:`GGUFModel` in ``path``: configuration, vocabulary and float32 weights."""
    reader = open_gguf(path)
    check_layout(reader, os.path.getsize(path))
    vocab = read_vocabulary(reader.fields)
    config = read_config(reader.fields, len(vocab.tokens))
    tensors = {t.name: t for t in reader.tensors}
    c = config
    expected = {"token_embd": (c.vocab_size, c.hidden), "output": (c.vocab_size, c.hidden), "output_norm": (c.hidden,),
                "attn_norm": (c.hidden,), "ffn_norm": (c.hidden,), "attn_q": (c.hidden, c.hidden),
                "attn_k": (c.kv_heads * c.head_dim, c.hidden), "attn_v": (c.kv_heads * c.head_dim, c.hidden),
                "attn_output": (c.hidden, c.hidden), "ffn_gate": (c.ffn, c.hidden), "ffn_up": (c.ffn, c.hidden),
                "ffn_down": (c.hidden, c.ffn)}
    used = set()

    def get(name, kind):
        """Tensor ``name`` dequantised to float32 [out, in] (a vector stays 1-D), its shape checked."""
        t = tensors.get(name)
        if t is None:
            raise UnsupportedModelError(f"the model has no tensor {name!r}: not a Llama-family model")
        used.add(name)
        from gguf.quants import dequantize
        if t.tensor_type.name in INTEGER_TYPES:
            raise UnsupportedModelError(f"tensor {name} is of type {t.tensor_type.name}: integers, not weights")
        shape = tuple(int(x) for x in reversed(t.shape))
        if shape != expected[kind]:
            raise UnsupportedModelError(f"tensor {name} has shape {shape}, not {expected[kind]} as the metadata says")
        try:
            w = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
        except NotImplementedError:
            raise UnsupportedModelError(f"tensor {name} is of type {t.tensor_type.name}, which the gguf package "
                                        "cannot dequantise") from None
        if not np.isfinite(w).all():
            raise UnsupportedModelError(f"tensor {name} holds {w.size - np.isfinite(w).sum()} NaN or infinite "
                                        "weights: the file is corrupt")
        return w

    layers = []
    for i in range(c.num_layers):
        w = {kind: get(f"blk.{i}.{kind}.weight", kind) for kind in LAYER_TENSORS}
        layers.append({"attn_norm": w["attn_norm"], "ffn_norm": w["ffn_norm"],
                       "qkv": np.concatenate([w["attn_q"], w["attn_k"], w["attn_v"]]),
                       "o": w["attn_output"], "gate_up": np.concatenate([w["ffn_gate"], w["ffn_up"]]),
                       "down": w["ffn_down"]})
    embedding = get("token_embd.weight", "token_embd")
    output = get("output.weight", "output") if "output.weight" in tensors else embedding
    weights = Weights(embedding=embedding, output=output,
                      output_norm=get("output_norm.weight", "output_norm"), layers=layers)
    unknown = sorted(set(tensors) - used)
    if unknown:
        raise UnsupportedModelError(f"the model has tensors the engine does not use ({', '.join(unknown[:4])}"
                                    f"{' ...' if len(unknown) > 4 else ''}): not a plain Llama-family model")
    return GGUFModel(os.fspath(path), config, vocab, weights)
