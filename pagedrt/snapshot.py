"""Snapshots: both mapping layers of a cache as one JSON-ready dict (schema in docs/SNAPSHOT.md).

:func:`build_snapshot` makes the dict from a cache's parts, :func:`write_snapshot`
writes it atomically (another process may be reading the file), and
:func:`load_snapshot` reads one back. A snapshot file may come from anywhere, so
the reader trusts nothing: it reads regular files only, a bounded number of
bytes and of nesting levels, and checks every field's type and range and the
sections against each other before anything renders it. The first problem found
raises :class:`~pagedrt.errors.SnapshotError` naming its JSON path.
"""

import json
import math
import os
import re
import stat
import tempfile
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from .errors import SnapshotError
from .layout import Layout
from .memory import Pool
from .supported import BLOCK_SIZES, HEAD_DIMS, KV_DTYPES, KV_ITEMSIZES, PLACEMENTS

SNAPSHOT_SCHEMA, SNAPSHOT_VERSION = "pagedrt-snapshot", 1
MAX_SNAPSHOT_BYTES = 16 << 20  # larger files are refused unread
MAX_DEPTH = 16                 # JSON nesting levels; a snapshot uses 4
ADDRESS_LIMIT = 1 << 64        # the pool's range must lie in a 64-bit address space
MAX_INDEX = (1 << 31) - 1      # block ids, sequence handles and table shapes are int32
BACKEND_NAMES = ("cuda", "host")

if TYPE_CHECKING:
    from .blocks import BlockAllocator, BlockTables

PathLike = Union[str, "os.PathLike[str]"]


def build_snapshot(layout: Layout, pool: Pool, allocator: "BlockAllocator", tables: "BlockTables") -> dict:
    """The snapshot dict of a cache made of these parts.

    Parameters
    ----------
    layout : Layout
        The cache's layout.
    pool : Pool
        Its pool (the hardware layer).
    allocator : BlockAllocator
        Its block allocator over ``pool``.
    tables : BlockTables
        Its block tables over ``allocator``.

    Returns
    -------
    dict
        JSON-ready, of the schema in docs/SNAPSHOT.md (:func:`validate_snapshot` accepts it).
    """
    a, t = allocator, tables
    frontier = (int(np.flatnonzero(a.chunk_mapped).max()) + 1 if a.chunk_mapped.any() else 0)
    return {
        "schema": SNAPSHOT_SCHEMA, "version": SNAPSHOT_VERSION, "time": time.time(),
        "layout": asdict(layout),
        "pool": {"backend": pool.backend, "base": pool.base, "max_bytes": pool.max_bytes,
                 "chunk_bytes": pool.chunk_bytes, "page_bytes": pool.page_bytes,
                 "num_chunks": pool.num_chunks, "chunks": [r.as_dict() for r in pool.mappings()]},
        "blocks": {"blocks_per_chunk": a.blocks_per_chunk, "num_planes": a.num_planes, "num_chunks": a.num_chunks,
                   "max_blocks": a.max_blocks, "free": a.num_free + a.num_host_free,
                   "held": a.num_held + a.num_host_held,
                   "chunk_mapped": a.chunk_mapped.tolist(), "free_in_chunk": a.free_in_chunk.tolist(),
                   "ref_counts": a.ref_count[:frontier * a.blocks_per_chunk].tolist(),
                   "cached": np.flatnonzero(a.index.cached).tolist()},
        "sequences": [{"seq": int(s), "length": int(t.lens[s]), "blocks": t.blocks(s).tolist(),
                       "swapped": bool(t.swapped[s])} for s in t.sequences],
        "max_seqs": t.max_seqs, "max_blocks_per_seq": t.max_blocks_per_seq,
    }


