"""KVSpec: what a cache holds, checked once; and the spec as the one interpreter of K/V dtypes."""

import ast
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from pagedrt import PagedKVCache
from pagedrt.errors import UnsupportedConfigError
from pagedrt.kernels import configs
from pagedrt.layout import Layout
from pagedrt.spec import KVSpec, plane_kv_dtype
from pagedrt.supported import FP8, KV_DTYPES

PACKAGE = Path(__file__).resolve().parents[1] / "pagedrt"
INTERPRETERS = {"spec.py", "supported.py"}  # the spec, and the tables it reads


def test_build_normalises_every_field():
    spec = KVSpec.build(np.int64(2), np.int32(4), np.int64(128), np.int16(16), np.float16, None, "block")
    assert spec == KVSpec(2, 4, 128, 16, np.dtype(np.float16), "float16", "block")
    assert all(type(getattr(spec, f)) is int for f in ("num_layers", "num_kv_heads", "head_dim", "block_size"))
    assert KVSpec.build(2, 4, 128, 16, "float32", "float32").kv_dtype == "float32"
    assert KVSpec.build(2, 4, 128, 16, np.dtype("float16"), np.float16).kv_dtype == "float16"


def test_derived_fields_of_each_kv_dtype():
    for kv_dtype, itemsize in (("float16", 2), (FP8, 1)):
        spec = KVSpec.build(3, 2, 64, 8, "float16", kv_dtype)
        assert spec.is_fp8 == (kv_dtype == FP8)
        assert spec.itemsize == spec.kv_numpy_dtype.itemsize == itemsize
        assert spec.kv_numpy_dtype == (np.uint8 if spec.is_fp8 else np.float16)
        assert spec.bytes_per_token == 2 * 3 * 2 * 64 * itemsize
        assert spec.scales_shape == ((3, 2, 2) if spec.is_fp8 else None)
    spec = KVSpec.build(2, 8, 128, 16, "float32")
    assert spec.shard(4) == dataclasses.replace(spec, num_kv_heads=2)


@pytest.mark.parametrize("kwargs, words", [
    (dict(num_layers=0), "num_layers must be a positive int"),
    (dict(num_kv_heads=True), "num_kv_heads must be a positive int"),
    (dict(head_dim=48), "head_dim=48"),
    (dict(head_dim=64.0), "head_dim=64.0"),
    (dict(block_size=24), "block_size=24"),
    (dict(placement="row"), "placement='row'"),
    (dict(dtype="float64"), "float64"),
    (dict(dtype=np.int8), "int8"),
    (dict(kv_dtype="float8_e5m2"), "K/V dtype"),
    (dict(kv_dtype=np.uint8), "K/V dtype"),  # FP8 is said by name: uint8 says nothing of what its bytes mean
    (dict(kv_dtype="float32"), "K/V are stored in the model's dtype"),
    (dict(kv_dtype=FP8, dtype="float32"), "float16, bfloat16"),
    (dict(kv_dtype=FP8, head_dim=96), "head_dim \\(FP8 K/V\\)=96"),
])
def test_build_refuses_what_is_not_supported(kwargs, words):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=128, block_size=16, dtype="float16", kv_dtype=None,
                placement="plane") | kwargs
    with pytest.raises(UnsupportedConfigError, match=words):
        KVSpec.build(**args)


def test_a_spec_is_frozen():
    spec = KVSpec.build(2, 2, 128, 16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.kv_dtype = FP8
    assert hash(spec) == hash(KVSpec.build(2, 2, 128, 16, np.float16))


def test_the_cache_layout_and_planes_follow_the_spec():
    for kv_dtype in ("float16", FP8):
        with PagedKVCache(2, 2, 128, 16, "float16", kv_dtype=kv_dtype, max_tokens=256, backend="host") as cache:
            spec = cache.spec
            assert spec == KVSpec.build(2, 2, 128, 16, "float16", kv_dtype)
            assert (cache.dtype, cache.kv_dtype) == (spec.dtype, spec.kv_dtype)
            assert cache.layout == Layout.plan(spec, cache.layout.page_bytes, cache.layout.device_blocks)
            assert cache.layout.bytes_per_token == spec.bytes_per_token
            assert all(p.dtype == spec.kv_numpy_dtype for p in cache.planes)
            assert plane_kv_dtype(cache.k(0).dtype) == (FP8 if spec.is_fp8 else None)
            assert (cache.k_scale(1) is None) == (not spec.is_fp8)


def test_plane_kv_dtype_and_config_read_the_same_names():
    assert plane_kv_dtype(np.dtype(np.uint8)) == FP8
    for dtype in (np.float16, np.float32, np.int8):
        assert plane_kv_dtype(np.dtype(dtype)) is None
    assert configs.config("float16", 128, 16, 4, kv_dtype=plane_kv_dtype(np.dtype(np.uint8))).fp8
    assert configs.config("float16", 128, 16, 4, kv_dtype="float16") == configs.config(np.float16, 128, 16, 4)
    with pytest.raises(UnsupportedConfigError, match="K/V dtype"):
        configs.config("float16", 128, 16, 4, kv_dtype=np.uint8)


def _interpretations(path):
    """(line, what) of every K/V dtype interpreted in a module: a string literal naming a K/V dtype other than
    the model's (FP8), and a comparison with np.uint8 (the FP8 planes' storage) but of a workspace's dtype."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value == FP8 and id(node) not in docstrings:
            found.append((node.lineno, repr(FP8)))
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "uint8" for s in sides) and \
                    "workspace" not in ast.unparse(node.left):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_spec_is_the_only_interpreter_of_kv_dtypes():
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {what}" for path in sorted(PACKAGE.rglob("*.py"))
             if path.name not in INTERPRETERS or path.parent != PACKAGE for line, what in _interpretations(path)]
    assert not found, "K/V dtypes interpreted outside pagedrt/spec.py:\n" + "\n".join(found)
    assert FP8 in KV_DTYPES  # what the scan looks for is the name the tables hold


def test_the_scan_finds_an_interpretation(tmp_path):
    module = tmp_path / "launcher.py"
    module.write_text('"""Says float8_e4m3 in a docstring, which is no reading of it."""\n'
                      'import numpy as np\n'
                      'def run(k, workspace):\n'
                      '    fp8 = k.dtype == np.uint8\n'
                      '    ok = workspace.dtype == np.uint8\n'
                      '    return fp8 or k.kind == "float8_e4m3"\n')
    assert [line for line, _ in _interpretations(module)] == [4, 6]
