"""A Llama-family model's shape and hyperparameters, read from a GGUF file's metadata, and checked.

GGUF names its hyperparameters after the architecture (``llama.block_count``,
``llama.attention.head_count`` ...). :func:`read_config` reads them from a
:class:`gguf.GGUFReader`'s fields and refuses what the engine does not run
(:class:`~pagedrt.errors.UnsupportedModelError`, naming the value and what it
supports): an architecture other than Llama's, rotary embeddings over part of a
head or scaled other than linearly, or a head size or grouping that pagedrt's
attention kernels do not support (:mod:`pagedrt.supported`).
"""

from dataclasses import dataclass

from ..errors import UnsupportedModelError
from ..supported import GROUPS, PREFILL_HEAD_DIMS

ARCHITECTURES = ("llama",)   # GGUF's name for Llama 1-3, Mistral, SmolLM, TinyLlama and other Llama-shaped models
ROPE_SCALINGS = ("none", "linear")


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
    def group(self):
        """Query heads per KV head."""
        return self.q_heads // self.kv_heads


def field(fields, key, default=None):
    """The value of GGUF metadata ``key``, or ``default`` when absent (an UnsupportedModelError when required)."""
    f = fields.get(key)
    if f is None:
        if default is None:
            raise UnsupportedModelError(f"the model's metadata has no {key!r}: not a complete Llama-family GGUF file")
        return default
    return f.contents()


def read_config(fields, vocab_size):
    """The checked :class:`ModelConfig` of a GGUF file's metadata ``fields`` (``GGUFReader.fields``)."""
    arch = field(fields, "general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"architecture {arch!r} is not supported: the engine runs "
                                    f"{', '.join(ARCHITECTURES)}")
    get = lambda key, default=None: field(fields, f"{arch}.{key}", default)  # noqa: E731
    hidden, q_heads = int(get("embedding_length")), int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", q_heads))
    head_dim = int(get("attention.key_length", hidden // q_heads if q_heads else 0))
    if q_heads <= 0 or kv_heads <= 0 or q_heads % kv_heads or head_dim * q_heads != hidden:
        raise UnsupportedModelError(f"{q_heads} query heads, {kv_heads} KV heads of {head_dim} for a width of "
                                    f"{hidden}: the heads must divide the width and the KV heads the query heads")
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModelError("keys and values of different head sizes are not supported")
    if head_dim not in PREFILL_HEAD_DIMS:
        raise UnsupportedModelError(f"head_dim {head_dim} is not supported: pagedrt's attention runs "
                                    f"{', '.join(map(str, PREFILL_HEAD_DIMS))}")
    if q_heads // kv_heads not in GROUPS:
        raise UnsupportedModelError(f"{q_heads // kv_heads} query heads per KV head is not supported: "
                                    f"{GROUPS[0]} to {GROUPS[-1]}")
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise UnsupportedModelError(f"rotary embeddings over {int(get('rope.dimension_count'))} of {head_dim} "
                                    "dimensions are not supported: only over whole heads")
    scaling = str(get("rope.scaling.type", "none"))
    if scaling not in ROPE_SCALINGS:
        raise UnsupportedModelError(f"rope scaling {scaling!r} is not supported: {', '.join(ROPE_SCALINGS)}")
    factor = float(get("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
    if get("expert_count", 0):
        raise UnsupportedModelError("mixture-of-experts models are not supported")
    return ModelConfig(
        name=str(field(fields, "general.name", arch)), num_layers=int(get("block_count")), hidden=hidden,
        ffn=int(get("feed_forward_length")), q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
        vocab_size=int(get("vocab_size", vocab_size)), context_length=int(get("context_length", 2048)),
        rope_theta=float(get("rope.freq_base", 10000.0)), rope_scale=1.0 / factor,
        rms_eps=float(get("attention.layer_norm_rms_epsilon")))
