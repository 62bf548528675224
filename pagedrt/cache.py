"""PagedKVCache: every layer's K and V over one pool, its sequences, and what kernels read.

The facade over the layers below: the pool (:mod:`pagedrt.memory`), the block
allocator and tables (:mod:`pagedrt.blocks`), growth ahead of demand
(:mod:`pagedrt.growth`), the step's device metadata (:mod:`pagedrt.step`), the
layout (:mod:`pagedrt.layout`) and snapshots (:mod:`pagedrt.snapshot`).
"""

import functools
import os
import threading

import numpy as np

from .blocks import BlockAllocator, BlockTables, ceil_div, ranks
from .errors import ConcurrentUseError, PoolClosedError, UnsupportedConfigError
from .growth import Growth
from .layout import KV, Layout, is_int, translate
from .memory import Pool, select_backend
from .snapshot import build_snapshot, write_snapshot
from .spec import KVSpec
from .step import StepMetadata
from .supported import (MAX_BLOCKS, MAX_POOL_BYTES, MAX_SEQ_LEN, MAX_SEQS, MAX_TABLE_ENTRIES, PREFILL_HEAD_DIMS, check,
                        check_positive)


def _check_sizes(layout, max_seqs, max_blocks_per_seq):
    """Refuse, before anything is allocated, a cache the bookkeeping cannot describe or the host not hold."""
    if layout.max_blocks > MAX_BLOCKS:
        raise UnsupportedConfigError(
            f"the cache would hold {layout.max_blocks} blocks but block ids are int32: at most {MAX_BLOCKS}")
    if layout.pool_bytes > MAX_POOL_BYTES:
        raise UnsupportedConfigError(
            f"the cache would reserve {layout.pool_bytes} bytes of address space; one reservation takes at most "
            f"{MAX_POOL_BYTES}")
    entries = max_seqs * max_blocks_per_seq
    if entries > MAX_TABLE_ENTRIES:
        raise UnsupportedConfigError(
            f"a block table of {max_seqs} sequences x {max_blocks_per_seq} blocks has {entries} entries; at most "
            f"{MAX_TABLE_ENTRIES}: lower max_seqs or max_seq_len")
    block_size = layout.block_size
    host = 4 * entries + (48 + 4 * block_size) * max_seqs + 15 * layout.max_blocks  # tables, per row, per block
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return
    if host > memory // 2:
        raise UnsupportedConfigError(
            f"the cache's host bookkeeping would take {host} bytes, more than half of this host's {memory}: "
            f"lower max_seqs, max_seq_len or the capacity")


def _growth_keywords(growth, blocks_per_chunk):
    """``growth=`` as the keywords of :class:`~pagedrt.growth.Growth`, defaults filled in; None for no growth."""
    if growth is None or growth is False:
        return None
    defaults = {"low_blocks": blocks_per_chunk, "high_blocks": 2 * blocks_per_chunk, "release_after": 64,
                "background": True}
    if growth is True:
        return defaults
    if not isinstance(growth, dict):
        raise UnsupportedConfigError(f"growth={growth!r:.80} must be None, False, True or a dict of Growth keywords")
    unknown = sorted(map(str, growth.keys() - defaults.keys()))
    if unknown:
        raise UnsupportedConfigError(f"growth has unknown keys {unknown}: it takes {sorted(defaults)}")
    return defaults | growth


def _exclusive(method):
    """``method`` run inside the cache's lock, taken without waiting, on an open cache.

    A second thread that calls in meanwhile gets ConcurrentUseError at once, before it
    reads or changes anything: misuse is a named error, never two tables sharing a block.
    The lock is taken as the first statement inside ``try`` and released only if taken.
    It is reentrant (an ``RLock``), so an interrupt that still lands between taking and
    releasing it (at the ``finally`` line) cannot lock out the thread that was using the
    cache; other threads are refused, as while a call runs.
    """
    name = method.__name__

    @functools.wraps(method)
    def exclusive(self, *args, **kwargs):
        locked = False
        try:
            locked = self._lock.acquire(False)
            if not locked:
                raise ConcurrentUseError(
                    f"cache.{name}() was called while another thread was inside this cache: a PagedKVCache is not "
                    f"thread-safe; call it from one thread, or hold a lock of your own around every call")
            if self.pool.closed:  # the cache's close() closes the pool
                raise PoolClosedError(f"cache.{name}(): this cache was closed; make a new one")
            return method(self, *args, **kwargs)
        finally:
            if locked:
                self._lock.release()
    return exclusive


