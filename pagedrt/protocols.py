"""The shapes a cache offers, named: what a scheduler or engine calls (:class:`KVCache`) and what a model reads
(:class:`KVPlanes`).

:class:`~pagedrt.cache.PagedKVCache` and :class:`~pagedrt.shard.ShardedKVCache` are both a :class:`KVCache`;
a :class:`~pagedrt.cache.PagedKVCache` and each :class:`~pagedrt.shard.Shard` of a sharded cache are both
:class:`KVPlanes`. Neither class inherits from these: they match structurally (``tests/test_protocols.py``
checks every member and its signature).

Properties and methods: a property is a cheap read of state the object holds, with no arguments (O(1), or a
fresh host list of what it holds, such as the live handles or the plane views); it never touches the device,
changes state or computes a summary. Anything that takes arguments, changes state, touches the device, or
computes (counts over the block tables, a snapshot, a dict of counters) is a method.
"""

from typing import Any, List, Optional, Protocol, Sequence, Union

import numpy as np

from .layout import Layout, Translation
from .spec import Array, KVSpec
from .step import Step

Handles = Union[int, Sequence[int], np.ndarray]  # one sequence handle, or several (int64 [n] as an array)
Counts = Union[int, Sequence[int], np.ndarray]   # new tokens: one count for every sequence, or one each


class KVCache(Protocol):
    """What a scheduler or engine may call on a cache, whole or sharded (properties and methods: module
    docstring). Every call after :meth:`close` raises :class:`~pagedrt.errors.PoolClosedError`."""

    @property
    def spec(self) -> KVSpec:
        """What the cache holds (for a sharded cache, the whole cache's: every KV head)."""

    @property
    def layout(self) -> Layout:
        """Where every block of every layer's K/V lies (a sharded cache: each shard's, of its heads)."""

    @property
    def num_layers(self) -> int:
        """Layers of K and V."""

    @property
    def num_kv_heads(self) -> int:
        """KV heads of the cache (a sharded cache: of all its shards)."""

    @property
    def head_dim(self) -> int:
        """Elements of one head's K (or V) of one token."""

    @property
    def block_size(self) -> int:
        """Tokens a block holds."""

    @property
    def dtype(self) -> np.dtype:
        """The model's dtype: q, k, v and the attention output."""

    @property
    def kv_dtype(self) -> str:
        """What the planes store: a name of :data:`~pagedrt.supported.KV_DTYPES`."""

    @property
    def xp(self) -> Any:
        """The array module of the cache's arrays: ``cupy``, or ``numpy`` on the host backend."""

    @property
    def sequences(self) -> List[int]:
        """The handles of the live sequences, in handle order."""

    @property
    def num_available_blocks(self) -> int:
        """Blocks appends can still get: the free ones and every block of chunks not mapped yet."""

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""

    def add_sequence(self, prefix: Optional[Sequence[int]] = None) -> int:
        """A new sequence; returns its handle.

        Parameters
        ----------
        prefix : sequence of int, optional
            The prompt's token ids: the sequence starts holding the cached blocks the prompt begins with.
        """

    def step(self, seqs: Optional[Handles] = None, counts: Counts = 1, token_ids: Optional[Sequence[int]] = None, *,
             arrivals: Sequence[Sequence[int]] = (), arrival_tokens: Optional[Counts] = None,
             forks: Handles = (), frees: Handles = ()) -> Step:
        """One engine step: frees, forks, arrivals, then ``counts`` new tokens for ``seqs``; all or nothing.

        Parameters
        ----------
        seqs : handles, optional
            The sequences that get new tokens; None: every live one not freed now.
        counts : int or int sequence
            New tokens per sequence.
        token_ids : sequence of int, optional
            ``sum(counts)`` ids, sequence by sequence (for the prefix cache).
        arrivals : sequence of int sequences
            Prompts, as token ids: each becomes a new sequence.
        arrival_tokens : int or int sequence, optional
            Tokens of each prompt to append now; None: the whole uncached rest.
        forks, frees : handles
            Parents to fork (one child each) and sequences to free.

        Returns
        -------
        Step
            The step's metadata (:class:`~pagedrt.step.Step`; a sharded cache's carries every shard's).

        Raises
        ------
        PagedRTError
            A named subclass for a step that cannot be satisfied; nothing changes then.
        """

    def fork(self, seq: int) -> int:
        """A new sequence sharing every block of ``seq``; returns its handle."""

    def free(self, seqs: Handles) -> None:
        """Free sequences, each given once; their blocks go back when no fork holds them."""

    def can_append(self, seqs: Handles, counts: Counts = 1) -> bool:
        """Whether ``counts`` more tokens for each of ``seqs`` would fit now."""

    def length(self, seq: int) -> int:
        """The tokens sequence ``seq`` holds."""

    def lengths(self, seqs: Handles) -> np.ndarray:
        """Host int64 [n]: the lengths of ``seqs``, in their order."""

    def translate(self, seq: int, pos: int, layer: int = 0, kv: str = "k", head: int = 0) -> Translation:
        """Token ``pos`` of ``seq`` (layer, ``"k"`` or ``"v"``, KV head) -> its whole address chain."""

    def snapshot(self) -> dict:
        """Both layers as a JSON-ready dict (docs/SNAPSHOT.md)."""

    def write_snapshot(self, path: str) -> None:
        """Write :meth:`snapshot` to ``path`` atomically."""

    def stats(self) -> dict:
        """Token and byte counts: what holds tokens against what is mapped."""

    def close(self) -> None:
        """Release the cache's memory; idempotent."""

    def __enter__(self) -> "KVCache":
        """The cache itself."""

    def __exit__(self, *exc: Any) -> None:
        """:meth:`close`."""


class KVPlanes(Protocol):
    """What a model reads to run attention and write K/V: one cache's planes (a whole cache's, or one shard's,
    of its KV heads), their shape and FP8 scales (properties and methods: module docstring)."""

    @property
    def spec(self) -> KVSpec:
        """What the planes hold (a shard's: its KV heads)."""

    @property
    def num_layers(self) -> int:
        """Layers of K and V."""

    @property
    def num_kv_heads(self) -> int:
        """KV heads in each plane."""

    @property
    def head_dim(self) -> int:
        """Elements of one head's K (or V) of one token."""

    @property
    def dtype(self) -> np.dtype:
        """The model's dtype: q, k, v and the attention output."""

    @property
    def xp(self) -> Any:
        """The array module of the planes: ``cupy``, or ``numpy`` on the host backend."""

    @property
    def planes(self) -> List[Array]:
        """Every plane, K and V of each layer in order (what ``kernels.copy_blocks`` takes)."""

    def k(self, layer: int) -> Array:
        """Layer ``layer``'s K plane, ``[max_blocks, num_kv_heads, block_size, head_dim]`` of
        ``spec.kv_numpy_dtype``: a strided view."""

    def v(self, layer: int) -> Array:
        """Layer ``layer``'s V plane, as :meth:`k`."""

    def k_scale(self, layer: int) -> Optional[Array]:
        """FP8 planes: layer ``layer``'s K scales, float32 [num_kv_heads]; else None."""

    def v_scale(self, layer: int) -> Optional[Array]:
        """FP8 planes: layer ``layer``'s V scales, float32 [num_kv_heads]; else None."""
