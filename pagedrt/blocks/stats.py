"""The software layer's counters, in one object (after vLLM's ``PrefixCacheStats``)."""

from dataclasses import asdict, dataclass


@dataclass
class BlockStats:
    """Every counter of the allocator, the prefix cache and the host tier.

    Counted through the transaction (:meth:`Transaction.count
    <pagedrt.blocks.transaction.Transaction.count>`), so a step that fails counts nothing,
    except ``sync_grows``: it counts attempts to map on the critical path, failed ones too.
    """

    lookups: int = 0         # prompts looked up in the prefix cache
    queried_tokens: int = 0  # their tokens
    hit_tokens: int = 0      # of those, found cached
    hit_blocks: int = 0      # the cached blocks found
    evictions: int = 0       # cached-free device blocks evicted (forgotten or offloaded)
    offloads: int = 0        # of those, copied to the host tier
    reloads: int = 0         # offloaded blocks brought back to the device by a prefix hit
    host_evictions: int = 0  # offloaded blocks dropped from the host tier
    sync_grows: int = 0      # times allocate mapped chunks itself, on the step's critical path

    def as_dict(self):
        return asdict(self)
