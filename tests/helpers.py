"""Helpers the test modules import (pytest puts tests/ on sys.path)."""

import numpy as np
import pytest


def _importable(name):
    try:
        __import__(name)
    except ImportError:
        return False
    return True


# bfloat16 is ml_dtypes.bfloat16 (the test and cuda extras install it): a test of it skips without the package
needs_ml_dtypes = pytest.mark.skipif(not _importable("ml_dtypes"), reason="bfloat16 needs the ml_dtypes package")


def to_host(a):
    """A NumPy copy of a NumPy or CuPy array."""
    return a.get() if hasattr(a, "get") else np.array(a)


def compile_all(*parts, per_module=6):
    """Compile the {file: name expressions} of ``parts`` up front, ``per_module`` instances per NVRTC call and
    the calls in parallel threads (NVRTC compiles without holding the GIL): what a GPU test module runs."""
    from concurrent.futures import ThreadPoolExecutor

    from pagedrt import source
    names = {}
    for part in parts:
        for file, listed in part.items():
            names.setdefault(file, []).extend(listed)
    jobs = [(file, tuple(listed[i:i + per_module])) for file, listed in names.items()
            for listed in [list(dict.fromkeys(listed))] for i in range(0, len(listed), per_module)]
    with ThreadPoolExecutor(max_workers=max(1, len(jobs))) as pool:
        list(pool.map(lambda job: source.preload(*job), jobs))
