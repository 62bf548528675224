"""A tiny Llama GGUF file written with ``gguf.GGUFWriter``: random weights and a small byte-level BPE tokenizer.

The same architecture as SmolLM2 at a smaller size (head_dim 64 and 3 query heads per
KV head, as SmolLM2's), so that the engine and llama.cpp can be compared on it without
the real model. The tokenizer's merges are learned from a fixed text by byte-pair
encoding training (the most frequent adjacent pair merged, 80 times), so its merges
and vocabulary are as consistent as a real model's.
"""

from collections import Counter

import numpy as np

CORPUS = """The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs into the
woods. There is a house in the woods where the old man lives with his cat. The cat watches the birds; the
birds sing in the morning and in the evening. In 2024 the man planted 365 trees, then 12 more. What's the
name of the cat? It's Tom, and he's the king of the house! Paging the cache: blocks, tables, slots."""
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
            "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SHAPE = dict(layers=2, hidden=192, q_heads=3, kv_heads=1, ffn=384, context=512)


def train_merges(count=80):
    """Byte-level BPE merges learned from CORPUS (split by the engine's pre-tokenizer)."""
    from pagedrt.engine.tokenizer import PRE_TOKENIZERS, byte_alphabet, compile_pattern, split
    alphabet = byte_alphabet()
    pieces = split(CORPUS, [compile_pattern(e) for e in PRE_TOKENIZERS["smollm"]])
    words = Counter(tuple(alphabet[b] for b in piece.encode()) for piece in pieces)
    merges = []
    for _ in range(count):
        pairs = Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        merged = Counter()
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return merges


def write(path, *, quantized=False, seed=0, vocab_pad=0, shape=SHAPE):
    """Write the tiny model to ``path``; ``quantized``: its matrices as Q4_1 and the embedding as Q8_0 (as
    SmolLM2's file), else float32; ``shape``: SHAPE's keys (another size). Returns the vocabulary size.
    A test that calls it skips without the gguf package."""
    import pytest
    gguf = pytest.importorskip("gguf", reason="the tiny model is written with the gguf package: pip install "
                                              "'pagedrt[model]'")
    from gguf.quants import quantize
    from pagedrt.engine.tokenizer import byte_alphabet
    s = shape
    head_dim = s["hidden"] // s["q_heads"]
    merges = train_merges()
    tokens = list(SPECIALS) + [byte_alphabet()[b] for b in range(256)] + [a + b for a, b in merges]
    tokens += [f"<pad{i}>" for i in range(vocab_pad)]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny llama")
    w.add_context_length(s["context"])
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["q_heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(3 if quantized else 0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    rng = np.random.default_rng(seed)

    def matrix(name, out, inp, kind=gguf.GGMLQuantizationType.Q4_1):
        m = (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)
        if quantized:
            w.add_tensor(name, quantize(m, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, m)

    def norm(name):
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(s["hidden"])).astype(np.float32))

    matrix("token_embd.weight", vocab, s["hidden"], gguf.GGMLQuantizationType.Q8_0)
    norm("output_norm.weight")
    kv = s["kv_heads"] * head_dim
    for i in range(s["layers"]):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        for name, out, inp in (("attn_q", s["hidden"], s["hidden"]), ("attn_k", kv, s["hidden"]),
                               ("attn_v", kv, s["hidden"]), ("attn_output", s["hidden"], s["hidden"]),
                               ("ffn_gate", s["ffn"], s["hidden"]), ("ffn_up", s["ffn"], s["hidden"]),
                               ("ffn_down", s["hidden"], s["ffn"])):
            matrix(f"blk.{i}.{name}.weight", out, inp)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return vocab
