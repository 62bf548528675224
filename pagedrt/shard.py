"""A KV cache sharded by KV heads over several devices: tensor parallelism's share of the cache.

One allocator and one set of block tables (shard 0's :class:`~pagedrt.cache.PagedKVCache`) serve every
shard; each device holds its heads of every block in its own pool, mapped whole when the cache is made.
docs/MULTIGPU.md ("Sharded cache") says how and why.
"""

import contextlib
from dataclasses import replace
from typing import Any, ContextManager, Dict, List, Optional, Sequence

import numpy as np

from .cache import PagedKVCache
from .planes import PlaneViews, plane_view
from .errors import PoolClosedError, ShardError, UnsupportedConfigError
from .layout import KV, Layout, Translation, is_int, translate
from .memory import Pool, select_backend
from .memory.backends import BACKENDS
from .snapshot import build_snapshot, write_snapshot
from .spec import Array, KVSpec
from .protocols import Counts, Handles
from .step import Step

STEP_ARRAYS = ("slot_mapping", "block_tables", "seq_lens", "qo_indptr")  # a Step's device arrays


def _devices(devices: Any) -> List[int]:
    """The device ordinals of ``devices``, checked: ShardError unless one or more ints >= 0."""
    if isinstance(devices, (str, bytes)) or not hasattr(devices, "__len__"):
        raise ShardError(f"devices={devices!r:.80} must be a sequence of device ordinals, one per shard")
    devices = list(devices)
    if not devices or not all(is_int(d) and d >= 0 for d in devices):
        raise ShardError(f"devices={devices!r:.80} must be one or more device ordinals (ints >= 0), one per shard")
    return [int(d) for d in devices]


def peer_copy(pairs: Sequence[tuple], source: int, target: int) -> None:
    """Copy arrays from device ``source`` to device ``target``, queued on ``source``'s current stream.

    ``target``'s current stream then waits for the copies (an event), so work queued there afterwards reads
    them. Each copy is one ``cudaMemcpyPeerAsync`` (a device-to-device copy when the devices are one).

    Parameters
    ----------
    pairs : sequence of (dst, src) pairs of cupy.ndarray
        ``dst`` on ``target``, ``src`` on ``source``, both contiguous, ``dst`` at least ``src.nbytes`` long.
    source, target : int
        CUDA device ordinals.
    """
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

    shards: tuple

    def __new__(cls, shards: Sequence[Step]) -> "ShardedStep":
        step = super().__new__(cls, *shards[0])
        step.shards = tuple(shards)
        return step


