"""The prefix cache's index (software layer): full blocks named by a hash chained over their token ids.

Block ``i`` of a sequence is named ``h_i = H(h_{i-1}, tokens of block i)`` (``H`` is
an 8-byte BLAKE2b over the parent's 8 bytes and the block's int32 token ids, so a
name is the same in every process, unlike Python's ``hash``); the first block's
parent is :data:`ROOT`. A name therefore stands for the whole prefix up to and
including its block. :class:`PrefixIndex` maps names to block ids and keeps each
named block's token ids, so a lookup that finds a name also compares the tokens:
two prefixes whose names collide never share a block.

Blocks named here are *cached*. A cached block that no sequence holds (reference
count 0) is *cached-free*: it keeps its data and name until the allocator needs
the block (:meth:`pagedrt.blocks.BlockAllocator.allocate` evicts such blocks least
recently freed first). The allocator owns the least-recently-used order; this
module only names blocks.
"""

import hashlib

import numpy as np

from .errors import InvalidTokenIdsError

ROOT = 0                # the parent name of a sequence's first block
MAX_TOKEN_ID = 1 << 31  # token ids are int32 >= 0


def chain_hash(parent, tokens):
    """The name of a full block holding ``tokens`` (int32) after the prefix named ``parent``."""
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(tokens.tobytes())
    return int.from_bytes(h.digest(), "little")


def check_token_ids(token_ids, length, what):
    """``token_ids`` as a flat int32 array of ``length`` ids (None: any length), or InvalidTokenIdsError."""
    try:
        ids = np.asarray(token_ids)
    except (ValueError, TypeError):
        raise InvalidTokenIdsError(f"{what} must be a flat list of ints, got {token_ids!r:.80}") from None
    if ids.ndim != 1:
        raise InvalidTokenIdsError(f"{what} must be a flat list of ints, got shape {ids.shape}")
    if ids.dtype.kind not in "iu" and (ids.size or ids.dtype.kind not in "f"):
        raise InvalidTokenIdsError(f"{what} must be ints, got {ids.dtype}")
    if length is not None and ids.size != length:
        raise InvalidTokenIdsError(f"{what} holds {ids.size} ids but {length} tokens are appended: one id per "
                                   f"token, sequence by sequence")
    if ids.size and (ids.min() < 0 or ids.max() >= MAX_TOKEN_ID):
        bad = ids[(ids < 0) | (ids >= MAX_TOKEN_ID)][0]
        raise InvalidTokenIdsError(f"{what} holds {bad}: token ids are in 0..{MAX_TOKEN_ID - 1}")
    return ids.astype(np.int32)


class PrefixIndex:
    """Names of cached blocks: name -> block id, block id -> name, and each cached block's token ids."""

    def __init__(self, max_blocks):
        self.block_of = {}                         # name -> block id
        self.name = np.zeros(max_blocks, np.uint64)
        self.cached = np.zeros(max_blocks, bool)   # per block: named here
        self.tokens = {}                           # block id -> its int32 token ids
        self.lookups = self.hit_blocks = self.hit_tokens = self.queried_tokens = 0

    def __len__(self):
        return len(self.block_of)

    def register(self, block, name, tokens):
        """Name a full ``block``; a name already taken keeps its first block (that block stays unnamed)."""
        if name in self.block_of or self.cached[block]:
            return
        self.block_of[name] = block
        self.name[block] = name
        self.cached[block] = True
        self.tokens[block] = tokens.copy()

    def forget(self, block):
        """Drop ``block``'s name (it is being evicted)."""
        del self.block_of[int(self.name[block])]
        del self.tokens[block]
        self.cached[block] = False
        self.name[block] = 0

    def move(self, src, dst):
        """Give ``src``'s name and token ids to ``dst`` (its copy in the other tier); ``src`` is unnamed after."""
        name = int(self.name[src])
        self.block_of[name] = dst
        self.name[dst], self.cached[dst] = name, True
        self.tokens[dst] = self.tokens.pop(src)
        self.cached[src], self.name[src] = False, 0

    def match(self, prompt, block_size, most):
        """(block ids, last name): the longest chain of cached blocks equal to ``prompt``'s first ``most`` blocks."""
        parent, found = ROOT, []
        for i in range(most):
            tokens = prompt[i * block_size:(i + 1) * block_size]
            name = chain_hash(parent, tokens)
            block = self.block_of.get(name)
            if block is None or not np.array_equal(self.tokens[block], tokens):
                break
            found.append(block)
            parent = name
        return np.array(found, np.int32), parent

    def stats(self):
        return {"lookups": self.lookups, "hit_blocks": self.hit_blocks, "hit_tokens": self.hit_tokens,
                "queried_tokens": self.queried_tokens, "cached_blocks": len(self)}
