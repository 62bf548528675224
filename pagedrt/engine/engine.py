"""Text generation with continuous batching over one :class:`~pagedrt.PagedKVCache`: the generate loop.

One :meth:`Engine.step` is one ``cache.step()`` and one model forward:

- **frees**: sequences that finished in the last step;
- **forks**: a request with ``n > 1`` samples runs its prompt once; when the prompt's last token is computed,
  ``n`` first tokens are drawn from its logits, and the next step forks the sequence ``n - 1`` times. The
  children share every prompt block; the first token each side appends to a shared, partly filled block is
  copied on write (``step.copies``);
- **decode**: every sequence that has a token to append appends it;
- **prefill**: the token budget left (``step_tokens`` less the decode tokens) goes to prompt chunks, sequences
  already prefilling first, then new arrivals in order. ``cache.step()`` starts each arrival holding the cached
  blocks its prompt begins with (the prefix cache), so only the rest is computed. An arrival whose first
  block equals that of another arrival in the same step, and of none in an earlier step, waits one step, so
  that it finds the other's blocks cached;
- an arrival is admitted only while the blocks every live sequence may still need, counted as if none were
  shared, fit in the blocks available: no step runs out of blocks.

Per-sequence state lives in NumPy arrays indexed by the cache's handles, updated vectorised per step; a Python
loop runs per event (an arrival, a fork, a finished sequence), never per generated token.
"""

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..cache import PagedKVCache
from ..shard import ShardedKVCache
from ..errors import RequestError
from . import loader, sampler
from .model import LlamaModel
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
    """Counters of the steps run so far: tokens, and wall time of steps with prompt tokens and without."""

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


@dataclass
class _Request:
    prompt: np.ndarray
    params: SamplingParams
    completion: Completion
    seeds: np.ndarray          # one stream seed per sample


