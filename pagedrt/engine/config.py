"""A Llama-family model's shape and hyperparameters, read from a GGUF file's metadata, and checked.

GGUF names its hyperparameters after the architecture (``llama.block_count``,
``llama.attention.head_count`` ...). Every metadata field is read through
:func:`field`, which checks its GGUF type, its presence and its range before the
value is used: a field of the wrong type, missing, out of range or huge (a count
past what any model has, which would size arrays before a shape check could
refuse it) is one :class:`~pagedrt.errors.UnsupportedModelError` naming the field.
:func:`read_config` then refuses what the engine does not run: an architecture
other than Llama's, rotary embeddings over part of a head or scaled other than
linearly, or a head size or grouping that pagedrt's attention kernels do not
support (:mod:`pagedrt.supported`).
"""

from dataclasses import dataclass
from typing import Any, Dict, Optional

from ..errors import UnsupportedModelError
from ..supported import GROUPS, PREFILL_HEAD_DIMS

ARCHITECTURES = ("llama",)   # GGUF's name for Llama 1-3, Mistral, SmolLM, TinyLlama and other Llama-shaped models
ROPE_SCALINGS = ("none", "linear")
# Bounds past every released Llama-family model (widths to 16k, 128 layers, vocabularies to 256k, contexts to 10M):
# a value beyond them is a corrupt or hostile file, refused before it sizes anything.
MAX_WIDTH, MAX_LAYERS, MAX_HEADS, MAX_VOCAB, MAX_CONTEXT = 1 << 16, 1 << 10, 1 << 10, 1 << 22, 1 << 31

# GGUF's value types (gguf.GGUFValueType, as the format's specification numbers them)
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
TYPES = {"int": {UINT8, INT8, UINT16, INT16, UINT32, INT32, UINT64, INT64}, "float": {FLOAT32, FLOAT64},
         "bool": {BOOL}, "str": {STRING}}
NAMES = {"int": ("an integer", "integers"), "float": ("a number", "numbers"), "bool": ("a boolean", "booleans"),
         "str": ("a string", "strings")}