class Shard(PlaneViews):
    """One device's share of a :class:`ShardedKVCache`: its KV heads of every block, in its own pool; its
    planes and scales (:class:`~pagedrt.cache.PlaneViews`) are of its heads: a
    :class:`~pagedrt.protocols.KVPlanes`, as a whole cache is.

    Parameters
    ----------
    index : int
        The shard's place, 0 first.
    device : int
        Its device ordinal (on the host backend a label).
    first_head : int
        The first of the cache's KV heads it holds; it holds ``spec.num_kv_heads`` of them.
    pool : Pool
        Its pool, of ``layout``.
    layout : Layout
        Every shard's layout (of one shard's heads).
    scales : array, float32 [num_layers, 2, spec.num_kv_heads], optional
        FP8: its heads' scales, on its device; else None.
    xp : module
        ``cupy``, or ``numpy`` on the host backend.
    spec : KVSpec
        The shard's spec (its KV heads).
    """

    def __init__(self, index: int, device: int, first_head: int, pool: Pool, layout: Layout,
                 scales: Optional[Array], xp: Any, spec: KVSpec):
        self.index, self.device, self.spec = index, device, spec  # spec: the shard's (its KV heads), as cache.spec
        self.kv_heads = range(first_head, first_head + spec.num_kv_heads)  # the cache's KV heads this shard holds
        self.pool, self.layout, self.xp = pool, layout, xp
        self._planes = [plane_view(pool, layout, spec, layer, kv) for layer in range(layout.num_layers) for kv in KV]
        self._scales = scales

    # a cache's shape as a model reads it (pagedrt.engine's LlamaModel runs on a shard as on a cache)
    dtype = property(lambda self: self.spec.dtype, doc="The model's dtype (q and attention output): numpy.dtype")
    num_layers = property(lambda self: self.layout.num_layers, doc="Layers of K and V: int")
    num_kv_heads = property(lambda self: self.layout.num_kv_heads, doc="The KV heads this shard holds: int")
    head_dim = property(lambda self: self.layout.head_dim, doc="Elements of one head of one token: int")

    def q_heads(self, group: int) -> range:
        """The query heads whose attention runs on this shard: shard ``s`` of ``h`` KV heads each takes
        ``range(s * h * group, (s + 1) * h * group)``.

        Parameters
        ----------
        group : int
            Query heads per KV head.
        """
        return range(self.kv_heads.start * group, self.kv_heads.stop * group)

    def device_context(self) -> ContextManager:
        """A context in which this shard's device is CuPy's current one (nothing on the host backend)."""
        if self.xp is np:
            return contextlib.nullcontext()
        return self.xp.cuda.Device(self.device)

    def _check_open(self, name: str) -> None:
        if self.pool.closed:
            raise PoolClosedError(f"shard {self.index}.{name}: this sharded cache was closed; make a new one")

    def __repr__(self):
        return (f"Shard({self.index}, device {self.device}, kv heads {self.kv_heads.start}.."
                f"{self.kv_heads.stop - 1}, {self.pool!r})")


