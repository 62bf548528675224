"""Refuse bad block tables and slots before a kernel reads or writes through them.

A kernel trusts every block id it is given: a stale or corrupt table would read
(or a bad slot write) another sequence's or another layer's memory. These checks
find the first bad length, table entry or slot, vectorised: NumPy on the host,
one small kernel plus one 16-byte device-to-host read on the device.
"""

import functools

import numpy as np

from .. import source
from .args import NULL, ptr
from ..errors import BlockTableError

FILE = "validate.cu"
NAMES = ("pagedrt::find_bad_entries", "pagedrt::find_bad_slots")
_NONE = np.iinfo(np.uint64).max
_THREADS = 256


def _fail(message, **fields):
    err = BlockTableError(message)
    for key, value in fields.items():
        setattr(err, key, value)
    raise err


def _length_error(row, length, width, block_size):
    _fail(f"seq_lens[{row}] = {length} is outside [1, {width * block_size}]: a block-table row holds "
          f"{width} blocks of {block_size} tokens; fix the length or widen the table",
          row=row, length=length)


def _entry_error(row, column, block_id, num_blocks, block_mask):
    if 0 <= block_id < num_blocks:
        why = f"a block that block_mask marks unusable (block_mask[{block_id}] == 0: free or released)"
    else:
        why = f"not a block of the pool: ids run 0..{num_blocks - 1}"
    _fail(f"block_tables[{row}, {column}] = {block_id} is {why}; the sequence in row {row} uses this "
          "column, so a kernel would read memory that is not its own: fix the table (refresh it from "
          "the allocator) before launching",
          row=row, column=column, block_id=block_id)


def check_block_tables(block_tables, seq_lens, block_size, num_blocks, block_mask=None, width=None):
    """Raise BlockTableError for the first bad length, then the first bad used entry (row-major).

    ``block_tables`` None checks only the lengths against ``width`` blocks per row
    (the contiguous baseline). Host arrays are checked with NumPy, device arrays on the device.
    """
    width = block_tables.shape[1] if block_tables is not None else width
    if isinstance(seq_lens, np.ndarray):
        bad_row, bad_entry = _host_first_bad(block_tables, seq_lens, block_size, num_blocks, block_mask, width)
    else:
        bad_row, bad_entry = _device_first_bad(block_tables, seq_lens, block_size, num_blocks, block_mask, width)
    if bad_row is not None:
        _length_error(bad_row, int(seq_lens[bad_row]), width, block_size)
    if bad_entry is not None:
        row, column = divmod(bad_entry, width)
        _entry_error(row, column, int(block_tables[row, column]), num_blocks, block_mask)


def _host_first_bad(block_tables, seq_lens, block_size, num_blocks, block_mask, width):
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
    if block_mask is not None:
        bad |= used & inside & ~block_mask.astype(bool)[np.where(inside, ids, 0)]
    hits = np.flatnonzero(bad)
    return None, (int(hits[0]) if hits.size else None)


@functools.lru_cache(maxsize=8)
def _result_buffer(device_id, stream_ptr):
    """A [2] uint64 device buffer per device and stream, reused by every check."""
    import cupy
    return cupy.empty(2, dtype=np.uint64)


def _device_results(launch):
    """Preset the result buffer to all ones, run ``launch(buffer)``, read the two results."""
    import cupy
    stream = cupy.cuda.get_current_stream()
    buf = _result_buffer(cupy.cuda.Device().id, stream.ptr)
    cupy.cuda.runtime.memsetAsync(buf.data.ptr, 0xFF, buf.nbytes, stream.ptr)
    launch(buf)
    return [None if x == _NONE else int(x) for x in buf.get()]


def _grid(total):
    return (max(1, min(-(-total // _THREADS), 4096)),)


def _device_first_bad(block_tables, seq_lens, block_size, num_blocks, block_mask, width):
    batch = seq_lens.shape[0]
    kernel = source.function(FILE, NAMES[0])
    table_args = (ptr(block_tables), np.int64(block_tables.strides[0] // 4)) if block_tables is not None \
        else (NULL, np.int64(0))

    def launch(buf):
        kernel(_grid(batch * width), (_THREADS,),
               (*table_args, np.int32(batch), np.int32(width), np.int32(block_size), ptr(seq_lens),
                np.int64(num_blocks), ptr(block_mask) if block_mask is not None else NULL, ptr(buf)))

    return _device_results(launch)


def check_slots(slot_mapping, capacity):
    """Raise BlockTableError for the first slot >= capacity (num_blocks * block_size); negative = padding."""
    if isinstance(slot_mapping, np.ndarray):
        hits = np.flatnonzero(slot_mapping >= capacity)
        first = int(hits[0]) if hits.size else None
    else:
        kernel = source.function(FILE, NAMES[1])
        n = slot_mapping.shape[0]
        first = _device_results(lambda buf: kernel(
            _grid(n), (_THREADS,), (ptr(slot_mapping), np.int64(n), np.int64(capacity), ptr(buf))))[0]
    if first is not None:
        _fail(f"slot_mapping[{first}] = {int(slot_mapping[first])} is past the cache's last slot "
              f"{capacity - 1}: a slot is block_id * block_size + slot_in_block (negative = padding); "
              "fix the slot mapping", token=first, slot=int(slot_mapping[first]))


def instances():
    return {FILE: NAMES}
