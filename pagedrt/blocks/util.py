"""Small array helpers of the software layer (and of :mod:`pagedrt.layout` and :mod:`pagedrt.growth`)."""

from typing import List, Sequence, Tuple, TypeVar

import numpy as np

NO_COPIES = np.empty((0, 2), np.int32)  # no (src, dst) block pairs
NO_ROWS = np.empty(0, np.int64)         # no rows, handles or block ids
for _empty in (NO_COPIES, NO_ROWS):
    _empty.flags.writeable = False

IntOrArray = TypeVar("IntOrArray", int, np.ndarray)


def ceil_div(a: IntOrArray, b: int) -> IntOrArray:
    """``a / b`` rounded up (ints, or int arrays and an int)."""
    return -(-a // b)


def ranks(counts: np.ndarray) -> np.ndarray:
    """For counts [2, 3] -> [0, 1, 0, 1, 2]: the index of each item within its group.

    Parameters
    ----------
    counts : np.ndarray
        int [groups]: items per group.
    """
    total = int(counts.sum())
    starts = np.cumsum(counts) - counts
    return np.arange(total) - np.repeat(starts, counts)


def pairs(moves: Sequence[Tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """A list of (src, dst) id arrays as one int32 ``[n, 2]`` array of pairs, in order."""
    if not moves:
        return NO_COPIES
    return np.stack([np.concatenate([m[0] for m in moves]), np.concatenate([m[1] for m in moves])],
                    axis=1).astype(np.int32)


def joined(arrays: List[np.ndarray]) -> np.ndarray:
    """One array of a list of int64 arrays (the list's only one as it is)."""
    if len(arrays) == 1:
        return arrays[0]
    return np.concatenate(arrays) if arrays else NO_ROWS
