"""Refuse bad block tables and slots before a kernel reads or writes through them.

A kernel trusts every block id it is given: a stale or corrupt table would read
(or a bad slot write) another sequence's or another layer's memory, or memory that
is not mapped at all (a block whose chunk was released: on the host backend a
segfault, on a GPU an illegal address that kills the process's CUDA context).
These checks find the first bad length, table entry or slot, vectorised: NumPy on
the host, one small kernel plus one 16-byte device-to-host read on the device.

Planes that lie in a :class:`~pagedrt.memory.Pool` are described by their
:class:`Spans`: the pool and the plane's offset in it. A block of such a plane is
usable only if every chunk under its bytes is mapped now (``Pool.mapped_mask``); a
plane in a closed pool raises ``PoolClosedError`` before anything runs.
"""

import weakref
from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence, Tuple, cast

import numpy as np

from .. import source
from .args import NULL, ptr
from ..errors import BlockTableError, PoolClosedError
from ..memory import Pool, find_pool
from ..spec import Array

FILE = "validate.cu"
NAMES = ("pagedrt::find_bad_entries", "pagedrt::find_bad_slots")
_NONE = np.iinfo(np.uint64).max
_THREADS = 256
_RESULTS = 2  # result words at the front of the scratch buffer

# Device buffers this module holds, released by release_buffers(): a scratch buffer per (device, stream)
# (the results, then the duplicate-slot hash set), and each pool's chunk mask on the device, with the
# pool version it was copied at. On the host, each pool's counts of unmapped chunks, by version.
_scratch: Dict[Tuple[int, int], Any] = {}
_masks: "weakref.WeakKeyDictionary[Pool, tuple]" = weakref.WeakKeyDictionary()
# host side: each pool's unmapped chunks before each chunk
_hole_counts: "weakref.WeakKeyDictionary[Pool, tuple]" = weakref.WeakKeyDictionary()


def release_buffers() -> None:
    """Drop every device buffer the launchers cache (the checks' scratch and chunk masks); the next check
    makes new ones. Plans hold their own workspaces; CuPy's memory pools keep what is dropped until
    ``free_all_blocks()``."""
    _scratch.clear()
    _masks.clear()


def _fail(message: str, **fields: int) -> NoReturn:
    err = BlockTableError(message)
    for key, value in fields.items():
        setattr(err, key, value)
    raise err


def _closed_error(pool: Pool) -> PoolClosedError:
    return PoolClosedError(f"the planes lie in a pool that was closed ({pool!r}): its memory is gone; make a new "
                           "cache (or pool) and take its planes again")


def address(a: Array) -> int:
    """The first byte of a NumPy or CuPy array."""
    return a.__array_interface__["data"][0] if isinstance(a, np.ndarray) else a.data.ptr


