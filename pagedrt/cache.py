"""PagedKVCache: every layer's K and V over one pool, and the whole chain from token to chunk.

Layout (see docs/ARCHITECTURE.md for why):

- Inside a block, K (and V) of one layer is ``[num_kv_heads, block_size, head_dim]``
  (HND): a decode thread block reads one KV head's ``block_size * head_dim`` run.
- Placement ``"plane"`` (the default) gives each (layer, K|V) its own region of the
  range, ``2 * num_layers`` planes; block ``b`` of a plane is at ``b * plane_block_bytes``
  and allocator chunk ``k`` is the k-th chunk of every plane. Placement ``"block"``
  puts all layers' K and V of a block together (``[layer][K|V][head][slot][dim]``),
  so one chunk holds whole blocks of every layer.

Either way a kernel sees, per layer and K|V, a base pointer and one block stride.
"""

import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, replace

import numpy as np

from .blocks import BlockAllocator, BlockTables, ranks, ceil_div
from .errors import SnapshotError, UnknownSequenceError, UnsupportedConfigError
from .memory import Pool, select_backend
from .step import StepMetadata
from .supported import BLOCK_SIZES, HEAD_DIMS, check, numpy_dtype

PLACEMENTS = ("plane", "block")
KINDS = ("k", "v")
SNAPSHOT_SCHEMA, SNAPSHOT_VERSION = "pagedrt-snapshot", 1
MiB = 1 << 20


