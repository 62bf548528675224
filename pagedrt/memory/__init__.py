"""The hardware layer: a pool of memory at one fixed virtual range, grown by mapping chunks."""

from .backends import BACKENDS, select_backend
from .pool import ChunkRecord, Pool

__all__ = ["BACKENDS", "ChunkRecord", "Pool", "select_backend"]
