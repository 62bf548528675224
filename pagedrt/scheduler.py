"""Scheduling policy over a :class:`~pagedrt.PagedKVCache`: what a step runs, never how blocks move.

The engine and the demo both schedule with it, so these rules exist once:

- **frees**: sequences that finished are freed the next step (a parent after its forks);
- **batch**: every other live sequence, in arrival order, appends one token (decoding) or its next prompt
  chunk (prefilling); ``step_tokens`` less the decode tokens is the prompt budget, given to prompt chunks in
  arrival order, then to new arrivals in order;
- **forks**: a request of ``n`` samples runs its prompt once; the step after its last prompt token, its
  sequence forks ``n - 1`` times (the children share every prompt block);
- **admission**: a waiting request arrives while the budget lasts, the block table has ``n`` rows to spare,
  and the blocks every live sequence may still need fit in the cache's available blocks, each counted as if
  none were shared and its partly filled last block copied on write: no step runs out of blocks, so none is
  preempted. An arrival whose first block equals that of another arrival of the same step (and of none of an
  earlier step) waits a step, to find the other's blocks cached.

It reads the cache (lengths, available blocks) and returns ``cache.step()``'s arguments; the caller makes the
step, runs its model (or the demo's synthetic K/V) and reports back (:meth:`Scheduler.update`,
:meth:`Scheduler.finish`). A step lists its batch in one Python pass over its sequences; the per-token work
(token ids, sampling, recording) is the caller's, vectorised over the batch.
"""

import enum
import typing
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Union

import numpy as np

from .blocks import ceil_div

if TYPE_CHECKING:
    from .protocols import KVCache
    from .step import Step


class Status(enum.Enum):
    PREFILL = "prefill"    # its prompt is partly in the cache
    DECODE = "decode"      # appends one token a step
    FINISHED = "finished"  # freed the next step


@dataclass(frozen=True)
class SchedulerConfig:
    """The policy's bounds: ``max_seqs`` rows of the block table; ``block_size`` tokens a block; ``step_tokens``
    tokens a step appends, decode tokens first (every decoding sequence appends one, even past it) and prompt
    chunks in the rest; ``first_chunk``: the most prompt tokens an arrival appends in its own step (None: what
    the budget leaves; the demo caps it to show prompts prefilled over several steps)."""

    max_seqs: int
    block_size: int
    step_tokens: int
    first_chunk: int | None = None


@dataclass(eq=False)
class Request:
    """A prompt (token ids, int64 [prompt_len]) to extend by at most ``max_tokens`` tokens in ``n`` samples;
    ``cached_tokens``: the prompt tokens its arrival found in the prefix cache."""

    prompt: np.ndarray
    max_tokens: int
    n: int = 1
    cached_tokens: int = 0

    @property
    def target(self) -> int:
        """The length at which each of its sequences ends at the latest."""
        return int(self.prompt.size) + self.max_tokens


@dataclass(eq=False)
class Sequence:
    """One sample of a request: a row of the cache (``handle``) and where it is."""

    request: Request
    handle: int
    target: int                    # the length at which it ends at the latest
    sample: int = 0                # which of its request's samples
    status: Status = Status.PREFILL
    prefilled: int = 0             # prompt tokens in the cache
    unforked: int = 0              # children to fork when its prompt ends


@dataclass
class ScheduledStep:
    """One step's decisions, as ``cache.step()`` takes them (:meth:`cache_args`).

    ``seqs``: the batch's rows in order, ``counts`` (int64 [rows]) the tokens each appends, ``decoding``
    (bool [rows]) the rows that append a sampled token (the others a prompt chunk); ``arrivals`` and
    ``arrival_tokens`` (the most prompt tokens each appends now); ``forks``: (parent, child's target, child's
    sample), one per child; ``frees``. ``staying``: the live sequences not freed, in arrival order.
    ``budget`` and ``rows``: the prompt tokens and block-table rows left after the decisions so far, ``need``
    the blocks they may need (None until a fork or an arrival asks); admission reads them. ``arrived``: the
    arrivals' sequences, after :meth:`Scheduler.update`.
    """

    seqs: list
    counts: np.ndarray
    decoding: np.ndarray
    staying: list
    frees: list
    forks: list
    budget: int
    rows: int
    need: int | None = None
    arrivals: list = field(default_factory=list)
    arrival_tokens: list = field(default_factory=list)
    arrived: list = field(default_factory=list)

    @cached_property
    def handles(self) -> np.ndarray:
        """The batch's rows as cache handles, int64 [rows]."""
        return np.array([s.handle for s in self.seqs], np.int64)

    def token_ids(self, decode_ids: Union[typing.Sequence[int], np.ndarray]) -> np.ndarray:
        """The batch's new token ids, int64 [counts.sum()]: the decoding rows' and the prompt chunks,
        interleaved as the rows are.

        Parameters
        ----------
        decode_ids : array_like of int
            The token each decoding row appends, in row order: [decoding.sum()].
        """
        decode_ids = np.asarray(decode_ids, np.int64)
        if self.decoding.all():
            return decode_ids
        parts, at = [], 0
        for seq, count, decoding in zip(self.seqs, self.counts.tolist(), self.decoding.tolist()):
            if decoding:
                parts.append(decode_ids[at:at + 1])
                at += 1
            else:
                parts.append(seq.request.prompt[seq.prefilled:seq.prefilled + count])
        return np.concatenate(parts)

    def cache_args(self, decode_ids: Union[typing.Sequence[int], np.ndarray]) -> dict:
        """``cache.step()``'s keyword arguments.

        Parameters
        ----------
        decode_ids : array_like of int
            The token each decoding row appends, in row order: [decoding.sum()].
        """
        return dict(seqs=self.handles, counts=self.counts,
                    token_ids=self.token_ids(decode_ids), arrivals=[r.prompt for r in self.arrivals],
                    arrival_tokens=self.arrival_tokens or None, forks=[p.handle for p, _, _ in self.forks],
                    frees=[s.handle for s in self.frees])


