"""The standard decode and prefill cases (../shared/WORKLOADS.md), as data: the one copy every benchmark uses.

Shape of every case: 32 query heads, 8 KV heads (GQA group 4), head_dim 128, block
size 16; block ids a seeded random permutation of the pool (:func:`scattered_table`),
never sequential, since a real cache is scattered.
"""

from dataclasses import dataclass

import numpy as np

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
TABLE_SEED = 1  # the block permutation's seed


@dataclass(frozen=True)
class DecodeCase:
    """One query token per sequence over ``lengths`` cached tokens each."""

    name: str
    dtype: str
    lengths: tuple

    @property
    def batch(self):
        return len(self.lengths)


@dataclass(frozen=True)
class PrefillCase:
    """Causal attention of ``new[b]`` query tokens per sequence over ``prefix[b]`` cached tokens and themselves.

    New token i of sequence b sits at position prefix[b] + i and attends to keys
    0..prefix[b] + i (the mask aligned bottom-right, as in chunked prefill).
    """

    name: str
    prefix: tuple
    new: tuple
    dtype: str = "float16"

    @property
    def batch(self):
        return len(self.new)

    @property
    def attended_keys(self):
        """Sum over the new tokens of the keys each attends to: sum of N*P + N*(N+1)/2."""
        p, n = np.asarray(self.prefix, np.int64), np.asarray(self.new, np.int64)
        return int((n * p + n * (n + 1) // 2).sum())

    @property
    def flops(self):
        """4 x query heads x head_dim per attended key: QK^T and PV, a multiply and an add each."""
        return 4 * Q_HEADS * HEAD_DIM * self.attended_keys


def _decode(name, batch, length, dtype="float16"):
    return DecodeCase(name, dtype, (length,) * batch)


DECODE_CASES = {c.name: c for c in (
    _decode("long-1", 1, 32768),
    _decode("b8", 8, 8192),
    _decode("b32", 32, 4096),
    _decode("b64", 64, 2048),
    _decode("b128", 128, 1024),
    _decode("b256", 256, 512),
    _decode("big", 64, 8192),
    DecodeCase("var", "float16", tuple(int(n) for n in np.random.default_rng(0).integers(1, 8193, 64))),
    _decode("big-bf16", 64, 8192, "bfloat16"),
)}

# Not a standard case (../shared/WORKLOADS.md keeps those): a heavy-tailed batch, issue 22's "skewed batches".
# 64 sequences, lognormal lengths (median 2560, sigma 1, seed 0) clipped to [1, 16384]: 260,819 tokens against
# var's 267,327, the longest 16,384 (the cap) against a median of 2,740.
SKEW_MEDIAN, SKEW_SIGMA, SKEW_CAP, SKEW_SEED = 2560, 1.0, 16384, 0
EXTRA_DECODE_CASES = {c.name: c for c in (
    DecodeCase("skew", "float16", tuple(int(n) for n in np.clip(
        np.random.default_rng(SKEW_SEED).lognormal(np.log(SKEW_MEDIAN), SKEW_SIGMA, 64).astype(np.int64), 1,
        SKEW_CAP))),
)}
BENCH_DECODE_CASES = {**DECODE_CASES, **EXTRA_DECODE_CASES}  # what the decode benchmarks run

PREFILL_CASES = {c.name: c for c in (
    PrefillCase("p1", (0,), (8192,)),
    PrefillCase("p16", (0,) * 16, (1024,) * 16),
    PrefillCase("chunk", (6144,) * 4, (2048,) * 4),
    PrefillCase("mixed", (0,) + (2048,) * 127, (1024,) + (1,) * 127),
    PrefillCase("var", (0,) * 32, tuple(int(n) for n in np.clip(
        np.random.default_rng(0).lognormal(np.log(512), 1.0, 32).astype(np.int64), 1, 8192))),
)}


def scattered_table(lengths, block_size=BLOCK_SIZE, shuffle=True):
    """A dense int32 block table over ``sum(ceil(length / block_size))`` blocks, padded with -1.

    Block ids are a permutation of 0..num_blocks-1 seeded with TABLE_SEED (the
    standard), or consecutive per sequence with ``shuffle=False`` (an experiment's
    control). Returns ``(table, num_blocks)``.
    """
    used = -(-np.asarray(lengths, np.int64) // block_size)
    num_blocks = int(used.sum())
    ids = np.random.default_rng(TABLE_SEED).permutation(num_blocks) if shuffle else np.arange(num_blocks)
    table = np.full((len(used), int(used.max())), -1, np.int32)
    starts = np.concatenate([[0], np.cumsum(used)[:-1]])
    for row, (s, n) in enumerate(zip(starts, used)):
        table[row, :n] = ids[s:s + n]
    return table, num_blocks
