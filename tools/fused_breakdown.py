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


def compiled(edit):
    """fused._kernel's signature over the source edited by ``edit``."""
    import cupy as cp
    text, kernels = edit(source.text(fused.FILE)), {}

    def kernel(dtype, head_dim, rows, per):
        key = (dtype, head_dim, rows, per)
        if key not in kernels:
            name = fused._name(dtype, head_dim, rows, per)
            kernels[key] = cp.RawModule(code=text, options=source.OPTIONS, name_expressions=(name,)).get_function(name)
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


if __name__ == "__main__":
    main()
