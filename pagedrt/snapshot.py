"""Snapshots: both mapping layers of a cache as one JSON-ready dict (schema in docs/SNAPSHOT.md).

:func:`build_snapshot` makes the dict from a cache's parts, :func:`write_snapshot`
writes it atomically (another process may be reading the file), and
:func:`load_snapshot` reads one back, refusing what is not a snapshot this version
can read.
"""

import json
import os
import tempfile
import time
from dataclasses import asdict

import numpy as np

from .errors import SnapshotError
from .layout import Layout

SNAPSHOT_SCHEMA, SNAPSHOT_VERSION = "pagedrt-snapshot", 1


def build_snapshot(layout, pool, allocator, tables):
    """The snapshot dict of a cache made of these parts."""
    a, t = allocator, tables
    frontier = (int(np.flatnonzero(a.chunk_mapped).max()) + 1 if a.chunk_mapped.any() else 0)
    return {
        "schema": SNAPSHOT_SCHEMA, "version": SNAPSHOT_VERSION, "time": time.time(),
        "layout": asdict(layout),
        "pool": {"backend": pool.backend, "base": pool.base, "max_bytes": pool.max_bytes,
                 "chunk_bytes": pool.chunk_bytes, "page_bytes": pool.page_bytes,
                 "num_chunks": pool.num_chunks, "chunks": [r.as_dict() for r in pool.mappings()]},
        "blocks": {"blocks_per_chunk": a.blocks_per_chunk, "num_planes": a.num_planes, "num_chunks": a.num_chunks,
                   "max_blocks": a.max_blocks, "free": a.num_free, "held": a.num_held,
                   "chunk_mapped": a.chunk_mapped.tolist(), "free_in_chunk": a.free_in_chunk.tolist(),
                   "ref_counts": a.ref_count[:frontier * a.blocks_per_chunk].tolist()},
        "sequences": [{"seq": int(s), "length": int(t.lens[s]), "blocks": t.blocks(s).tolist()}
                      for s in t.sequences],
        "max_seqs": t.max_seqs, "max_blocks_per_seq": t.max_blocks_per_seq,
    }


def write_snapshot(snap, path):
    """Write ``snap`` to ``path`` atomically: a temporary file in the same directory, renamed over it."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".snapshot-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(snap, f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def load_snapshot(path):
    """Read a snapshot file; SnapshotError if it is missing, corrupt, or of a newer schema."""
    try:
        with open(path) as f:
            snap = json.load(f)
    except FileNotFoundError:
        raise SnapshotError(f"no snapshot at {path}: write one with cache.write_snapshot(path)") from None
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"cannot read snapshot {path}: {exc}") from None
    if not isinstance(snap, dict) or snap.get("schema") != SNAPSHOT_SCHEMA:
        raise SnapshotError(f"{path} is not a pagedrt snapshot (no schema {SNAPSHOT_SCHEMA!r})")
    version = snap.get("version")
    if not isinstance(version, int) or version > SNAPSHOT_VERSION:
        raise SnapshotError(f"{path} has snapshot version {version!r}; this pagedrt reads up to "
                            f"version {SNAPSHOT_VERSION}: upgrade pagedrt")
    try:
        Layout(**snap["layout"])
        for key in ("pool", "blocks", "sequences"):
            snap[key]
    except (KeyError, TypeError) as exc:
        raise SnapshotError(f"{path} is a corrupt snapshot: {exc!r}") from None
    return snap
