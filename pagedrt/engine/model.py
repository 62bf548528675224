"""A Llama-family model's forward pass over pagedrt's paged KV cache: one call per engine step.

:meth:`LlamaModel.forward` takes a :class:`~pagedrt.step.Step` (from ``cache.step()``)
and the step's new token ids, and returns the logits of each batch row's last token.
Per layer: RMSNorm, one GEMM for Q, K and V, rotary embeddings (each token at its
position, found on the device from the step's query offsets and KV lengths) fused with
the new K/V's write into the cache through the step's slot mapping (:class:`RopeWritePlan`),
paged attention through the step's block tables (``attention.DecodePlan`` when every
row has one new token, else ``attention.PrefillPlan``: prompts, prompt chunks after
cached tokens, mixed batches), the output projection, then RMSNorm and SwiGLU (one
GEMM for gate and up). The residual stream is float32; weights and activations are the
cache's dtype on a GPU, float64 on the host (where q, k and v are cast to the cache's
dtype for the attention references). Over an FP8 cache (``cache.spec.is_fp8``) the
write quantises and the attention dequantises with the layer's scales
(``cache.k_scale(layer)``, ``cache.v_scale(layer)``); q, k and v stay in the model's dtype.

Decode steps on a GPU run as CUDA graphs, one per batch size (the step's arrays are
fixed buffers, so a graph captured over one step reads each later step's): the first
decode step of a batch size runs eagerly, the second of that size in a row makes its
plans, runs and captures them, and later ones replay. A graph's plans were checked
when it was captured; replays trust the tables and slots ``cache.step()`` wrote since.
A decode step of at most ``fused.MAX_ROWS`` rows runs as one launch instead
(:class:`~pagedrt.engine.fused.FusedDecode`, the same arithmetic), unless the model was made with
``fused=False`` or :func:`~pagedrt.engine.fused.unsupported` names a reason (an FP8 cache, say).
Decode steps of 9 to 64 rows (``layer_gemm.step_rows_fit``) run the layers with :mod:`.layer_gemm`'s GEMMs,
which fuse the norms, SwiGLU and the residual adds (six launches a layer instead of nine), unless the model
was made with ``fused=False`` (tensor-parallel shards are: their o and down outputs are summed over the shards
before the residual add) or :func:`~pagedrt.engine.layer_gemm.unsupported` names a reason. Prefill steps keep
cuBLAS.
"""

import contextlib
from collections import OrderedDict
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, Optional, Tuple, Union

import numpy as np

from .. import attention, kernels
from ..errors import UnsupportedModelError
from ..protocols import KVPlanes
from ..spec import Array
from ..step import Step
from . import fused as fused_step
from . import layer_gemm, ops
from .loader import GGUFModel
from .rope_write import RopeWritePlan

if TYPE_CHECKING:  # pagedrt.engine.parallel imports this module
    from .parallel import _ShardModel

MAX_GRAPHS = 8  # decode graphs kept (one per batch size), least recently used dropped first