class Spans:
    """Where planes' blocks lie in pools: per plane in a pool, ``(pool, offset of its first byte)``.

    Planes in no pool are left out (nothing to check beyond the id range).

    Parameters
    ----------
    planes : sequence of array
        NumPy or CuPy planes.
    block_stride, block_bytes : int
        The planes' shared block stride and block size, in bytes.

    Raises
    ------
    PoolClosedError
        A plane in a closed pool.
    """

    def __init__(self, planes: Sequence[Array], block_stride: int, block_bytes: int) -> None:
        self.spans: List[Tuple[Pool, int]] = []
        for a in planes:
            pool = find_pool(address(a))
            if pool is not None:
                if pool.closed:
                    raise _closed_error(pool)
                self.spans.append((pool, address(a) - pool.base))
        self.pools = tuple(dict.fromkeys(pool for pool, _ in self.spans))
        self._offsets = [np.array([offset for p, offset in self.spans if p is pool], np.int64) for pool in self.pools]
        self.block_stride, self.block_bytes = int(block_stride), int(block_bytes)

    def check_open(self) -> None:
        """Raise PoolClosedError if a pool of these planes was closed since (a plan's run)."""
        for pool in self.pools:
            if pool.closed:
                raise _closed_error(pool)

    def unusable(self, ids: np.ndarray) -> np.ndarray:
        """Per block id (an int64 NumPy array of ids inside the planes): True where some chunk under it, in
        some plane, is not mapped now. Vectorised over the planes of each pool; where every chunk from the
        lowest id's to the highest id's is mapped in every plane (a whole sequence, a pool without holes), that
        is all it looks at."""
        bad = np.zeros(ids.shape, bool)
        if not ids.size:
            return bad
        low, high = int(ids.min()), int(ids.max())
        for pool, offsets in zip(self.pools, self._offsets):
            holes = _holes(pool)
            if not _unmapped(pool, holes, offsets + low * self.block_stride,
                             offsets + high * self.block_stride + self.block_bytes).any():
                continue
            lo = offsets.reshape((-1,) + (1,) * ids.ndim) + ids * self.block_stride
            bad |= _unmapped(pool, holes, lo, lo + self.block_bytes).any(axis=0)
        return bad

    def why(self, block_id: int) -> Optional[str]:
        """Which chunk makes ``block_id`` unusable, as words for an error message."""
        for pool, offset in self.spans:
            lo = offset + block_id * self.block_stride
            chunks = range(lo // pool.chunk_bytes, (lo + self.block_bytes - 1) // pool.chunk_bytes + 1)
            mask = np.asarray(pool.mapped_mask(), bool)
            hole = next((c for c in chunks if not (0 <= c < pool.num_chunks and mask[c])), None)
            if hole is not None:
                return (f"a block whose memory is not mapped (pool chunk {hole} was released or never mapped: a "
                        "stale table or slot, e.g. one taken before free() and trim())")
        return None

    def device_args(self) -> tuple:
        """The kernel arguments of two spans (K, V): mask pointer, chunks, chunk bytes, offset each."""
        out = []
        for pool, offset in (self.spans * 2)[:2]:
            out += [ptr(_device_mask(pool)), np.int64(pool.num_chunks), np.int64(pool.chunk_bytes),
                    np.int64(offset)]
        out += [NULL, np.int64(0), np.int64(1), np.int64(0)] * (2 - len(out) // 4)
        return (*out, np.int64(self.block_stride), np.int64(self.block_bytes))


NO_SPANS = Spans((), 0, 0)


def _holes(pool: Pool) -> np.ndarray:
    """Unmapped chunks before each chunk of the pool (``[num_chunks + 1]``), computed again only when the pool's
    version changes."""
    version = pool.version
    held = _hole_counts.get(pool)
    if held is None or held[0] != version:
        held = (version, np.concatenate(([0], np.cumsum(~np.asarray(pool.mapped_mask(), bool)))))
        _hole_counts[pool] = held
    return held[1]


def _unmapped(pool: Pool, holes: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """True where some chunk under the bytes ``[lo, hi)`` (int64 arrays) lies outside the pool or is not mapped."""
    n = pool.num_chunks
    first, last = lo // pool.chunk_bytes, (hi - 1) // pool.chunk_bytes
    return (lo < 0) | (last >= n) | (holes[np.minimum(last + 1, n)] > holes[np.maximum(first, 0)])


def _device_mask(pool: Pool) -> Array:
    """The pool's chunk mask as a device uint8 array, copied again only when the pool's version changes."""
    version = pool.version
    held = _masks.get(pool)
    if held is None or held[0] != version:
        import cupy
        held = (version, cupy.asarray(np.asarray(pool.mapped_mask(), np.uint8)))
        _masks[pool] = held
    return held[1]


def _length_error(row: int, length: int, width: int, block_size: int) -> NoReturn:
    _fail(f"seq_lens[{row}] = {length} is outside [1, {width * block_size}]: a block-table row holds "
          f"{width} blocks of {block_size} tokens; fix the length or widen the table",
          row=row, length=length)


def _entry_error(row: int, column: int, block_id: int, num_blocks: int, block_mask: Optional[Array],
                 spans: Spans) -> NoReturn:
    why: Optional[str]
    if not 0 <= block_id < num_blocks:
        why = f"not a block of the pool: ids run 0..{num_blocks - 1}"
    elif block_mask is not None and not int(block_mask[block_id]):
        why = f"a block that block_mask marks unusable (block_mask[{block_id}] == 0: free or released)"
    else:
        why = spans.why(block_id)
    _fail(f"block_tables[{row}, {column}] = {block_id} is {why}; the sequence in row {row} uses this "
          "column, so a kernel would read memory that is not its own: fix the table (refresh it from "
          "the allocator) before launching",
          row=row, column=column, block_id=block_id)


def check_block_tables(block_tables: Optional[Array], seq_lens: Array, block_size: int, num_blocks: int,
                       block_mask: Optional[Array] = None, width: Optional[int] = None,
                       spans: Spans = NO_SPANS) -> None:
    """Raise BlockTableError for the first bad length, then the first bad used entry (row-major).

    Host arrays are checked with NumPy, device arrays on the device (one launch, one 16-byte read).

    Parameters
    ----------
    block_tables : array, int32 [batch, width], optional
        None checks only the lengths against ``width`` blocks per row (the contiguous baseline).
    seq_lens : array, int32 [batch]
        Each row's length: in ``[1, width * block_size]``.
    block_size, num_blocks : int
        The planes' block size and blocks: used entries must be ids in ``[0, num_blocks)``.
    block_mask : array, bool/uint8 [num_blocks], optional
        0 marks a block unusable.
    width : int, optional
        Blocks per row when ``block_tables`` is None.
    spans : Spans
        The planes' spans, whose unmapped blocks are bad too.

    Raises
    ------
    BlockTableError
        With ``row`` and ``length``, or ``row``, ``column`` and ``block_id``, as attributes.
    """
    width = cast(int, block_tables.shape[1] if block_tables is not None else width)
    first_bad = _host_first_bad if isinstance(seq_lens, np.ndarray) else _device_first_bad
    bad_row, bad_entry = first_bad(block_tables, seq_lens, block_size, num_blocks, block_mask, width, spans)
    if bad_row is not None:
        _length_error(bad_row, int(seq_lens[bad_row]), width, block_size)
    if bad_entry is not None:
        row, column = divmod(bad_entry, width)
        _entry_error(row, column, int(cast(Array, block_tables)[row, column]), num_blocks, block_mask, spans)


def _host_first_bad(block_tables: Optional[np.ndarray], seq_lens: np.ndarray, block_size: int, num_blocks: int,
                    block_mask: Optional[np.ndarray], width: int, spans: Spans) -> Tuple[Optional[int], Optional[int]]:
    lens = seq_lens.astype(np.int64)
    bad_len = (lens < 1) | (lens > width * block_size)
    if bad_len.any():
        return int(np.argmax(bad_len)), None
    if block_tables is None:
        return None, None
    used = np.arange(width) < ((lens + block_size - 1) // block_size)[:, None]
    ids = block_tables.astype(np.int64)
    inside = (ids >= 0) & (ids < num_blocks)
    bad = used & ~inside
    safe = np.where(inside, ids, 0)
    if block_mask is not None:
        bad |= used & inside & ~block_mask.astype(bool)[safe]
    if spans.spans:
        bad |= used & inside & spans.unusable(safe)
    hits = np.flatnonzero(bad)
    return None, (int(hits[0]) if hits.size else None)


def _scratch_buffer(words: int) -> Array:
    """A uint64 device buffer of at least ``words`` words for the current device and stream, reused."""
    import cupy
    key = (cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr)
    buf = _scratch.get(key)
    if buf is None or buf.size < words:
        buf = _scratch[key] = cupy.empty(max(words, 2 * (buf.size if buf is not None else 0)), dtype=np.uint64)
    return buf


def _device_results(launch: Callable[[np.uint64, np.uint64], None], extra_words: int = 0) -> List[Optional[int]]:
    """Preset the scratch (results, then ``extra_words``) to all ones, run ``launch(results, extra)``, read the
    two results."""
    import cupy
    buf = _scratch_buffer(_RESULTS + extra_words)
    cupy.cuda.runtime.memsetAsync(buf.data.ptr, 0xFF, (_RESULTS + extra_words) * 8,
                                  cupy.cuda.get_current_stream().ptr)
    launch(ptr(buf), np.uint64(buf.data.ptr + _RESULTS * 8))
    return [None if x == _NONE else int(x) for x in buf[:_RESULTS].get()]


def _grid(total: int) -> Tuple[int]:
    return (max(1, min(-(-total // _THREADS), 4096)),)


def _device_first_bad(block_tables: Optional[Array], seq_lens: Array, block_size: int, num_blocks: int,
                      block_mask: Optional[Array], width: int, spans: Spans) -> List[Optional[int]]:
    batch = seq_lens.shape[0]
    kernel = source.function(FILE, NAMES[0])
    table_args = (ptr(block_tables), np.int64(block_tables.strides[0] // 4)) if block_tables is not None \
        else (NULL, np.int64(0))

    def launch(results, _):
        kernel(_grid(batch * width), (_THREADS,),
               (*table_args, np.int32(batch), np.int32(width), np.int32(block_size), ptr(seq_lens),
                np.int64(num_blocks), ptr(block_mask) if block_mask is not None else NULL, *spans.device_args(),
                results))

    return _device_results(launch)


def _table_bits(num_tokens: int) -> int:
    """log2 of the duplicate-slot hash set's size: a power of two at least twice the tokens (64 or more)."""
    return max(6, (2 * max(num_tokens, 1) - 1).bit_length())


def check_slots(slot_mapping: Array, block_size: int, num_blocks: int, spans: Spans = NO_SPANS) -> None:
    """Raise BlockTableError for the first slot past the cache or in a block whose memory is not mapped, then
    for a slot given to two tokens.

    Parameters
    ----------
    slot_mapping : array, int64 [num_tokens]
        ``block_id * block_size + slot_in_block``; negative is padding.
    block_size, num_blocks : int
        The planes' (``num_blocks * block_size`` slots).
    spans : Spans
        The planes' spans, whose unmapped blocks are bad too.

    Raises
    ------
    BlockTableError
        With ``token`` and ``slot`` (and ``first_token`` for a repeat) as attributes.
    """
    capacity = num_blocks * block_size
    if isinstance(slot_mapping, np.ndarray):
        live = np.flatnonzero(slot_mapping >= 0)
        slots = slot_mapping[live]
        bad = slots >= capacity
        if spans.spans:
            bad |= spans.unusable(np.where(bad, 0, slots // block_size))
        first = int(live[np.argmax(bad)]) if bad.any() else None
        duplicate = 0 if first is None and np.unique(slots).size < slots.size else None
    else:
        kernel = source.function(FILE, NAMES[1])
        n = slot_mapping.shape[0]
        bits = _table_bits(n)
        first, duplicate = _device_results(lambda results, seen: kernel(
            _grid(n), (_THREADS,), (ptr(slot_mapping), np.int64(n), np.int64(capacity), np.int32(block_size),
                                    *spans.device_args(), seen, np.int32(bits), results)), 1 << bits)
    if first is not None:
        slot = int(slot_mapping[first])
        why = (f"past the cache's last slot {capacity - 1}" if slot >= capacity
               else f"in block {slot // block_size}, {spans.why(slot // block_size)}")
        _fail(f"slot_mapping[{first}] = {slot} is {why}: a slot is block_id * block_size + slot_in_block "
              "(negative = padding); fix the slot mapping", token=first, slot=slot)
    if duplicate is not None:
        _duplicate_error(slot_mapping if isinstance(slot_mapping, np.ndarray) else slot_mapping.get())


def _duplicate_error(slots: np.ndarray) -> NoReturn:
    """Name the first token whose slot an earlier token already has."""
    live = np.flatnonzero(slots >= 0)
    order = live[np.argsort(slots[live], kind="stable")]
    repeats = np.flatnonzero(slots[order[1:]] == slots[order[:-1]])
    later = int(order[1:][repeats].min())
    slot = int(slots[later])
    earlier = int(np.flatnonzero(slots == slot)[0])
    _fail(f"slot_mapping[{later}] = {slot} repeats slot_mapping[{earlier}]: each token needs a slot of its own "
          "(two writes to one slot leave whichever lands last); fix the slot mapping",
          token=later, slot=slot, first_token=earlier)


def instances() -> Dict[str, Tuple[str, ...]]:
    """{file: name expressions} of the validation kernels."""
    return {FILE: NAMES}
