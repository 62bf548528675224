"""A KV cache sharded by KV heads over several devices: tensor parallelism's share of the cache.

One allocator and one set of block tables serve every shard, so a block id names the same
tokens on every device; each device has its own pool holding its ``num_kv_heads / shards``
heads of every block (the same layout on each: block ``b`` of layer ``l`` lies at the same
offset of every shard's range). Shard 0 is a :class:`~pagedrt.cache.PagedKVCache` over its
heads whose allocator, tables and step metadata are the cache's; the other shards are pools
mapped chunk for chunk as shard 0's.

A sharded cache maps its whole capacity on every device when it is made, and never grows or
trims: the pools then never have to change together, so a step cannot succeed on one device
and fail on another. :meth:`ShardedKVCache.step` turns the scheduler's decisions into a
:class:`ShardedStep`: shard 0's :class:`~pagedrt.step.Step`, and one a shard in ``.shards``, its
device arrays on the shard's device (peer copies of shard 0's, queued after them), so each
device's writes and attention read their own.

Attention and writes run per shard on its heads (:class:`Shard`): query heads are cut as the
KV heads are (with ``group`` query heads per KV head, shard ``s`` takes query heads
``[s * heads * group, (s + 1) * heads * group)``), and the outputs, concatenated along the
heads, are the unsharded cache's. Shards may share a device (how the tests run on one GPU);
on the host backend a device is a label and every shard's arrays are host arrays.

Not offered here: a host tier, background growth and ``max_bytes`` (no such keywords: give
``max_tokens``); a backend object is refused (give its name: one backend is made per device).
"""

import contextlib
from dataclasses import replace

import numpy as np

from .cache import PagedKVCache, PlaneViews, plane_view
from .errors import PoolClosedError, ShardError, UnsupportedConfigError
from .layout import KV, is_int, translate
from .memory import Pool, select_backend
from .memory.backends import BACKENDS
from .snapshot import build_snapshot, write_snapshot
from .spec import KVSpec
from .step import Step

STEP_ARRAYS = ("slot_mapping", "block_tables", "seq_lens", "qo_indptr")  # a Step's device arrays


def _devices(devices):
    if isinstance(devices, (str, bytes)) or not hasattr(devices, "__len__"):
        raise ShardError(f"devices={devices!r:.80} must be a sequence of device ordinals, one per shard")
    devices = list(devices)
    if not devices or not all(is_int(d) and d >= 0 for d in devices):
        raise ShardError(f"devices={devices!r:.80} must be one or more device ordinals (ints >= 0), one per shard")
    return [int(d) for d in devices]


def peer_copy(pairs, source, target):
    """Copy each (dst, src) pair of CuPy arrays from device ``source`` to device ``target`` (cudaMemcpyPeerAsync,
    a device-to-device copy when they are one), queued on ``source``'s current stream; ``target``'s current stream
    then waits for the copies (an event), so work queued there afterwards reads them."""
    import cupy
    with cupy.cuda.Device(source):
        stream = cupy.cuda.get_current_stream()
        for dst, src in pairs:
            if src.nbytes:
                cupy.cuda.runtime.memcpyPeerAsync(dst.data.ptr, target, src.data.ptr, source, src.nbytes, stream.ptr)
        copied = cupy.cuda.Event(disable_timing=True)
        copied.record(stream)
    with cupy.cuda.Device(target):
        cupy.cuda.get_current_stream().wait_event(copied)


class ShardedStep(Step):
    """A sharded cache's step: shard 0's :class:`~pagedrt.step.Step` (so a scheduler reads it as any step's),
    and ``shards``, every shard's, in shard order (shard ``s``'s device arrays on its device)."""

    def __new__(cls, shards):
        step = super().__new__(cls, *shards[0])
        step.shards = tuple(shards)
        return step


