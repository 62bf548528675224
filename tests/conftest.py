"""Shared fixtures: the pool contract runs on every backend; CUDA cases skip without a GPU."""

import functools

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
