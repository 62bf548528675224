"""The hardware layer: a pool of memory at one fixed virtual range, grown by mapping chunks."""

from .backends import BACKENDS, select_backend
from .pool import ChunkRecord, Pool, find_pool

__all__ = ["BACKENDS", "ChunkRecord", "Pool", "find_pool", "select_backend"]
