"""Shared fixtures: the pool contract runs on every backend; CUDA cases skip without a GPU; the tiny GGUF model
(tests/tiny_gguf.py) written once a module."""

import functools
import os

import pytest

import tiny_gguf


@functools.lru_cache(maxsize=1)
def cuda_probe():
    from pagedrt.driver import probe
    return probe()


def pytest_collection_modifyitems(config, items):
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        # device-wide free memory moves with every other worker's allocations, and filling it starves them
        alone = pytest.mark.skip(reason="needs the GPU to itself: run `pytest -m alone` without -n")
        for item in items:
            if "alone" in item.keywords:
                item.add_marker(alone)
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


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model's file (float32); a test that asks for it skips without the gguf package."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    tiny_gguf.write(path)
    return path
