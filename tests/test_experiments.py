"""The experiment tools (tools/seed_table.py, tools/frag_sim.py) on small configurations.

Each tool is imported from its file and its main function called, as its command
would; the figures it returns are checked against the seeds' numbers, computed
here independently, and against the invariants of its accounting.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_tool(name):
    spec = importlib.util.spec_from_file_location(f"tools_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- seed_table --------------------------------------------------------------------------------

SEED_BYTES_PER_TOKEN = 2 * 80 * 8 * 128 * 2  # K and V x layers x KV heads x head_dim x fp16
MiB = 1 << 20


def test_seed_table_matches_the_seed(capsys):
    r = load_tool("seed_table").main([])
    out = capsys.readouterr().out
    assert r["bytes_per_token"] == SEED_BYTES_PER_TOKEN == 327680
    for bs, bound_mib, mean_mib in ((16, 4.69, 2.5), (32, 9.69, 5.0)):  # the seed's figures
        w = r["waste"][bs]
        assert w["bound_tokens"] == bs - 1 == w["measured_max_tokens"]
        assert round(w["bound_tokens"] * SEED_BYTES_PER_TOKEN / MiB, 2) == bound_mib
        assert w["seed_mean_tokens"] * SEED_BYTES_PER_TOKEN / MiB == mean_mib
        assert w["measured_mean_tokens"] == (bs - 1) / 2  # the exact mean over lengths uniform mod bs
    for bs, per_request in ((8, 16384), (16, 8192)):  # 32768 / bs int32 entries
        t = r["tables"][bs]
        assert t["entries"] == 32768 // bs
        assert t["bytes_one"] == per_request == 4 * 32768 // bs
        assert t["bytes_many"] == 100 * per_request
    assert r["tables"][16]["bytes_many"] == 800 * 1024
    for text in ("327,680 B (320 KiB)", "4.69 MiB", "2.50 MiB", "9.69 MiB", "5.00 MiB", "800 KiB"):
        assert text in out


def test_seed_table_runs_as_a_command():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "seed_table.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert "Dense block table" in done.stdout
