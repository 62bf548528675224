"""The hardware layer: a pool of memory at one fixed virtual range, grown by mapping chunks."""

from .backends import BACKENDS, Backend, select_backend
from .ipc import ImportedChunks, receive_chunks, send_chunks
from .pool import ChunkRecord, Pool, find_pool

__all__ = ["BACKENDS", "Backend", "ChunkRecord", "ImportedChunks", "Pool", "find_pool", "receive_chunks",
           "select_backend", "send_chunks"]