def _umask():
    """The process's umask, read without changing it where Linux says it (/proc), else by setting it back."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_snapshot(snap: dict, path: PathLike) -> None:
    """Write ``snap`` to ``path`` atomically: a temporary file in the same directory, renamed over it.

    Parameters
    ----------
    snap : dict
        A snapshot (:func:`build_snapshot`), or any JSON-ready dict.
    path : str or os.PathLike
        The file; it gets the permissions ``open`` would give a new file (0666 less the umask).

    Raises
    ------
    OSError
        Naming ``path``, not the temporary file (which is removed).
    """
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".snapshot-", suffix=".json")
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, path) from None
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w") as f:
            json.dump(snap, f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


# --- reading ---------------------------------------------------------------------------------

_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def _read_bounded(path):
    """The bytes of a regular file of at most MAX_SNAPSHOT_BYTES; never blocks on a FIFO or device."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise SnapshotError(f"no snapshot at {path}: write one with cache.write_snapshot(path)") from None
    except OSError as exc:
        raise SnapshotError(f"cannot read snapshot {path}: {exc.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            file_type = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
            raise SnapshotError(f"{path} is {file_type}, not a snapshot file: give a file written by "
                                f"cache.write_snapshot")
        parts, total = [], 0
        while total <= MAX_SNAPSHOT_BYTES:
            part = os.read(fd, min(1 << 20, MAX_SNAPSHOT_BYTES + 1 - total))
            if not part:
                break
            parts.append(part)
            total += len(part)
    except OSError as exc:
        raise SnapshotError(f"cannot read snapshot {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if total > MAX_SNAPSHOT_BYTES:
        raise SnapshotError(f"{path} is larger than {MAX_SNAPSHOT_BYTES >> 20} MiB, the most a snapshot "
                            f"file may hold")
    return b"".join(parts)


def _nesting_depth(text):
    """How deeply arrays and objects nest in JSON ``text`` (strings skipped), without parsing it."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text)).encode()
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, np.uint8)
    return int(np.cumsum(np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)).max())


def _no_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def _parse(path, data):
    try:
        text = data.decode("utf-8")
        if _nesting_depth(text) > MAX_DEPTH:
            raise ValueError(f"arrays and objects nest deeper than {MAX_DEPTH} levels")
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise SnapshotError(f"cannot read snapshot {path}: {exc}") from None


class _Invalid(Exception):
    """A problem at a JSON path; load_snapshot turns it into a SnapshotError naming the file."""


def _fail(where, problem):
    raise _Invalid(f"{where}: {problem}")


def _get(obj, key, where):
    if not isinstance(obj, dict):
        _fail(where, f"must be an object, got {_kind(obj)}")
    if key not in obj:
        _fail(f"{where}.{key}" if where != "$" else key, "is missing")
    return obj[key]


def _show(value, limit=60):
    """A value as it may appear in a one-line message: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _kind(value):
    return "null" if value is None else type(value).__name__


def _int(value, where, lo=0, hi=ADDRESS_LIMIT):
    if not isinstance(value, int) or isinstance(value, bool):
        _fail(where, f"must be an int, got {_kind(value)}")
    if not lo <= value <= hi:
        _fail(where, f"must be in {lo}..{hi}, got {_show(value)}")
    return value


def _same(value, expected) -> bool:
    """value == expected, and of its type (2.0 and True are not 2), list by list."""
    if isinstance(expected, list):
        return (isinstance(value, list) and len(value) == len(expected)
                and all(_same(v, e) for v, e in zip(value, expected)))
    return type(value) is type(expected) and value == expected


def _equal(value, expected, where, why):
    if not _same(value, expected):
        _fail(where, f"is {_show(value)} but {why} make it {expected}")


def _list(value, where, length=None, hi=None):
    if not isinstance(value, list):
        _fail(where, f"must be a list, got {_kind(value)}")
    if length is not None and len(value) != length:
        _fail(where, f"has {len(value)} entries, not {length}")
    if hi is not None and len(value) > hi:
        _fail(where, f"has {len(value)} entries, more than {hi}")
    return value


def _choice(value, where, choices):
    if value not in choices or isinstance(value, bool):
        _fail(where, f"must be one of {', '.join(map(repr, choices))}, got {_show(value)}")
    return value


def _int_list(value, where, length, lo, hi):
    """A list of ``length`` ints in lo..hi, as an int64 array."""
    _list(value, where, length)
    for i, v in enumerate(value):
        if type(v) is not int:
            _fail(f"{where}[{i}]", f"must be an int, got {_kind(v)}")
    try:
        array = np.array(value, dtype=np.int64)
        bad = np.flatnonzero((array < lo) | (array > hi))
    except OverflowError:
        bad = [next(i for i, v in enumerate(value) if not lo <= v <= hi)]
    if len(bad):
        _fail(f"{where}[{bad[0]}]", f"must be in {lo}..{hi}, got {_show(value[bad[0]])}")
    return array


def _check_layout(snap):
    raw = _get(snap, "layout", "$")
    where = "layout"
    fields = {}
    for key in ("num_layers", "num_kv_heads", "chunks_per_plane"):
        fields[key] = _int(_get(raw, key, where), f"{where}.{key}", 1, MAX_INDEX)
    fields["host_chunks"] = _int(_get(raw, "host_chunks", where), f"{where}.host_chunks", 0,
                                 fields["chunks_per_plane"] - 1)
    for key in ("page_bytes", "chunk_bytes"):
        fields[key] = _int(_get(raw, key, where), f"{where}.{key}", 1)
    fields["head_dim"] = _choice(_get(raw, "head_dim", where), f"{where}.head_dim", HEAD_DIMS)
    fields["block_size"] = _choice(_get(raw, "block_size", where), f"{where}.block_size", BLOCK_SIZES)
    fields["dtype"] = _choice(_get(raw, "dtype", where), f"{where}.dtype", KV_DTYPES)
    fields["placement"] = _choice(_get(raw, "placement", where), f"{where}.placement", PLACEMENTS)
    fields["itemsize"] = _get(raw, "itemsize", where)
    _equal(fields["itemsize"], KV_ITEMSIZES[fields["dtype"]], f"{where}.itemsize", f"{fields['dtype']} elements")
    lay = Layout(**fields)
    if lay.pool_bytes >= ADDRESS_LIMIT:
        _fail(where, f"describes a {lay.pool_bytes}-byte range, more than a 64-bit address space")
    if lay.chunk_bytes % lay.chunk_step:
        _fail(f"{where}.chunk_bytes", f"{lay.chunk_bytes} is not a multiple of {lay.chunk_step} (whole pages "
                                      f"and whole blocks)")
    return lay


def _check_shard(snap, lay):
    """``shard`` (a sharded cache's snapshots only): its index of ``of`` shards, its device, and the cache's KV heads
    ``[first, end)`` it holds, as many as the layout's, of ``num_kv_heads`` = ``of`` x the layout's."""
    if "shard" not in snap:
        return
    raw, where = snap["shard"], "shard"
    if not isinstance(raw, dict):
        _fail(where, f"must be an object, got {_kind(raw)}")
    of = _int(_get(raw, "of", where), f"{where}.of", 1, MAX_INDEX)
    index = _int(_get(raw, "index", where), f"{where}.index", 0, of - 1)
    _int(_get(raw, "device", where), f"{where}.device", 0, MAX_INDEX)
    _equal(_get(raw, "num_kv_heads", where), of * lay.num_kv_heads, f"{where}.num_kv_heads",
           f"{of} shards of {lay.num_kv_heads} heads")
    first = index * lay.num_kv_heads
    _equal(_get(raw, "kv_heads", where), [first, first + lay.num_kv_heads], f"{where}.kv_heads",
           f"shard {index}'s {lay.num_kv_heads} heads")


def _check_pool(snap, lay):
    pool, where = _get(snap, "pool", "$"), "pool"
    _choice(_get(pool, "backend", where), f"{where}.backend", BACKEND_NAMES)
    base = _int(_get(pool, "base", where), f"{where}.base")
    for key, expected, why in (("max_bytes", lay.pool_bytes, "layout's planes and chunks"),
                               ("chunk_bytes", lay.chunk_bytes, "layout.chunk_bytes"),
                               ("page_bytes", lay.page_bytes, "layout.page_bytes"),
                               ("num_chunks", lay.chunks_per_plane * lay.num_planes, "layout's planes and chunks")):
        _equal(_int(_get(pool, key, where), f"{where}.{key}"), expected, f"{where}.{key}", f"the {why}")
    if base + lay.pool_bytes > ADDRESS_LIMIT:
        _fail(f"{where}.base", f"{base:#x} + {lay.pool_bytes} bytes runs past a 64-bit address space")
    records = _list(_get(pool, "chunks", where), f"{where}.chunks", hi=lay.chunks_per_plane * lay.num_planes)
    mapped, previous = set(), -1
    for i, record in enumerate(records):
        at = f"{where}.chunks[{i}]"
        chunk = _int(_get(record, "chunk", at), f"{at}.chunk", 0, lay.chunks_per_plane * lay.num_planes - 1)
        if chunk <= previous:
            _fail(f"{at}.chunk", f"{chunk} is out of order: records are by chunk index, each once")
        previous = chunk
        offset = chunk * lay.chunk_bytes
        for key, expected in (("offset", offset), ("va_start", base + offset),
                              ("va_end", base + offset + lay.chunk_bytes), ("size", lay.chunk_bytes)):
            _equal(_get(record, key, at), expected, f"{at}.{key}", f"chunk {chunk} of the pool's range must")
        state = _choice(_get(record, "state", at), f"{at}.state", ("mapped", "released"))
        live = state == "mapped"
        _equal(_get(record, "access", at), "rw" if live else "none", f"{at}.access", f"a {state} chunk must")
        location = _choice(_get(record, "location", at), f"{at}.location", ("device", "host"))
        tier = "host" if chunk % lay.chunks_per_plane >= lay.chunks_per_plane - lay.host_chunks else "device"
        _equal(location, tier, f"{at}.location", f"chunk {chunk}'s place in the layout's tiers must")
        location_id = _get(record, "location_id", at)
        if location_id is not None:
            _int(location_id, f"{at}.location_id", 0, MAX_INDEX)
        handle = _get(record, "handle", at)
        if live:
            _int(handle, f"{at}.handle")
            mapped.add(chunk)
        elif handle is not None:
            _fail(f"{at}.handle", f"must be null for a released chunk, got {_show(handle)}")
    return mapped


def _check_blocks(snap, lay, pool_mapped):
    blocks, where = _get(snap, "blocks", "$"), "blocks"
    n, bpc = lay.chunks_per_plane, lay.blocks_per_chunk
    for key, expected, why in (("blocks_per_chunk", bpc, "layout's chunk and block sizes"),
                               ("num_planes", lay.num_planes, "layout's placement and layers"),
                               ("num_chunks", n, "layout.chunks_per_plane"),
                               ("max_blocks", n * bpc, "layout's chunks and blocks per chunk")):
        _equal(_int(_get(blocks, key, where), f"{where}.{key}"), expected, f"{where}.{key}", f"the {why}")
    if n * bpc > MAX_INDEX:
        _fail(f"{where}.max_blocks", f"{n * bpc} blocks: block ids must fit an int32")
    chunk_mapped = _list(_get(blocks, "chunk_mapped", where), f"{where}.chunk_mapped", n)
    planes_mapped = np.bincount([c % n for c in pool_mapped], minlength=n)
    for k, value in enumerate(chunk_mapped):
        if not isinstance(value, bool):
            _fail(f"{where}.chunk_mapped[{k}]", f"must be true or false, got {_kind(value)}")
        if planes_mapped[k] != (lay.num_planes if value else 0):
            _fail(f"{where}.chunk_mapped[{k}]", f"is {str(value).lower()} but pool.chunks maps chunk {k} of "
                                                f"{planes_mapped[k]} of the {lay.num_planes} planes")
    mapped = np.array(chunk_mapped, dtype=bool)
    free_in_chunk = _int_list(_get(blocks, "free_in_chunk", where), f"{where}.free_in_chunk", n, 0, bpc)
    frontier = int(np.flatnonzero(mapped).max()) + 1 if mapped.any() else 0
    refs = _int_list(_get(blocks, "ref_counts", where), f"{where}.ref_counts", frontier * bpc, 0, MAX_INDEX)
    held_in_chunk = np.bincount(np.flatnonzero(refs) // bpc, minlength=n) if refs.size else np.zeros(n, np.int64)
    cached = _check_cached(blocks, where, refs, mapped, bpc)
    idle_in_chunk = np.bincount(cached[refs[cached] == 0] // bpc, minlength=n)  # cached-free blocks
    for k in np.flatnonzero(held_in_chunk + idle_in_chunk + free_in_chunk != np.where(mapped, bpc, 0)):
        _fail(f"{where}.free_in_chunk[{k}]", f"is {free_in_chunk[k]} but chunk {k} is "
                                             f"{'mapped' if mapped[k] else 'not mapped'} with {held_in_chunk[k]} "
                                             f"referenced and {idle_in_chunk[k]} cached-free blocks of {bpc}")
    _equal(_int(_get(blocks, "free", where), f"{where}.free"), int(free_in_chunk.sum()), f"{where}.free",
           "blocks.free_in_chunk's entries")
    _equal(_int(_get(blocks, "held", where), f"{where}.held"), int(held_in_chunk.sum()), f"{where}.held",
           "the referenced blocks in blocks.ref_counts")
    return mapped, refs


def _check_cached(blocks, where, refs, mapped, bpc):
    """``blocks.cached``: distinct block ids in increasing order, each in a mapped chunk."""
    raw = _list(_get(blocks, "cached", where), f"{where}.cached", hi=refs.size)
    cached = _int_list(raw, f"{where}.cached", len(raw), 0, MAX_INDEX)
    for i in np.flatnonzero(np.diff(cached) <= 0)[:1]:
        _fail(f"{where}.cached[{i + 1}]", f"is {cached[i + 1]}: cached block ids are distinct, in increasing order")
    outside = np.flatnonzero(cached >= refs.size)
    outside = outside if outside.size else np.flatnonzero(~mapped[cached // bpc])
    for i in outside[:1]:
        _fail(f"{where}.cached[{i}]", f"block {cached[i]} lies in chunk {cached[i] // bpc}, which is not mapped")
    return cached


def _check_sequences(snap, lay, mapped, refs):
    max_seqs = _int(_get(snap, "max_seqs", "$"), "max_seqs", 1, MAX_INDEX)
    per_seq = _int(_get(snap, "max_blocks_per_seq", "$"), "max_blocks_per_seq", 1, MAX_INDEX)
    seqs = _list(_get(snap, "sequences", "$"), "sequences", hi=max_seqs)
    holders = np.zeros(refs.size, np.int64)
    seen = set()
    for i, entry in enumerate(seqs):
        at = f"sequences[{i}]"
        seq = _int(_get(entry, "seq", at), f"{at}.seq", 0, max_seqs - 1)
        if seq in seen:
            _fail(f"{at}.seq", f"sequence {seq} appears twice")
        seen.add(seq)
        length = _int(_get(entry, "length", at), f"{at}.length", 0, per_seq * lay.block_size)
        count = -(-length // lay.block_size)
        ids = _int_list(_get(entry, "blocks", at), f"{at}.blocks", count, 0, lay.max_blocks - 1)
        if np.unique(ids).size != ids.size:
            _fail(f"{at}.blocks", "holds a block twice")
        unmapped = np.flatnonzero(ids >= refs.size)
        unmapped = unmapped if unmapped.size else np.flatnonzero(~mapped[ids // lay.blocks_per_chunk])
        if unmapped.size:
            j = unmapped[0]
            _fail(f"{at}.blocks[{j}]", f"block {ids[j]} lies in chunk {ids[j] // lay.blocks_per_chunk}, "
                                       f"which is not mapped")
        swapped = _get(entry, "swapped", at)
        if not isinstance(swapped, bool):
            _fail(f"{at}.swapped", f"must be true or false, got {_kind(swapped)}")
        host = np.flatnonzero(ids >= lay.device_blocks)
        if host.size and not swapped:
            _fail(f"{at}.blocks[{host[0]}]", f"block {ids[host[0]]} is in the host tier but the sequence is not "
                                             f"swapped out")
        holders[ids] += 1
    for b in np.flatnonzero(holders != refs)[:1]:
        _fail(f"blocks.ref_counts[{b}]", f"is {refs[b]} but {holders[b]} sequences hold block {b}")


def validate_snapshot(snap: Any) -> dict:
    """Check a snapshot dict against the schema (types, ranges, sections agreeing).

    Parameters
    ----------
    snap : object
        What a JSON reader returned, trusted in nothing.

    Returns
    -------
    dict
        ``snap`` itself, checked.

    Raises
    ------
    SnapshotError
        The first problem found, naming its JSON path.
    """
    try:
        if not isinstance(snap, dict) or snap.get("schema") != SNAPSHOT_SCHEMA:
            raise _Invalid(f"not a pagedrt snapshot (no schema {SNAPSHOT_SCHEMA!r})")
        version = snap.get("version")
        if type(version) is not int or version != SNAPSHOT_VERSION:
            raise _Invalid(f"snapshot version {_show(version)}; this pagedrt reads version {SNAPSHOT_VERSION}, the "
                           f"only one" + (": upgrade pagedrt" if type(version) is int and version > 1 else ""))
        taken = _get(snap, "time", "$")
        if not isinstance(taken, (int, float)) or isinstance(taken, bool) or not math.isfinite(taken) or taken < 0:
            _fail("time", f"must be a Unix time (a finite number >= 0), got {_show(taken)}")
        lay = _check_layout(snap)
        _check_shard(snap, lay)
        mapped, refs = _check_blocks(snap, lay, _check_pool(snap, lay))
        _check_sequences(snap, lay, mapped, refs)
    except _Invalid as exc:
        raise SnapshotError(str(exc)) from None
    return snap


def load_snapshot(path: PathLike) -> dict:
    """Read and check a snapshot file: a regular file of at most 16 MiB, nested at most 16 levels.

    Parameters
    ----------
    path : str or os.PathLike
        The file.

    Returns
    -------
    dict
        The snapshot, checked by :func:`validate_snapshot`.

    Raises
    ------
    SnapshotError
        The file cannot be read, is not a regular file, is too large or too deep, is not JSON, or is not a valid
        snapshot; the message names the file and the first problem.
    """
    snap = _parse(path, _read_bounded(path))
    try:
        return validate_snapshot(snap)
    except SnapshotError as exc:
        raise SnapshotError(f"{path}: {exc}") from None
