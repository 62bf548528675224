"""Text generation with continuous batching over one :class:`~pagedrt.PagedKVCache`: the generate loop.

One :meth:`Engine.step` is one decision of :class:`~pagedrt.scheduler.Scheduler` (frees, forks, the batch of
decode tokens and prompt chunks, arrivals: the rules are in its module), one ``cache.step()`` and one model
forward. When a prompt's last token is computed, ``n`` first tokens are drawn from its logits: its own and
those of the ``n - 1`` children the scheduler forks the next step. The children share every prompt block; the
first token each side appends to a shared, partly filled block is copied on write (``step.copies``).

Each request and sample is an object (the scheduler's ``Request`` and ``Sequence``); what the decode path
reads and writes per token (the token to append, the counts, sampling parameters, the tokens generated) is
mirrored in NumPy arrays indexed by the cache's handles (``_Rows``), so that a step samples and records its
batch vectorised: a Python loop runs per event (an arrival, a fork, a finished sequence) or to list the batch's
handles, never per generated token.

Steps overlap (``overlap``): the host schedules, makes and queues step n+1 while step n runs, and reads step
n's tokens after that (:mod:`.flight`). The tokens are sampled on the device, and step n+1's decode rows read
their ids there; the host learns them one step late, so a sequence that stops or reaches its length limit at
step n runs step n+1 too, whose token is discarded. The ids a step appends are given to the prefix cache when
known (``cache.name_tokens``). A decode step is padded to a few batch sizes with captured graphs
(:mod:`.padding`).
"""

import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..blocks import ceil_div
from ..cache import PagedKVCache
from ..errors import InvalidTokenIdsError, RequestError
from ..scheduler import Request, Scheduler, SchedulerConfig
from ..shard import ShardedKVCache
from . import loader, sampler
from .flight import Flight, TokenBuffers
from .model import LlamaModel
from .padding import Padding
from .parallel import TensorParallelModel
from .tokenizer import Tokenizer

DEFAULT_KV_TOKENS = 1 << 19


@dataclass(frozen=True)
class SamplingParams:
    """How a request samples: ``n`` sequences of at most ``max_tokens`` new tokens each; temperature 0 is
    greedy; ``top_p`` keeps the most likely tokens holding that much probability; ``seed`` makes it
    reproducible."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    n: int = 1

    def __post_init__(self):
        for name, ok in (("max_tokens", _int(self.max_tokens) and self.max_tokens >= 1),
                         ("n", _int(self.n) and self.n >= 1), ("seed", _int(self.seed) and self.seed >= 0),
                         ("temperature", _real(self.temperature) and self.temperature >= 0),
                         ("top_p", _real(self.top_p) and 0 < self.top_p <= 1)):
            if not ok:
                raise RequestError(f"{name}={getattr(self, name)!r} is out of range: max_tokens and n are ints >= 1, "
                                   "seed an int >= 0, temperature >= 0 and 0 < top_p <= 1")


def _int(x):
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _real(x):
    return _int(x) or (isinstance(x, (float, np.floating)) and np.isfinite(x))


@dataclass
class Completion:
    """One request's result: per sample its token ids, text and why it ended ("stop" or "length")."""

    prompt_tokens: int
    cached_tokens: int = 0
    tokens: list = field(default_factory=list)
    texts: list = field(default_factory=list)
    finish_reasons: list = field(default_factory=list)


@dataclass
class Stats:
    """Counters of the steps run so far: tokens, and wall time of steps with prompt tokens and without.

    A step's wall time is its host turn (scheduling, ``cache.step()``, queueing its forward and sampling) and the
    wait for its tokens and their bookkeeping, which with ``overlap`` falls in the next step's turn: so a prompt's
    computation is the prefill's time, not that of the first decode step that waits for it.
    """

    steps: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    prefill_steps: int = 0
    prefill_seconds: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    max_batch: int = 0


@dataclass(eq=False)
class _Request(Request):
    """A request of one :meth:`Engine.generate` call: its place in the call, sampling parameters, result, one
    stream seed per sample, and the first tokens of its children (drawn when its prompt ended)."""

    index: int = 0
    params: SamplingParams = None
    completion: Completion = None
    seeds: np.ndarray = None
    firsts: np.ndarray = None


