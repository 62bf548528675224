"""Where the one-launch decode step's time goes, on a GPU (SmolLM2-135M's shape, random fp16 weights).

    python3 tools/fused_breakdown.py

First the decode step as a replayed CUDA graph, fused (``pagedrt.engine.fused``) and layered, at batches 1 to 8
(contexts of 531 tokens): where one launch stops paying. Then the fused kernel launched alone (CUDA events,
median of 40) at batches 1 and 8, whole and as variants compiled from its source with one stage left out (as
docs/ENGINE.md reads them): the attention phase, every layer (the embedding and the logits remain), the L2
prefetches, the barriers' waiting (the grid runs on unsynchronised: wrong results, only the time counts).
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedrt import PagedKVCache, source  # noqa: E402
from pagedrt.bench import harness  # noqa: E402
from pagedrt.bench.generate import synthetic_model  # noqa: E402
from pagedrt.engine import fused  # noqa: E402
from pagedrt.engine.model import LlamaModel  # noqa: E402

VARIANTS = {
    "whole": lambda t: t,
    "no attention": lambda t: t.replace("attend<T, HEAD_DIM>(s, k_plane", "if (0) attend<T, HEAD_DIM>(s, k_plane"),
    "no layers": lambda t: t.replace("for (int layer = 0; layer < num_layers; ++layer)",
                                     "for (int layer = 0; layer < 0; ++layer)"),
    "no L2 prefetch": lambda t: t.replace('asm volatile("prefetch.global.L2 [%0];" ::"l"(p));', ""),
    "no barrier wait": lambda t: t.replace("} while ((int)(seen - target) < 0);", "} while (0);"),
}


STAMP_SLOTS = 256  # grid barriers a step may stamp (1 + 5 a layer)
PHASES = ("qkv", "attention", "o", "gate_up", "down")  # the phase each layer's barriers close, in order


def stamped(text):
    """The kernel's source with every grid barrier stamped: ``stamps[block][slot] = (arrive, leave)``, as
    (%globaltimer ns, clock64) pairs."""
    array = f'extern "C" __device__ unsigned long long pagedrt_stamps[1024 * {STAMP_SLOTS} * 4];'
    text = text.replace("namespace pagedrt {", array + "\nnamespace pagedrt {", 1)
    text = text.replace("namespace fused {", f"""namespace fused {{
__device__ __forceinline__ void stamp(unsigned slot, int leaving) {{
    unsigned long long ns, cycles;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
    cycles = clock64();
    unsigned long long* at = pagedrt_stamps + ((blockIdx.x * {STAMP_SLOTS} + slot) * 2 + leaving) * 2;
    at[0] = ns, at[1] = cycles;
}}""", 1)
    arrive = "    target += gridDim.x;\n    if (threadIdx.x == 0) {\n"
    assert arrive in text
    text = text.replace(arrive, arrive + "        stamp(target / gridDim.x - 1, 0);\n")
    leave = "} while ((int)(seen - target) < 0);\n"
    assert leave in text
    return text.replace(leave, leave + "        stamp(target / gridDim.x - 1, 1);\n")


def timeline(module, grid, layers):
    """Per phase of a layer: (busiest block's work, median block's work, barrier latency), us, medians over
    the layers, from the stamps of the last step run."""
    import cupy as cp
    slots = 1 + len(PHASES) * layers
    raw = cp.ndarray((1024, STAMP_SLOTS, 2, 2), cp.uint64, module.get_global("pagedrt_stamps")).get()
    ns = raw[:grid, :slots, :, 0].astype(np.float64)
    cycles = raw[:grid, :slots, :, 1].astype(np.float64)
    per_ns = (ns[:, -1, 1] - ns[:, 0, 0]) / (cycles[:, -1, 1] - cycles[:, 0, 0])  # each SM's clock, ns a cycle
    work = (cycles[:, 1:, 0] - cycles[:, :-1, 1]) * per_ns[:, None] / 1e3  # [block, barrier k >= 1]
    latency = (np.median(ns[:, 1:, 1], axis=0) - ns[:, 1:, 0].max(axis=0)) / 1e3
    rows = []
    for i, name in enumerate(PHASES):
        ks = np.arange(layers) * len(PHASES) + i  # work before barrier k + 1
        rows.append((name, np.median(work[:, ks].max(axis=0)), np.median(np.median(work[:, ks], axis=0)),
                     np.median(latency[ks])))
    return rows, (ns[:, -1, 1].max() - ns[:, 0, 0].min()) / 1e3


def compiled(edit):
    """fused._kernel's signature over the source edited by ``edit``."""
    import cupy as cp
    text, kernels = edit(source.text(fused.FILE)), {}

    def kernel(dtype, head_dim, rows, per, smem_limit):
        key = (dtype, head_dim, rows, per)
        if key not in kernels:
            name = fused._name(dtype, head_dim, rows, per)
            kernels[key] = cp.RawModule(code=text, options=source.OPTIONS, name_expressions=(name,)).get_function(name)
            kernels[key].max_dynamic_shared_size_bytes = smem_limit
        return kernels[key]
    return kernel


def timed(fn):
    """Median us of ``fn()`` between two CUDA events, after five calls."""
    import cupy as cp
    return harness.event_seconds(cp, fn, 40, warmup=5) * 1e6


def decoding(gguf, batch, graphs, use_fused):
    """A cache holding ``batch`` prompts of 530 tokens, its model, and a decode step made after three more."""
    import cupy as cp
    c = gguf.config
    rng = np.random.default_rng(0)
    cache = PagedKVCache(c.num_layers, c.kv_heads, c.head_dim, 16, "float16", max_tokens=batch * 700,
                         max_seqs=batch, max_seq_len=700, max_step_tokens=8192, backend="cuda")
    model = LlamaModel(gguf, cache, graphs=graphs, fused=use_fused)
    with model.stream:
        prompts = [rng.integers(0, c.vocab_size, 530) for _ in range(batch)]
        tokens = cp.argmax(model.forward(cache.step([], arrivals=prompts), cp.asarray(np.concatenate(prompts))),
                           axis=1).get()
        for _ in range(3):
            tokens = cp.argmax(model.forward(cache.step(None, 1, tokens), cp.asarray(tokens)), axis=1).get()
        step = cache.step(None, 1, tokens)
    return cache, model, step, tokens


def main():
    import cupy as cp
    gguf = synthetic_model()
    for batch in range(1, 9):
        us = []
        for use_fused in (True, False):
            cache, model, _, _ = decoding(gguf, batch, True, use_fused)
            with cache, model.stream:
                graph = model.graph(batch)
                us.append(timed(lambda: graph.graph.launch(graph.stream)))
        print(f"batch {batch}: graph step fused {us[0]:7.1f} us, layered {us[1]:7.1f} us", flush=True)
    for batch in (1, 8):
        cache, model, step, tokens = decoding(gguf, batch, False, True)
        with cache, model.stream:
            ids, out = cp.asarray(tokens), cp.empty((batch, gguf.config.vocab_size), cp.float32)
            launcher = fused._kernel
            for name, edit in VARIANTS.items():
                fused._kernel = compiled(edit)
                print(f"batch {batch}: {name:16s} {timed(lambda: model.fused.run(step, ids, out)):7.1f} us",
                      flush=True)
            fused._kernel = launcher
    cache, model, step, tokens = decoding(gguf, 1, False, True)
    with cache, model.stream:
        ids, out = cp.asarray(tokens), cp.empty((1, gguf.config.vocab_size), cp.float32)
        text = stamped(source.text(fused.FILE))
        name = fused._name(model.fused.dtype, gguf.config.head_dim, 1, fused.norm_per(gguf.config.hidden))
        module = cp.RawModule(code=text, options=source.OPTIONS, name_expressions=(name,))
        function = module.get_function(name)
        function.max_dynamic_shared_size_bytes = model.fused.smem_limit
        launcher, fused._kernel = fused._kernel, lambda *key: function
        for _ in range(3):
            model.fused.run(step, ids, out)
        cp.cuda.get_current_stream().synchronize()
        fused._kernel = launcher
        rows, span = timeline(module, model.fused.grid, gguf.config.num_layers)
    print(f"batch 1 timeline, first barrier to last: {span:.1f} us; per layer, medians over the layers (us):")
    for name, busiest, median, latency in rows:
        print(f"  {name:10s} busiest block {busiest:6.2f}  median block {median:6.2f}  barrier {latency:6.2f}")


if __name__ == "__main__":
    main()
