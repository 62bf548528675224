"""Text generation on pagedrt: a Llama-family GGUF model over a paged KV cache (``pagedrt generate``).

Above the runtime, beside the command line: it uses pagedrt's public API for the KV
cache (``PagedKVCache.step``, ``kernels.copy_blocks``,
``attention.DecodePlan``/``PrefillPlan``) and CuPy (NumPy on the host backend) for the
rest. Modules, one job each: :mod:`.config` (a model's hyperparameters from GGUF
metadata), :mod:`.loader` (reading and dequantising a GGUF file), :mod:`.tokenizer`
(byte-level BPE), :mod:`.chat` (ChatML), :mod:`.fetch` (the default model, fetched on
first use), :mod:`.ops` (norms, SwiGLU, GEMMs: ``cuda_src/engine.cu`` and NumPy
references), :mod:`.rope_write` (rotary embeddings fused with the K/V write),
:mod:`.model` (the forward pass of one step), :mod:`.sampler` (greedy and top-p
sampling), :mod:`.engine` (the generate loop over :mod:`pagedrt.scheduler`'s decisions:
continuous batching, parallel samples by fork, prefix caching). Needs the ``gguf``
package (``pip install 'pagedrt[model]'``).
"""

from .engine import Completion, Engine, SamplingParams, Stats
from .fetch import model_path
from .loader import load

__all__ = ["Completion", "Engine", "SamplingParams", "Stats", "load", "model_path"]
