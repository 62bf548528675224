"""One engine step on the block tables: its arguments checked, then its operations in order, as one transaction.

A step first validates its arguments: handles, duplicates, counts, token ids, the
step's token budget and a row's capacity. These are pure checks; none restates a rule
of an operation (what is freed, copied, moved or evicted, or whether blocks suffice).
Then it runs the one implementation of each operation, in order: frees, forks,
arrivals (prefix hits claimed, offloaded ones reserved), swap-outs, swap-ins, reloads,
then the appends (copy-on-write inside), all inside one transaction
(:mod:`pagedrt.blocks.transaction`): an error half-way, ``PoolExhaustedError`` or a
``KeyboardInterrupt`` alike, rolls every change back. The :class:`StepResult` is the
record of what was done: what the caller applies on the device.
"""

from typing import TYPE_CHECKING, NamedTuple, Optional, Sequence, Union

import numpy as np

from ..errors import InvalidTokenCountError, InvalidTokenIdsError, SwapStateError, UnknownSequenceError
from . import prefix
from .util import NO_ROWS, pairs

if TYPE_CHECKING:  # pagedrt.protocols imports pagedrt.step, which imports this package
    from ..protocols import Counts, Handles
    from .tables import BlockTables


class StepResult(NamedTuple):
    """What one :meth:`BlockTables.step <pagedrt.blocks.tables.BlockTables.step>` did, on the host.

    Attributes
    ----------
    rows : numpy.ndarray
        int64 ``[batch]``: the step's sequences in batch order (scheduled, then arrivals).
    counts : int or numpy.ndarray
        Their new tokens: one int for every row, or int64 ``[batch]``.
    slots : numpy.ndarray
        int64 ``[tokens]``: the new tokens' pool slots, row by row.
    copies : numpy.ndarray
        int32 ``[n, 2]``: (src, dst) blocks to copy before writing (copy-on-write).
    arrived : numpy.ndarray
        int64 ``[arrivals]``: the arrivals' handles, in the order given.
    cached : numpy.ndarray
        int64 ``[arrivals]``: per arrival, its leading tokens found in the prefix cache.
    forked : numpy.ndarray
        int64 ``[forks]``: the children's handles, one per fork, in the order given.
    swaps : numpy.ndarray
        int32 ``[n, 2]``: (src, dst) tier copies (swaps, offloads, reloads) to make first, in order.
    """

    rows: np.ndarray
    counts: Union[int, np.ndarray]
    slots: np.ndarray
    copies: np.ndarray
    arrived: np.ndarray
    cached: np.ndarray
    forked: np.ndarray
    swaps: np.ndarray


class _Checked(NamedTuple):
    rows: np.ndarray
    step: object
    token_ids: object
    freed: np.ndarray
    parents: np.ndarray
    prompts: list
    matches: list
    chunk: np.ndarray
    out_rows: np.ndarray
    in_rows: np.ndarray


def run(tables: "BlockTables", seqs: Optional["Handles"], counts: "Counts", token_ids: Optional[Sequence[int]],
        arrivals: Optional[Sequence[Sequence[int]]], arrival_tokens: Optional["Counts"], forks: Optional["Handles"],
        frees: Optional["Handles"], max_tokens: int, swap_out: Optional["Handles"],
        swap_in: Optional["Handles"]) -> StepResult:
    """:meth:`BlockTables.step <pagedrt.blocks.tables.BlockTables.step>` (its docstring says what each argument
    is): the arguments checked, then the operations as one transaction; a :class:`StepResult`."""
    if _empty(arrivals, forks, frees, swap_out, swap_in):
        if arrival_tokens is not None:
            _no_arrivals(arrival_tokens)
        rows, step = tables._request(seqs, counts)  # the decode step: appends alone
        _check_step_tokens(rows, step, 0, max_tokens)

        def append():
            slots, copies = tables._append_rows(rows, step, token_ids)
            return StepResult(rows, step, slots, copies, NO_ROWS, NO_ROWS, NO_ROWS, pairs(tables.tx.moves))
        return tables.tx.run(append, moves=True)
    checked = _check(tables, seqs, counts, token_ids, arrivals, arrival_tokens, forks, frees, max_tokens, swap_out,
                     swap_in)
    return tables.tx.run(lambda: _apply(tables, checked), moves=True)


