"""Shared fixtures: the pool contract runs on every backend; CUDA cases skip without a GPU."""

import functools

import numpy as np
import pytest


@functools.lru_cache(maxsize=1)
def cuda_probe():
    from pagedrt.driver import probe
    return probe()


def pytest_collection_modifyitems(config, items):
    info = cuda_probe()
    if info["usable"]:
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU: {info['reason']}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["host", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request):
    """Each pool test runs once per backend."""
    return request.param


def to_host(a):
    """A NumPy copy of a NumPy or CuPy array."""
    return a.get() if hasattr(a, "get") else np.array(a)
