"""Where every block of every layer's K and V lies in the pool's range, and one token's whole chain.

Layout (see docs/ARCHITECTURE.md for why):

- Inside a block, K (and V) of one layer is ``[num_kv_heads, block_size, head_dim]``
  (HND): a decode thread block reads one KV head's ``block_size * head_dim`` run.
- Placement ``"plane"`` (the default) gives each (layer, K|V) its own region of the
  range, ``2 * num_layers`` planes; block ``b`` of a plane is at ``b * plane_block_bytes``
  and allocator chunk ``k`` is the k-th chunk of every plane. Placement ``"block"``
  puts all layers' K and V of a block together (``[layer][K|V][head][slot][dim]``),
  so one chunk holds whole blocks of every layer.

The host tier, when there is one, is more allocator chunks after the device's:
block ids ``[device_blocks, max_blocks)`` lie in chunks of pinned host memory mapped
into the same range (:mod:`pagedrt.memory`), so a kernel reads a host-tier block
through the same plane pointer and block stride as any other.

Either way a kernel sees, per layer and K|V, a base pointer and one block stride.
:func:`translate` follows one token from its position to its chunk and page, from
a block-table row alone, so it works on a snapshot as on a live cache.
"""

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Collection, Optional, Sequence, Tuple, Union

import numpy as np

from .blocks.util import ceil_div
from .errors import InvalidPositionError, UnsupportedConfigError
from .spec import KVSpec

KV = ("k", "v")
MiB = 1 << 20


@dataclass(frozen=True)
class Layout:
    """Where every block of every layer's K and V lies in the pool's range (bytes)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str             # what the planes hold (pagedrt.supported.KV_DTYPES): the spec's K/V dtype
    itemsize: int          # bytes of one stored value (KVSpec.itemsize)
    placement: str
    page_bytes: int
    chunk_bytes: int       # one physical chunk
    chunks_per_plane: int  # allocator chunks, the device's then the host tier's
    host_chunks: int = 0   # the last chunks_per_plane chunks that are the host tier's

    @classmethod
    def plan(cls, spec: KVSpec, page_bytes: int, max_blocks: int, chunk_bytes: Optional[int] = None,
             host_blocks: int = 0) -> "Layout":
        """Choose the chunk size (a whole number of pages and of blocks) and the range's size: ``max_blocks``
        device blocks, then ``host_blocks`` host-tier blocks, each rounded up to whole chunks.

        Parameters
        ----------
        spec : KVSpec
            What the cache holds (:meth:`pagedrt.spec.KVSpec.build`).
        page_bytes : int
            The backend's mapping granularity.
        max_blocks, host_blocks : int
            Blocks of the device tier and of the host tier.
        chunk_bytes : int, optional
            A chunk's bytes: a positive multiple of :attr:`chunk_step`; default about 64 MiB a grow step.
        """
        shape = cls(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_size, spec.kv_dtype,
                    spec.itemsize, spec.placement, page_bytes, 0, 0)
        step, unit = shape.chunk_step, shape.block_stride_bytes
        if chunk_bytes is not None and (not is_int(chunk_bytes) or chunk_bytes <= 0 or chunk_bytes % step):
            raise UnsupportedConfigError(
                f"chunk_bytes={chunk_bytes} must be a positive multiple of {step} bytes (a whole number of "
                f"{page_bytes}-byte pages and of {unit}-byte blocks)")
        # By default 64 MiB a grow step, and never chunks under 16 MiB: memory mapped in
        # small chunks streams slower (docs/ARCHITECTURE.md). Less for a small cache.
        wanted = (int(chunk_bytes) if chunk_bytes is not None
                  else min(max(64 * MiB // shape.num_planes, 16 * MiB), max_blocks * unit))
        chunk = ceil_div(wanted, step) * step
        host = ceil_div(host_blocks, chunk // unit)
        return replace(shape, chunk_bytes=chunk, chunks_per_plane=ceil_div(max_blocks, chunk // unit) + host,
                       host_chunks=host)

    # --- derived sizes ----------------------------------------------------------------

    @property
    def num_planes(self) -> int:
        """Regions of the range: ``2 * num_layers`` plane-major, 1 block-major."""
        return 2 * self.num_layers if self.placement == "plane" else 1

    @property
    def chunk_step(self) -> int:
        """Chunk sizes must be multiples of this: whole pages, and whole blocks of one plane."""
        return math.lcm(self.page_bytes, self.block_stride_bytes)

    @property
    def plane_block_bytes(self) -> int:
        """One block of one layer's K (or V)."""
        return self.num_kv_heads * self.block_size * self.head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        """One block of every layer's K and V: what a block id costs."""
        return 2 * self.num_layers * self.plane_block_bytes

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in every layer."""
        return self.block_bytes // self.block_size

    @property
    def block_stride_bytes(self) -> int:
        """Bytes between block b and b + 1 of one plane; also what one block takes in one chunk."""
        return self.plane_block_bytes if self.placement == "plane" else self.block_bytes

    @property
    def blocks_per_chunk(self) -> int:
        """Blocks of one plane in one chunk."""
        return self.chunk_bytes // self.block_stride_bytes

    @property
    def max_blocks(self) -> int:
        """Block ids of both tiers."""
        return self.chunks_per_plane * self.blocks_per_chunk

    @property
    def device_blocks(self) -> int:
        """Block ids ``[0, device_blocks)`` are the device's; the rest the host tier's."""
        return (self.chunks_per_plane - self.host_chunks) * self.blocks_per_chunk

    def location(self, block_id: int) -> str:
        """Where block ``block_id`` lives: ``"device"`` or ``"host"`` (the host tier)."""
        return "host" if block_id >= self.device_blocks else "device"

    @property
    def pool_bytes(self) -> int:
        """The pool's whole range: every chunk of every plane."""
        return self.chunks_per_plane * self.chunk_bytes * self.num_planes

    # --- addresses ----------------------------------------------------------------------

    def plane_offset(self, layer: int, kv: str) -> int:
        """Byte offset of block 0 of layer ``layer``'s K (``kv`` ``"k"``) or V (``"v"``) from the pool's base."""
        index = 2 * layer + KV.index(kv)
        if self.placement == "plane":
            return index * self.chunks_per_plane * self.chunk_bytes
        return index * self.plane_block_bytes

    def offset(self, block_id: int, slot: int, layer: int, kv: str, head: int = 0) -> int:
        """Byte offset from the pool's base of the ``head_dim`` values of one token's KV head.

        Parameters
        ----------
        block_id, slot : int
            The block and the token's slot in it (``0 <= slot < block_size``).
        layer, kv, head : int, str, int
            The layer, ``"k"`` or ``"v"``, and the KV head. Unchecked (:meth:`check`).
        """
        inner = (head * self.block_size + slot) * self.head_dim * self.itemsize
        return self.plane_offset(layer, kv) + block_id * self.block_stride_bytes + inner

    def locate(self, offset: int) -> Tuple[int, int, int]:
        """(pool chunk, offset inside it, page inside it) of a byte offset from the pool's base."""
        chunk, within = divmod(offset, self.chunk_bytes)
        return chunk, within, within // self.page_bytes

    def check(self, layer: Any, kv: Any, head: Any) -> None:
        """UnsupportedConfigError unless ``layer`` and ``head`` are ints in range and ``kv`` is ``"k"`` or ``"v"``."""
        if not is_int(layer) or not 0 <= layer < self.num_layers:
            raise UnsupportedConfigError(f"layer {layer!r:.80} does not exist: layers are 0..{self.num_layers - 1}")
        if not isinstance(kv, str) or kv not in KV:
            raise UnsupportedConfigError(f"kv {kv!r:.80} must be 'k' or 'v'")
        if not is_int(head) or not 0 <= head < self.num_kv_heads:
            raise UnsupportedConfigError(f"kv head {head!r:.80} does not exist: heads are 0..{self.num_kv_heads - 1}")