def _empty(*values):
    """Whether each of ``values`` is None or an empty list or tuple (the decode step's)."""
    for value in values:
        if value is not None and not (type(value) in (list, tuple) and not value):
            return False
    return True


def _no_arrivals(arrival_tokens):
    raise InvalidTokenCountError(f"arrival_tokens={arrival_tokens!r:.80} is given for no arrivals: give arrivals, "
                                 f"or leave arrival_tokens out")


def _prompts(arrivals):
    """``arrivals`` as a list of checked int32 prompts (None: none)."""
    if arrivals is None:
        return []
    try:
        listed = list(arrivals)
    except TypeError:
        raise InvalidTokenIdsError(f"arrivals must be a list of prompts (lists of token ids), got "
                                   f"{arrivals!r:.80}") from None
    return [prefix.check_token_ids(p, None, f"arrivals[{i}]") for i, p in enumerate(listed)]


def _handles(tables, seqs):
    """Handles (one int, a list, or None: none) as checked live rows."""
    return NO_ROWS if seqs is None else tables.rows(seqs)


def _check(tables, seqs, counts, token_ids, arrivals, arrival_tokens, forks, frees, max_tokens, swap_out, swap_in):
    """Every argument of a step checked, changing nothing: a :class:`_Checked`."""
    t = tables
    freed = np.sort(t._distinct(_handles(t, frees), "step's frees", "free each sequence once"))
    parents = _handles(t, forks)
    _not_freed(parents, freed, "is forked and freed in one step: fork it, or free it")
    none = ()
    out_rows = t._swap_rows(none if swap_out is None else swap_out, "swap_out", False)
    in_rows = t._swap_rows(none if swap_in is None else swap_in, "swap_in", True)
    for moved in (out_rows, in_rows):
        _not_freed(moved, freed, "is swapped and freed in one step")
    swapped = t.swapped.copy()
    swapped[out_rows] = True
    away = swapped[parents]
    if away.any():
        raise SwapStateError(f"sequence {parents[away][0]} is forked but swapped out: swap it in first")
    swapped[in_rows] = False
    if seqs is None:
        rows = np.flatnonzero(t.live & ~swapped)
        rows = rows[~np.isin(rows, freed)]
    else:
        rows = t._distinct(t.rows(seqs), "step", "sum its counts instead")
        _not_freed(rows, freed, "is given tokens and freed in one step")
    step = t._counts(rows, counts)
    if token_ids is not None:
        total = step * rows.size if isinstance(step, int) else int(step.sum())
        token_ids = prefix.check_token_ids(token_ids, total, "token_ids")
    prompts = _prompts(arrivals)
    if not prompts and arrival_tokens is not None:
        _no_arrivals(arrival_tokens)
    matches = [t.match(p, reload=True) for p in prompts]
    cached = np.array([m[0].size for m in matches], np.int64) * t.block_size
    rest = np.array([p.size for p in prompts], np.int64) - cached
    chunk = _arrival_chunks(arrival_tokens, rest, max_tokens)
    if chunk.size and (cached + chunk).max() > t.row_tokens:
        t._too_many(int((cached + chunk).max()))
    _check_step_tokens(rows, step, int(chunk.sum()), max_tokens)
    return _Checked(rows, step, token_ids, freed, parents, prompts, matches, chunk, out_rows, in_rows)


def _not_freed(rows, freed, what):
    gone = np.isin(rows, freed)
    if gone.any():
        raise UnknownSequenceError(f"sequence {rows[gone][0]} {what}")


