"""Decode steps padded to a few batch sizes, so that a batch that shrinks as sequences end still replays a
captured CUDA graph (the model captures one per batch size, when a size repeats) instead of running eagerly.

A step whose rows each have one new token is extended to the next size of :func:`sizes` with padding rows
that write nothing and read one valid block: the step's arrays are views of the cache's fixed buffers
(:class:`~pagedrt.step.StepMetadata`), which past the step hold slot -1 (the K/V write skips it), block -1,
length 0 and the token count as query offset. A padding row gets length 1 over the first block of the batch's
first row (attention's plans refuse a length 0; that block is live and mapped, and is only read) and query
offset ``row``, one query token each, so positions and the last-token rows stay inside the padded batch. Its
slot stays -1: no sequence's K/V changes. Its logits are garbage the sampler never reads.
"""

from bisect import bisect_left

import numpy as np

from ..step import Step


def sizes(max_seqs: int) -> tuple:
    """The padded batch sizes: the powers of two below ``max_seqs``, then ``max_seqs``."""
    out = [1]
    while out[-1] * 2 < max_seqs:
        out.append(out[-1] * 2)
    return tuple(out) + ((max_seqs,) if max_seqs > 1 else ())


class Padding:
    """Pads decode steps of a CUDA cache to :func:`sizes` of its ``max_seqs``.

    Parameters
    ----------
    cache : PagedKVCache
        A cache on the cuda backend (its ``metadata.buffers`` are the step's fixed device buffers).
    max_seqs : int
        Its rows.
    """

    def __init__(self, cache, max_seqs: int):
        self.sizes = sizes(max_seqs)
        self.buffers = cache.metadata.buffers
        self._offsets = cache.xp.arange(max_seqs + 1, dtype=np.int32)
        self._views = {}  # size -> the four arrays of a padded step

    def size(self, batch: int) -> int:
        """The padded size of a batch of ``batch`` rows (1 <= batch <= max_seqs)."""
        return self.sizes[bisect_left(self.sizes, batch)]

    def pad(self, step: Step, size: int) -> Step:
        """``step`` (one new token a row, ``len(step.seqs)`` rows) as a step of ``size`` rows: the padding rows
        of the module docstring, written on the current stream."""
        batch, b = len(step.seqs), self.buffers
        tables = b["block_tables"]
        tables[batch:size, :1] = tables[:1, :1]
        b["seq_lens"][batch:size] = 1
        b["qo_indptr"][batch + 1:size + 1] = self._offsets[batch + 1:size + 1]
        views = self._views.get(size)
        if views is None:
            views = self._views[size] = dict(slot_mapping=b["slot_mapping"][:size], block_tables=tables[:size],
                                             seq_lens=b["seq_lens"][:size], qo_indptr=b["qo_indptr"][:size + 1])
        seqs = np.concatenate([step.seqs, np.full(size - batch, -1, np.int64)])
        return step._replace(seqs=seqs, query_lens=np.ones(size, np.int64), num_tokens=size, **views)
