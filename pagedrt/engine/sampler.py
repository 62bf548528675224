"""Choosing the next token of many sequences at once: greedy, or temperature and nucleus (top-p) sampling.

Every sequence draws its own random number from a counter-based generator, a hash of
(its seed, how many tokens it has drawn), so a sequence's tokens depend on its seed
and its logits alone, not on which other sequences share its steps. Computed
vectorised over the batch, on the logits' device: the tokens stay there (the next step's input ids are
read from them), and the engine copies them to the host asynchronously.
"""

from typing import Optional, Sequence, Union

import numpy as np

from ..spec import Array

_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(z):
    """splitmix64's finaliser over uint64 (wrapping)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _MIX[0]
        z = (z ^ (z >> np.uint64(27))) * _MIX[1]
    return z ^ (z >> np.uint64(31))


def seeds(seed: int, count: int) -> np.ndarray:
    """``count`` independent uint64 stream seeds from one request seed (one per parallel sample)."""
    with np.errstate(over="ignore"):
        return _mix(np.uint64(seed % 2**64) + _GOLDEN * (np.arange(count, dtype=np.uint64) + np.uint64(1)))


def uniforms(stream_seeds: Union[Sequence[int], np.ndarray], counters: Union[Sequence[int], np.ndarray]) -> np.ndarray:
    """One float64 in [0, 1) per (stream seed, counter): the counter-th draw of that stream."""
    with np.errstate(over="ignore"):
        bits = _mix(np.asarray(stream_seeds, np.uint64) + _GOLDEN * np.asarray(counters, np.uint64))
    return (bits >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def sample(logits: Array, rows: Union[Sequence[int], np.ndarray], temperature: Union[Sequence[float], np.ndarray],
           top_p: Union[Sequence[float], np.ndarray], draws: Union[Sequence[float], np.ndarray],
           out: Optional[Array] = None) -> Array:
    """The chosen token of logits row ``rows[i]`` for each i: int64 [len(rows)] on the logits' device, nothing
    copied to the host (``out[:len(rows)]`` when given, a buffer of that device).

    logits: float32 [batch, vocab] (NumPy or CuPy); rows: host ints (a row may repeat: parallel samples);
    temperature, top_p, draws: host floats per i. Temperature 0 is greedy (the first largest logit); else
    softmax(logits / temperature) is cut to the fewest most likely tokens whose mass reaches top_p, and token
    i is where ``draws[i]`` (uniform in [0, 1)) falls in that cut distribution's cumulative sum.
    """
    xp = np if isinstance(logits, np.ndarray) else __import__("cupy")
    rows, temperature = np.asarray(rows, np.int64), np.asarray(temperature, np.float64)
    out = xp.empty(rows.size, np.int64) if out is None else out[:rows.size]
    greedy = temperature <= 0
    if greedy.all() and rows.size <= logits.shape[0] and np.array_equal(rows, np.arange(rows.size)):
        return xp.argmax(logits[:rows.size], axis=1, out=out)  # a greedy decode step: the first rows, in order
    if greedy.any():
        picked = logits[xp.asarray(rows[greedy])]
        out[xp.asarray(np.flatnonzero(greedy))] = xp.argmax(picked, axis=1)
    if not greedy.all():
        hot = ~greedy
        x = logits[xp.asarray(rows[hot])] / xp.asarray(temperature[hot], np.float32)[:, None]
        x = x - x.max(axis=1, keepdims=True)
        p = xp.exp(x)
        p /= p.sum(axis=1, keepdims=True)
        order = xp.argsort(-p, axis=1)
        p = xp.take_along_axis(p, order, axis=1)
        before = xp.cumsum(p, axis=1) - p  # mass of the more likely tokens
        p = xp.where(before < xp.asarray(np.asarray(top_p, np.float32)[hot])[:, None], p, 0)
        total = xp.cumsum(p, axis=1)
        target = xp.asarray(np.asarray(draws, np.float32)[hot]) * total[:, -1]
        index = xp.minimum((total <= target[:, None]).sum(axis=1), p.shape[1] - 1)
        out[xp.asarray(np.flatnonzero(hot))] = xp.take_along_axis(order, index[:, None], axis=1)[:, 0]
    return out
