"""pagedrt: a torch-free paged KV cache runtime for NVIDIA GPUs (CuPy + cuda-python).

Two address translations, in layers (each imports only the ones below it):
``driver`` -> ``memory`` (the pool: hardware mapping, the MMU translates) ->
``blocks`` (allocator and block tables: software mapping, the kernel translates) ->
``step`` (the step's device metadata) -> ``layout``, ``snapshot``, ``cache`` (PagedKVCache,
translate) -> ``kernels`` (writes, copies, validation) -> ``attention`` (plan/run) -> ``scheduler``
(what a step runs) -> ``demo``, ``engine``, ``cli``, with ``bench`` (the benchmarks) on top. docs/ARCHITECTURE.md has the table.
"""

from .cache import PagedKVCache
from .errors import PagedRTError
from .memory import ChunkRecord, Pool

__version__ = "0.1.0"
__all__ = ["ChunkRecord", "PagedKVCache", "PagedRTError", "Pool", "__version__"]
