"""Read a Llama-family GGUF file: its configuration, its tokenizer's data and its weights, dequantised once.

The ``gguf`` package (llama.cpp's own reader, NumPy only) maps the file and parses
its metadata; :func:`gguf.quants.dequantize` turns every tensor type it knows
(F32, F16, BF16, Q4_0 ... Q8_0, the K-quants) into float32 rows. A weight
``[out, in]`` (GGUF's ``ne`` = [in, out]) is returned transposed, ``[in, out]``
C-contiguous, so a layer is ``x @ w``; the attention's Q, K and V are
concatenated into one matrix and the feed-forward's gate and up into another, so
each is one GEMM. GGUF's Llama Q and K weights are permuted by its converter so
that rotary embeddings rotate adjacent pairs (llama.cpp's "normal" RoPE), which
is how :mod:`pagedrt.engine.ops` applies them.

Errors: a missing or unreadable file, or one that is truncated or not GGUF, is a
:class:`~pagedrt.errors.ModelFileError`; a file the engine cannot run (another
architecture, a missing tensor, one of the wrong shape or an unknown one) an
:class:`~pagedrt.errors.UnsupportedModelError`.
"""

import os
from dataclasses import dataclass

import numpy as np

from ..errors import ModelFileError, UnsupportedModelError
from .config import ModelConfig, field, read_config

LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                 "ffn_down")


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
    output: np.ndarray     # [hidden, vocab] (the embedding transposed when tied)
    output_norm: np.ndarray
    layers: list           # dicts: attn_norm, qkv [hidden, q+2kv], o, ffn_norm, gate_up [hidden, 2 ffn], down


@dataclass
class GGUFModel:
    path: str
    config: ModelConfig
    vocab: Vocabulary
    weights: Weights


def open_gguf(path):
    """A :class:`gguf.GGUFReader` over ``path``; ModelFileError when it is missing, unreadable or not GGUF."""
    try:
        import gguf
    except ImportError:
        raise UnsupportedModelError("reading GGUF files needs the gguf package: pip install 'pagedrt[model]'") from None
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ModelFileError(f"model file {path} does not exist")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError, OSError, EOFError) as exc:
        raise ModelFileError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc}): it may be "
                             "truncated or corrupt; fetch it again") from None


def read_vocabulary(fields):
    """The :class:`Vocabulary` of a GGUF file's metadata."""
    model = field(fields, "tokenizer.ggml.model")
    tokens = list(field(fields, "tokenizer.ggml.tokens"))
    n = len(tokens)
    types = np.asarray(field(fields, "tokenizer.ggml.token_type", [1] * n), np.int32)
    ids = [int(field(fields, f"tokenizer.ggml.{k}_token_id", -1)) for k in ("bos", "eos", "eot", "eom")]
    for name, i in zip(("bos", "eos"), ids):
        if not 0 <= i < n:
            raise UnsupportedModelError(f"the tokenizer's {name} token id {i} is not one of its {n} tokens")
    return Vocabulary(model=str(model), pre=str(field(fields, "tokenizer.ggml.pre", "default")), tokens=tokens,
                      token_types=types, merges=list(field(fields, "tokenizer.ggml.merges", [])), bos=ids[0],
                      eos=ids[1], stop=tuple(dict.fromkeys(i for i in ids[1:] if 0 <= i < n)),
                      add_bos=bool(field(fields, "tokenizer.ggml.add_bos_token", True)),
                      chat_template=str(field(fields, "tokenizer.chat_template", "")))


def load(path):
    """The :class:`GGUFModel` in ``path``: configuration, vocabulary and float32 weights."""
    reader = open_gguf(path)
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
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise UnsupportedModelError(f"tensor {name} is of type {t.tensor_type.name}, which the gguf package "
                                        "cannot dequantise") from None
        w = np.asarray(w, np.float32).reshape(tuple(int(x) for x in reversed(t.shape)))
        if w.shape != expected[kind]:
            raise UnsupportedModelError(f"tensor {name} has shape {w.shape}, not {expected[kind]} as the metadata says")
        return w

    layers = []
    for i in range(c.num_layers):
        w = {kind: get(f"blk.{i}.{kind}.weight", kind) for kind in LAYER_TENSORS}
        layers.append({"attn_norm": w["attn_norm"], "ffn_norm": w["ffn_norm"],
                       "qkv": np.ascontiguousarray(np.concatenate([w["attn_q"], w["attn_k"], w["attn_v"]]).T),
                       "o": np.ascontiguousarray(w["attn_output"].T),
                       "gate_up": np.ascontiguousarray(np.concatenate([w["ffn_gate"], w["ffn_up"]]).T),
                       "down": np.ascontiguousarray(w["ffn_down"].T)})
    embedding = get("token_embd.weight", "token_embd")
    output = get("output.weight", "output") if "output.weight" in tensors else embedding
    weights = Weights(embedding=embedding, output=np.ascontiguousarray(output.T),
                      output_norm=get("output_norm.weight", "output_norm"), layers=layers)
    unknown = sorted(set(tensors) - used)
    if unknown:
        raise UnsupportedModelError(f"the model has tensors the engine does not use ({', '.join(unknown[:4])}"
                                    f"{' ...' if len(unknown) > 4 else ''}): not a plain Llama-family model")
    return GGUFModel(os.fspath(path), config, vocab, weights)
