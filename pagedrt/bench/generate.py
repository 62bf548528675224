"""Decode steps of a whole model (SmolLM2-135M by default) on pagedrt: tokens/s, step time against its floor, and
where the time goes.

    python3 -m pagedrt.bench.generate [--model PATH | --synthetic] [--batches 1,256] [--context 512] [--steps 32]
                                      [--peers generate_peers.json]

Per batch size: every sequence's prompt of ``--context`` random tokens is prefilled
(``cache.step`` arrivals, ``PrefillPlan``), then greedy decode steps run as the
engine's overlapped loop runs them (``cache.step`` -> the model's forward, a CUDA
graph per batch size -> argmax on the device into the next step's ids -> the tokens
copied back asynchronously, read a step later). Reported per batch size:

- ``step ms``: the GPU time of one decode step (its graph replayed, CUDA events, median);
- ``loop ms``: wall time of a step of that loop (the host's least: ``cache.step``, the forward's launches, the
  sampler, the copy back);
- ``e2e ms`` and ``tok/s``: wall time of a decode step of :class:`~pagedrt.engine.Engine` (scheduler, cache
  step, forward, sampling, bookkeeping, steps overlapped) generating for the batch's prompts, and the batch's
  tokens per second at that pace; ``plain ms``: the same with each step waiting for its tokens
  (``overlap=False``). Only with a model file (the engine needs its vocabulary): with ``--synthetic`` they are
  ``-`` and tok/s is the loop's;
- ``floor ms``: the larger of the memory floor (weight bytes + the step's K/V bytes at the read-only streaming
  ceiling) and the compute floor (the GEMMs' FLOPs at the dense fp16 rate), both ceilings measured in this run
  (``mem ms``, ``gemm ms``); ``x floor`` = step / floor.

Then a breakdown of the decode step: each kind of launch (a GEMM, attention, the K/V write, the norms ...) of
all layers captured alone as a graph and timed the same way, against the whole step; and, given ``--peers``
(the JSON ``shared/peers/peer_generate.py --out DIR`` writes, run beside this), the peers' step times of the
same batch and context beside ours.

``--synthetic`` (the default when the model file is absent) uses random weights of SmolLM2-135M's shape: a
decode step's time depends on the shapes, not on the values.
"""

import json
import re
import statistics
import time

import numpy as np

from .. import PagedKVCache
from . import harness

COLUMNS = (
    harness.Column("batch", "batch", width=5),
    harness.Column("context", "context", width=7),
    harness.Column("step_ms", "step ms", "{:.3f}"),
    harness.Column("loop_ms", "loop ms", "{:.3f}"),
    harness.Column("e2e_ms", "e2e ms", "{:.3f}"),
    harness.Column("plain_ms", "plain ms", "{:.3f}", 9),
    harness.Column("tokens_s", "tok/s", "{:,.0f}", 9),
    harness.Column("mem_ms", "mem ms", "{:.3f}"),
    harness.Column("gemm_ms", "gemm ms", "{:.3f}"),
    harness.Column("floor_ms", "floor ms", "{:.3f}", 9),
    harness.Column("x_floor", "x floor", "{:.2f}", 7),
)
KIND_COLUMNS = (
    harness.Column("batch", "batch", width=5),
    harness.Column("kind", "kind", width=13, left=True),
    harness.Column("launches", "launches", width=8),
    harness.Column("us", "us", "{:.1f}"),
    harness.Column("pct", "% step", "{:.1f}", 6),
)
PEER_COLUMNS = (
    harness.Column("batch", "batch", width=5),
    harness.Column("context", "context", width=7),
    harness.Column("peer", "peer", width=24, left=True),
    harness.Column("step_ms", "step ms", "{:.3f}"),
    harness.Column("ours_ms", "ours ms", "{:.3f}"),
    harness.Column("ratio", "ours/peer", "{:.2f}", 9),
)
SMOLLM2 = dict(name="SmolLM2-135M shape, random weights", num_layers=30, hidden=576, ffn=1536, q_heads=9,
               kv_heads=3, head_dim=64, vocab_size=49152, context_length=8192, rope_theta=100000.0, rope_scale=1.0,
               rms_eps=1e-5)


def synthetic_model(seed=0):
    """A :class:`~pagedrt.engine.loader.GGUFModel` of SmolLM2-135M's shape with random weights (no vocabulary)."""
    from ..engine.config import ModelConfig
    from ..engine.loader import GGUFModel, Weights
    c = ModelConfig(**SMOLLM2)
    rng = np.random.default_rng(seed)
    mat = lambda i, o: (rng.standard_normal((o, i), np.float32) / np.sqrt(i)).astype(np.float32)  # noqa: E731
    qkv = (c.q_heads + 2 * c.kv_heads) * c.head_dim
    layers = [{"attn_norm": np.ones(c.hidden, np.float32), "ffn_norm": np.ones(c.hidden, np.float32),
               "qkv": mat(c.hidden, qkv), "o": mat(c.hidden, c.hidden), "gate_up": mat(c.hidden, 2 * c.ffn),
               "down": mat(c.ffn, c.hidden)} for _ in range(c.num_layers)]
    embedding = mat(c.hidden, c.vocab_size)  # [vocab, hidden], tied
    weights = Weights(embedding, embedding, np.ones(c.hidden, np.float32), layers)
    return GGUFModel("synthetic", c, None, weights)