REQUIRED = object()


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know of a model besides its tensors."""

    name: str
    num_layers: int
    hidden: int           # embedding width
    ffn: int              # SwiGLU's inner width
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int   # the longest sequence the model was trained for
    rope_theta: float     # the rotary embedding's base
    rope_scale: float     # positions are multiplied by this (linear scaling: 1 / factor)
    rms_eps: float

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.q_heads // self.kv_heads


def field(fields: Dict[str, Any], key: str, kind: str, default: Any = REQUIRED, *, low: Optional[float] = None,
          high: Optional[float] = None) -> Any:
    """The value of GGUF metadata ``key``, checked; ``default`` when it is absent and not required.

    Parameters
    ----------
    fields : dict
        ``GGUFReader.fields``: key -> ``ReaderField``.
    key : str
        The field's name.
    kind : str
        ``"int"``, ``"float"``, ``"bool"``, ``"str"``, or one of them followed by ``" list"`` (a GGUF array of
        them, returned as a list).
    low, high : number, optional
        The range a number (or every number of a list) must lie in, inclusive; NaN is out of every range.

    Raises UnsupportedModelError naming ``key`` when it is missing and required, of another type, out of range
    or not UTF-8 text.
    """
    f = fields.get(key)
    if f is None:
        if default is REQUIRED:
            raise UnsupportedModelError(f"the model's metadata has no {key!r}: not a complete Llama-family GGUF file")
        return default
    base, is_list = kind.split(" ")[0], kind.endswith(" list")
    types = [int(t) for t in f.types]
    shape_ok = len(types) == 2 and types[0] == ARRAY if is_list else len(types) == 1
    if not shape_ok or types[-1] not in TYPES[base]:
        expected = f"an array of {NAMES[base][1]}" if is_list else NAMES[base][0]
        raise UnsupportedModelError(f"metadata {key!r} is {_described(types)}, not {expected}")
    try:
        value = f.contents()
    except UnicodeDecodeError:
        raise UnsupportedModelError(f"metadata {key!r} is not UTF-8 text") from None
    for x in value if is_list else [value]:
        if (low is not None and not low <= x) or (high is not None and not x <= high):
            raise UnsupportedModelError(f"metadata {key!r} = {x!r} is out of range: {low} to {high}")
    return value


def _described(types):
    """How a field of GGUF ``types`` reads in a message (``an array of strings``, ``a number``)."""
    one, many = next((NAMES[k] for k, kinds in TYPES.items() if types and types[-1] in kinds),
                     ("of an unknown type", "values of an unknown type"))
    if len(types) > 1:
        return "an array of arrays" if ARRAY in types[1:] else f"an array of {many}"
    return one


def read_config(fields: Dict[str, Any], vocab_size: int) -> ModelConfig:
    """The checked :class:`ModelConfig` of a GGUF file's metadata ``fields`` (``GGUFReader.fields``), whose
    tokenizer has ``vocab_size`` tokens."""
    arch = field(fields, "general.architecture", "str")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"architecture {arch!r} (general.architecture) is not supported: the engine "
                                    f"runs {', '.join(ARCHITECTURES)}")
    p = f"{arch}."
    get = lambda key, kind, default=REQUIRED, **bounds: field(fields, p + key, kind, default, **bounds)  # noqa: E731
    hidden = get("embedding_length", "int", low=1, high=MAX_WIDTH)
    q_heads = get("attention.head_count", "int", low=1, high=MAX_HEADS)
    kv_heads = get("attention.head_count_kv", "int", q_heads, low=1, high=q_heads)
    head_dim = get("attention.key_length", "int", hidden // q_heads, low=1, high=MAX_WIDTH)
    if q_heads % kv_heads or head_dim * q_heads != hidden:
        raise UnsupportedModelError(f"{q_heads} query heads, {kv_heads} KV heads of {head_dim} for a width of "
                                    f"{hidden} ({p}attention.*): the heads must divide the width and the KV heads "
                                    "the query heads")
    if get("attention.value_length", "int", head_dim, low=1, high=MAX_WIDTH) != head_dim:
        raise UnsupportedModelError(f"keys and values of different head sizes ({p}attention.value_length) are not "
                                    "supported")
    if head_dim not in PREFILL_HEAD_DIMS:
        raise UnsupportedModelError(f"head_dim {head_dim} ({p}attention.*) is not supported: pagedrt's attention runs "
                                    f"{', '.join(map(str, PREFILL_HEAD_DIMS))}")
    if q_heads // kv_heads not in GROUPS:
        raise UnsupportedModelError(f"{q_heads // kv_heads} query heads per KV head ({p}attention.*) is not supported: "
                                    f"{GROUPS[0]} to {GROUPS[-1]}")
    rope_dims = get("rope.dimension_count", "int", head_dim, low=1, high=MAX_WIDTH)
    if rope_dims != head_dim:
        raise UnsupportedModelError(f"rotary embeddings over {rope_dims} of {head_dim} dimensions "
                                    f"({p}rope.dimension_count) are not supported: only over whole heads")
    scaling = get("rope.scaling.type", "str", "none")
    if scaling not in ROPE_SCALINGS:
        raise UnsupportedModelError(f"rope scaling {scaling!r} ({p}rope.scaling.type) is not supported: "
                                    f"{', '.join(ROPE_SCALINGS)}")
    factor = get("rope.scaling.factor", "float", 1.0, low=1e-6, high=1e6) if scaling == "linear" else 1.0
    if get("expert_count", "int", 0, low=0, high=MAX_HEADS):
        raise UnsupportedModelError(f"mixture-of-experts models ({p}expert_count) are not supported")
    vocab = get("vocab_size", "int", vocab_size, low=1, high=MAX_VOCAB)
    if vocab != vocab_size:
        raise UnsupportedModelError(f"metadata {p + 'vocab_size'!r} = {vocab}, but the tokenizer has {vocab_size} "
                                    "tokens")
    return ModelConfig(
        name=field(fields, "general.name", "str", arch), num_layers=get("block_count", "int", low=1, high=MAX_LAYERS),
        hidden=hidden, ffn=get("feed_forward_length", "int", low=1, high=4 * MAX_WIDTH), q_heads=q_heads,
        kv_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
        context_length=get("context_length", "int", 2048, low=1, high=MAX_CONTEXT),
        rope_theta=float(get("rope.freq_base", "float", 10000.0, low=1.0, high=1e12)), rope_scale=1.0 / factor,
        rms_eps=float(get("attention.layer_norm_rms_epsilon", "float", low=1e-12, high=0.1)))
