"""The software layer's counters, in one object (after vLLM's ``PrefixCacheStats``)."""

from dataclasses import asdict, dataclass
from typing import Dict


@dataclass
class BlockStats:
    """Every counter of the allocator, the prefix cache and the host tier.

    Counted through the transaction (:meth:`Transaction.count
    <pagedrt.blocks.transaction.Transaction.count>`), so a step that fails counts nothing,
    except ``sync_grows``: it counts attempts to map on the critical path, failed ones too.

    Attributes
    ----------
    lookups : int
        Prompts looked up in the prefix cache.
    queried_tokens : int
        Their tokens.
    hit_tokens : int
        Of those, found cached.
    hit_blocks : int
        The cached blocks found.
    evictions : int
        Cached-free device blocks evicted (forgotten or offloaded).
    offloads : int
        Of those, copied to the host tier.
    reloads : int
        Offloaded blocks brought back to the device by a prefix hit.
    host_evictions : int
        Offloaded blocks dropped from the host tier.
    sync_grows : int
        Times allocate mapped chunks itself, on the step's critical path.
    """

    lookups: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    hit_blocks: int = 0
    evictions: int = 0
    offloads: int = 0
    reloads: int = 0
    host_evictions: int = 0
    sync_grows: int = 0

    def as_dict(self) -> Dict[str, int]:
        """Every counter, by its name."""
        return asdict(self)