def _check_positive(name, value):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise UnsupportedConfigError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class Layout:
    """Where every block of every layer's K and V lies in the pool's range (bytes)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    itemsize: int
    placement: str
    page_bytes: int
    chunk_bytes: int       # one physical chunk
    chunks_per_plane: int  # allocator chunks

    @classmethod
    def plan(cls, num_layers, num_kv_heads, head_dim, block_size, dtype, placement, page_bytes,
             max_blocks, chunk_bytes=None):
        """Choose the chunk size (a whole number of pages and of blocks) and the range's size."""
        dtype = numpy_dtype(dtype)
        shape = cls(num_layers, num_kv_heads, head_dim, block_size, dtype.name, dtype.itemsize, placement,
                    page_bytes, 0, 0)
        step, unit = shape.chunk_step, shape.block_stride_bytes
        if chunk_bytes is not None and (chunk_bytes <= 0 or chunk_bytes % step):
            raise UnsupportedConfigError(
                f"chunk_bytes={chunk_bytes} must be a positive multiple of {step} bytes (a whole number of "
                f"{page_bytes}-byte pages and of {unit}-byte blocks)")
        # By default 64 MiB a grow step, and never chunks under 16 MiB: memory mapped in
        # 2 MiB chunks streams 20% slower (docs/ARCHITECTURE.md). Less for a small cache.
        wanted = chunk_bytes or min(max(64 * MiB // shape.planes, 16 * MiB), max_blocks * unit)
        chunk = ceil_div(wanted, step) * step
        return replace(shape, chunk_bytes=chunk, chunks_per_plane=ceil_div(max_blocks, chunk // unit))

    # --- derived sizes ----------------------------------------------------------------

    @property
    def planes(self):
        return 2 * self.num_layers if self.placement == "plane" else 1

    @property
    def chunk_step(self):
        """Chunk sizes must be multiples of this: whole pages, and whole blocks of one plane."""
        return math.lcm(self.page_bytes, self.block_stride_bytes)

    @property
    def plane_block_bytes(self):
        """One block of one layer's K (or V)."""
        return self.num_kv_heads * self.block_size * self.head_dim * self.itemsize

    @property
    def block_bytes(self):
        """One block of every layer's K and V: what a block id costs."""
        return 2 * self.num_layers * self.plane_block_bytes

    @property
    def bytes_per_token(self):
        return self.block_bytes // self.block_size

    @property
    def block_stride_bytes(self):
        """Bytes between block b and b + 1 of one plane; also what one block takes in one chunk."""
        return self.plane_block_bytes if self.placement == "plane" else self.block_bytes

    @property
    def blocks_per_chunk(self):
        return self.chunk_bytes // self.block_stride_bytes

    @property
    def max_blocks(self):
        return self.chunks_per_plane * self.blocks_per_chunk

    @property
    def pool_bytes(self):
        return self.chunks_per_plane * self.chunk_bytes * self.planes

    # --- addresses ----------------------------------------------------------------------

    def plane_offset(self, layer, kind):
        """Byte offset of block 0 of (layer, K|V) from the pool's base."""
        index = 2 * layer + KINDS.index(kind)
        if self.placement == "plane":
            return index * self.chunks_per_plane * self.chunk_bytes
        return index * self.plane_block_bytes

    def offset(self, block_id, slot, layer, kind, head=0):
        """Byte offset of (block, slot, layer, K|V, kv head)'s ``head_dim`` values from the base."""
        inner = (head * self.block_size + slot) * self.head_dim * self.itemsize
        return self.plane_offset(layer, kind) + block_id * self.block_stride_bytes + inner

    def locate(self, offset):
        """(pool chunk, offset inside it, page inside it) of a byte offset."""
        chunk, within = divmod(offset, self.chunk_bytes)
        return chunk, within, within // self.page_bytes

    def check(self, layer, kind, head):
        if not 0 <= layer < self.num_layers:
            raise UnsupportedConfigError(f"layer {layer} does not exist: layers are 0..{self.num_layers - 1}")
        if kind not in KINDS:
            raise UnsupportedConfigError(f"kind {kind!r} must be 'k' or 'v'")
        if not 0 <= head < self.num_kv_heads:
            raise UnsupportedConfigError(f"kv head {head} does not exist: heads are 0..{self.num_kv_heads - 1}")


@dataclass(frozen=True)
class Translation:
    """The whole chain for one token of one sequence, layer, K|V and KV head."""

    seq: int
    pos: int
    layer: int
    kind: str
    kv_head: int
    logical_block: int    # pos // block_size
    slot: int             # pos % block_size
    block_id: int         # block_table[seq][logical_block]
    pool_offset: int      # bytes from the pool's base
    virtual_address: int  # pool base + pool_offset
    chunk: int            # the pool chunk (physical allocation) the MMU maps it to
    chunk_offset: int     # bytes into that chunk
    page: int             # page index inside the chunk
    nbytes: int           # contiguous bytes of this token's head_dim values

    def as_dict(self):
        return asdict(self)


def translate(layout, base, block_row, length, seq, pos, layer=0, kind="k", head=0):
    """The chain for token ``pos`` of a sequence whose block-table row and length are given."""
    if not 0 <= pos < length:
        raise UnknownSequenceError(f"sequence {seq} has no token {pos}: its positions are 0..{length - 1}")
    layout.check(layer, kind, head)
    logical, slot = divmod(pos, layout.block_size)
    block_id = int(block_row[logical])
    offset = layout.offset(block_id, slot, layer, kind, head)
    chunk, within, page = layout.locate(offset)
    return Translation(seq, pos, layer, kind, head, logical, slot, block_id, offset, base + offset,
                       chunk, within, page, layout.head_dim * layout.itemsize)


class PagedKVCache:
    """K and V of ``num_layers`` layers in blocks of ``block_size`` tokens, over one growable pool.

    Give the capacity as ``max_tokens`` or ``max_bytes`` (KV bytes); the pool reserves
    that much address space and maps chunks only as sequences need blocks.
    ``max_seqs`` and ``max_seq_len`` size the dense block table. ``backend`` is a name
    or a backend made by :func:`pagedrt.memory.select_backend`.
    """

    def __init__(self, num_layers, num_kv_heads, head_dim, block_size, dtype="float16", *,
                 max_tokens=None, max_bytes=None, max_seqs=256, max_seq_len=None,
                 placement="plane", chunk_bytes=None, backend="auto"):
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("max_seqs", max_seqs)):
            _check_positive(name, value)
        check("head_dim", head_dim, HEAD_DIMS)
        check("block_size", block_size, BLOCK_SIZES)
        check("placement", placement, PLACEMENTS)
        self.dtype = numpy_dtype(dtype)
        if (max_tokens is None) == (max_bytes is None):
            raise UnsupportedConfigError("give the capacity as exactly one of max_tokens or max_bytes")
        _check_positive("max_tokens" if max_bytes is None else "max_bytes", max_tokens or max_bytes)
        token_bytes = 2 * num_layers * num_kv_heads * head_dim * self.dtype.itemsize
        max_blocks = (ceil_div(max_tokens, block_size) if max_bytes is None
                      else max(max_bytes // (token_bytes * block_size), 1))
        backend = select_backend(backend) if isinstance(backend, str) else backend
        self.layout = Layout.plan(num_layers, num_kv_heads, head_dim, block_size, dtype, placement,
                                  backend.page_bytes, max_blocks, chunk_bytes)
        if max_seq_len is None:
            max_seq_len = min(self.layout.max_blocks * block_size, 32768)
        _check_positive("max_seq_len", max_seq_len)
        self.pool = Pool(self.layout.pool_bytes, self.layout.chunk_bytes, backend)
        self.allocator = BlockAllocator(self.pool, self.layout.blocks_per_chunk, self.layout.planes)
        self.tables = BlockTables(self.allocator, block_size, max_seqs, ceil_div(max_seq_len, block_size))
        self.step = StepMetadata(self.tables, self.pool.xp)
        self._planes = [self._plane_view(layer, kind) for layer in range(num_layers) for kind in KINDS]
        self._mask = None  # device copy of allocator.usable_mask(), rebuilt after grow/trim
        self._mask_version = None

    # --- shape ------------------------------------------------------------------------

    num_layers = property(lambda self: self.layout.num_layers)
    num_kv_heads = property(lambda self: self.layout.num_kv_heads)
    head_dim = property(lambda self: self.layout.head_dim)
    block_size = property(lambda self: self.layout.block_size)
    placement = property(lambda self: self.layout.placement)
    max_blocks_per_seq = property(lambda self: self.tables.max_blocks_per_seq)
    xp = property(lambda self: self.pool.xp)

    # --- sequences (delegated to the block tables) --------------------------------------

    def add_sequence(self):
        """A new empty sequence; returns its handle (its row in the block table)."""
        return self.tables.add()

    def append(self, seqs, counts=1):
        """Room for ``counts`` more tokens per sequence: ``(slot_mapping, copies)``.

        Write the new tokens' K/V through ``slot_mapping`` (``kernels.write_kv``) after
        copying each ``copies`` (src, dst) block pair (``kernels.copy_blocks(cache.planes, copies)``).
        """
        return self.tables.append(seqs, counts)

    def fork(self, seq):
        """A new sequence sharing every block of ``seq``; its first append copies a shared tail block."""
        return self.tables.fork(seq)

    def free(self, seqs):
        self.tables.free(seqs)

    def trim(self):
        """Hand back every chunk whose blocks are all free; returns the allocator chunks released."""
        return self.allocator.trim()

    def length(self, seq):
        return int(self.tables.lens[self.tables.rows(seq)[0]])

    @property
    def sequences(self):
        return [int(s) for s in self.tables.sequences]

    # --- what kernels read ----------------------------------------------------------------

    def k(self, layer):
        """Layer ``layer``'s K plane: ``[max_blocks, num_kv_heads, block_size, head_dim]``, a strided view."""
        return self._planes[2 * layer]

    def v(self, layer):
        return self._planes[2 * layer + 1]

    @property
    def planes(self):
        """Every plane, K and V of each layer in order (what ``copy_blocks`` takes)."""
        return list(self._planes)

    def block_tables(self, seqs=None):
        """The device block table (int32), all rows or those of ``seqs`` in order.

        Consecutive handles give a view of the table (no copy); others a gathered copy.
        """
        self.step.upload()
        return self._select(self.step.block_table, seqs)

    def seq_lens(self, seqs=None):
        """The device lengths (int32), all rows or those of ``seqs`` in order."""
        self.step.upload()
        return self._select(self.step.seq_lens, seqs)

    def _select(self, array, seqs):
        if seqs is None:
            return array
        rows = self.tables.rows(seqs)
        first = int(rows[0]) if rows.size else 0
        if rows.size and int(rows[-1]) - first + 1 == rows.size and (np.diff(rows) == 1).all():
            return array[first:first + rows.size]
        return array[self.xp.asarray(rows)]

    def block_mask(self):
        """Per block, on the device: 1 where its chunk is mapped. Kernels validate tables against it."""
        if self._mask_version != self.allocator.version:
            self._mask = self.xp.asarray(self.allocator.usable_mask().astype(np.uint8))
            self._mask_version = self.allocator.version
        return self._mask

    def _plane_view(self, layer, kind):
        lay = self.layout
        e = lay.itemsize
        shape = (lay.max_blocks, lay.num_kv_heads, lay.block_size, lay.head_dim)
        strides = (lay.block_stride_bytes, lay.block_size * lay.head_dim * e, lay.head_dim * e, e)
        return self.pool.view(lay.plane_offset(layer, kind), shape, self.dtype, strides, allow_holes=True)

    # --- both layers at once ----------------------------------------------------------------

    def translate(self, seq, pos, layer=0, kind="k", head=0):
        """Token ``pos`` of ``seq`` -> logical block, slot, block id, pool offset, VA, chunk, page."""
        row = self.tables.rows(seq)[0]
        return translate(self.layout, self.pool.base, self.tables.table[row], int(self.tables.lens[row]),
                         int(seq), pos, layer, kind, head)

    def stats(self):
        """Token and byte counts: what holds tokens against what is mapped.

        ``tokens`` counts every sequence's tokens; ``stored_tokens`` counts the token
        slots filled in held blocks, once even when forks share them, and
        ``token_bytes`` is what those hold.
        """
        lay, a, t = self.layout, self.allocator, self.tables
        rows = t.sequences
        lens = t.lens[rows].astype(np.int64)
        nb = ceil_div(lens, lay.block_size)
        held_rows, cols = np.repeat(rows, nb), ranks(nb)
        fill = np.minimum(lay.block_size, np.repeat(lens, nb) - cols * lay.block_size)
        filled = np.zeros(a.max_blocks, np.int64)
        np.maximum.at(filled, t.table[held_rows, cols], fill)
        stored = int(filled.sum())
        return {
            "sequences": int(rows.size), "tokens": int(lens.sum()), "stored_tokens": stored,
            "token_bytes": stored * lay.bytes_per_token,
            "held_blocks": a.num_held, "free_blocks": a.num_free, "mapped_blocks": a.num_mapped_blocks,
            "max_blocks": a.max_blocks, "mapped_bytes": self.pool.mapped_bytes,
            "reserved_bytes": self.pool.max_bytes,
        }

    def snapshot(self):
        """Both layers as a JSON-ready dict (schema in docs/SNAPSHOT.md)."""
        lay, a, t = self.layout, self.allocator, self.tables
        frontier = (int(np.flatnonzero(a.chunk_mapped).max()) + 1 if a.chunk_mapped.any() else 0)
        return {
            "schema": SNAPSHOT_SCHEMA, "version": SNAPSHOT_VERSION, "time": time.time(),
            "layout": asdict(lay),
            "pool": {"backend": self.pool.backend, "base": self.pool.base, "max_bytes": self.pool.max_bytes,
                     "chunk_bytes": self.pool.chunk_bytes, "page_bytes": self.pool.page_bytes,
                     "num_chunks": self.pool.num_chunks, "chunks": [r.as_dict() for r in self.pool.mappings()]},
            "blocks": {"blocks_per_chunk": a.blocks_per_chunk, "planes": a.planes, "num_chunks": a.num_chunks,
                       "max_blocks": a.max_blocks, "free": a.num_free, "held": a.num_held,
                       "chunk_mapped": a.chunk_mapped.tolist(), "free_in_chunk": a.free_in_chunk.tolist(),
                       "ref_counts": a.ref_count[:frontier * a.blocks_per_chunk].tolist()},
            "sequences": [{"seq": int(s), "length": int(t.lens[s]), "blocks": t.blocks(s).tolist()}
                          for s in t.sequences],
            "max_seqs": t.max_seqs, "max_blocks_per_seq": t.max_blocks_per_seq,
        }

    def write_snapshot(self, path):
        """Write :meth:`snapshot` to ``path`` atomically (a temp file renamed over it)."""
        directory = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".snapshot-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.snapshot(), f)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise

    # --- lifetime -----------------------------------------------------------------------------

    def close(self):
        self._planes.clear()
        self._mask = None
        self.pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        lay = self.layout
        return (f"PagedKVCache({lay.num_layers} layers, {lay.num_kv_heads} kv heads x {lay.head_dim}, "
                f"block {lay.block_size}, {lay.dtype}, {lay.placement}-major, {self.pool!r})")


def load_snapshot(path):
    """Read a snapshot file; SnapshotError if it is missing, corrupt, or of a newer schema."""
    try:
        with open(path) as f:
            snap = json.load(f)
    except FileNotFoundError:
        raise SnapshotError(f"no snapshot at {path}: write one with cache.write_snapshot(path)") from None
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"cannot read snapshot {path}: {exc}") from None
    if not isinstance(snap, dict) or snap.get("schema") != SNAPSHOT_SCHEMA:
        raise SnapshotError(f"{path} is not a pagedrt snapshot (no schema {SNAPSHOT_SCHEMA!r})")
    version = snap.get("version")
    if not isinstance(version, int) or version > SNAPSHOT_VERSION:
        raise SnapshotError(f"{path} has snapshot version {version!r}; this pagedrt reads up to "
                            f"version {SNAPSHOT_VERSION}: upgrade pagedrt")
    try:
        Layout(**snap["layout"])
        for key in ("pool", "blocks", "sequences"):
            snap[key]
    except (KeyError, TypeError) as exc:
        raise SnapshotError(f"{path} is a corrupt snapshot: {exc!r}") from None
    return snap