class ShardedKVCache:
    """K and V of ``num_layers`` layers, their ``num_kv_heads`` KV heads split evenly over ``devices``.

    A :class:`~pagedrt.protocols.KVCache`, as :class:`~pagedrt.cache.PagedKVCache` is; :attr:`shards` lists
    the :class:`Shard` objects, each a :class:`~pagedrt.protocols.KVPlanes`. Every shard's pool is mapped
    whole here and never grows or trims, so there is no host tier, growth or ``max_bytes``.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim, block_size, dtype
        As :class:`~pagedrt.cache.PagedKVCache`'s; ``num_kv_heads`` a multiple of ``len(devices)``.
    devices : sequence of int
        One device ordinal per shard (shards may share one; on the host backend an ordinal is a label).
    max_tokens : int
        The capacity in tokens, every shard holding its heads of each.
    max_seqs, max_seq_len, max_step_tokens, placement, chunk_bytes, kv_dtype
        As :class:`~pagedrt.cache.PagedKVCache`'s.
    backend : str
        ``"auto"``, ``"cuda"`` or ``"host"``: one backend is made per device (a backend object is refused).
    kv_scales : array-like, float32 [num_layers, 2, num_kv_heads], optional
        FP8 only: cut by heads with the planes.

    Raises
    ------
    ShardError
        Heads that do not divide among the devices, no or bad devices, devices that do not exist; everything
        made so far is closed again.
    UnsupportedConfigError
        A backend that is not a name, ``kv_scales`` of the wrong shape, and what PagedKVCache refuses.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: Any = "float16",
                 *, devices: Sequence[int], max_tokens: int, max_seqs: int = 256, max_seq_len: Optional[int] = None,
                 max_step_tokens: Optional[int] = None, placement: str = "plane", chunk_bytes: Optional[int] = None,
                 backend: str = "auto", kv_dtype: Optional[str] = None, kv_scales: Any = None):
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
            self._xp: Any
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
            self._buffers: List[Any] = [self._step_buffers(shard) for shard in self.shards[1:]]
            undo.pop_all()

    def _backend_kind(self, backend: str, devices: List[int]) -> str:
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

    def _on(self, device: int) -> ContextManager:
        return contextlib.nullcontext() if self._xp is np else self._xp.cuda.Device(device)

    def _step_buffers(self, shard: Shard) -> Optional[Dict[str, Array]]:
        """Fixed device buffers on ``shard``'s device for the step arrays (as large as shard 0's), so a CUDA
        graph captured over them stays valid from step to step."""
        if self._xp is np:
            return None
        with self._on(shard.device):
            return {name: self._xp.empty_like(buf) for name, buf in self.lead.metadata.buffers.items()
                    if name in STEP_ARRAYS}

    # --- shape ------------------------------------------------------------------------

    num_layers = property(lambda self: self.lead.num_layers, doc="Layers of K and V: int")
    num_kv_heads = property(lambda self: self.lead.num_kv_heads * len(self.shards),
                            doc="KV heads of every shard together: int")
    head_dim = property(lambda self: self.lead.head_dim, doc="Elements of one head of one token: int")
    block_size = property(lambda self: self.lead.block_size, doc="Tokens a block holds: int")
    dtype = property(lambda self: self.spec.dtype, doc="The model's dtype (q and attention output): numpy.dtype")
    kv_dtype = property(lambda self: self.spec.kv_dtype, doc="What the planes store: a name of supported.KV_DTYPES")
    layout = property(lambda self: self.lead.layout, doc="Every shard's layout (of one shard's heads): Layout")
    xp = property(lambda self: self._xp, doc="cupy, or numpy on the host backend")

    # --- sequences: the one allocator and set of tables (shard 0's) ---------------------------

    def add_sequence(self, prefix: Optional[Sequence[int]] = None) -> int:
        """A new sequence's handle (as :meth:`PagedKVCache.add_sequence <pagedrt.cache.PagedKVCache.add_sequence>`).
        """
        return self.lead.add_sequence(prefix)

    def fork(self, seq: int) -> int:
        """A new sequence sharing every block of ``seq``; returns its handle."""
        return self.lead.fork(seq)

    def free(self, seqs: Handles) -> None:
        """Free sequences, each given once; their blocks go back when no fork holds them."""
        self.lead.free(seqs)

    def can_append(self, seqs: Handles, counts: Counts = 1) -> bool:
        """Whether ``counts`` more tokens for each of ``seqs`` would fit now (as the whole cache's)."""
        return self.lead.can_append(seqs, counts)

    def length(self, seq: int) -> int:
        """The tokens sequence ``seq`` holds."""
        return self.lead.length(seq)

    def lengths(self, seqs: Handles) -> np.ndarray:
        """Host int64 [n]: the lengths of ``seqs``, in their order."""
        return self.lead.lengths(seqs)

    @property
    def sequences(self) -> List[int]:
        """The handles of the live sequences, in handle order."""
        return self.lead.sequences

    @property
    def num_available_blocks(self) -> int:
        """Blocks appends can still get (every shard has the same)."""
        return self.lead.num_available_blocks

    def step(self, seqs: Optional[Handles] = None, counts: Counts = 1, token_ids: Optional[Sequence[int]] = None, *,
             arrivals: Sequence[Sequence[int]] = (), arrival_tokens: Optional[Counts] = None, forks: Handles = (),
             frees: Handles = ()) -> ShardedStep:
        """One engine step, as :meth:`PagedKVCache.step <pagedrt.cache.PagedKVCache.step>` without swaps; all
        or nothing.

        The host fields (sequences, copies, arrivals, ...) are the same objects in every shard's step. Shard
        0's device arrays are uploaded on its device's current stream, then copied to each other shard's
        device (:func:`peer_copy`) into fixed buffers; work queued afterwards on that device's current
        stream reads them.

        Parameters
        ----------
        seqs, counts, token_ids, arrivals, arrival_tokens, forks, frees
            As :meth:`PagedKVCache.step <pagedrt.cache.PagedKVCache.step>`.

        Returns
        -------
        ShardedStep
            Shard 0's :class:`~pagedrt.step.Step`, with every shard's in ``.shards``.
        """
        with self._on(self.devices[0]):
            step = self.lead.step(seqs, counts, token_ids, arrivals=arrivals, arrival_tokens=arrival_tokens,
                                  forks=forks, frees=frees)
        if self._xp is np:
            return ShardedStep((step,) * len(self.shards))
        return ShardedStep((step,) + tuple(self._copy_step(step, shard, buffers)
                                           for shard, buffers in zip(self.shards[1:], self._buffers)))

    def _copy_step(self, step: Step, shard: Shard, buffers: Dict[str, Array]) -> Step:
        fields = {name: buffers[name][:getattr(step, name).shape[0]] for name in STEP_ARRAYS}
        peer_copy([(fields[name], getattr(step, name)) for name in STEP_ARRAYS], self.devices[0], shard.device)
        return step._replace(**fields)

    # --- both layers -----------------------------------------------------------------------

    def translate(self, seq: int, pos: int, layer: int = 0, kv: str = "k", head: int = 0) -> Translation:
        """Token ``pos`` of ``seq``, KV head ``head`` of the cache -> the shard and device holding it, and the
        chain in that shard's pool.

        Parameters
        ----------
        seq, pos, layer, kv
            As :meth:`PagedKVCache.translate <pagedrt.cache.PagedKVCache.translate>`.
        head : int
            One of the cache's KV heads, ``0 <= head < num_kv_heads``.

        Returns
        -------
        Translation
            Its ``kv_head`` the cache's head, ``shard`` and ``device`` set.

        Raises
        ------
        UnsupportedConfigError
            A head out of range (and what the whole cache's translate refuses).
        """
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

    def snapshot(self, shard: int = 0) -> dict:
        """Shard ``shard``'s snapshot (docs/SNAPSHOT.md): its pool and the shared tables, with a ``shard``
        section naming its device and KV heads.

        Raises
        ------
        ShardError
            ``shard`` is not one of ``0 .. len(shards) - 1``.
        """
        self._check_open("snapshot")
        if not is_int(shard) or not 0 <= shard < len(self.shards):
            raise ShardError(f"shard={shard!r:.40} must be one of 0..{len(self.shards) - 1}")
        sh = self.shards[int(shard)]
        snap = build_snapshot(self.layout, sh.pool, self.lead.allocator, self.lead.tables)
        snap["shard"] = {"index": sh.index, "of": len(self.shards), "device": sh.device,
                         "kv_heads": [sh.kv_heads.start, sh.kv_heads.stop], "num_kv_heads": self.num_kv_heads}
        return snap

    def write_snapshot(self, path: str, shard: int = 0) -> None:
        """Write :meth:`snapshot` of ``shard`` to ``path`` atomically."""
        write_snapshot(self.snapshot(shard), path)

    def stats(self) -> dict:
        """Token and byte counts, as :meth:`PagedKVCache.stats <pagedrt.cache.PagedKVCache.stats>`.

        The counts of sequences, tokens and blocks are the shared tables'; ``token_bytes``,
        ``mapped_bytes`` and ``reserved_bytes`` are summed over the shards.
        """
        self._check_open("stats")
        stats = self.lead.stats()
        stats["token_bytes"] *= len(self.shards)
        stats["mapped_bytes"] = sum(shard.pool.mapped_bytes for shard in self.shards)
        stats["reserved_bytes"] = sum(shard.pool.max_bytes for shard in self.shards)
        return stats

    # --- lifetime ---------------------------------------------------------------------------

    def _check_open(self, name: str) -> None:
        if self.closed:
            raise PoolClosedError(f"sharded cache.{name}: this cache was closed; make a new one")

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self.lead.closed

    def close(self) -> None:
        """Close every shard's pool (shard 0's cache last); idempotent."""
        if self.closed:
            return
        for shard in self.shards[1:]:
            with self._on(shard.device):
                shard.pool.close()
        self._buffers = []
        with self._on(self.devices[0]):
            self.lead.close()

    def __enter__(self) -> "ShardedKVCache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ShardedKVCache({self.num_layers} layers, {self.num_kv_heads} kv heads over devices "
                f"{self.devices}, {self.layout.num_kv_heads} each)")