class Shard(PlaneViews):
    """One device's share of a :class:`ShardedKVCache`: its KV heads of every block, in its own pool; its
    planes and scales (:class:`~pagedrt.cache.PlaneViews`) are of its heads."""

    def __init__(self, index, device, first_head, pool, layout, scales, xp, spec):
        self.index, self.device, self.spec = index, device, spec  # spec: the shard's (its KV heads), as cache.spec
        self.kv_heads = range(first_head, first_head + spec.num_kv_heads)  # the cache's KV heads this shard holds
        self.pool, self.layout, self.xp = pool, layout, xp
        self._planes = [plane_view(pool, layout, spec, layer, kv) for layer in range(layout.num_layers) for kv in KV]
        self._scales = scales

    dtype = property(lambda self: self.spec.dtype)  # the model's (q and attention output), as PagedKVCache.dtype

    # a cache's shape as a model reads it (pagedrt.engine's LlamaModel runs on a shard as on a cache)
    num_layers = property(lambda self: self.layout.num_layers)
    num_kv_heads = property(lambda self: self.layout.num_kv_heads)
    head_dim = property(lambda self: self.layout.head_dim)

    def q_heads(self, group):
        """The query heads whose attention runs on this shard, for ``group`` query heads per KV head."""
        return range(self.kv_heads.start * group, self.kv_heads.stop * group)

    def device_context(self):
        """A context in which this shard's device is CuPy's current one (nothing on the host backend)."""
        if self.xp is np:
            return contextlib.nullcontext()
        return self.xp.cuda.Device(self.device)

    def _check_open(self, name):
        if self.pool.closed:
            raise PoolClosedError(f"shard {self.index}.{name}: this sharded cache was closed; make a new one")

    def __repr__(self):
        return (f"Shard({self.index}, device {self.device}, kv heads {self.kv_heads.start}.."
                f"{self.kv_heads.stop - 1}, {self.pool!r})")


