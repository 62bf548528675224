"""The prefix cache: full blocks named by a hash chained over their token ids, and the cached-free LRU.

Block ``i`` of a sequence is named ``h_i = H(h_{i-1}, tokens of block i)`` (``H`` is
an 8-byte BLAKE2b over the parent's 8 bytes and the block's int32 token ids, so a
name is the same in every process, unlike Python's ``hash``); the first block's
parent is :data:`ROOT`. A name therefore stands for the whole prefix up to and
including its block. :class:`PrefixIndex` maps names to block ids and keeps each
named block's token ids, so a lookup that finds a name also compares the tokens:
two prefixes whose names collide never share a block.

Blocks named here are *cached*. A cached block that no sequence holds (reference
count 0) is *cached-free*: it keeps its data and name until the allocator needs
the block. :class:`CachedFree` keeps them in least-recently-used order (an
``OrderedDict`` keyed by block id: O(1) to add, remove or take the oldest), one per
tier; the eviction rule is :meth:`CachedFree.take_oldest`: the allocator evicts the
least recently freed first (:meth:`pagedrt.blocks.BlockAllocator.allocate`). Every
change here is journaled (:mod:`pagedrt.blocks.transaction`).
"""

import hashlib
from collections import OrderedDict
from functools import partial
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import InvalidTokenIdsError
from .transaction import Transaction

ROOT = 0                # the parent name of a sequence's first block
MAX_TOKEN_ID = 1 << 31  # token ids are int32 >= 0


def chain_hash(parent: int, tokens: np.ndarray) -> int:
    """The name of a full block holding ``tokens`` (int32) after the prefix named ``parent``."""
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(tokens.tobytes())
    return int.from_bytes(h.digest(), "little")


def check_token_ids(token_ids: Any, length: Optional[int], what: str) -> np.ndarray:
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

    def __init__(self, max_blocks: int, tx: Transaction) -> None:
        self.tx = tx                               # the journal (pagedrt.blocks.transaction)
        self.block_of = {}                         # name -> block id
        self.name = np.zeros(max_blocks, np.uint64)
        self.cached = np.zeros(max_blocks, bool)   # per block: named here
        self.tokens = {}                           # block id -> its int32 token ids

    def __len__(self):
        return len(self.block_of)

    def register(self, block: int, name: int, tokens: np.ndarray) -> None:
        """Name a full ``block``; a name already taken keeps its first block (that block stays unnamed)."""
        if name in self.block_of or self.cached[block]:
            return
        self.tx.undo(partial(self._unname, block, name))
        self._name(block, name, tokens.copy())

    def forget(self, block: int) -> None:
        """Drop ``block``'s name (it is being evicted)."""
        name = int(self.name[block])
        self.tx.undo(partial(self._name, block, name, self.tokens[block]))
        self._unname(block, name)

    def move(self, src: int, dst: int) -> None:
        """Give ``src``'s name and token ids to ``dst`` (its copy in the other tier); ``src`` is unnamed after."""
        name, tokens = int(self.name[src]), self.tokens[src]
        self.tx.undo(partial(self._moved_back, src, dst, name, tokens))
        self._moved_back(dst, src, name, tokens)

    # Each of these leaves the index consistent from whatever point the one it undoes was cut short at.

    def _name(self, block, name, tokens):
        self.block_of[name] = block
        self.tokens[block] = tokens
        self.name[block], self.cached[block] = name, True

    def _unname(self, block, name):
        if self.block_of.get(name) == block:
            del self.block_of[name]
        self.tokens.pop(block, None)
        self.cached[block], self.name[block] = False, 0

    def _moved_back(self, src, dst, name, tokens):
        """``name`` (with ``tokens``) on ``src``, ``dst`` unnamed: undoes a move from ``src`` to ``dst`` (a copy
        that had no name of its own)."""
        self.tokens.pop(dst, None)
        self.cached[dst], self.name[dst] = False, 0
        self._name(src, name, tokens)

    def match(self, prompt: np.ndarray, block_size: int, most: int) -> Tuple[np.ndarray, int]:
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


class CachedFree(OrderedDict):
    """Cached-free blocks of one tier (named, held by none), least recently used first; changes journaled."""

    def __init__(self, tx: Transaction) -> None:
        super().__init__()
        self.tx = tx

    def push(self, blocks: Sequence[int]) -> None:
        """Add ``blocks`` (none of them here), the last the most recent."""
        self.tx.undo(partial(self._drop, blocks))
        for block in blocks:
            self[block] = None

    def take_oldest(self, n: int) -> List[int]:
        """Remove and return the ``n`` least recently used blocks, oldest first: the eviction rule."""
        taken = []
        self.tx.undo(partial(self._put_back, taken))
        for _ in range(n):
            block = next(iter(self))
            taken.append(block)  # recorded before it goes: an interrupt between the two loses nothing
            del self[block]
        return taken

    def remove(self, blocks: Sequence[int]) -> None:
        """Remove ``blocks`` (each here) wherever they are in the order."""
        if self.tx.open and blocks:
            self.tx.undo(partial(self._restore, list(self)))  # O(size), once per call: only prefix hits remove
        for block in blocks:
            del self[block]

    def _drop(self, blocks):
        for block in blocks:
            self.pop(block, None)

    def _put_back(self, taken):
        for block in reversed(taken):
            self[block] = None
            self.move_to_end(block, last=False)

    def _restore(self, order):
        self.clear()
        self.update(dict.fromkeys(order))
