"""The CUDA sources in the top-level ``cuda_src/``, compiled with ``cupy.RawModule`` once per configuration.

From a source tree, ``cuda_src/`` sits beside the package; an installed wheel carries
it as ``pagedrt/cuda_src``. :func:`module` compiles a file for a set of template
instances (``name_expressions``) and caches the result for the process; CuPy also
caches the binary on disk, so a configuration is compiled once per machine.
"""

import functools
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent.parent


def _find_cuda_src():
    for candidate in (_PACKAGE.parent / "cuda_src", _PACKAGE / "cuda_src"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"cuda_src/ not found beside or inside {_PACKAGE}: reinstall pagedrt")


CUDA_SRC = _find_cuda_src()
OPTIONS = ("-std=c++17", f"-I{CUDA_SRC}")


@functools.lru_cache(maxsize=None)
def module(filename, name_expressions):
    """A compiled ``cupy.RawModule`` of ``cuda_src/<filename>`` holding ``name_expressions``."""
    import cupy
    code = (CUDA_SRC / filename).read_text()
    return cupy.RawModule(code=code, options=OPTIONS, name_expressions=tuple(name_expressions))