def dense_rate(cp, timer, size=8192):
    """FLOP/s of an fp16 GEMM of ``size`` cubed through the engine's GEMM (cuBLAS, float32 accumulation)."""
    from ..engine import ops
    a = cp.random.default_rng(0).standard_normal((size, size), dtype=np.float32).astype(np.float16)
    out = cp.empty_like(a)
    us = timer.gpu_us(lambda: ops.gemm(a, a, out), 20)
    return 2 * size ** 3 / (us * 1e-6)


def gemm_flops(c, batch):
    """FLOPs of one decode step's GEMMs (every layer's, and the output projection)."""
    per_layer = c.hidden * ((c.q_heads + 2 * c.kv_heads) * c.head_dim + c.hidden + 2 * c.ffn) + c.ffn * c.hidden
    return 2 * batch * (c.num_layers * per_layer + c.hidden * c.vocab_size)


def run(cp, timer, gguf, batch, context, steps, ceilings):
    from ..engine import sampler
    from ..engine.flight import TokenBuffers
    from ..engine.model import LlamaModel
    c = gguf.config
    rng = np.random.default_rng(batch)
    prompts = rng.integers(0, c.vocab_size, (batch, context))
    per_step = max(1, 8192 // context)  # prompts prefilled per step
    greedy = (np.arange(batch), np.zeros(batch), np.ones(batch), np.zeros(batch))
    with PagedKVCache(c.num_layers, c.kv_heads, c.head_dim, 16, "float16", max_tokens=batch * (context + steps + 32),
                      max_seqs=batch, max_seq_len=context + steps + 32, max_step_tokens=per_step * context + batch,
                      backend="cuda") as cache:
        model, tokens = LlamaModel(gguf, cache), TokenBuffers(batch)
        with model.stream:
            last = []
            for lo in range(0, batch, per_step):
                chunk = prompts[lo:lo + per_step]
                step = cache.step([], arrivals=list(chunk))
                logits = model.forward(step, cp.asarray(chunk.reshape(-1)))
                last.append(cp.argmax(logits, axis=1).get())
            ids, landing = cp.asarray(np.concatenate(last)), None

            def decode():  # the engine's steady decode step: ids on the device, tokens read a step late
                nonlocal ids, landing
                step = cache.step(None, 1)
                logits = model.forward(step, ids)
                ids = sampler.sample(logits, *greedy, tokens.next(logits))
                if landing is not None:
                    landing[1].synchronize()
                    landing[0][:batch].copy()
                landing = tokens.send(batch)
                return step

            for _ in range(3):  # eager, captured, replayed
                decode()
            cp.cuda.get_current_stream().synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                step = decode()
            loop = (time.perf_counter() - start) / steps
            graph = model.graph(batch)
            step_us = timer.gpu_us(lambda: graph.graph.launch(graph.stream), 50)
            kinds = breakdown(cp, timer, model, step, graph)
        lengths = cache.lengths(cache.sequences)
    kv_bytes = int(lengths.sum()) * 2 * c.num_layers * c.kv_heads * c.head_dim * 2
    mem_s = (model.weight_bytes + kv_bytes) / ceilings["stream"]
    gemm_s = gemm_flops(c, batch) / ceilings["dense"]
    floor = max(mem_s, gemm_s)
    row = {"batch": batch, "context": int(lengths.mean()), "step_ms": step_us / 1e3, "loop_ms": loop * 1e3,
           "mem_ms": mem_s * 1e3, "gemm_ms": gemm_s * 1e3, "floor_ms": floor * 1e3,
           "x_floor": step_us * 1e-6 / floor, "weight_bytes": model.weight_bytes, "kv_bytes": kv_bytes}
    for k in kinds:
        k["batch"], k["pct"] = batch, 100 * k["us"] / step_us
    return row, kinds


ENGINE_RUNS = 5  # runs of the engine per row: the first is dropped, the median of the others reported


def engine_rows(path, rows, context, steps):
    """Each row's ``e2e_ms`` and ``plain_ms``: wall time (ms) of a decode step of an
    :class:`~pagedrt.engine.Engine` (overlapped, then not) generating ``steps`` greedy tokens for ``batch``
    prompts of ``context`` random tokens (no stop token), after ``warm_up()``: the median of each run's mean step
    over ENGINE_RUNS runs but the first, which runs slower (docs/ENGINE.md, "Speed")."""
    from ..engine import Engine, SamplingParams
    from ..engine.engine import Stats
    most = max(row["batch"] for row in rows)
    for key, overlap in (("e2e_ms", True), ("plain_ms", False)):
        with Engine(path, backend="cuda", max_seqs=most, kv_tokens=most * (context + steps + 32),
                    step_tokens=most * context, overlap=overlap) as engine:  # every prompt in the first step
            engine.stop_tokens = np.empty(0, np.int64)
            engine.warm_up()
            for row in rows:
                runs = []
                for seed in range(ENGINE_RUNS):
                    prompts = list(np.random.default_rng(seed).integers(0, engine.config.vocab_size,
                                                                        (row["batch"], context)))
                    engine.stats = Stats()
                    engine.generate(prompts, SamplingParams(max_tokens=steps))
                    runs.append(engine.stats.decode_seconds / engine.stats.decode_steps * 1e3)
                row[key] = statistics.median(runs[1:])


def peer_rows(peers, rows):
    """The peers' results (``peer_generate.py``'s JSON records) of each row's batch and context (within 10%),
    beside our GPU step."""
    out = []
    for row in rows:
        for p in peers:
            batch, context = map(int, p["case"].split("x"))
            if batch == row["batch"] and abs(context - row["context"]) <= 0.1 * row["context"] and "step_ms" in p:
                out.append({"batch": batch, "context": context, "peer": p["peer"], "step_ms": p["step_ms"],
                            "ours_ms": row["step_ms"], "ratio": row["step_ms"] / p["step_ms"]})
    return out


def breakdown(cp, timer, model, step, graph):
    """Each kind of the decode step's launches, all layers, captured alone as a graph and timed."""
    fixed = graph.buffers
    launches = list(model.launches(step, graph.ids, fixed, *graph.plans))
    out = []
    for kind in dict.fromkeys(k for k, _ in launches):
        calls = [fn for k, fn in launches if k == kind]
        stream = cp.cuda.get_current_stream()
        stream.begin_capture()
        for fn in calls:
            fn()
        g = stream.end_capture()
        out.append({"kind": kind, "launches": len(calls), "us": timer.gpu_us(lambda: g.launch(stream), 50)})
    return out


def parser():
    ap = harness.parser("pagedrt.bench.generate", __doc__)
    ap.add_argument("--model", help="a GGUF file (default: the default model when fetched, else --synthetic)")
    ap.add_argument("--synthetic", action="store_true", help="random weights of SmolLM2-135M's shape")
    ap.add_argument("--batches", default="1,256", help="comma-separated batch sizes")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed end to end")
    ap.add_argument("--peers", help="generate_peers.json of shared/peers/peer_generate.py, run beside this")
    return ap


def read_peers(ap, path):
    """The peers' JSON records in ``path`` (a list of dicts), or an argument error naming what is wrong."""
    if path is None:
        return []
    try:
        with open(path) as f:
            peers = json.load(f)
    except (OSError, ValueError) as e:
        ap.error(f"--peers {path}: {e}")
    def record(p):
        return (isinstance(p, dict) and isinstance(p.get("peer"), str) and isinstance(p.get("case"), str)
                and re.fullmatch(r"\d+x\d+", p["case"]) is not None)
    if not isinstance(peers, list) or not all(record(p) for p in peers):
        ap.error(f"--peers {path}: not a list of records as peer_generate.py writes (each a peer and a case BxC)")
    return peers


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    peers = read_peers(ap, args.peers)  # before the device's minute of work
    from ..engine import fetch, loader
    path = args.model or (None if args.synthetic else fetch.default_path())
    if path is not None and not args.model and not path.is_file():
        path = None
    gguf = loader.load(path) if path else synthetic_model()
    import cupy as cp
    info = harness.device_info(cp)
    timer = harness.Timer(cp)
    ceilings = harness.ceilings(timer, 10)
    ceilings["dense"] = dense_rate(cp, timer)
    print(harness.header(info, ceilings))
    print(f"dense fp16 GEMM {ceilings['dense'] / 1e12:.0f} TFLOP/s (8192^3, cuBLAS); model: "
          f"{path or gguf.config.name}; fp16, block 16, greedy")
    rows, kinds = [], []
    for batch in (int(b) for b in args.batches.split(",")):
        row, k = run(cp, timer, gguf, batch, args.context, args.steps, ceilings)
        cp.get_default_memory_pool().free_all_blocks()
        rows.append(row)
        kinds += k
    if path is not None:
        engine_rows(path, rows, args.context, args.steps)
    for row in rows:
        row["tokens_s"] = row["batch"] / (row.get("e2e_ms", row["loop_ms"]) * 1e-3)
    table = harness.format_table(COLUMNS, rows) + "\n\n" + harness.format_table(KIND_COLUMNS, kinds)
    beside = peer_rows(peers, rows)
    if beside:
        table += "\n\n" + harness.format_table(PEER_COLUMNS, beside)
    harness.publish("generate", args.out, info, rows + kinds + beside, table, args.plot, ceilings=ceilings,
                    model=str(path or gguf.config.name))


if __name__ == "__main__":
    main()