class LlamaModel:
    """The weights of a :class:`~pagedrt.engine.loader.GGUFModel` on the cache's device, and its forward pass."""

    def __init__(self, model: Union[GGUFModel, "_ShardModel"], cache: KVPlanes, *, graphs: bool = True,
                 fused: bool = True) -> None:
        c = self.config = model.config
        if (cache.num_layers, cache.num_kv_heads, cache.head_dim) != (c.num_layers, c.kv_heads, c.head_dim):
            raise UnsupportedModelError(
                f"the cache holds {cache.num_layers} layers of {cache.num_kv_heads} KV heads x {cache.head_dim} but "
                f"the model has {c.num_layers} of {c.kv_heads} x {c.head_dim}")
        self.cache, self.xp = cache, cache.xp
        host = self.xp is np
        spec = cache.spec  # what the cache holds: q, k, v in spec.dtype; the planes in spec.kv_dtype
        self.qkv_dtype = spec.dtype  # q, k, v and the attention output: what the write and attention take
        self.act_dtype = np.dtype(np.float64) if host else spec.dtype  # the activations' (weights' too)
        w = model.weights
        put = lambda a, dtype: self.xp.asarray(np.ascontiguousarray(a, dtype))  # noqa: E731
        act, f32 = self.act_dtype, np.float32
        self.embedding = put(w.embedding, act)
        self.output = self.embedding if w.output is w.embedding else put(w.output, act)  # [vocab, hidden]
        self.output_norm = put(w.output_norm, f32)
        self.layers = [{"attn_norm": put(x["attn_norm"], f32), "ffn_norm": put(x["ffn_norm"], f32),
                        "qkv": put(x["qkv"], act), "o": put(x["o"], act), "gate_up": put(x["gate_up"], act),
                        "down": put(x["down"], act)} for x in w.layers]
        exponents = np.arange(0, c.head_dim, 2, dtype=np.float64) / c.head_dim
        self.inv_freq = put(c.rope_scale * c.rope_theta ** -exponents, f32)
        self.stream = contextlib.nullcontext() if host else self.xp.cuda.Stream(non_blocking=True)
        self._graphs = None if host or not graphs else OrderedDict()  # batch size -> _Graph
        self._last_decode = 0  # the batch size of the last decode step
        use_fused = (fused and not host and fused_step.unsupported(
            c, spec, *layer_gemm.device_limits(self.xp.cuda.Device().id)) is None)
        self.fused = fused_step.FusedDecode(self) if use_fused else None  # decode steps of <= MAX_ROWS rows
        self.fused_gemms = fused and not host and layer_gemm.unsupported(
            c, spec, *layer_gemm.device_limits(self.xp.cuda.Device().id)) is None  # larger decode steps: layer_gemm's GEMMs
        if not host:  # a non-blocking stream: it waits for what came before it (the weights, the cache's buffers)
            self.stream.wait_event(self.xp.cuda.get_current_stream().record())

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one step reads (the output projection's once, even when tied to the embedding)."""
        arrays = [self.output, self.output_norm] + [a for layer in self.layers for a in layer.values()]
        return sum(int(a.nbytes) for a in arrays)

    def graph(self, batch: int) -> Optional["_Graph"]:
        """The captured decode step of batch size ``batch`` (its ``graph``, ``stream``, input ``ids``, ``buffers``
        and ``plans``), or None."""
        return None if self._graphs is None else self._graphs.get(batch)

    def forward(self, step: Step, ids: Array) -> Array:
        """Logits (float32 [batch, vocab], valid until the next call) of each batch row's last new token.

        ``ids``: the step's new token ids (int64 [step.num_tokens], on the cache's device), batch row by batch
        row. Copies ``step.copies`` first (copy-on-write). Run it on :attr:`stream` (``with model.stream:``),
        the stream ``cache.step()`` uploaded the step on.
        """
        if len(step.copies):
            kernels.copy_blocks(self.cache.planes, step.copies)
        n, batch = step.num_tokens, len(step.seqs)
        decode = n == batch
        if decode and self._graphs is not None:
            graph = self._graphs.get(batch)
            if graph is not None:
                self._graphs.move_to_end(batch)
                return graph.replay(ids)
            if self._last_decode == batch:
                return self._capture(step, ids)
        self._last_decode = batch if decode else 0
        buffers = self.buffers(n, batch)
        self._run(step, ids, buffers, *self.plans(step, buffers, decode))
        return buffers["logits"]

    def buffers(self, n: int, batch: int) -> Dict[str, Array]:
        """Every activation of a step of ``n`` tokens in ``batch`` rows."""
        c, xp, act, kv = self.config, self.xp, self.act_dtype, self.qkv_dtype
        d = c.head_dim
        shapes = {"residual": ((n, c.hidden), np.float32), "h": ((n, c.hidden), act),
                  "qkv": ((n, (c.q_heads + 2 * c.kv_heads) * d), act), "q": ((n, c.q_heads, d), kv),
                  "attn": ((n, c.q_heads, d), kv),
                  "delta": ((n, c.hidden), act), "gate_up": ((n, 2 * c.ffn), act), "mlp": ((n, c.ffn), act),
                  "last": ((batch, c.hidden), act), "logits": ((batch, c.vocab_size), np.float32)}
        return {name: xp.empty(shape, dtype) for name, (shape, dtype) in shapes.items()}

    def plans(self, step: Step, buffers: Dict[str, Array],
              decode: bool) -> Tuple[Union[attention.DecodePlan, attention.PrefillPlan], RopeWritePlan]:
        """The step's attention plan and rotary + K/V write plan (checked once, run per layer)."""
        q, k0 = buffers["q"], self.cache.k(0)
        if decode:
            plan = attention.DecodePlan(q, k0, step.block_tables, step.seq_lens)
        else:
            plan = attention.PrefillPlan(q, k0, step.block_tables, step.seq_lens, step.qo_indptr,
                                         query_lens=step.query_lens)
        return plan, RopeWritePlan(buffers["qkv"], q, k0, step.slot_mapping, step.qo_indptr, step.seq_lens,
                                   self.inv_freq)

    def _run(self, step, ids, b, plan, writer):
        """Every layer of one step; allocates nothing (a CUDA graph can capture it)."""
        for _, launch in self.launches(step, ids, b, plan, writer):
            launch()

    def launches(self, step: Step, ids: Array, b: Dict[str, Array],
                 plan: Union[attention.DecodePlan, attention.PrefillPlan],
                 writer: RopeWritePlan) -> Iterator[Tuple[str, Callable[[], Any]]]:
        """The step's launches in order, as (kind, call) pairs: what :meth:`forward` runs, and what the benchmark
        times kind by kind. ``b``: the step's buffers; ``plan``, ``writer``: its attention and rotary + write plans."""
        c = self.config
        n = step.num_tokens
        if self.fused is not None and n == len(step.seqs) <= fused_step.MAX_ROWS:
            yield "fused_step", partial(self.fused.run, step, ids, b["logits"])
            return
        yield "embed", partial(ops.embed, ids, self.embedding, b["residual"])
        fused_gemms = self.fused_gemms and n == len(step.seqs) and layer_gemm.step_rows_fit(n)
        delta = yield from (self._fused_layers if fused_gemms else self._layers)(n, b, plan, writer)
        yield "rms_norm", partial(ops.add_rms_norm, b["residual"], delta, self.output_norm, b["last"], c.rms_eps,
                                  rows=step.qo_indptr)
        yield "gemm_logits", partial(ops.gemm, b["last"], self.output, b["logits"])

    def _scales(self, layer):
        cache = self.cache
        return {"k_scale": cache.k_scale(layer), "v_scale": cache.v_scale(layer)} if cache.spec.is_fp8 else {}

    def _layers(self, n, b, plan, writer):
        """Every layer's launches, the GEMMs cuBLAS's; returns the last layer's output, which the final norm adds."""
        c, cache, eps = self.config, self.cache, self.config.rms_eps
        attn = b["attn"].reshape(n, c.q_heads * c.head_dim)  # hidden, but for a tensor-parallel shard
        delta = None
        for layer, w in enumerate(self.layers):
            k, v, scales = cache.k(layer), cache.v(layer), self._scales(layer)
            yield "rms_norm", partial(ops.add_rms_norm, b["residual"], delta, w["attn_norm"], b["h"], eps)
            yield "gemm_qkv", partial(ops.gemm, b["h"], w["qkv"], b["qkv"])
            yield "rope_write", partial(writer.run, b["qkv"], b["q"], k, v, **scales)
            yield "attention", partial(plan.run, b["q"], k, v, out=b["attn"], **scales)
            yield "gemm_o", partial(ops.gemm, attn, w["o"], b["delta"])
            yield "rms_norm", partial(ops.add_rms_norm, b["residual"], b["delta"], w["ffn_norm"], b["h"], eps)
            yield "gemm_gate_up", partial(ops.gemm, b["h"], w["gate_up"], b["gate_up"])
            yield "silu_mul", partial(ops.silu_mul, b["gate_up"], b["mlp"])
            yield "gemm_down", partial(ops.gemm, b["mlp"], w["down"], b["delta"])
            delta = b["delta"]
        return delta

    def _fused_layers(self, n, b, plan, writer):
        """Every layer's launches of a decode step, the norms, the rotary embeddings + K/V write, SwiGLU and the
        residual adds inside the GEMMs (:mod:`.layer_gemm`); returns None: the residual holds every layer's
        output."""
        c, cache, eps = self.config, self.cache, self.config.rms_eps
        attn = b["attn"].reshape(n, c.q_heads * c.head_dim)
        for layer, w in enumerate(self.layers):
            k, v, scales = cache.k(layer), cache.v(layer), self._scales(layer)
            yield "norm_gemm_qkv_rope_write", partial(layer_gemm.norm_gemm_rope_write, b["residual"], w["attn_norm"],
                                                      w["qkv"], writer, b["q"], k, v, eps, **scales)
            yield "attention", partial(plan.run, b["q"], k, v, out=b["attn"], **scales)
            yield "gemm_o_add", partial(layer_gemm.gemm_add, attn, w["o"], b["residual"])
            yield "norm_gemm_gate_up_silu", partial(layer_gemm.norm_gemm_silu, b["residual"], w["ffn_norm"],
                                                    w["gate_up"], b["mlp"], eps)
            yield "gemm_down_add", partial(layer_gemm.gemm_add, b["mlp"], w["down"], b["residual"])
        return None

    def _capture(self, step, ids):
        """Run this decode step, then capture it as the graph of its batch size; returns its logits."""
        batch = step.num_tokens
        buffers = self.buffers(batch, batch)
        fixed_ids = self.xp.empty(batch, np.int64)
        fixed_ids[...] = ids
        plans = self.plans(step, buffers, True)
        self._run(step, fixed_ids, buffers, *plans)
        stream = self.xp.cuda.get_current_stream()
        stream.begin_capture()
        try:
            self._run(step, fixed_ids, buffers, *plans)
        finally:
            graph = stream.end_capture()
        self._graphs[batch] = _Graph(graph, stream, fixed_ids, buffers, plans)
        if len(self._graphs) > MAX_GRAPHS:
            self._graphs.popitem(last=False)
        return buffers["logits"]


class _Graph:
    """A captured decode step: the graph, its fixed input ids, its buffers and the plans it runs (kept alive)."""

    def __init__(self, graph, stream, ids, buffers, plans):
        self.graph, self.stream, self.ids, self.buffers, self.plans = graph, stream, ids, buffers, plans

    def replay(self, ids):
        self.ids[...] = ids
        self.graph.launch(self.stream)
        return self.buffers["logits"]
