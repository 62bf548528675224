"""What the pool describes itself with: a chunk's record, runs of chunk indices, an array's byte extent."""

from dataclasses import dataclass, fields
from typing import Any, Dict, Iterable, List, Sequence, Tuple


@dataclass(frozen=True)
class ChunkRecord:
    """One row of the chunk table, as :meth:`Pool.mappings` returns it."""

    chunk: int          # chunk index: its place in the range, offset // chunk_bytes
    va_start: int       # first virtual address
    va_end: int         # one past the last virtual address
    offset: int         # bytes from the pool's base
    size: int           # bytes
    handle: int | None  # CUDA allocation handle, or the host memfd's inode; None once released
    state: str          # "mapped" or "released"
    access: str         # "rw" while mapped, "none" once released
    location: str       # "device" or "host": where its memory lives (lived, once released)
    location_id: int | None  # the device ordinal or host NUMA node (CUDA); None on the host backend
    devices: tuple      # the GPUs that may read and write it (CUDA: its pool's and those granted); () once released
                        # and on the host backend

    def as_dict(self) -> Dict[str, Any]:
        """The record as a dict (its fields are ints, strings, None and a tuple of ints: nothing to copy deeply,
        so not ``dataclasses.asdict``, which a snapshot of many chunks would wait on)."""
        return {name: getattr(self, name) for name in _FIELDS}


_FIELDS = tuple(f.name for f in fields(ChunkRecord))


def runs(sorted_chunks: Iterable[int]) -> List[Tuple[int, int]]:
    """(first, count) for each run of consecutive indices."""
    runs = []
    for c in sorted_chunks:
        if runs and runs[-1][0] + runs[-1][1] == c:
            runs[-1][1] += 1
        else:
            runs.append([c, 1])
    return [tuple(r) for r in runs]


def c_strides(shape: Sequence[int], itemsize: int) -> Tuple[int, ...]:
    """The byte strides of a C-contiguous array of ``shape`` and ``itemsize``-byte items (an empty axis counted as
    length 1)."""
    strides, step = [], itemsize
    for s in reversed(shape):
        strides.append(step)
        step *= max(s, 1)
    return tuple(reversed(strides))


def extent(offset: int, shape: Sequence[int], strides: Sequence[int], itemsize: int) -> Tuple[int, int]:
    """[lo, hi) byte range an array of this layout touches."""
    if any(s == 0 for s in shape):
        return offset, offset
    lo = offset + sum((n - 1) * st for n, st in zip(shape, strides) if st < 0)
    hi = offset + sum((n - 1) * st for n, st in zip(shape, strides) if st > 0) + itemsize
    return lo, hi
