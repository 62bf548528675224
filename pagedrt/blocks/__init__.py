"""The software layer: block ids over the pool's chunks, per-sequence block tables, the prefix cache and the host
tier, every operation all or nothing.

One job per module: :mod:`~pagedrt.blocks.allocator` (block ids, reference counts,
chunk-aware free counts, mapping), :mod:`~pagedrt.blocks.tables` (rows, lengths, token
ids; append with copy-on-write, fork, free), :mod:`~pagedrt.blocks.prefix` (block names,
the index, the cached-free LRU and its eviction rule), :mod:`~pagedrt.blocks.tiers` (the
host tier: swap, offload, reload), :mod:`~pagedrt.blocks.steps` (one engine step),
:mod:`~pagedrt.blocks.transaction` (the undo journal), :mod:`~pagedrt.blocks.stats` (the
counters) and :mod:`~pagedrt.blocks.util`.
"""

from .allocator import BlockAllocator
from .stats import BlockStats
from .steps import StepResult
from .tables import BlockTables, Changes
from .transaction import Transaction
from .util import ceil_div, ranks

__all__ = ["BlockAllocator", "BlockStats", "BlockTables", "Changes", "StepResult", "Transaction", "ceil_div", "ranks"]