def _arrival_chunks(arrival_tokens, rest, max_tokens):
    """How many prompt tokens each arrival appends now: at least one, at most its uncached ``rest``."""
    n = rest.size
    if arrival_tokens is None:
        chunk = rest
    else:
        try:
            chunk = np.broadcast_to(np.asarray(arrival_tokens), (n,))
        except ValueError:
            raise InvalidTokenCountError(f"arrival_tokens must be one int or one per arrival ({n}), got "
                                         f"{arrival_tokens!r:.80}") from None
        if chunk.dtype.kind not in "iu" or chunk.min() < 1:
            raise InvalidTokenCountError(f"arrival_tokens must be ints >= 1, got {arrival_tokens!r:.80}")
        if chunk.max() > max_tokens:  # compared before any conversion: no wrap past int64
            raise InvalidTokenCountError(f"arrival_tokens holds {chunk.max()} but a step holds at most {max_tokens} "
                                         f"new tokens (max_step_tokens)")
        chunk = np.minimum(chunk.astype(np.int64), rest)
    if chunk.size and chunk.min() < 1:
        raise InvalidTokenCountError(f"arrivals[{int(chunk.argmin())}] is empty: a prompt has a token at least")
    return chunk


def _check_step_tokens(rows, step, more, max_tokens):
    total = (step * rows.size if isinstance(step, int) else int(step.sum())) + more
    if total > max_tokens:
        raise InvalidTokenCountError(f"the step has {total} new tokens but steps hold at most {max_tokens} "
                                     f"(max_step_tokens): split the prompt into chunks")


def _apply(tables, c):
    """The step's operations, in order (inside its transaction); its :class:`StepResult`."""
    t, a = tables, tables.allocator
    if c.freed.size:
        t._free(c.freed)
    forked = np.array([t._fork(int(p)) for p in c.parents], np.int64)
    arrived = np.array([t._add_row() for _ in c.prompts], np.int64)
    for blocks, _ in c.matches:  # claimed now, so that no swap or reload evicts them
        a.claim_cached(blocks[blocks < a.device_blocks])
    offloaded, holders = _offloaded_hits(c.matches, a.device_blocks)
    a.reserve_offloaded(offloaded.tolist())
    if c.out_rows.size:
        t._swap_out(c.out_rows)
    if c.in_rows.size:
        t._swap_in(c.in_rows)
    reloaded = a.reload(offloaded, holders) if offloaded.size else NO_ROWS
    for row, prompt, (blocks, name) in zip(arrived.tolist(), c.prompts, c.matches):
        t._start(row, prompt, (_translate(blocks, offloaded, reloaded), name), claim=False)
    cached = t.lens[arrived].astype(np.int64)
    rows, step = c.rows, c.step
    slots, copies = t._append_rows(rows, step, c.token_ids)
    if arrived.size:
        ids = np.concatenate([p[k:k + n] for p, k, n in zip(c.prompts, cached.tolist(), c.chunk.tolist())])
        new_slots, new_copies = t._append_rows(arrived, c.chunk, ids)
        slots, copies = np.concatenate([slots, new_slots]), np.concatenate([copies, new_copies])
        rows, step = np.concatenate([rows, arrived]), np.concatenate([np.broadcast_to(step, rows.shape), c.chunk])
    return StepResult(rows, step, slots, copies, arrived, cached, forked, pairs(t.tx.moves))


def _offloaded_hits(matches, device_blocks):
    """The host-tier (offloaded) blocks in the arrivals' matches, each once in order of first appearance, and how
    many arrivals hit each."""
    hits = np.concatenate([NO_ROWS] + [m[0][m[0] >= device_blocks].astype(np.int64) for m in matches])
    blocks, first, counts = np.unique(hits, return_index=True, return_counts=True)
    order = np.argsort(first)
    return blocks[order], counts[order]


def _translate(blocks, src, dst):
    """``blocks`` with each id found in ``src`` replaced by its ``dst``."""
    if not src.size:
        return blocks
    out = blocks.astype(np.int64)
    for s, d in zip(src.tolist(), dst.tolist()):
        out[out == s] = d
    return out.astype(np.int32)