class Engine:
    """A model from a GGUF file, its tokenizer and a paged KV cache, and the loop that generates with them.

    ``backend``: the cache's ("auto", "cuda", "host"); ``max_seqs``: sequences at once; ``kv_tokens``: the
    cache's capacity (address space reserved; memory is mapped as blocks are used); ``step_tokens``: the most
    new tokens one step computes (decode tokens and prompt chunks); ``graphs``: decode steps as CUDA graphs.
    ``kv_dtype``: what the cache stores (default: ``dtype``), or ``"float8_e4m3"``: K and V as float8 e4m3 with
    a scale of 1 per layer and KV head (what engines use without a calibration pass), half the cache's bytes;
    the model's head_dim must then be 64 or 128. ``devices`` (device ordinals, default None: one cache on the
    current device): the cache sharded by KV heads over them and the model run tensor-parallel
    (:class:`~pagedrt.shard.ShardedKVCache`, :class:`~pagedrt.engine.parallel.TensorParallelModel`: its sums
    through NCCL over distinct GPUs; its steps run eagerly, whatever ``graphs`` says).
    """

    def __init__(self, model_path, *, backend="auto", max_seqs=256, kv_tokens=DEFAULT_KV_TOKENS, block_size=16,
                 step_tokens=2048, graphs=True, dtype="float16", kv_dtype=None, devices=None):
        gguf = loader.load(model_path)
        self.config, self.path = gguf.config, gguf.path
        self.tokenizer = Tokenizer(gguf.vocab)
        c = self.config
        self.max_seq_len = min(c.context_length, kv_tokens)
        self.step_tokens = step_tokens
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
        rows = max_seqs
        self._request_of = np.full(rows, -1, np.int64)   # handle -> request index
        self._sample_of = np.zeros(rows, np.int64)       # handle -> sample index in its request
        self._count = np.zeros(rows, np.int64)           # handle -> tokens generated
        self._limit = np.zeros(rows, np.int64)           # handle -> max_tokens
        self._last = np.zeros(rows, np.int64)            # handle -> the token to append next
        self._decoding = np.zeros(rows, bool)            # handle -> has a token to append
        self._temperature = np.zeros(rows)
        self._top_p = np.ones(rows)
        self._seed = np.zeros(rows, np.uint64)
        self._final = np.zeros(rows, np.int64)           # handle -> its length when it is done at the latest
        self.stats = Stats()

    # --- requests -----------------------------------------------------------------------------

    def encode_prompt(self, prompt, *, chat=True):
        """Token ids of ``prompt`` (a str, or token ids as they are); ``chat``: in the model's chat format
        (ChatML, with its default system prompt) when its template is ChatML."""
        if not isinstance(prompt, str):
            return np.asarray(prompt, np.int64)
        if not prompt:
            raise RequestError("the prompt is empty: give it some text")
        template = self.tokenizer.vocab.chat_template
        if chat and "<|im_start|>" in template:
            from .chat import chatml
            prompt = chatml(prompt, template)
            return self.tokenizer.encode(prompt, special=True, limit=self.max_seq_len)
        return self.tokenizer.encode(prompt, limit=self.max_seq_len)

    def check(self, prompt_ids, params):
        """Raise RequestError unless a prompt of these ids with ``params`` can be served by this cache."""
        size = int(prompt_ids.size)
        if size == 0:
            raise RequestError("the prompt is empty: give it at least one token")
        if prompt_ids.ndim != 1 or prompt_ids.min() < 0 or prompt_ids.max() >= self.config.vocab_size:
            raise RequestError(f"prompt token ids must be a 1-D array of ids in [0, {self.config.vocab_size})")
        if size + params.max_tokens > self.max_seq_len:
            raise RequestError(f"the prompt has {size} tokens and {params.max_tokens} are to be generated, "
                               f"{size + params.max_tokens} in all, but a sequence holds at most {self.max_seq_len}: "
                               "shorten the prompt or ask for fewer tokens")
        if params.n > self._request_of.size:
            raise RequestError(f"n={params.n} samples but the cache holds at most {self._request_of.size} sequences")
        need = params.n * self._blocks(size + params.max_tokens)
        capacity = self.cache.layout.max_blocks
        if need > capacity:
            raise RequestError(f"{params.n} samples of {size + params.max_tokens} tokens need up to {need} blocks, "
                               f"more than the cache's {capacity}: ask for fewer samples or tokens")

    def _blocks(self, tokens):
        return -(-np.asarray(tokens, np.int64) // self.cache.block_size)

    # --- the loop -------------------------------------------------------------------------------------------

    def generate(self, prompts, params=None, *, chat=True, on_token=None, snapshot=None):
        """Complete every prompt; returns one :class:`Completion` per prompt, in order.

        ``prompts``: strs (``chat``: in the model's chat format) or token id arrays. ``params``: one
        :class:`SamplingParams` for all, or one per prompt. ``on_token(request, sample, token)`` is called for
        every generated token as its step ends (a streaming hook). ``snapshot``: a path the cache's snapshot is
        written to just before the first sequence is freed, while every sequence is live (for ``pagedrt map``).
        """
        prompts = list(prompts)
        params = params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"{len(params)} sampling parameters for {len(prompts)} prompts: give one, or one each")
        requests = []
        for prompt, p in zip(prompts, params):
            ids = self.encode_prompt(prompt, chat=chat)
            self.check(ids, p)
            requests.append(_Request(ids, p, Completion(int(ids.size)), sampler.seeds(p.seed, p.n)))
        self._requests = requests
        self._out = np.zeros((self._request_of.size, max((p.max_tokens for p in params), default=1)), np.int64)
        self._waiting = deque(range(len(requests)))
        self._prefilling = {}     # handle -> its prompt tokens in the cache, in arrival order
        self._forks = []          # (parent handle, first tokens of its children): forked next step
        self._to_free = []
        self._firsts = set()      # the first blocks of the prompts that arrived in earlier steps
        self._snapshot, self._on_token = snapshot, on_token
        with self.model.stream:
            while self._waiting or self._prefilling or self._decoding.any() or self._forks or self._to_free:
                self.step()
        return [r.completion for r in requests]

    def step(self):
        """One scheduling decision, one ``cache.step()``, one forward pass and one sampling."""
        start = time.perf_counter()
        parents = {p for p, _ in self._forks}
        frees = [h for h in self._to_free if h not in parents]  # a parent is freed after its fork
        self._to_free = [h for h in self._to_free if h in parents]
        if frees and self._snapshot:
            self.cache.write_snapshot(self._snapshot)
            self._snapshot = None
        forks = [p for p, firsts in self._forks for _ in firsts]
        decode = np.flatnonzero(self._decoding)
        budget = self.step_tokens - decode.size
        chunks = {}
        for handle, done in self._prefilling.items():
            chunk = min(self._requests[self._request_of[handle]].prompt.size - done, budget)
            if chunk <= 0:
                break
            chunks[handle], budget = chunk, budget - chunk
        arrivals = self._admit(budget, len(forks) - len(frees))
        seqs = np.array([*decode.tolist(), *chunks], np.int64)
        counts = np.array([1] * decode.size + list(chunks.values()), np.int64)
        ids = [self._last[decode]] + [self._prompt(h)[self._prefilling[h]:][:c] for h, c in chunks.items()]
        step = self.cache.step(seqs, counts, np.concatenate(ids), forks=forks, frees=frees,
                               arrivals=[self._requests[r].prompt for r, _ in arrivals],
                               arrival_tokens=[c for _, c in arrivals] or None)
        self._request_of[frees] = -1
        self._start_children(step.forked)
        for h, c in chunks.items():
            self._prefilling[h] += c
        for i, ((r, _), handle) in enumerate(zip(arrivals, step.arrived.tolist())):
            cached, chunk = int(step.cached[i]), int(step.query_lens[seqs.size + i])
            self._requests[r].completion.cached_tokens = cached
            self._request_of[handle], self._sample_of[handle] = r, 0
            self._final[handle] = self._requests[r].prompt.size + self._requests[r].params.max_tokens
            self._prefilling[handle] = cached + chunk
            ids.append(self._requests[r].prompt[cached:cached + chunk])
            self.stats.cached_tokens += cached
        if step.num_tokens:
            logits = self.model.forward(step, self.cache.xp.asarray(np.concatenate(ids)))
            self._sample(step, decode, logits)
        self._account(start, step, decode.size, step.num_tokens - decode.size)

    def _prompt(self, handle):
        return self._requests[self._request_of[handle]].prompt

    def _admit(self, budget, more_rows):
        """(request, prompt tokens it may append now) of the requests that arrive this step, in order: while the
        budget, the block table's rows and the blocks every live sequence may still need allow, and while no two
        begin with the same block that no earlier step's arrival began with (the later one waits a step, to find
        the earlier one's blocks cached; once one arrived, the others that begin alike arrive together)."""
        if not self._waiting or budget <= 0:
            return []
        live = np.flatnonzero(self._request_of >= 0)
        rows_free = self._request_of.size - live.size - max(more_rows, 0)
        need = int((self._blocks(self._final[live]) - self._blocks(self.cache.lengths(live))).sum())
        need += sum(len(firsts) * int(self._blocks(self._final[p])) for p, firsts in self._forks)
        available = self.cache.num_available_blocks
        admitted, firsts = [], set()
        while self._waiting and budget > 0:
            req = self._requests[self._waiting[0]]
            first = req.prompt[:self.cache.block_size].tobytes()
            blocks = req.params.n * int(self._blocks(req.prompt.size + req.params.max_tokens))
            repeated = first in firsts and first not in self._firsts
            if rows_free < req.params.n or need + blocks > available or repeated:
                break
            chunk = min(req.prompt.size, budget)
            admitted.append((self._waiting.popleft(), chunk))
            firsts.add(first)
            need, rows_free, budget = need + blocks, rows_free - req.params.n, budget - chunk
        self._firsts |= firsts
        return admitted

    def _start_children(self, children):
        """The children forked this step: each starts from its first token, drawn when its prompt ended."""
        if len(children):
            parents = np.array([p for p, firsts in self._forks for _ in firsts], np.int64)
            samples = np.concatenate([np.arange(1, len(firsts) + 1) for _, firsts in self._forks])
            children = np.asarray(children, np.int64)
            for name in ("_request_of", "_limit", "_temperature", "_top_p", "_final"):
                array = getattr(self, name)
                array[children] = array[parents]
            self._sample_of[children] = samples
            self._seed[children] = [self._requests[r].seeds[s] for r, s in zip(self._request_of[children], samples)]
            self._count[children] = 0
            self._record(children, np.array([t for _, firsts in self._forks for t in firsts], np.int64))
        self._forks = []

    def _sample(self, step, decode, logits):
        """Draw the next token of every decoding sequence, and the first tokens of each prompt finished now
        (``n`` of them, one per sample: the first is the sequence's own, the others its children's)."""
        rows, handles, seeds, counters = [np.arange(decode.size)], [decode], [self._seed[decode]], [self._count[decode]]
        ended = []  # (handle, samples) of the prompts finished this step
        for i, h in enumerate(step.seqs[decode.size:].tolist(), decode.size):
            req = self._requests[self._request_of[h]]
            if self._prefilling[h] < req.prompt.size:
                continue
            del self._prefilling[h]
            p = req.params
            self._limit[h], self._temperature[h], self._top_p[h] = p.max_tokens, p.temperature, p.top_p
            self._seed[h], self._count[h] = req.seeds[0], 0
            rows.append(np.full(p.n, i))
            handles.append(np.full(p.n, h))
            seeds.append(req.seeds)
            counters.append(np.zeros(p.n, np.int64))
            ended.append((h, p.n))
        handles = np.concatenate(handles)
        tokens = sampler.sample(logits, np.concatenate(rows), self._temperature[handles], self._top_p[handles],
                                sampler.uniforms(np.concatenate(seeds), np.concatenate(counters)))
        self._record(decode, tokens[:decode.size])
        at = decode.size
        for h, n in ended:
            self._record(np.array([h]), tokens[at:at + 1])
            if n > 1:
                self._forks.append((h, tokens[at + 1:at + n].tolist()))
            at += n

    def _record(self, handles, tokens):
        """Append each handle's new token; finish those that stopped or reached their limit."""
        if not handles.size:
            return
        self._out[handles, self._count[handles]] = tokens
        self._count[handles] += 1
        self._last[handles] = tokens
        self.stats.generated_tokens += handles.size
        stopped = np.isin(tokens, self.stop_tokens)
        ended = stopped | (self._count[handles] >= self._limit[handles])
        self._decoding[handles] = ~ended
        if self._on_token is not None:
            for h, t in zip(handles.tolist(), tokens.tolist()):
                self._on_token(int(self._request_of[h]), int(self._sample_of[h]), t)
        for h, stop in zip(handles[ended].tolist(), stopped[ended].tolist()):
            self._finish(h, "stop" if stop else "length")

    def _finish(self, handle, reason):
        """Record a finished sample's tokens and text (without its stop token); free its sequence next step."""
        c = self._requests[self._request_of[handle]].completion
        s, count = int(self._sample_of[handle]), int(self._count[handle])
        while len(c.tokens) <= s:
            c.tokens.append(None), c.texts.append(None), c.finish_reasons.append(None)
        ids = self._out[handle, :count - (reason == "stop")].copy()
        c.tokens[s], c.texts[s], c.finish_reasons[s] = ids, self.tokenizer.decode(ids), reason
        self._to_free.append(handle)

    def _account(self, start, step, decode_tokens, prompt_tokens):
        s = self.stats
        seconds = time.perf_counter() - start
        s.steps += 1
        s.max_batch = max(s.max_batch, len(step.seqs))
        if prompt_tokens:
            s.prefill_steps += 1
            s.prefill_seconds += seconds
            s.prompt_tokens += prompt_tokens
        elif decode_tokens:
            s.decode_steps += 1
            s.decode_seconds += seconds
            s.decode_tokens += decode_tokens

    def warm_up(self):
        """Run a prompt step and two decode steps of one short sequence through the model, then free it: the
        kernels of one sequence are compiled or loaded (on first use, by CuPy) and its decode step captured as a
        graph before the steps that are timed. Other batch sizes may still compile kernels of their own."""
        ids = np.zeros(4, np.int64)
        with self.model.stream:
            step = self.cache.step([], arrivals=[ids[:2]])  # two prompt tokens: the prefill path
            self.model.forward(step, self.cache.xp.asarray(ids[:2]))
            seq = step.arrived.tolist()
            for token in (ids[2:3], ids[3:4]):  # an eager decode step, then one captured
                step = self.cache.step(seq, 1, token)
                self.model.forward(step, self.cache.xp.asarray(token))
            self.cache.step([], frees=seq)

    def close(self):
        self.cache.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