def _kv_scales(spec, kv_scales):
    """The checked float32 scales of an FP8 cache (all 1 by default), None for other caches; raises
    UnsupportedConfigError for scales where there is no FP8, scales of the wrong shape and values that are not
    positive, normal and finite."""
    shape = spec.scales_shape
    if shape is None:
        if kv_scales is not None:
            raise UnsupportedConfigError(f"kv_scales are for FP8 K/V only: this cache stores {spec.kv_dtype}")
        return None
    if kv_scales is None:
        return np.ones(shape, np.float32)
    try:
        scales = np.array(kv_scales, dtype=np.float32)
    except (TypeError, ValueError):
        raise UnsupportedConfigError(f"kv_scales must be float32 numbers [{', '.join(map(str, shape))}]") from None
    if scales.shape != shape:
        raise UnsupportedConfigError(f"kv_scales must have shape {shape} (layers, K then V, KV heads), got "
                                     f"{scales.shape}")
    if not (np.isfinite(scales).all() and (scales >= np.finfo(np.float32).tiny).all()):
        raise UnsupportedConfigError("kv_scales must be positive, normal and finite: stored bytes mean value / scale")
    return scales


def plane_view(pool, layout, spec, layer, kv):
    """Layer ``layer``'s K (``kv`` 0) or V (1) plane in ``pool`` under ``layout``: ``[max_blocks, num_kv_heads,
    block_size, head_dim]`` of ``spec.kv_numpy_dtype``, a strided view (no copy)."""
    lay, e = layout, layout.itemsize
    shape = (lay.max_blocks, lay.num_kv_heads, lay.block_size, lay.head_dim)
    strides = (lay.block_stride_bytes, lay.block_size * lay.head_dim * e, lay.head_dim * e, e)
    return pool.view(lay.plane_offset(layer, kv), shape, spec.kv_numpy_dtype, strides, allow_holes=True)


class PlaneViews:
    """What kernels read of a cache: each layer's K and V planes, and FP8 scales. A class using it holds
    ``_planes`` (K and V of each layer in order), ``_scales`` (float32 [num_layers, 2, num_kv_heads] on its
    device, or None), ``layout``, and ``_check_open(name)``."""

    def k(self, layer):
        """Layer ``layer``'s K plane: ``[max_blocks, num_kv_heads, block_size, head_dim]``, a strided view."""
        return self._plane(layer, 0)

    def v(self, layer):
        return self._plane(layer, 1)

    @property
    def planes(self):
        """Every plane, K and V of each layer in order (what ``copy_blocks`` takes)."""
        self._check_open("planes")
        return list(self._planes)

    def k_scale(self, layer):
        """FP8 caches: layer ``layer``'s K scales, float32 [num_kv_heads] (on the cache's device); else None."""
        return self._scale(layer, 0)

    def v_scale(self, layer):
        """FP8 caches: layer ``layer``'s V scales, float32 [num_kv_heads]; else None."""
        return self._scale(layer, 1)

    def _scale(self, layer, kv):
        self._plane(layer, kv)  # checks the cache is open and the layer
        return None if self._scales is None else self._scales[layer, kv]

    def _plane(self, layer, kv):
        self._check_open("k" if kv == 0 else "v")
        if not is_int(layer) or not 0 <= layer < self.layout.num_layers:
            self.layout.check(layer, "k", 0)
        return self._planes[2 * layer + kv]