class Scheduler:
    """The policy of the module docstring over ``cache`` (its ``lengths`` and ``num_available_blocks``).

    Parameters
    ----------
    config : SchedulerConfig
        The bounds of a step.
    cache : PagedKVCache or ShardedKVCache
        The cache the steps run on; read, never changed here.
    """

    def __init__(self, config: SchedulerConfig, cache: "KVCache") -> None:
        self.config, self.cache = config, cache
        self.waiting = deque()   # requests, in order
        self.running = {}        # handle -> Sequence, in arrival order
        self._forks = []         # (parent, child's target, child's sample): forked next step
        self._firsts = {}        # first blocks of the last max_seqs prompts that arrived in earlier steps (ordered)

    @property
    def idle(self) -> bool:
        """Whether nothing is waiting, running or to be freed."""
        return not (self.waiting or self.running or self._forks)

    def add(self, request: Request) -> None:
        """Queue ``request`` behind those waiting; it arrives when admitted.

        Parameters
        ----------
        request : Request
            Its prompt fits a sequence and its ``n`` samples the cache (the caller checks: the engine's
            ``check``); one that never fits waits for ever.
        """
        self.waiting.append(request)

    def withdraw(self) -> None:
        """Drop the requests still waiting (the demo's users do not wait)."""
        self.waiting.clear()

    def clear(self) -> list:
        """Forget every request and sequence (a caller that gave up midway); returns the live sequences' handles,
        for the caller to free."""
        handles = list(self.running)
        self.waiting.clear(), self.running.clear(), self._forks.clear(), self._firsts.clear()
        return handles

    def finish(self, seq: Sequence) -> None:
        """Mark a sequence done; it is freed the next step (a parent after its forks).

        Parameters
        ----------
        seq : Sequence
            A live sequence of :attr:`running`.
        """
        seq.status = Status.FINISHED

    def schedule(self) -> ScheduledStep:
        """The next step's decisions: :meth:`begin` then :meth:`admit`."""
        plan = self.begin()
        self.admit(plan)
        return plan

    def begin(self) -> ScheduledStep:
        """Frees, forks and the batch of the next step, its arrivals not admitted yet."""
        parents = {id(p) for p, _, _ in self._forks}
        frees, staying, growing, decoding = [], [], [], []
        finished, decode = Status.FINISHED, Status.DECODE
        for seq in self.running.values():
            if seq.status is not finished:
                staying.append(seq), growing.append(seq), decoding.append(seq.status is decode)
            else:
                (staying if id(seq) in parents else frees).append(seq)
        decoding = np.array(decoding, bool)
        budget = self.config.step_tokens - int(decoding.sum())
        rows = len(staying) + sum(s.unforked for s in staying) + len(self._forks)
        if decoding.all():
            return ScheduledStep(growing, np.ones(len(growing), np.int64), decoding, staying, frees,
                                 list(self._forks), budget, rows)
        seqs, counts, rows_decoding = [], [], []
        for seq, decodes in zip(growing, decoding.tolist()):
            chunk = 1 if decodes else min(seq.request.prompt.size - seq.prefilled, budget)
            if chunk > 0:
                seqs.append(seq), counts.append(chunk), rows_decoding.append(decodes)
                budget -= 0 if decodes else chunk
        return ScheduledStep(seqs, np.array(counts, np.int64), np.array(rows_decoding, bool), staying, frees,
                             list(self._forks), budget, rows)

    def _need(self, plan):
        """The blocks the live sequences of ``plan``, the samples they will fork and its forks may still need:
        each as if it shared none, its partly filled last block copied on write. Counted once a step, when a
        fork or an arrival asks."""
        if plan.need is None:
            bs = self.config.block_size
            growing = [s for s in plan.staying if s.status is not Status.FINISHED]
            targets = np.array([s.target for s in growing], np.int64)
            weights = np.array([1 + s.unforked for s in growing], np.int64)
            lengths = self.cache.lengths([s.handle for s in growing]) if growing else targets
            need = int((weights * (ceil_div(targets, bs) - lengths // bs)).sum())
            plan.need = need + sum(ceil_div(t, bs) - self._length(p) // bs for p, t, _ in plan.forks)
        return plan.need

    def fork(self, plan: ScheduledStep, parent: Sequence, target: int) -> bool:
        """Fork a sequence in ``plan``'s step, if a row and the blocks the child may need are free.

        Parameters
        ----------
        plan : ScheduledStep
            From :meth:`begin`, not admitted yet.
        parent : Sequence
            A decoding sequence of ``plan.staying``.
        target : int
            The length at which the child ends at the latest.

        Returns
        -------
        bool
            Whether the fork is in ``plan``.
        """
        need = ceil_div(target, self.config.block_size) - self._length(parent) // self.config.block_size
        if plan.rows >= self.config.max_seqs or self._need(plan) + need > self.cache.num_available_blocks:
            return False
        plan.forks.append((parent, target, parent.sample))
        plan.rows, plan.need = plan.rows + 1, plan.need + need
        return True

    def admit(self, plan: ScheduledStep) -> None:
        """Move waiting requests into ``plan``'s arrivals, in order, while the rules of the module docstring let
        them.

        Parameters
        ----------
        plan : ScheduledStep
            From :meth:`begin` (and :meth:`fork`).
        """
        c, available, firsts = self.config, self.cache.num_available_blocks, set()
        while self.waiting and plan.budget > 0:
            request = self.waiting[0]
            first = request.prompt[:c.block_size].tobytes()
            blocks = request.n * ceil_div(request.target, c.block_size)
            repeated = first in firsts and first not in self._firsts
            if plan.rows + request.n > c.max_seqs or self._need(plan) + blocks > available or repeated:
                break
            chunk = min(request.prompt.size, plan.budget, c.first_chunk or plan.budget)
            plan.arrivals.append(self.waiting.popleft())
            plan.arrival_tokens.append(chunk)
            firsts.add(first)
            plan.need, plan.rows, plan.budget = plan.need + blocks, plan.rows + request.n, plan.budget - chunk
        for first in firsts:  # the newest last; bounded, so a server that is never idle does not grow it
            self._firsts.pop(first, None)
            self._firsts[first] = None
        while len(self._firsts) > c.max_seqs:
            del self._firsts[next(iter(self._firsts))]

    def update(self, plan: ScheduledStep, step: "Step") -> list:
        """Take in a step made: the freed go, the children and the arrivals (``plan.arrived``) join, prompt
        chunks advance.

        Parameters
        ----------
        plan : ScheduledStep
            The step's decisions.
        step : pagedrt.step.Step
            What ``cache.step(**plan.cache_args(...))`` returned.

        Returns
        -------
        list of Sequence
            Those whose prompt ended in this step, in the step's row order (the arrivals last); their children
            fork the next step.
        """
        for seq in plan.frees:
            del self.running[seq.handle]
        self._forks = []
        for (parent, target, sample), handle in zip(plan.forks, step.forked.tolist()):
            self.running[handle] = Sequence(parent.request, handle, target, sample, Status.DECODE, parent.prefilled)
        ended = []
        for i in np.flatnonzero(~plan.decoding).tolist():
            seq = plan.seqs[i]
            seq.prefilled += int(plan.counts[i])
            ended += [seq] if seq.prefilled == seq.request.prompt.size else []
        rows = len(plan.seqs)
        for i, (request, handle) in enumerate(zip(plan.arrivals, step.arrived.tolist())):
            request.cached_tokens = int(step.cached[i])
            prefilled = request.cached_tokens + int(step.query_lens[rows + i])
            seq = Sequence(request, handle, request.target, prefilled=prefilled, unforked=request.n - 1)
            self.running[handle] = seq
            plan.arrived.append(seq)
            ended += [seq] if seq.prefilled == request.prompt.size else []
        for seq in ended:
            seq.status = Status.DECODE
            self._forks += [(seq, seq.target, s) for s in range(1, seq.unforked + 1)]
            seq.unforked = 0
        if self.idle:
            self._firsts.clear()
        return ended

    def _length(self, seq):
        return int(self.cache.lengths([seq.handle])[0])
