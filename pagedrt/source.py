"""The CUDA sources in the top-level ``cuda_src/``, compiled with ``cupy.RawModule`` once per configuration.

From a source tree, ``cuda_src/`` sits beside the package; an installed wheel carries
it as ``pagedrt/cuda_src``. :func:`text` gives a file with its local ``#include "..."``
files inlined: CuPy's on-disk cache is keyed on the source text only, so an edited
header must change that text. :func:`module` compiles a file for a set of template
instances (``name_expressions``) and caches the result for the process; CuPy also
caches the binary on disk, so a configuration is compiled once per machine. A file
listed in :data:`ARCHES` uses instructions of one target only and is compiled for it
(:func:`options`); the others are compiled for the device at hand.
:func:`function` finds a kernel in any module compiled so far, compiling it alone
only when none holds it; :func:`preload` compiles many instances in one NVRTC call
(one compile costs seconds, mostly per call rather than per instance).
"""

import functools
import re
from pathlib import Path
from typing import Any, Dict, Iterable, Tuple

_PACKAGE = Path(__file__).resolve().parent
_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


def _find_cuda_src() -> Path:
    for candidate in (_PACKAGE.parent / "cuda_src", _PACKAGE / "cuda_src"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"cuda_src/ not found beside or inside {_PACKAGE}: reinstall pagedrt")


CUDA_SRC = _find_cuda_src()
OPTIONS = ("-std=c++17",)
ARCHES = {"prefill_sm90.cu": "sm_90a"}  # files compiled for one target: Hopper's wgmma and setmaxnreg

_functions: Dict[Tuple[str, str], Any] = {}  # (filename, name expression) -> cupy.RawKernel


def text(filename: str) -> str:
    """``cuda_src/<filename>`` with its local includes inlined, each file once."""
    seen = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        out = []
        for line in (CUDA_SRC / name).read_text().splitlines():
            match = _LOCAL_INCLUDE.match(line)
            if match:
                out.append(expand(match.group(1)))
            elif line.strip() != "#pragma once":
                out.append(line)
        return "\n".join(out)

    return expand(filename) + "\n"


def options(filename: str) -> Tuple[str, ...]:
    """The NVRTC options of ``cuda_src/<filename>``: OPTIONS, and its target when :data:`ARCHES` names one."""
    arch = ARCHES.get(filename)
    return OPTIONS + ((f"-arch={arch}",) if arch else ())


@functools.lru_cache(maxsize=None)
def module(filename: str, name_expressions: Tuple[str, ...]) -> Any:
    """A compiled ``cupy.RawModule`` of ``cuda_src/<filename>`` holding ``name_expressions`` (a tuple: the cache's
    key), cached for the process."""
    import cupy
    return cupy.RawModule(code=text(filename), options=options(filename), name_expressions=tuple(name_expressions))


def preload(filename: str, name_expressions: Iterable[str]) -> None:
    """Compile all ``name_expressions`` of ``filename`` in one module and register them for :func:`function`.

    Parameters
    ----------
    filename : str
        A file of ``cuda_src/``.
    name_expressions : iterable of str
        Kernel instances, as C++ name expressions (``"pagedrt::write_kv<half, 128, 16>"``).
    """
    names = tuple(sorted(set(name_expressions)))
    mod = module(filename, names)
    for name in names:
        _functions.setdefault((filename, name), mod.get_function(name))


def function(filename: str, name: str) -> Any:
    """The kernel ``name`` of ``filename`` (a ``cupy.RawKernel``), from a preloaded module or compiled on first use.
    """
    key = (filename, name)
    fn = _functions.get(key)
    if fn is None:
        preload(filename, (name,))
        fn = _functions[key]
    return fn