@dataclass
class _Rows:
    """The decode path's state of each cache row (indexed by handle), so that a step samples and records its
    whole batch vectorised: the token it appends next (when the host knows it), the tokens generated (``out``
    [rows, max_tokens]) and their count, the draws queued (``drawn``: the counter of its next random number),
    its sample's limit, temperature, top_p and stream seed, whether it finished, and its ``epoch`` (how many
    samples the row has started: a late token of a row's earlier sample is told apart by it)."""

    last: np.ndarray
    count: np.ndarray
    drawn: np.ndarray
    limit: np.ndarray
    epoch: np.ndarray
    temperature: np.ndarray
    top_p: np.ndarray
    seed: np.ndarray
    done: np.ndarray
    out: np.ndarray

    @classmethod
    def zeros(cls, rows):
        return cls(*(np.zeros(rows, np.int64) for _ in range(5)), np.zeros(rows), np.ones(rows),
                   np.zeros(rows, np.uint64), np.zeros(rows, bool), np.zeros((rows, 1), np.int64))

    def start(self, seqs, drawn):
        """The rows of ``seqs`` (scheduler Sequences) start generating their sample, ``drawn`` tokens drawn."""
        handles = [s.handle for s in seqs]
        params = [s.request.params for s in seqs]
        self.limit[handles] = [p.max_tokens for p in params]
        self.temperature[handles] = [p.temperature for p in params]
        self.top_p[handles] = [p.top_p for p in params]
        self.seed[handles] = [s.request.seeds[s.sample] for s in seqs]
        self.count[handles], self.drawn[handles], self.done[handles] = 0, drawn, False
        self.epoch[handles] += 1