class PagedKVCache(PlaneViews):
    """K and V of ``num_layers`` layers in blocks of ``block_size`` tokens, over one growable pool.

    Give the capacity as ``max_tokens`` or ``max_bytes`` (KV bytes); the pool reserves
    that much address space and maps chunks only as sequences need blocks.
    ``max_seqs`` and ``max_seq_len`` size the dense block table; ``max_step_tokens``
    (default ``max_seq_len + max_seqs``: a whole prompt and a decode token for every other
    sequence) sizes the step's slot buffer, the most new tokens one :meth:`step` takes.
    ``backend`` is a name or a backend made by :func:`pagedrt.memory.select_backend`.
    ``head_dim`` is one that prefill attends (64, 128, 256: ``supported.PREFILL_HEAD_DIMS``), since prompts
    fill a cache; decode alone attends 80 and 96 too, over planes of one's own.

    ``dtype`` is the model's (q and attention output); ``kv_dtype`` what the planes store
    (default: ``dtype``). ``kv_dtype="float8_e4m3"`` stores K and V as float8 e4m3 bits
    (uint8 planes, half the bytes of fp16; :mod:`pagedrt.fp8`) under float32 scales, one per
    layer and KV head for K and for V: ``kv_scales`` [num_layers, 2, num_kv_heads] (K then V,
    positive and finite; default all 1), fixed for the cache's life since stored bytes mean
    value / scale. :meth:`k_scale` and :meth:`v_scale` give one layer's, as ``write_kv`` and
    decode take them. FP8 needs ``dtype`` float16 or bfloat16 and head_dim 64 or 128.

    ``host_tokens`` or ``host_bytes`` (at most one; default none) gives the cache a host
    tier of that capacity (rounded up to whole chunks): pinned host memory mapped into the
    same range after the device's blocks, created here, ahead of need, since pinning is
    slow (:class:`~pagedrt.errors.HostOutOfMemoryError` if the host refuses, and nothing is
    left). Sequences swap out to it and back (:meth:`step`'s ``swap_out``/``swap_in``, or
    :meth:`swap_out`/:meth:`swap_in`), and the prefix cache offloads the blocks it would
    evict to it, bringing them back on a later hit (inside :meth:`step`).

    ``growth`` maps chunks ahead of demand, on a worker thread (:mod:`pagedrt.growth`).
    None or False (the default): chunks are mapped only when an append needs them.
    True: one to two chunks' blocks are kept spare (``low_blocks`` one chunk's blocks,
    ``high_blocks`` two) and a chunk all free for 64 ticks is released
    (``release_after``). A dict of :class:`~pagedrt.growth.Growth` keywords sets some
    of those (and ``background``), the rest as True does. ``cache.growth`` is the
    :class:`~pagedrt.growth.Growth` or None; call its ``tick()`` once per step, on the
    thread that calls the cache.

    The cache is not thread-safe: call it from one thread at a time. Concurrent use is
    detected: a call made while another thread is inside the cache raises
    :class:`~pagedrt.errors.ConcurrentUseError` and changes nothing. After :meth:`close`
    every call raises :class:`~pagedrt.errors.PoolClosedError`.
    """

    def __init__(self, num_layers, num_kv_heads, head_dim, block_size, dtype="float16", *,
                 max_tokens=None, max_bytes=None, max_seqs=256, max_seq_len=None, max_step_tokens=None,
                 placement="plane", chunk_bytes=None, backend="auto", growth=None, host_tokens=None, host_bytes=None,
                 kv_dtype=None, kv_scales=None):
        self.spec = spec = KVSpec.build(num_layers, num_kv_heads, head_dim, block_size, dtype, kv_dtype, placement)
        max_seqs = check_positive("max_seqs", max_seqs, MAX_SEQS)
        check("head_dim", spec.head_dim, PREFILL_HEAD_DIMS)  # what prefill attends, not decode alone
        scales = _kv_scales(spec, kv_scales)
        if (max_tokens is None) == (max_bytes is None):
            raise UnsupportedConfigError("give the capacity as exactly one of max_tokens or max_bytes")
        block_bytes = spec.bytes_per_token * spec.block_size
        if max_bytes is None:
            max_blocks = ceil_div(check_positive("max_tokens", max_tokens), spec.block_size)
        else:
            max_blocks = max(check_positive("max_bytes", max_bytes) // block_bytes, 1)
        if host_tokens is not None and host_bytes is not None:
            raise UnsupportedConfigError("give the host tier's capacity as at most one of host_tokens or host_bytes")
        host_blocks = (0 if host_tokens is None and host_bytes is None else
                       ceil_div(check_positive("host_tokens", host_tokens), spec.block_size) if host_bytes is None
                       else max(check_positive("host_bytes", host_bytes) // block_bytes, 1))
        if max_blocks + host_blocks > MAX_BLOCKS:
            raise UnsupportedConfigError(
                f"a capacity of {max_blocks + host_blocks} blocks is more than block ids (int32) can name: at most "
                f"{MAX_BLOCKS}")
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
        _check_sizes(self.layout, max_seqs, ceil_div(max_seq_len, spec.block_size))
        growth = _growth_keywords(growth, self.layout.blocks_per_chunk)
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
        self._mask_version = None

    # --- shape ------------------------------------------------------------------------

    dtype = property(lambda self: self.spec.dtype, doc="The model's dtype (q, k, v, attention output): numpy.dtype")
    kv_dtype = property(lambda self: self.spec.kv_dtype, doc="What the planes store: a name of supported.KV_DTYPES")
    num_layers = property(lambda self: self.layout.num_layers)
    num_kv_heads = property(lambda self: self.layout.num_kv_heads)
    head_dim = property(lambda self: self.layout.head_dim)
    block_size = property(lambda self: self.layout.block_size)
    placement = property(lambda self: self.layout.placement)
    max_blocks_per_seq = property(lambda self: self.tables.max_blocks_per_seq)
    xp = property(lambda self: self.pool.xp)

    # --- sequences (delegated to the block tables) --------------------------------------

    @_exclusive
    def add_sequence(self, prefix=None):
        """A new sequence; returns its handle (its row in the block table).

        Without ``prefix`` it starts empty. With ``prefix``, the prompt's token ids, it
        starts holding the cached blocks that the prompt begins with (shared, by
        reference count), never all of the prompt: ``cache.length(seq)`` tokens are
        cached, and the prefill appends the other ``len(prefix) - cache.length(seq)``
        with their ids (``append(seq, n, token_ids=prefix[length:])``), attending over
        the cached ones as a chunk with a prefix.
        """
        return self.tables.add(prefix)

    @_exclusive
    def append(self, seqs, counts=1, token_ids=None):
        """Room for ``counts`` more tokens per sequence: ``(slot_mapping, copies)``.

        Write the new tokens' K/V through ``slot_mapping`` (``kernels.write_kv``) after
        copying each ``copies`` (src, dst) block pair (``kernels.copy_blocks(cache.planes, copies)``).
        ``token_ids`` (optional, ``sum(counts)`` ids, sequence by sequence) lets the
        blocks these tokens fill be cached for later prompts that begin alike.
        """
        return self.tables.append(seqs, counts, token_ids)

    @_exclusive
    def step(self, seqs=None, counts=1, token_ids=None, *, arrivals=(), arrival_tokens=None, forks=(), frees=(),
             swap_out=(), swap_in=()):
        """One engine step in one call: the scheduler's decisions in, the step's kernel metadata out.

        In order: ``frees`` (handles) are freed; each of ``forks`` (parent handles; one
        child each, a parent may repeat; never a swapped-out one) gets a child sharing its
        blocks as they are before this step's tokens; each of ``arrivals`` (prompts, as token
        ids) becomes a new sequence holding the cached blocks its prompt begins with (blocks
        offloaded to the host tier are brought back), and appends ``arrival_tokens`` more of
        the prompt (one int, one per arrival, or None: the whole uncached rest; a chunked
        prefill appends the rest in later steps, with its ids); ``swap_out`` (handles) move to
        the host tier and ``swap_in`` (swapped-out handles) back (:meth:`swap_out`); then
        ``seqs`` (None: every live sequence not freed now and not swapped out after the swaps,
        before the arrivals and forks) get ``counts`` new tokens each (``token_ids``: their
        ids, optional, as for :meth:`append`). With ``growth``, the step ends with its
        :meth:`~pagedrt.growth.Growth.tick`.

        Preempting: by swap, ``swap_out=[seq]`` now and ``swap_in=[seq]`` when there is room
        (:meth:`can_swap_in`); by recompute, ``frees=[seq]`` now and its tokens so far as an
        arrival later (with their ids, its full blocks stay in the prefix cache meanwhile,
        offloaded to the host tier if evicted, so the arrival recomputes what was lost).

        Returns a :class:`~pagedrt.step.Step`: the slot mapping, the batch's block tables,
        KV lengths and query offsets on the device (one pinned upload), the tier copies and
        then the copy-on-write pairs to copy first, and the arrivals' handles and cached
        tokens and the children's handles. All or nothing: a step that cannot be satisfied
        (an unknown, finished or repeated sequence, ids of the wrong length, more tokens than
        ``max_step_tokens`` or than the cache holds, a swap-out the host tier cannot hold)
        raises a named error and changes nothing; so does any exception raised inside it,
        ``KeyboardInterrupt`` included (docs/ARCHITECTURE.md, "All or nothing"). ``None``
        for any list means none; ``frees`` may be one handle, as :meth:`free` takes.
        """
        t = self.tables
        step = t.tx.run(lambda: self.metadata.build(t.step(seqs, counts, token_ids, arrivals, arrival_tokens, forks,
                                                           frees, self.metadata.max_step_tokens, swap_out,
                                                           swap_in)), moves=True)
        if self.growth is not None:  # for the next step: chunks mapped meanwhile adopted, more asked for
            self.growth.tick()
        return step

    @_exclusive
    def swap_out(self, seqs):
        """Move the device blocks of ``seqs`` (live, not swapped out) to the host tier; they are left out of
        ``step()``'s default batch until :meth:`swap_in`.

        Returns int32 ``[n, 2]`` (src, dst) block pairs: copy them in order
        (``kernels.swap_blocks(cache.planes, pairs, stream)``) before anything writes into
        the device blocks they free. A block moves once every sequence holding it is swapped
        out (forks swap out together to free their shared blocks). All or nothing:
        :class:`~pagedrt.errors.HostTierExhaustedError` when the host tier is short.
        """
        return self.tables.swap_out(seqs)

    @_exclusive
    def swap_in(self, seqs):
        """Move the host-tier blocks of ``seqs`` (swapped out) back to the device: the pairs to copy first, in
        order, as for :meth:`swap_out`. All or nothing: :class:`~pagedrt.errors.PoolExhaustedError` when the
        device is short."""
        return self.tables.swap_in(seqs)

    @_exclusive
    def can_swap_out(self, seqs):
        """Whether :meth:`swap_out` of ``seqs`` would succeed now."""
        return self.tables.can_swap_out(seqs)

    @_exclusive
    def can_swap_in(self, seqs):
        """Whether :meth:`swap_in` of ``seqs`` would succeed now."""
        return self.tables.can_swap_in(seqs)

    @property
    @_exclusive
    def swapped(self):
        """The handles of the sequences swapped out to the host tier."""
        return [int(s) for s in self.tables.swapped_sequences]

    @_exclusive
    def fork(self, seq):
        """A new sequence sharing every block of ``seq``; its first append copies a shared tail block."""
        return self.tables.fork(seq)

    @_exclusive
    def free(self, seqs):
        """Free sequences, each given once; their blocks go back when no fork holds them."""
        self.tables.free(seqs)

    @_exclusive
    def can_append(self, seqs, counts=1):
        """Whether ``append(seqs, counts)`` would succeed now.

        Every sequence's block-table row must be wide enough, and the available blocks
        must cover the new blocks and the private copies of shared tail blocks that
        copy-on-write takes. Bad arguments raise as :meth:`append` does.
        """
        return self.tables.can_append(seqs, counts)

    @property
    @_exclusive
    def num_available_blocks(self):
        """Blocks that appends can still get: the free ones and every block of chunks not mapped yet."""
        return self.allocator.num_available

    @property
    @_exclusive
    def num_cached_blocks(self):
        """Blocks named in the prefix cache, held by sequences or cached-free (evictable)."""
        return len(self.allocator.index)

    @_exclusive
    def prefix_stats(self):
        """Prefix-cache counters: lookups, hit_blocks, hit_tokens, queried_tokens, cached_blocks, evictable,
        evictions; with a host tier, offloaded (cached blocks in it now), offloads, reloads and host_evictions
        (offloaded blocks dropped)."""
        a, st = self.allocator, self.allocator.stats
        return {"lookups": st.lookups, "hit_blocks": st.hit_blocks, "hit_tokens": st.hit_tokens,
                "queried_tokens": st.queried_tokens, "cached_blocks": len(a.index), "evictable": len(a.evictable),
                "evictions": st.evictions, "offloaded": len(a.host_evictable), "offloads": st.offloads,
                "reloads": st.reloads, "host_evictions": st.host_evictions}

    @_exclusive
    def trim(self):
        """Hand back every chunk whose blocks are all free; returns the allocator chunks released.

        Cached-free blocks are not free: a chunk holding one stays mapped until
        allocation evicts the block.
        """
        return self.allocator.trim()

    @_exclusive
    def length(self, seq):
        return int(self.tables.lens[self.tables.row(seq)])

    @_exclusive
    def lengths(self, seqs):
        """The lengths of live sequences ``seqs`` (handles), as a host int64 array in their order: a scheduler's
        view, without a device round trip (:meth:`seq_lens` is the device's)."""
        return self.tables.lens[self.tables.rows(seqs)].astype(np.int64)

    @property
    @_exclusive
    def sequences(self):
        return [int(s) for s in self.tables.sequences]

    # --- what kernels read: PlaneViews' k, v, planes, k_scale, v_scale ----------------------------

    @_exclusive
    def block_tables(self, seqs=None):
        """The device block table (int32), all rows or those of ``seqs`` in order.

        Consecutive handles give a view of the table (no copy); others a gathered copy.
        """
        self.tables.tx.run(self.metadata.upload)  # drained changes logged again if it is cut short
        return self._select(self.metadata.block_table, seqs)

    @_exclusive
    def seq_lens(self, seqs=None):
        """The device lengths (int32), all rows or those of ``seqs`` in order."""
        self.tables.tx.run(self.metadata.upload)  # drained changes logged again if it is cut short
        return self._select(self.metadata.seq_lens, seqs)

    def _select(self, array, seqs):
        if seqs is None:
            return array
        rows = self.tables.rows(seqs)
        first = int(rows[0]) if rows.size else 0
        if rows.size and int(rows[-1]) - first + 1 == rows.size and (np.diff(rows) == 1).all():
            return array[first:first + rows.size]
        return array[self.xp.asarray(rows)]

    @_exclusive
    def block_mask(self):
        """Per block, on the device: 1 where its chunk is mapped. Kernels validate tables against it."""
        if self._mask_version != self.allocator.version:
            self._mask = self.xp.asarray(self.allocator.usable_mask().astype(np.uint8))
            self._mask_version = self.allocator.version
        return self._mask

    def _plane_view(self, layer, kv):
        return plane_view(self.pool, self.layout, self.spec, layer, kv)

    # --- both layers at once ----------------------------------------------------------------

    @_exclusive
    def translate(self, seq, pos, layer=0, kv="k", head=0):
        """Token ``pos`` of ``seq`` -> logical block, slot, block id, pool offset, VA, chunk, page."""
        row = self.tables.row(seq)
        return translate(self.layout, self.pool.base, self.tables.table[row], int(self.tables.lens[row]),
                         row, pos, layer, kv, head, cached=self.allocator.index.cached)

    @_exclusive
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
            "max_blocks": a.device_blocks, "mapped_bytes": self.pool.mapped_bytes,
            "reserved_bytes": self.pool.max_bytes, "swapped_sequences": int(t.swapped_sequences.size),
            "host_blocks": a.host_blocks, "host_held_blocks": a.num_host_held, "host_free_blocks": a.num_host_free,
        }

    @_exclusive
    def snapshot(self):
        """Both layers as a JSON-ready dict (schema in docs/SNAPSHOT.md)."""
        return build_snapshot(self.layout, self.pool, self.allocator, self.tables)

    @_exclusive
    def write_snapshot(self, path):
        """Write :meth:`snapshot` to ``path`` atomically (a temp file renamed over it)."""
        write_snapshot(build_snapshot(self.layout, self.pool, self.allocator, self.tables), path)

    # --- lifetime -----------------------------------------------------------------------------

    def _check_open(self, name):
        if self.pool.closed:
            raise PoolClosedError(f"cache.{name}: this cache was closed; make a new one")

    @property
    def closed(self):
        return self.pool.closed

    def close(self):
        """Stop growth (its worker), then unmap and release the pool; idempotent. Every later call raises
        PoolClosedError."""
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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        lay = self.layout
        return (f"PagedKVCache({lay.num_layers} layers, {lay.num_kv_heads} kv heads x {lay.head_dim}, "
                f"block {lay.block_size}, {lay.dtype}, {lay.placement}-major, {self.pool!r})")
