"""The float64 references of the attention kernels: what the tests compare with, and what the host backend runs.

One core, :func:`attend`, computes softmax attention of one sequence's query rows
over its keys (GQA: query head h uses KV head h // group), optionally causal with
the mask aligned bottom-right, and optionally cut into segments whose partial
states are merged exactly as the split kernel merges them. The decode references
gather each sequence's keys (through the block table, or from contiguous K/V) and
call it with one query row; the prefill reference calls it with each sequence's
query rows, causal aligned bottom-right.
"""

import math
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from .. import fp8
from .planner import SplitPlan, plan_splits


def _partial(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, first: int,
             causal_offset: Optional[int]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unnormalised state of query rows q [rows, kv, group, d] over keys k, v [kv, n, d] at positions
    first..first+n-1 (float64): (m, l, o) = max score, sum of exp(score - m), sum of exp(score - m) * v.
    A row that sees no key gets m = -inf, l = 0, o = 0."""
    scores = np.einsum("rhgd,hnd->rhgn", q, k, optimize=True) * scale  # optimize: through BLAS
    if causal_offset is not None:
        keys = first + np.arange(k.shape[1])
        visible = keys[None, :] <= causal_offset + np.arange(q.shape[0])[:, None]  # [rows, n]
        scores = np.where(visible[:, None, None, :], scores, -np.inf)
    m = scores.max(axis=3, initial=-np.inf)
    p = np.exp(scores - np.where(np.isneginf(m), 0.0, m)[..., None])
    return m, p.sum(axis=3), np.einsum("rhgn,hnd->rhgd", p, v, optimize=True)


def merge_partials(m: np.ndarray, l: np.ndarray, o: np.ndarray) -> np.ndarray:
    """Combine split states along axis 0: m, l [splits, ...], o [splits, ..., d] -> normalised output.

    m* = max m_i; l* = sum l_i exp(m_i - m*); out = sum o_i exp(m_i - m*) / l*.
    Empty splits (m_i = -inf) get weight 0.
    """
    top = m.max(axis=0)
    with np.errstate(invalid="ignore"):
        w = np.where(np.isneginf(m), 0.0, np.exp(m - top))
    total = (w * l).sum(axis=0)
    return (w[..., None] * o).sum(axis=0) / total[..., None]


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, *, causal_offset: Optional[int] = None,
           segments: Optional[Sequence[Tuple[int, int]]] = None) -> np.ndarray:
    """Float64 attention of one sequence's query rows q [rows, q_heads, d] over its keys k, v [kv_heads, n, d].

    Returns float64 [rows, q_heads, d]; query head h uses KV head h // (q_heads // kv_heads).
    ``causal_offset`` P: query row i sits at position P + i and sees keys 0..P+i (the
    causal mask aligned bottom-right: P cached tokens before the rows); None: every
    row sees every key. ``segments``: token ranges [(begin, end)] of the keys whose
    partial states are computed apart and merged (:func:`merge_partials`), as the
    split kernel does, empty ranges included; None: one range, all keys.
    """
    rows, q_heads, d = q.shape
    kv_heads = k.shape[0]
    qh = np.asarray(q, np.float64).reshape(rows, kv_heads, q_heads // kv_heads, d)
    k, v = np.asarray(k, np.float64), np.asarray(v, np.float64)
    parts = [_partial(qh, k[:, a:b], v[:, a:b], scale, a, causal_offset)
             for a, b in (segments or [(0, k.shape[1])])]
    m, l, o = (np.stack(x) for x in zip(*parts))
    return merge_partials(m, l, o).reshape(rows, q_heads, d)


def split(max_seq_len: int, block_size: int, num_splits: int = 1, geometry: str = "standard") -> SplitPlan:
    """The :class:`~pagedrt.attention.planner.SplitPlan` the decode references cut by: ``num_splits``
    segments of whole blocks (the kernel cuts whole tiles), the last taking the rest."""
    return plan_splits(1, 1, max_seq_len, block_size, 1, 1, num_splits=num_splits, geometry=geometry)


def _decode(q: np.ndarray, keys: Callable[[int], Tuple[np.ndarray, np.ndarray]], scale: Optional[float],
            num_splits: int, max_seq_len: int, block_size: int) -> np.ndarray:
    """Decode (one query row per sequence) over the per-sequence keys and values ``keys(i)``, in q's dtype."""
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    plan = split(max_seq_len, block_size, num_splits)
    out = np.empty(q.shape, np.float64)
    for i in range(q.shape[0]):
        k, v = keys(i)
        out[i] = attend(q[i:i + 1], k, v, scale, segments=plan.segments(k.shape[1]))[0]
    return out.astype(q.dtype)


def _tokens(blocks: np.ndarray, n: int) -> np.ndarray:
    """[nb, kv, bs, d] blocks -> [kv, n, d] float64, the first n tokens in order."""
    nb, kv, bs, d = blocks.shape
    return blocks.astype(np.float64).transpose(1, 0, 2, 3).reshape(kv, nb * bs, d)[:, :n]


def _gather(cache, blocks, n, scale):
    """The first ``n`` tokens of ``blocks`` (block ids) of a plane ``cache`` [num_blocks, kv, bs, d], as
    [kv, n, d] float64; with ``scale`` the plane holds FP8 bits and only these blocks are dequantised."""
    gathered = cache[blocks]
    return _tokens(gathered if scale is None else fp8.dequantise(gathered, scale), n)


def paged_decode(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                 seq_lens: np.ndarray, scale: Optional[float] = None, *, num_splits: int = 1,
                 max_seq_len: Optional[int] = None, k_scale: Optional[np.ndarray] = None,
                 v_scale: Optional[np.ndarray] = None) -> np.ndarray:
    """Reference of :func:`pagedrt.attention.paged_decode` (no checks): gather through the table, softmax,
    weighted sum; with ``num_splits`` > 1 cut and merged as the split kernel does (see :func:`split`).
    With ``k_scale`` and ``v_scale`` the planes hold FP8 bits, dequantised exactly (:func:`pagedrt.fp8.dequantise`),
    only the blocks a sequence reads."""
    block_size = k_cache.shape[2]

    def keys(i: int) -> Tuple[np.ndarray, np.ndarray]:
        n = int(seq_lens[i])
        blocks = block_tables[i, :-(-n // block_size)]
        return _gather(k_cache, blocks, n, k_scale), _gather(v_cache, blocks, n, v_scale)

    return _decode(q, keys, scale, num_splits, max_seq_len or block_tables.shape[1] * block_size, block_size)


def contiguous_decode(q: np.ndarray, k: np.ndarray, v: np.ndarray, seq_lens: np.ndarray, scale: Optional[float] = None,
                      *, num_splits: int = 1, max_seq_len: Optional[int] = None) -> np.ndarray:
    """Reference of :func:`pagedrt.attention.contiguous_decode` (no checks); k, v [batch, width, kv_heads,
    block_size, head_dim]."""
    width, block_size = k.shape[1], k.shape[3]

    def keys(i: int) -> Tuple[np.ndarray, np.ndarray]:
        n = int(seq_lens[i])
        return _tokens(k[i], n), _tokens(v[i], n)

    return _decode(q, keys, scale, num_splits, max_seq_len or width * block_size, block_size)


def prefill(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray, kv_lens: np.ndarray,
            qo_indptr: np.ndarray, scale: Optional[float] = None, causal: bool = True,
            k_scale: Optional[np.ndarray] = None, v_scale: Optional[np.ndarray] = None) -> np.ndarray:
    """Reference of :func:`pagedrt.attention.paged_prefill` (no checks), in q's dtype.

    Sequence b's query rows are q[qo_indptr[b]:qo_indptr[b + 1]] (n of them) over its
    kv_lens[b] keys gathered through the table; causal: its row i sees keys
    0..kv_lens[b] - n + i (the last n keys are the rows' own). With ``k_scale`` and ``v_scale`` the planes
    hold FP8 bits, dequantised exactly (:func:`pagedrt.fp8.dequantise`), only the blocks a sequence reads.
    """
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    block_size = k_cache.shape[2]
    out = np.zeros(q.shape, np.float64)
    for b in range(block_tables.shape[0]):
        first, end, n = int(qo_indptr[b]), int(qo_indptr[b + 1]), int(kv_lens[b])
        if end == first:
            continue
        blocks = block_tables[b, :-(-n // block_size)]
        out[first:end] = attend(q[first:end], _gather(k_cache, blocks, n, k_scale),
                                _gather(v_cache, blocks, n, v_scale), scale,
                                causal_offset=n - (end - first) if causal else None)
    return out.astype(q.dtype)