def is_int(value: Any) -> bool:
    """An int or NumPy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Translation:
    """The whole chain for one token of one sequence, layer, K|V and KV head."""

    seq: int
    pos: int
    layer: int
    kv: str
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
    cached: bool = False  # the block is in the prefix cache (named by its tokens' hash chain)
    location: str = "device"  # the block's tier: "device", or "host" (pinned host memory, same pointers)
    shard: Optional[int] = None   # a sharded cache's shard holding kv_head (offset and address are in its pool)
    device: Optional[int] = None  # and that shard's device

    def as_dict(self) -> dict:
        """The fields as a dict; ``shard`` and ``device`` only for a sharded cache's."""
        fields = asdict(self)
        if self.shard is None:
            del fields["shard"], fields["device"]
        return fields


def translate(layout: Layout, base: int, block_row: Sequence[int], length: int, seq: int, pos: Any, layer: Any = 0,
              kv: Any = "k", head: Any = 0, cached: Union[np.ndarray, Collection[int]] = ()) -> Translation:
    """The chain for token ``pos`` of a sequence whose block-table row and length are given (from a live
    cache's tables or a snapshot's).

    Parameters
    ----------
    layout : Layout
        The cache's layout.
    base : int
        The pool's base address.
    block_row : int sequence or int32 array [>= ceil(length / block_size)]
        The sequence's block ids, in logical order.
    length : int
        The sequence's tokens.
    seq : int
        Its handle (recorded in the result).
    pos, layer, kv, head
        The token's position, the layer, ``"k"`` or ``"v"``, and the KV head; checked.
    cached : bool array [max_blocks] or collection of int
        Per block id, whether it is in the prefix cache; or the cached ids.

    Raises
    ------
    InvalidPositionError
        ``pos`` is not an int in ``[0, length)``.
    UnsupportedConfigError
        A layer, K|V or head that does not exist.
    """
    if not is_int(pos) or not 0 <= pos < length:
        raise InvalidPositionError(f"sequence {seq} has no token {pos!r:.80}: its positions are 0..{length - 1}")
    layout.check(layer, kv, head)
    pos, layer, head = int(pos), int(layer), int(head)
    logical, slot = divmod(pos, layout.block_size)
    block_id = int(block_row[logical])
    offset = layout.offset(block_id, slot, layer, kv, head)
    chunk, within, page = layout.locate(offset)
    return Translation(seq, pos, layer, kv, head, logical, slot, block_id, offset, base + offset,
                       chunk, within, page, layout.head_dim * layout.itemsize,
                       bool(cached[block_id]) if isinstance(cached, np.ndarray) else block_id in cached,
                       layout.location(block_id))