class Engine:
    """A model from a GGUF file, its tokenizer and a paged KV cache, and the loop that generates with them.

    Parameters
    ----------
    model_path : str or os.PathLike
        The GGUF file.
    backend : str
        The cache's: "auto", "cuda" or "host".
    max_seqs : int
        Sequences at once (rows of the block table).
    kv_tokens : int
        The cache's capacity (address space reserved; memory is mapped as blocks are used).
    block_size : int
        Tokens a block.
    step_tokens : int
        The most new tokens one step computes (decode tokens and prompt chunks).
    graphs : bool
        Decode steps as CUDA graphs.
    dtype : str
        The model's activations.
    kv_dtype : str or None
        What the cache stores (default: ``dtype``), or ``"float8_e4m3"``: K and V as float8 e4m3 with a scale of
        1 per layer and KV head (what engines use without a calibration pass), half the cache's bytes; the
        model's head_dim must then be 64 or 128.
    devices : sequence of int or None
        Device ordinals: the cache sharded by KV heads over them and the model run tensor-parallel
        (:class:`~pagedrt.shard.ShardedKVCache`, :class:`~pagedrt.engine.parallel.TensorParallelModel`: its sums
        through NCCL over distinct GPUs; its steps run eagerly, whatever ``graphs`` says). None: one cache on
        the current device.
    overlap : bool
        Schedule and queue each step while the one before runs (module docstring); False: each step waits for
        its tokens before the next is scheduled. The tensor-parallel engine (``devices``) does not overlap.

    What runs next is :class:`~pagedrt.scheduler.Scheduler`'s decision; the engine runs the model over it and
    samples.
    """

    def __init__(self, model_path: str | os.PathLike, *, backend: str = "auto", max_seqs: int = 256,
                 kv_tokens: int = DEFAULT_KV_TOKENS, block_size: int = 16, step_tokens: int = 2048, graphs: bool = True,
                 dtype: str = "float16", kv_dtype: str | None = None, devices: Sequence[int] | None = None,
                 overlap: bool = True) -> None:
        gguf = loader.load(model_path)
        self.config, self.path = gguf.config, gguf.path
        self.tokenizer = Tokenizer(gguf.vocab)
        c = self.config
        self.max_seq_len = min(c.context_length, kv_tokens)
        shape = (c.num_layers, c.kv_heads, c.head_dim, block_size, dtype)
        sizes = dict(max_tokens=kv_tokens, max_seqs=max_seqs, max_seq_len=self.max_seq_len,
                     max_step_tokens=step_tokens + max_seqs, backend=backend, kv_dtype=kv_dtype)
        if devices is None:
            self.cache = PagedKVCache(*shape, **sizes)
        else:
            self.cache = ShardedKVCache(*shape, devices=devices, **sizes)
        try:
            self.model = (LlamaModel(gguf, self.cache, graphs=graphs) if devices is None
                          else TensorParallelModel(gguf, self.cache))
        except BaseException:
            self.cache.close()
            raise
        self.stop_tokens = np.array(self.tokenizer.stop, np.int64)
        self.scheduler = Scheduler(SchedulerConfig(max_seqs, block_size, step_tokens), self.cache)
        self._rows = _Rows.zeros(max_seqs)
        self._overlap = overlap and devices is None  # a sharded cache takes its ids with the step
        self._tokens = TokenBuffers(max_seqs)
        self._flight = None   # the step whose tokens the host has not read yet
        self._awaiting = []   # children forked before their first token (drawn by their parent's step) was read
        self._landing = 0.0   # seconds this step has spent reading tokens (counted as their own steps')
        cuda_graphs = graphs and devices is None and self.cache.xp is not np
        self._padding = Padding(self.cache, max_seqs) if cuda_graphs else None
        self._snapshot = self._on_token = None  # generate()'s
        self.stats = Stats()

    # --- requests -----------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | Sequence[int] | np.ndarray, *, chat: bool = True) -> np.ndarray:
        """Token ids (int64 [prompt_len]) of ``prompt``.

        Parameters
        ----------
        prompt : str or sequence of int
            Text, or token ids: a flat list or array of ints in [0, vocab_size) (floats, nested lists and None
            are refused with :class:`~pagedrt.errors.InvalidTokenIdsError`, not converted).
        chat : bool
            Text in the model's chat format (ChatML, with its default system prompt) when its template is ChatML.
        """
        if not isinstance(prompt, str):
            return self._token_ids(prompt)
        if not prompt:
            raise RequestError("the prompt is empty: give it some text")
        template = self.tokenizer.vocab.chat_template
        if chat and "<|im_start|>" in template:
            from .chat import chatml
            prompt = chatml(prompt, template)
            return self.tokenizer.encode(prompt, special=True, limit=self.max_seq_len)
        return self.tokenizer.encode(prompt, limit=self.max_seq_len)

    def _token_ids(self, prompt):
        """``prompt`` as int64 ids, refused unless a flat list or array of ints in [0, vocab_size)."""
        vocab = self.config.vocab_size
        what = f"prompt token ids must be a flat list of ints in [0, {vocab})"
        try:
            ids = np.asarray(prompt)
        except (ValueError, TypeError, OverflowError):  # ragged nesting, ints past int64
            raise InvalidTokenIdsError(f"{what}, got {prompt!r:.60}") from None
        if ids.size == 0 and ids.ndim == 1:
            raise RequestError("the prompt is empty: give it at least one token")
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise InvalidTokenIdsError(f"{what}, got {prompt!r:.60}")
        if ids.min() < 0 or ids.max() >= vocab:
            raise InvalidTokenIdsError(f"{what}, got {int(ids.min() if ids.min() < 0 else ids.max())}")
        return ids.astype(np.int64)

    def check(self, prompt_ids: np.ndarray, params: SamplingParams) -> None:
        """Raise RequestError unless a prompt of ``prompt_ids`` (int64 [prompt_len], from :meth:`encode_prompt`)
        with ``params`` (:class:`SamplingParams`) can be served by this cache."""
        size = int(prompt_ids.size)
        if size == 0:
            raise RequestError("the prompt is empty: give it at least one token")
        if size + params.max_tokens > self.max_seq_len:
            raise RequestError(f"the prompt has {size} tokens and {params.max_tokens} are to be generated, "
                               f"{size + params.max_tokens} in all, but a sequence holds at most {self.max_seq_len}: "
                               "shorten the prompt or ask for fewer tokens")
        max_seqs = self.scheduler.config.max_seqs
        if params.n > max_seqs:
            raise RequestError(f"n={params.n} samples but the cache holds at most {max_seqs} sequences")
        need = params.n * ceil_div(size + params.max_tokens, self.cache.block_size)
        capacity = self.cache.layout.max_blocks
        if need > capacity:
            raise RequestError(f"{params.n} samples of {size + params.max_tokens} tokens need up to {need} blocks, "
                               f"more than the cache's {capacity}: ask for fewer samples or tokens")

    # --- the loop -------------------------------------------------------------------------------------------

    def generate(self, prompts: Iterable, params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 chat: bool = True, on_token: Callable[[int, int, int], None] | None = None,
                 snapshot: str | os.PathLike | None = None) -> list[Completion]:
        """Complete every prompt; returns one :class:`Completion` per prompt, in order.

        Parameters
        ----------
        prompts : iterable of str or of token ids
            Strs (``chat``: in the model's chat format) or token ids (see :meth:`encode_prompt`); all are
            checked before any runs.
        params : SamplingParams or sequence of SamplingParams, optional
            One for all, or one per prompt (default: ``SamplingParams()``).
        chat : bool
            Strs in the model's chat format.
        on_token : callable, optional
            ``on_token(request, sample, token)`` for every generated token as its step ends (a streaming hook).
        snapshot : str or os.PathLike, optional
            Where the cache's snapshot is written just before the first sequence is freed, while every sequence
            is live (for ``pagedrt map``).

        A call that raises midway (``on_token`` raised, an interrupt) frees its sequences before it returns.
        """
        prompts = list(prompts)
        params = params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"{len(params)} sampling parameters for {len(prompts)} prompts: give one, or one each")
        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            ids = self.encode_prompt(prompt, chat=chat)
            self.check(ids, p)
            requests.append(_Request(ids, p.max_tokens, p.n, index=i, params=p, completion=Completion(int(ids.size)),
                                     seeds=sampler.seeds(p.seed, p.n)))
        self._rows.out = np.zeros((self._rows.out.shape[0], max((p.max_tokens for p in params), default=1)), np.int64)
        self._snapshot, self._on_token = snapshot, on_token
        for request in requests:
            self.scheduler.add(request)
        try:
            with self.model.stream:
                while not self.scheduler.idle:
                    self.step()
                self._drain()
        except BaseException:  # an on_token hook that raised, Ctrl-C: the next call starts from an empty cache
            handles = self.scheduler.clear()
            if handles:
                self.cache.step([], frees=handles)
            raise
        finally:
            self._snapshot = self._on_token = self._flight = None
            self._awaiting = []
        return [r.completion for r in requests]

    def step(self) -> None:
        """One scheduling decision, one ``cache.step()``, one forward pass and one sampling queued; then the
        tokens of the step before are read (with ``overlap``; else this step's)."""
        start, self._landing = time.perf_counter(), 0.0
        plan = self.scheduler.schedule()
        if plan.frees and self._snapshot:
            self.cache.write_snapshot(self._snapshot)
            self._snapshot = None
        decode = plan.handles[plan.decoding]
        prev = self._flight
        src = prev.where[decode] if prev is not None else np.full(decode.size, -1)  # draws of prev, or -1: known
        late = src >= 0
        args = plan.cache_args(self._rows.last[decode])  # a late row's id is a placeholder
        ids = args["token_ids"]
        if late.any():
            args["token_ids"] = None
        step = self.cache.step(**args)
        ended = self.scheduler.update(plan, step)
        if late.any():
            self._name_known(plan, ids, late)
        self._start_children(step.forked)
        ids = np.concatenate([ids] + [s.request.prompt[s.request.cached_tokens:s.prefilled] for s in plan.arrived])
        for request in plan.arrivals:
            request.completion.cached_tokens = request.cached_tokens
            self.stats.cached_tokens += request.cached_tokens
        self._flight = None
        if step.num_tokens:
            batch, size = step, step.num_tokens
            if size == len(step.seqs) and self._padding is not None:
                size = self._padding.size(size)
                batch = self._padding.pad(step, size) if size > step.num_tokens else step
            inputs = self._inputs(batch.num_tokens, plan, ids, src, late, prev)
            self._flight = self._draw(plan, decode, ended, self.model.forward(batch, inputs))
        if prev is not None:
            self._land(prev, (decode[late], src[late]))
        if not self._overlap:
            self._drain()
        self._account(start, step, decode.size, step.num_tokens - decode.size)

    def _name_known(self, plan, ids, late):
        """Give the prefix cache the ids of this step's rows that the host knows (prompt chunks, decode rows
        whose token it has read); ``ids``: the plan's, ``late``: which decoding rows' ids are still on the
        device."""
        known = ~plan.decoding
        known[plan.decoding] = ~late
        if known.any():
            self.cache.name_tokens(plan.handles[known], plan.counts[known], ids[np.repeat(known, plan.counts)])

    def _inputs(self, size, plan, ids, src, late, prev):
        """The step's input ids on the device (int64 [size], past ``ids``: padding rows'): ``ids``, the late
        rows' read from ``prev``'s draws ``src``; a batch that decodes ``prev``'s draws in order reads them in
        place."""
        n, xp = ids.size, self.cache.xp
        if n and late.all() and n == src.size and src[-1] == n - 1 and (np.diff(src) == 1).all():
            return prev.device[:size]
        padded = np.zeros(size, np.int64)
        padded[:n] = ids
        inputs = xp.asarray(padded)
        if late.any():
            rows = (np.cumsum(plan.counts) - plan.counts)[plan.decoding][late]
            inputs[xp.asarray(rows)] = prev.device[xp.asarray(src[late])]
        return inputs

    def _start_children(self, children):
        """The children forked this step: each starts from its first token, drawn when its prompt ended (and
        recorded once that step's tokens are read)."""
        if len(children):
            seqs = [self.scheduler.running[h] for h in children.tolist()]
            self._rows.start(seqs, 1)
            self._awaiting += seqs
            self._record_children()

    def _record_children(self):
        """Record the first token of each child awaiting it whose parent's step has been read."""
        ready = [s for s in self._awaiting if s.request.firsts is not None]
        if ready:
            self._awaiting = [s for s in self._awaiting if s.request.firsts is None]
            self._record(np.array([s.handle for s in ready], np.int64),
                         np.array([s.request.firsts[s.sample - 1] for s in ready], np.int64))

    def _draw(self, plan, decode, ended, logits):
        """Queue the draws of the next token of every decoding sequence and the first tokens of each prompt
        that ended now (``n`` of them, one per sample: the first is the sequence's own, the others its
        children's), on the device, and their copy to the host; returns the step's :class:`~.flight.Flight`."""
        r = self._rows
        rows, handles = [np.flatnonzero(plan.decoding)], [decode]
        seeds, counters = [r.seed[decode]], [r.drawn[decode]]
        own, forks = [np.arange(decode.size)], []
        if ended:
            r.start(ended, 0)
            row_of = {id(s): i for i, s in enumerate(plan.seqs + plan.arrived)}
            at = decode.size
            for seq in ended:
                n = seq.request.n
                rows.append(np.full(n, row_of[id(seq)]))
                handles.append(np.full(n, seq.handle))
                seeds.append(seq.request.seeds)
                counters.append(np.zeros(n, np.int64))
                own.append(np.array([at]))
                forks.append((seq.request, at, n))
                at += n
        handles, own = np.concatenate(handles), np.concatenate(own)
        temperature = r.temperature[handles]
        draws = (np.zeros(handles.size) if (temperature <= 0).all()
                 else sampler.uniforms(np.concatenate(seeds), np.concatenate(counters)))
        device = self._tokens.next(logits)
        sampler.sample(logits, np.concatenate(rows), temperature, r.top_p[handles], draws, device)
        host, event = self._tokens.send(handles.size)
        mine = handles[own]
        r.drawn[mine] += 1
        where = np.full(r.last.size, -1, np.int64)
        where[mine] = own
        return Flight(device, host, event, handles.size, mine, own, r.epoch[mine].copy(), forks, where,
                      bool(plan.decoding.all()) and not plan.arrivals)

    def _drain(self):
        """Read the last step's tokens, if the host has not yet."""
        flight, self._flight = self._flight, None
        if flight is not None:
            self._land(flight)

    def _land(self, flight, late=None):
        """Read ``flight``'s tokens: give the prefix cache the ids of ``late`` (handles, draws: the rows of the
        step after it that appended them), record each row's token unless its sample finished or the row started
        another since, and the first tokens of the children of the prompts that ended. The time it takes (the wait
        included) is ``flight``'s step's (:class:`Stats`)."""
        start = time.perf_counter()
        tokens = flight.tokens()
        if late is not None and late[0].size:
            self.cache.name_tokens(late[0], 1, tokens[late[1]])
        r = self._rows
        keep = (r.epoch[flight.handles] == flight.epoch) & ~r.done[flight.handles]
        for request, at, n in flight.forks:
            request.firsts = tokens[at + 1:at + n]
        self._record(flight.handles[keep], tokens[flight.index[keep]])
        if flight.decoding:
            self.stats.decode_tokens += int(keep.sum())
        self._record_children()
        seconds = time.perf_counter() - start
        self._landing += seconds
        if flight.decoding:
            self.stats.decode_seconds += seconds
        else:
            self.stats.prefill_seconds += seconds

    def _record(self, handles, tokens):
        """Append each handle's new token; finish those that stopped or reached their limit."""
        if not handles.size:
            return
        r = self._rows
        r.out[handles, r.count[handles]] = tokens
        r.count[handles] += 1
        r.last[handles] = tokens
        self.stats.generated_tokens += handles.size
        stopped = np.isin(tokens, self.stop_tokens)
        ended = stopped | (r.count[handles] >= r.limit[handles])
        if self._on_token is not None:
            for h, t in zip(handles.tolist(), tokens.tolist()):
                seq = self.scheduler.running[h]
                self._on_token(seq.request.index, seq.sample, t)
        for h, stop in zip(handles[ended].tolist(), stopped[ended].tolist()):
            self._finish(self.scheduler.running[h], "stop" if stop else "length")

    def _finish(self, seq, reason):
        """Record a finished sample's tokens and text (without its stop token); free its sequence next step."""
        self._rows.done[seq.handle] = True
        c, s, count = seq.request.completion, seq.sample, int(self._rows.count[seq.handle])
        while len(c.tokens) <= s:
            c.tokens.append(None), c.texts.append(None), c.finish_reasons.append(None)
        ids = self._rows.out[seq.handle, :count - (reason == "stop")].copy()
        c.tokens[s], c.texts[s], c.finish_reasons[s] = ids, self.tokenizer.decode(ids), reason
        self.scheduler.finish(seq)

    def _account(self, start, step, decode_tokens, prompt_tokens):
        """Count ``step`` (begun at ``start``) and its turn's wall time but the reading of tokens (``_land``, which
        counts its own)."""
        s = self.stats
        seconds = time.perf_counter() - start - self._landing
        s.steps += 1
        s.max_batch = max(s.max_batch, len(step.seqs))
        if prompt_tokens:
            s.prefill_steps += 1
            s.prefill_seconds += seconds
            s.prompt_tokens += prompt_tokens
        elif decode_tokens:  # its tokens are counted as they are read (a sequence's extra step's are not)
            s.decode_steps += 1
            s.decode_seconds += seconds

    def warm_up(self) -> None:
        """Run a prompt step and two decode steps of one short sequence through the model and the greedy
        sampler, then free it: the kernels of one sequence are compiled or loaded (on first use, by CuPy) and its
        decode step captured as a graph before the steps that are timed. Other batch sizes may still compile
        kernels of their own."""
        ids = np.zeros(4, np.int64)
        with self.model.stream:
            step = self.cache.step([], arrivals=[ids[:2]])  # two prompt tokens: the prefill path
            self.model.forward(step, self.cache.xp.asarray(ids[:2]))
            seq = step.arrived.tolist()
            for token in (ids[2:3], ids[3:4]):  # an eager decode step, then one captured
                step = self.cache.step(seq, 1, token)
                logits = self.model.forward(step, self.cache.xp.asarray(token))
            sampler.sample(logits, [0], [0.0], [1.0], [0.0])  # the greedy sampler's kernel
            self.cache.step([], frees=seq)

    def close(self) -> None:
        """Close the cache (its memory goes back)."""
        self.cache.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
