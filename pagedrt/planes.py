"""What kernels read of a cache: each layer's K and V planes as strided views of the pool, and FP8 scales.

:func:`plane_view` makes one plane's view, :class:`PlaneViews` gives a cache (or a shard) ``k``, ``v``,
``planes``, ``k_scale`` and ``v_scale``, and :class:`TableViews` the device block tables, lengths and block mask.
"""

from typing import Callable, List, Optional

import numpy as np

from .exclusive import exclusive
from .layout import Layout, is_int
from .memory import Pool
from .protocols import Handles
from .spec import Array, KVSpec


def plane_view(pool: Pool, layout: Layout, spec: KVSpec, layer: int, kv: str) -> Array:
    """One plane of ``pool``, a strided view (no copy).

    Parameters
    ----------
    pool : Pool
        The pool the plane lies in.
    layout : Layout
        Where the plane lies in ``pool`` and its strides.
    spec : KVSpec
        What the plane stores (``spec.kv_numpy_dtype``).
    layer : int
        The layer, ``0 <= layer < layout.num_layers``.
    kv : str
        ``"k"`` or ``"v"``.

    Returns
    -------
    Array
        ``[max_blocks, num_kv_heads, block_size, head_dim]`` of ``spec.kv_numpy_dtype``, on the pool's device.
    """
    lay, e = layout, layout.itemsize
    shape = (lay.max_blocks, lay.num_kv_heads, lay.block_size, lay.head_dim)
    strides = (lay.block_stride_bytes, lay.block_size * lay.head_dim * e, lay.head_dim * e, e)
    return pool.view(lay.plane_offset(layer, kv), shape, spec.kv_numpy_dtype, strides, allow_holes=True)


class PlaneViews:
    """What kernels read of a cache: each layer's K and V planes, and FP8 scales. A class using it holds
    ``_planes`` (K and V of each layer in order), ``_scales`` (float32 [num_layers, 2, num_kv_heads] on its
    device, or None), ``layout``, and ``_check_open(name)``."""

    _planes: List[Array]
    _scales: Optional[Array]
    layout: Layout
    _check_open: Callable[[str], None]

    def k(self, layer: int) -> Array:
        """Layer ``layer``'s K plane, a strided view (no copy).

        Parameters
        ----------
        layer : int
            ``0 <= layer < num_layers``.

        Returns
        -------
        Array
            ``[max_blocks, num_kv_heads, block_size, head_dim]`` of ``spec.kv_numpy_dtype`` (uint8 for FP8).

        Raises
        ------
        PoolClosedError
            After ``close()``.
        UnsupportedConfigError
            A layer that is not an int in range.
        """
        return self._plane(layer, 0)

    def v(self, layer: int) -> Array:
        """Layer ``layer``'s V plane: as :meth:`k`."""
        return self._plane(layer, 1)

    @property
    def planes(self) -> List[Array]:
        """Every plane, K and V of each layer in order (``2 * num_layers``; what ``kernels.copy_blocks``
        takes): a fresh list of the views. PoolClosedError after ``close()``."""
        self._check_open("planes")
        return list(self._planes)

    def k_scale(self, layer: int) -> Optional[Array]:
        """Layer ``layer``'s K scales.

        Parameters
        ----------
        layer : int
            ``0 <= layer < num_layers``.

        Returns
        -------
        Array or None
            FP8 planes: float32 ``[num_kv_heads]`` on the planes' device (a view); other planes: None.

        Raises
        ------
        PoolClosedError, UnsupportedConfigError
            As :meth:`k`.
        """
        return self._scale(layer, 0)

    def v_scale(self, layer: int) -> Optional[Array]:
        """Layer ``layer``'s V scales: as :meth:`k_scale`."""
        return self._scale(layer, 1)

    def _scale(self, layer: int, kv: int) -> Optional[Array]:
        self._plane(layer, kv)  # checks the cache is open and the layer
        return None if self._scales is None else self._scales[layer, kv]

    def _plane(self, layer: int, kv: int) -> Array:
        self._check_open("k" if kv == 0 else "v")
        if not is_int(layer) or not 0 <= layer < self.layout.num_layers:
            self.layout.check(layer, "k", 0)
        return self._planes[2 * layer + kv]


class TableViews:
    """What kernels read of a cache's tables, on the device: block tables, lengths and the block mask. A class
    using it holds ``tables`` (:class:`~pagedrt.blocks.BlockTables`), ``metadata``
    (:class:`~pagedrt.step.StepMetadata`), ``allocator``, ``xp``, ``_mask``/``_mask_version`` and a ``_lock`` with
    ``pool`` for :func:`~pagedrt.exclusive.exclusive`."""

    @exclusive
    def block_tables(self, seqs: Optional[Handles] = None) -> Array:
        """The device block table, uploaded first if the host's changed.

        Parameters
        ----------
        seqs : handles, optional
            Live sequences; None: every row.

        Returns
        -------
        Array
            int32 ``[max_seqs, max_blocks_per_seq]``, or ``[n, max_blocks_per_seq]`` for ``seqs`` in order:
            consecutive handles give a view (no copy), others a gathered copy.

        Raises
        ------
        UnknownSequenceError
            A handle not live.
        """
        self.tables.tx.run(self.metadata.upload)  # drained changes logged again if it is cut short
        return self._select(self.metadata.block_table, seqs)

    @exclusive
    def seq_lens(self, seqs: Optional[Handles] = None) -> Array:
        """The device lengths: int32 ``[max_seqs]``, or ``[n]`` for ``seqs`` in order (as
        :meth:`block_tables`)."""
        self.tables.tx.run(self.metadata.upload)  # drained changes logged again if it is cut short
        return self._select(self.metadata.seq_lens, seqs)

    def _select(self, array: Array, seqs: Optional[Handles]) -> Array:
        if seqs is None:
            return array
        rows = self.tables.rows(seqs)
        first = int(rows[0]) if rows.size else 0
        if rows.size and int(rows[-1]) - first + 1 == rows.size and (np.diff(rows) == 1).all():
            return array[first:first + rows.size]
        return array[self.xp.asarray(rows)]

    @exclusive
    def block_mask(self) -> Array:
        """uint8 ``[max_blocks]`` on the device (both tiers' blocks): 1 where the block's chunk is mapped.
        Kernels validate tables against it; the same array until chunks are mapped or released."""
        if self._mask_version != self.allocator.version:
            self._mask = self.xp.asarray(self.allocator.usable_mask().astype(np.uint8))
            self._mask_version = self.allocator.version
        return self._mask
