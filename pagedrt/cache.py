"""PagedKVCache: every layer's K and V over one pool, its sequences, and what kernels read; the facade over the
pool, the software layer, growth, the step's device metadata, the layout and snapshots."""

import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from .blocks import BlockAllocator, BlockTables, ceil_div, ranks
from .cache_options import capacity_blocks, check_sizes, growth_keywords, kv_scales_of
from .errors import ConcurrentUseError, PoolClosedError, UnsupportedConfigError
from .exclusive import exclusive
from .growth import Growth
from .layout import KV, Layout, Translation, is_int, translate
from .memory import Pool, select_backend
from .memory.backends import Backend
from .planes import PlaneViews, TableViews, plane_view
from .protocols import Counts, Handles
from .snapshot import build_snapshot, write_snapshot
from .spec import Array, KVSpec
from .step import Step, StepMetadata
from .supported import MAX_SEQ_LEN, MAX_SEQS, PREFILL_HEAD_DIMS, check, check_positive


class PagedKVCache(PlaneViews, TableViews):
    """K and V of ``num_layers`` layers in blocks of ``block_size`` tokens, over one growable pool.

    The pool reserves the capacity's address space and maps chunks only as sequences need blocks. A
    :class:`~pagedrt.protocols.KVCache` and a :class:`~pagedrt.protocols.KVPlanes`. Not thread-safe: a call made
    while another thread is inside the cache raises :class:`~pagedrt.errors.ConcurrentUseError` and changes
    nothing; after :meth:`close` every call raises :class:`~pagedrt.errors.PoolClosedError`
    (docs/ARCHITECTURE.md, "Layers").

    Parameters
    ----------
    num_layers, num_kv_heads : int
        Layers, and KV heads per layer.
    head_dim : int
        One that prefill attends (``supported.PREFILL_HEAD_DIMS``: 64, 128, 256), since prompts fill a cache;
        decode alone attends 80 and 96 too, over planes of one's own. FP8: 64 or 128.
    block_size : int
        Tokens a block holds (``supported.BLOCK_SIZES``).
    dtype : str or numpy.dtype
        The model's dtype: q, k, v and the attention output (float16, bfloat16 or float32).
    max_tokens, max_bytes : int
        The device capacity, one of them: tokens (rounded up to whole blocks) or KV bytes (down, at least a block).
    max_seqs : int
        Rows of the block table: the most live sequences.
    max_seq_len : int, optional
        The most tokens a sequence holds (sizes each row); default the capacity, at most 32768.
    max_step_tokens : int, optional
        The most new tokens one :meth:`step` takes (sizes the slot buffer); default ``max_seq_len + max_seqs``.
    placement : str
        ``"plane"`` (each layer's K and V its own region) or ``"block"`` (a block's every layer together).
    chunk_bytes : int, optional
        Bytes of one pool chunk (a multiple of the backend's page); default the layout's choice.
    backend : str or Backend
        ``"auto"``, ``"cuda"`` or ``"host"``, or a backend made by :func:`pagedrt.memory.select_backend`.
    growth : None, bool or dict
        None or False: chunks are mapped when an append needs them. True: a :class:`~pagedrt.growth.Growth`
        keeps one to two chunks' blocks spare (``low_blocks``, ``high_blocks``) and releases a chunk all free for
        64 ticks (``release_after``), on a worker thread (``background``); a dict sets some, the rest as True.
    host_tokens, host_bytes : int, optional
        At most one: a host tier of that capacity (rounded up to whole chunks), pinned here, ahead of need.
    kv_dtype : str, optional
        What the planes store (``supported.KV_DTYPES``; default ``dtype``); ``"float8_e4m3"``: uint8 bits under
        ``kv_scales``, for ``dtype`` float16 or bfloat16.
    kv_scales : array-like, float32 [num_layers, 2, num_kv_heads], optional
        FP8 only: the scales of K then V per layer and KV head, positive, normal and finite (stored bytes mean
        value / scale, so fixed for the cache's life); default all 1.

    Raises
    ------
    UnsupportedConfigError
        A shape, dtype, capacity or option pagedrt does not support, or a cache the host bookkeeping or block
        ids (int32) cannot describe; nothing is allocated then.
    HostOutOfMemoryError
        The host refused to pin the host tier; nothing is left allocated.

    Attributes
    ----------
    spec, layout, pool, allocator, tables, metadata, growth
        The parts under the facade (:class:`~pagedrt.spec.KVSpec`, :class:`~pagedrt.layout.Layout`, a
        :class:`~pagedrt.memory.Pool`, :class:`~pagedrt.blocks.BlockAllocator`, :class:`~pagedrt.blocks.BlockTables`,
        :class:`~pagedrt.step.StepMetadata`, a :class:`~pagedrt.growth.Growth` or None); callers need ``spec`` only.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: Any = "float16",
                 *, max_tokens: Optional[int] = None, max_bytes: Optional[int] = None, max_seqs: int = 256,
                 max_seq_len: Optional[int] = None, max_step_tokens: Optional[int] = None, placement: str = "plane",
                 chunk_bytes: Optional[int] = None, backend: Union[str, Backend] = "auto",
                 growth: Union[None, bool, Dict[str, Any]] = None, host_tokens: Optional[int] = None,
                 host_bytes: Optional[int] = None, kv_dtype: Optional[str] = None, kv_scales: Any = None):
        self.spec = spec = KVSpec.build(num_layers, num_kv_heads, head_dim, block_size, dtype, kv_dtype, placement)
        max_seqs = check_positive("max_seqs", max_seqs, MAX_SEQS)
        check("head_dim", spec.head_dim, PREFILL_HEAD_DIMS)  # what prefill attends, not decode alone
        scales = kv_scales_of(spec, kv_scales)
        max_blocks, host_blocks = capacity_blocks(spec, max_tokens, max_bytes, host_tokens, host_bytes)
        if isinstance(backend, str):
            backend = select_backend(backend)
        elif not is_int(getattr(backend, "page_bytes", None)):
            raise UnsupportedConfigError(f"backend={backend!r:.80} must be a name or a backend from select_backend()")
        self.layout = Layout.plan(spec, backend.page_bytes, max_blocks, chunk_bytes, host_blocks)
        if max_seq_len is None:
            max_seq_len = min(self.layout.device_blocks * spec.block_size, 32768)
        max_seq_len = check_positive("max_seq_len", max_seq_len, MAX_SEQ_LEN)
        if max_step_tokens is None:
            max_step_tokens = max_seq_len + max_seqs
        max_step_tokens = check_positive("max_step_tokens", max_step_tokens, MAX_SEQ_LEN + MAX_SEQS)
        self._lock = threading.RLock()
        check_sizes(self.layout, max_seqs, ceil_div(max_seq_len, spec.block_size))
        growth = growth_keywords(growth, self.layout.blocks_per_chunk)
        self.pool = Pool(self.layout.pool_bytes, self.layout.chunk_bytes, backend)
        self.allocator = BlockAllocator(self.pool, self.layout.blocks_per_chunk, self.layout.num_planes,
                                        self.layout.host_chunks)
        try:
            self.allocator.map_host()
            self.growth = None if growth is None else Growth(self.allocator, **growth)
        except BaseException:
            self.pool.close()
            raise
        self.tables = BlockTables(self.allocator, spec.block_size, max_seqs, ceil_div(max_seq_len, spec.block_size))
        self.metadata = StepMetadata(self.tables, self.pool.xp, max_step_tokens)
        self._planes = [self._plane_view(layer, kv) for layer in range(spec.num_layers) for kv in KV]
        self._scales = None if scales is None else self.pool.xp.asarray(scales)
        self._mask = None  # device copy of allocator.usable_mask(), rebuilt after grow/trim
        self._mask_version: Optional[int] = None

    # --- shape ------------------------------------------------------------------------

    @property
    def dtype(self) -> np.dtype:
        """The model's dtype: q, k, v and the attention output."""
        return self.spec.dtype

    @property
    def kv_dtype(self) -> str:
        """What the planes store: a name of ``supported.KV_DTYPES``."""
        return self.spec.kv_dtype

    @property
    def num_layers(self) -> int:
        """Layers of K and V."""
        return self.layout.num_layers

    @property
    def num_kv_heads(self) -> int:
        """KV heads in each plane."""
        return self.layout.num_kv_heads

    @property
    def head_dim(self) -> int:
        """Elements of one head's K (or V) of one token."""
        return self.layout.head_dim

    @property
    def block_size(self) -> int:
        """Tokens a block holds."""
        return self.layout.block_size

    @property
    def placement(self) -> str:
        """``"plane"`` or ``"block"``: how the planes lie in the pool."""
        return self.layout.placement

    @property
    def max_blocks_per_seq(self) -> int:
        """Columns of the block table: the most blocks one sequence holds."""
        return self.tables.max_blocks_per_seq

    @property
    def xp(self) -> Any:
        """The array module of the cache's arrays: ``cupy``, or ``numpy`` on the host backend."""
        return self.pool.xp

    # --- sequences (delegated to the block tables) --------------------------------------

    @exclusive
    def add_sequence(self, prefix: Optional[Sequence[int]] = None) -> int:
        """A new sequence.

        Parameters
        ----------
        prefix : sequence of int, optional
            The prompt's token ids: the sequence starts holding the cached blocks the prompt begins with
            (shared), never all of it; the prefill appends the other ``len(prefix) - length(seq)`` tokens with
            their ids. None: it starts empty.

        Returns
        -------
        int
            Its handle (its row in the block table).

        Raises
        ------
        TooManySequencesError
            ``max_seqs`` sequences are live.
        InvalidTokenIdsError
            ``prefix`` is not a flat sequence of int32 ids.
        """
        return self.tables.add(prefix)

    @exclusive
    def append(self, seqs: Optional[Handles], counts: Counts = 1,
               token_ids: Optional[Sequence[int]] = None) -> Tuple[np.ndarray, np.ndarray]:
        """Room for ``counts`` more tokens per sequence; all or nothing.

        Parameters
        ----------
        seqs : handles or None
            Live sequences, each once; None: every live sequence, in handle order.
        counts : int or int sequence
            New tokens: one count for every sequence, or one each.
        token_ids : sequence of int, optional
            ``sum(counts)`` ids, sequence by sequence: the blocks these tokens fill are named in the prefix cache.

        Returns
        -------
        slot_mapping : numpy.ndarray
            Host int64 ``[sum(counts)]``: each new token's slot (``block * block_size + offset``), for
            ``kernels.write_kv``.
        copies : numpy.ndarray
            Host int32 ``[n, 2]`` (src, dst) block pairs to copy first (``kernels.copy_blocks(cache.planes,
            copies)``): copy-on-write of shared tail blocks.

        Raises
        ------
        UnknownSequenceError, DuplicateSequenceError, InvalidTokenCountError, InvalidTokenIdsError
            Bad arguments.
        SequenceFullError, PoolExhaustedError
            A row or the cache cannot hold the tokens; nothing changes.
        """
        return self.tables.append(seqs, counts, token_ids)

    @exclusive
    def step(self, seqs: Optional[Handles] = None, counts: Counts = 1, token_ids: Optional[Sequence[int]] = None, *,
             arrivals: Sequence[Sequence[int]] = (), arrival_tokens: Optional[Counts] = None, forks: Handles = (),
             frees: Handles = (), swap_out: Handles = (), swap_in: Handles = ()) -> Step:
        """One engine step in one call: the scheduler's decisions in, the step's kernel metadata out.

        In order: ``frees``, ``forks``, ``arrivals``, ``swap_out``, ``swap_in``, then ``counts`` new tokens for
        ``seqs``; with ``growth``, the step ends with its :meth:`~pagedrt.growth.Growth.tick`. All or nothing:
        any error, ``KeyboardInterrupt`` included, changes nothing (docs/ARCHITECTURE.md, "All or nothing").
        Preempting: by swap, ``swap_out=[seq]`` now and ``swap_in=[seq]`` when :meth:`can_swap_in`; by
        recompute, ``frees=[seq]`` now and its tokens so far as an arrival later. ``None`` for any list means
        none.

        Parameters
        ----------
        seqs : handles, optional
            The sequences that get new tokens; None: every live one not freed now and not swapped out after the
            swaps, before the arrivals and forks.
        counts : int or int sequence
            New tokens: one count for every sequence of ``seqs``, or one each.
        token_ids : sequence of int, optional
            ``sum(counts)`` ids, sequence by sequence (for the prefix cache, as :meth:`append`).
        arrivals : sequence of int sequences
            Prompts, as token ids: each becomes a new sequence holding the cached blocks its prompt begins with
            (blocks offloaded to the host tier are brought back).
        arrival_tokens : int or int sequence, optional
            Tokens of each prompt to append now, one for all or one per arrival; None: the whole uncached rest
            (a chunked prefill appends the rest in later steps, with its ids).
        forks : handles
            Parents (a parent may repeat, never a swapped-out one): each gets a child sharing its blocks as they
            are before this step's tokens.
        frees : handles
            Sequences to free (one handle, or several).
        swap_out, swap_in : handles
            Live sequences to move to the host tier, and swapped-out ones to move back (:meth:`swap_out`).

        Returns
        -------
        Step
            The slot mapping, the batch's block tables, KV lengths and query offsets on the device (one pinned
            upload), the tier copies then the copy-on-write pairs to copy first, the arrivals' handles and cached
            tokens and the children's handles (:class:`~pagedrt.step.Step`).

        Raises
        ------
        UnknownSequenceError, DuplicateSequenceError, InvalidTokenCountError, InvalidTokenIdsError, SwapStateError
            An unknown, finished, repeated or wrongly swapped sequence, counts or ids of the wrong length, or
            more new tokens than ``max_step_tokens``.
        SequenceFullError, PoolExhaustedError, TooManySequencesError, HostTierExhaustedError
            More than a row, the cache or the block table holds, or a swap a tier cannot hold.
        """
        t = self.tables
        step = t.tx.run(lambda: self.metadata.build(t.step(seqs, counts, token_ids, arrivals, arrival_tokens, forks,
                                                           frees, self.metadata.max_step_tokens, swap_out,
                                                           swap_in)), moves=True)
        if self.growth is not None:  # for the next step: chunks mapped meanwhile adopted, more asked for
            self.growth.tick()
        return step

    @exclusive
    def name_tokens(self, seqs: Handles, counts: Counts, token_ids: Sequence[int]) -> None:
        """The ids of the last ``counts`` tokens a :meth:`step` without ids appended to ``seqs``: the blocks they
        fill are named in the prefix cache then (:meth:`BlockTables.name <pagedrt.blocks.BlockTables.name>`)."""
        self.tables.name(seqs, counts, token_ids)

    @exclusive
    def swap_out(self, seqs: Handles) -> np.ndarray:
        """Move the device blocks of ``seqs`` to the host tier; they are left out of :meth:`step`'s default
        batch until :meth:`swap_in`. A block moves once every sequence holding it is swapped out (forks swap
        out together to free their shared blocks). All or nothing.

        Parameters
        ----------
        seqs : handles
            Live sequences, not swapped out, each once.

        Returns
        -------
        numpy.ndarray
            Host int32 ``[n, 2]`` (src, dst) block pairs: copy them in order
            (``kernels.swap_blocks(cache.planes, pairs, stream)``) before anything writes into the device blocks
            they free.

        Raises
        ------
        HostTierExhaustedError
            The host tier is short (or there is none).
        UnknownSequenceError, DuplicateSequenceError, SwapStateError
            Bad handles, or a sequence already swapped out.
        """
        return self.tables.swap_out(seqs)

    @exclusive
    def swap_in(self, seqs: Handles) -> np.ndarray:
        """Move the host-tier blocks of ``seqs`` back to the device. All or nothing.

        Parameters
        ----------
        seqs : handles
            Swapped-out sequences, each once.

        Returns
        -------
        numpy.ndarray
            Host int32 ``[n, 2]`` (src, dst) block pairs to copy first, in order, as for :meth:`swap_out`.

        Raises
        ------
        PoolExhaustedError
            The device is short.
        UnknownSequenceError, DuplicateSequenceError, SwapStateError
            Bad handles, or a sequence not swapped out.
        """
        return self.tables.swap_in(seqs)

    @exclusive
    def can_swap_out(self, seqs: Handles) -> bool:
        """Whether :meth:`swap_out` of ``seqs`` (handles) would succeed now; bad handles raise as it does."""
        return self.tables.can_swap_out(seqs)

    @exclusive
    def can_swap_in(self, seqs: Handles) -> bool:
        """Whether :meth:`swap_in` of ``seqs`` (handles) would succeed now; bad handles raise as it does."""
        return self.tables.can_swap_in(seqs)

    @property
    @exclusive
    def swapped(self) -> List[int]:
        """The handles of the sequences swapped out to the host tier, in handle order."""
        return [int(s) for s in self.tables.swapped_sequences]

    @exclusive
    def fork(self, seq: int) -> int:
        """A new sequence sharing every block of ``seq``; its first append copies a shared tail block.

        Parameters
        ----------
        seq : int
            A live sequence, not swapped out.

        Returns
        -------
        int
            The child's handle.

        Raises
        ------
        UnknownSequenceError, SwapStateError, TooManySequencesError
            ``seq`` is not live, is swapped out, or ``max_seqs`` sequences are live.
        """
        return self.tables.fork(seq)

    @exclusive
    def free(self, seqs: Handles) -> None:
        """Free sequences; their blocks go back when no fork holds them (named full blocks stay cached-free).

        Parameters
        ----------
        seqs : handles
            Live sequences, each once.

        Raises
        ------
        UnknownSequenceError, DuplicateSequenceError
            A handle not live or given twice; nothing is freed.
        """
        self.tables.free(seqs)

    @exclusive
    def can_append(self, seqs: Optional[Handles], counts: Counts = 1) -> bool:
        """Whether ``append(seqs, counts)`` would succeed now: every row wide enough, and the available blocks
        cover the new blocks and the copy-on-write copies of shared tail blocks.

        Parameters
        ----------
        seqs, counts
            As :meth:`append`'s; bad ones raise as it does.
        """
        return self.tables.can_append(seqs, counts)

    @property
    @exclusive
    def num_available_blocks(self) -> int:
        """Blocks that appends can still get: the free ones and every block of chunks not mapped yet."""
        return self.allocator.num_available

    @property
    @exclusive
    def num_cached_blocks(self) -> int:
        """Blocks named in the prefix cache, held by sequences or cached-free (evictable)."""
        return len(self.allocator.index)

    @exclusive
    def prefix_stats(self) -> Dict[str, int]:
        """Prefix-cache counters: lookups, hit_blocks, hit_tokens, queried_tokens, cached_blocks, evictable,
        evictions; with a host tier, offloaded (cached blocks in it now), offloads, reloads and host_evictions
        (offloaded blocks dropped)."""
        a, st = self.allocator, self.allocator.stats
        return {"lookups": st.lookups, "hit_blocks": st.hit_blocks, "hit_tokens": st.hit_tokens,
                "queried_tokens": st.queried_tokens, "cached_blocks": len(a.index), "evictable": len(a.evictable),
                "evictions": st.evictions, "offloaded": len(a.host_evictable), "offloads": st.offloads,
                "reloads": st.reloads, "host_evictions": st.host_evictions}

    @exclusive
    def trim(self) -> List[int]:
        """Hand back every device chunk whose blocks are all free (a cached-free block is not free: its chunk
        stays mapped until allocation evicts it).

        Returns
        -------
        list of int
            The allocator chunks released, in increasing order.
        """
        return self.allocator.trim()

    @exclusive
    def length(self, seq: int) -> int:
        """The tokens live sequence ``seq`` holds; UnknownSequenceError for a handle not live."""
        return int(self.tables.lens[self.tables.row(seq)])

    @exclusive
    def lengths(self, seqs: Handles) -> np.ndarray:
        """The lengths of live sequences ``seqs`` (handles): a scheduler's view, without a device round trip.

        Returns
        -------
        numpy.ndarray
            Host int64 ``[n]``, in the order of ``seqs`` (:meth:`seq_lens` is the device's).

        Raises
        ------
        UnknownSequenceError
            A handle not live.
        """
        return self.tables.lens[self.tables.rows(seqs)].astype(np.int64)

    @property
    @exclusive
    def sequences(self) -> List[int]:
        """The handles of the live sequences, in handle order."""
        return [int(s) for s in self.tables.sequences]

    def _plane_view(self, layer: int, kv: str) -> Array:
        return plane_view(self.pool, self.layout, self.spec, layer, kv)

    # --- both layers at once ----------------------------------------------------------------

    @exclusive
    def translate(self, seq: int, pos: int, layer: int = 0, kv: str = "k", head: int = 0) -> Translation:
        """Token ``pos`` of ``seq`` -> logical block, slot, block id, pool offset, VA, chunk, page.

        Parameters
        ----------
        seq : int
            A live sequence.
        pos : int
            ``0 <= pos < length(seq)``.
        layer, kv, head : int, str, int
            The layer, ``"k"`` or ``"v"``, and the KV head.

        Returns
        -------
        Translation
            The whole address chain (:class:`~pagedrt.layout.Translation`).

        Raises
        ------
        UnknownSequenceError, InvalidPositionError, UnsupportedConfigError
            A handle not live, a position it does not hold, a layer, kv or head that does not exist.
        """
        row = self.tables.row(seq)
        return translate(self.layout, self.pool.base, self.tables.table[row], int(self.tables.lens[row]),
                         row, pos, layer, kv, head, cached=self.allocator.index.cached)

    @exclusive
    def stats(self) -> Dict[str, int]:
        """Token and byte counts: what holds tokens against what is mapped.

        Returns
        -------
        dict of str to int
            ``sequences``, ``tokens`` (every sequence's), ``stored_tokens`` (slots filled in held blocks, once
            even when forks share them) and ``token_bytes`` (what those hold); ``held_blocks``, ``free_blocks``,
            ``mapped_blocks``, ``max_blocks`` (device), ``mapped_bytes``, ``reserved_bytes``;
            ``swapped_sequences``, ``host_blocks``, ``host_held_blocks``, ``host_free_blocks``.
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
            "max_blocks": a.device_blocks, "mapped_bytes": self.pool.mapped_bytes,
            "reserved_bytes": self.pool.max_bytes, "swapped_sequences": int(t.swapped_sequences.size),
            "host_blocks": a.host_blocks, "host_held_blocks": a.num_host_held, "host_free_blocks": a.num_host_free,
        }

    @exclusive
    def snapshot(self) -> dict:
        """Both layers as a JSON-ready dict (schema in docs/SNAPSHOT.md)."""
        return build_snapshot(self.layout, self.pool, self.allocator, self.tables)

    @exclusive
    def write_snapshot(self, path: str) -> None:
        """Write :meth:`snapshot` to ``path`` (a file name) atomically: a temp file renamed over it."""
        write_snapshot(build_snapshot(self.layout, self.pool, self.allocator, self.tables), path)

    # --- lifetime -----------------------------------------------------------------------------

    def _check_open(self, name: str) -> None:
        if self.pool.closed:
            raise PoolClosedError(f"cache.{name}: this cache was closed; make a new one")

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self.pool.closed

    def close(self) -> None:
        """Stop growth (its worker), then unmap and release the pool; idempotent. Every later call raises
        PoolClosedError; ConcurrentUseError while another thread is inside the cache."""
        locked = False
        try:
            locked = self._lock.acquire(False)
            if not locked:
                raise ConcurrentUseError("cache.close() was called while another thread was inside this cache")
            if self.growth is not None:
                self.growth.close()
            self._planes.clear()
            self._mask = None
            self.pool.close()
        finally:
            if locked:
                self._lock.release()

    def __enter__(self) -> "PagedKVCache":
        """The cache itself."""
        return self

    def __exit__(self, *exc: Any) -> None:
        """:meth:`close`."""
        self.close()

    def __repr__(self) -> str:
        lay = self.layout
        return (f"PagedKVCache({lay.num_layers} layers, {lay.num_kv_heads} kv heads x {lay.head_dim}, "
                f"block {lay.block_size}, {lay.dtype}, {lay.placement}-major, {self.pool!r})")