class ShardedKVCache:
    """K and V of ``num_layers`` layers, their ``num_kv_heads`` KV heads split evenly over ``devices``.

    ``devices``: one device ordinal per shard (shards may share one). ``max_tokens`` is
    the capacity in tokens, every shard holding its heads of each. The other arguments
    are :class:`~pagedrt.cache.PagedKVCache`'s; ``kv_scales`` ([num_layers, 2,
    num_kv_heads], FP8 only) is cut by heads with the planes. ``backend`` is a name
    (``"auto"``, ``"cuda"``, ``"host"``). :attr:`shards` lists the :class:`Shard` objects.

    Raises :class:`~pagedrt.errors.ShardError` for heads that do not divide among the
    devices and devices that do not exist; everything made so far is closed again then.
    """

    def __init__(self, num_layers, num_kv_heads, head_dim, block_size, dtype="float16", *, devices, max_tokens,
                 max_seqs=256, max_seq_len=None, max_step_tokens=None, placement="plane", chunk_bytes=None,
                 backend="auto", kv_dtype=None, kv_scales=None):
        devices = _devices(devices)
        n = len(devices)
        if not is_int(num_kv_heads) or num_kv_heads <= 0 or num_kv_heads % n:
            raise ShardError(f"num_kv_heads={num_kv_heads!r:.40} must be a positive multiple of the {n} shards "
                             f"(devices {devices}): every shard holds as many KV heads")
        if backend not in BACKENDS:
            raise UnsupportedConfigError(f"backend={backend!r:.80} must be one of {', '.join(BACKENDS)}: a sharded "
                                         f"cache makes one backend per device")
        self.spec = KVSpec.build(num_layers, num_kv_heads, head_dim, block_size, dtype, kv_dtype, placement)
        shard = self.spec.shard(n)
        heads = shard.num_kv_heads
        scales = None
        if kv_scales is not None:
            scales = np.asarray(kv_scales, np.float32)
            shape = (self.spec.num_layers, 2, self.spec.num_kv_heads)
            if scales.shape != shape:
                raise UnsupportedConfigError(f"kv_scales must have shape {shape} (layers, K then V, KV heads), got "
                                             f"{scales.shape}")
        part = (lambda s: None) if scales is None else (lambda s: scales[:, :, s * heads:(s + 1) * heads])
        self.devices = devices
        with contextlib.ExitStack() as undo:
            kind = self._backend_kind(backend, devices)
            if kind == "host":
                self._xp = np
            else:
                import cupy
                self._xp = cupy
            with self._on(devices[0]):
                lead = PagedKVCache(shard.num_layers, heads, shard.head_dim, shard.block_size, shard.dtype,
                                    max_tokens=max_tokens, max_seqs=max_seqs, max_seq_len=max_seq_len,
                                    max_step_tokens=max_step_tokens, placement=shard.placement,
                                    chunk_bytes=chunk_bytes, backend=select_backend(kind), kv_dtype=shard.kv_dtype,
                                    kv_scales=part(0))
                undo.callback(lead.close)
                lead.allocator.grow(lead.allocator.device_chunks)  # the whole capacity, now (module docstring)
            self.lead = lead
            lay, chunks = lead.layout, np.flatnonzero(lead.pool.mapped_mask()).tolist()
            self.shards = [Shard(0, devices[0], 0, lead.pool, lay, lead._scales, self._xp, lead.spec)]
            for s, device in enumerate(devices[1:], 1):
                with self._on(device):
                    pool = Pool(lay.pool_bytes, lay.chunk_bytes, select_backend(kind))
                    undo.callback(pool.close)
                    pool.map(chunks)
                    shard_scales = None if scales is None else self._xp.asarray(part(s))
                self.shards.append(Shard(s, device, s * heads, pool, lay, shard_scales, self._xp, lead.spec))
            self._buffers = [self._step_buffers(shard) for shard in self.shards[1:]]
            undo.pop_all()

    def _backend_kind(self, backend, devices):
        """"cuda" or "host" for every shard; ShardError for a CUDA device that does not exist."""
        probe = select_backend(backend)  # what "auto" comes to here; each shard makes its own on its device
        kind = probe.name
        probe.close()
        if kind == "cuda":
            import cupy
            count = cupy.cuda.runtime.getDeviceCount()
            missing = sorted({d for d in devices if d >= count})
            if missing:
                raise ShardError(f"devices {missing} do not exist: this machine has {count} CUDA device(s), "
                                 f"0..{count - 1}")
        return kind

    def _on(self, device):
        return contextlib.nullcontext() if self._xp is np else self._xp.cuda.Device(device)

    def _step_buffers(self, shard):
        """Fixed device buffers on ``shard``'s device for the step arrays (as large as shard 0's), so a CUDA
        graph captured over them stays valid from step to step."""
        if self._xp is np:
            return None
        with self._on(shard.device):
            return {name: self._xp.empty_like(buf) for name, buf in self.lead.metadata.buffers.items()
                    if name in STEP_ARRAYS}

    # --- shape ------------------------------------------------------------------------

    num_layers = property(lambda self: self.lead.num_layers)
    num_kv_heads = property(lambda self: self.lead.num_kv_heads * len(self.shards))
    head_dim = property(lambda self: self.lead.head_dim)
    block_size = property(lambda self: self.lead.block_size)
    dtype = property(lambda self: self.spec.dtype)
    kv_dtype = property(lambda self: self.spec.kv_dtype)
    layout = property(lambda self: self.lead.layout)  # every shard's

    # --- sequences: the one allocator and set of tables (shard 0's) ---------------------------

    def add_sequence(self, prefix=None):
        """A new sequence's handle (as :meth:`PagedKVCache.add_sequence`)."""
        return self.lead.add_sequence(prefix)

    def fork(self, seq):
        return self.lead.fork(seq)

    def free(self, seqs):
        return self.lead.free(seqs)

    def can_append(self, seqs, counts=1):
        return self.lead.can_append(seqs, counts)

    def length(self, seq):
        return self.lead.length(seq)

    def lengths(self, seqs):
        return self.lead.lengths(seqs)

    @property
    def sequences(self):
        return self.lead.sequences

    @property
    def num_available_blocks(self):
        return self.lead.num_available_blocks

    xp = property(lambda self: self._xp)

    def step(self, seqs=None, counts=1, token_ids=None, *, arrivals=(), arrival_tokens=None, forks=(), frees=()):
        """One engine step (as :meth:`PagedKVCache.step`, without swaps): a :class:`ShardedStep`, shard 0's
        step with every shard's in ``.shards``.

        The host fields (sequences, copies, arrivals, ...) are the same objects in every one;
        shard ``s``'s slot mapping, block tables, lengths and query offsets are on its device,
        in fixed buffers: shard 0's are uploaded on its current stream, then copied to each
        other shard's device on that stream, and each other device's current stream waits for
        the copy, so work queued there afterwards reads them. All or nothing, as the cache's.
        """
        with self._on(self.devices[0]):
            step = self.lead.step(seqs, counts, token_ids, arrivals=arrivals, arrival_tokens=arrival_tokens,
                                  forks=forks, frees=frees)
        if self._xp is np:
            return ShardedStep((step,) * len(self.shards))
        return ShardedStep((step,) + tuple(self._copy_step(step, shard, buffers)
                                           for shard, buffers in zip(self.shards[1:], self._buffers)))

    def _copy_step(self, step, shard, buffers):
        fields = {name: buffers[name][:getattr(step, name).shape[0]] for name in STEP_ARRAYS}
        peer_copy([(fields[name], getattr(step, name)) for name in STEP_ARRAYS], self.devices[0], shard.device)
        return step._replace(**fields)

    # --- both layers -----------------------------------------------------------------------

    def translate(self, seq, pos, layer=0, kv="k", head=0):
        """Token ``pos`` of ``seq``, KV head ``head`` of the cache -> the shard and device holding it, and the
        chain in that shard's pool (:class:`~pagedrt.layout.Translation`, its ``kv_head`` the cache's head)."""
        self._check_open("translate")
        heads = self.lead.num_kv_heads
        if not is_int(head) or not 0 <= head < self.num_kv_heads:
            raise UnsupportedConfigError(f"kv head {head!r:.80} does not exist: heads are 0..{self.num_kv_heads - 1}")
        shard = self.shards[int(head) // heads]
        t = self.lead.tables
        row = t.row(seq)
        chain = translate(self.layout, shard.pool.base, t.table[row], int(t.lens[row]), row, pos, layer, kv,
                          int(head) % heads, cached=self.lead.allocator.index.cached)
        return replace(chain, kv_head=int(head), shard=shard.index, device=shard.device)

    def snapshot(self, shard=0):
        """Shard ``shard``'s snapshot (docs/SNAPSHOT.md): its pool and the shared tables, with a ``shard``
        section naming its device and KV heads."""
        self._check_open("snapshot")
        if not is_int(shard) or not 0 <= shard < len(self.shards):
            raise ShardError(f"shard={shard!r:.40} must be one of 0..{len(self.shards) - 1}")
        sh = self.shards[int(shard)]
        snap = build_snapshot(self.layout, sh.pool, self.lead.allocator, self.lead.tables)
        snap["shard"] = {"index": sh.index, "of": len(self.shards), "device": sh.device,
                         "kv_heads": [sh.kv_heads.start, sh.kv_heads.stop], "num_kv_heads": self.num_kv_heads}
        return snap

    def write_snapshot(self, path, shard=0):
        """Write :meth:`snapshot` of ``shard`` to ``path`` atomically."""
        write_snapshot(self.snapshot(shard), path)

    # --- lifetime ---------------------------------------------------------------------------

    def _check_open(self, name):
        if self.closed:
            raise PoolClosedError(f"sharded cache.{name}: this cache was closed; make a new one")

    @property
    def closed(self):
        return self.lead.closed

    def close(self):
        """Close every shard's pool (shard 0's cache last); idempotent."""
        if self.closed:
            return
        for shard in self.shards[1:]:
            with self._on(shard.device):
                shard.pool.close()
        self._buffers = []
        with self._on(self.devices[0]):
            self.lead.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"ShardedKVCache({self.num_layers} layers, {self.num_kv_heads} kv heads over devices "
                f"{self.devices}, {self.layout.num_kv_heads} each)")
