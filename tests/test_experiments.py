"""The experiment tools (tools/seed_table.py, tools/frag_sim.py) on small configurations.

Each tool is imported from its file and its main function called, as its command
would; the figures it returns are checked against the seeds' numbers, computed
here independently, and against the invariants of its accounting.
"""

import importlib.util
import os
import subprocess
import sys
from contextlib import redirect_stdout
from io import StringIO
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


# --- frag_sim ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def frag():
    """One --tiny run of tools/frag_sim.py: the module, what it returned and what it printed."""
    tool = load_tool("frag_sim")
    out = StringIO()
    with redirect_stdout(out):
        results = tool.main(["--tiny"])
    return tool, results, out.getvalue()


def rows_by_policy(results, trace):
    return {r["policy"]: r for r in results[trace]["rows"]}


def test_frag_sim_traces_respect_the_caps(frag):
    tool, results, _ = frag
    for name, res in results.items():
        t = res["trace"]
        assert t.prompt.min() >= 1 and t.output.min() >= 1
        assert t.final.max() <= tool.TINY["max_model_len"]
        assert (np.diff(t.arrival) >= 0).all()
        assert t.prompt.size == tool.TINY["requests"][name]
    assert results["short"]["trace"].final.mean() < results["long"]["trace"].final.mean() / 4


def test_frag_sim_accounting_adds_up(frag):
    tool, results, out = frag
    budget = tool.TINY["budget"]
    for name in results:
        rows = rows_by_policy(results, name)
        assert list(rows) == ["contig-max", "contig-pow2", "contig-exact"] + [
            f"paged-{bs}" for bs in tool.BLOCK_SIZES]
        for policy, r in rows.items():
            s, steps = r["sums"], r["waiting_steps"]
            assert steps > 0, f"{name}/{policy} never had a request waiting: not memory-bound"
            assert 0 < r["util"] <= 1
            # empty slots read per sequence (tables / regions) + tokens = what the allocator holds
            assert s["used"] + s["internal"] == s["held"]
            assert s["held"] + s["free"] == steps * budget
            assert 0 <= s["external"] <= s["free"]
            assert r["used"] + r["internal"] + r["external"] + r["idle"] == pytest.approx(1)
            assert policy in out


def test_frag_sim_paged_waste_and_fragmentation(frag):
    tool, results, _ = frag
    for name in results:
        rows = rows_by_policy(results, name)
        for bs in tool.BLOCK_SIZES:
            r = rows[f"paged-{bs}"]
            assert r["max_tail"] <= bs - 1  # the seeds' bound, from the block tables, every step
            assert r["external"] == 0 and r["frag_delayed"] == 0  # any free block serves anyone
        # equal regions in a budget that is a whole number of them leave no unusable hole
        assert rows["contig-max"]["external"] == 0
        assert rows["contig-max"]["max_batch"] == tool.TINY["budget"] // tool.TINY["max_model_len"]
        # regions of different sizes do
        assert rows["contig-exact"]["external"] > 0 and rows["contig-exact"]["frag_delayed"] > 0
        assert rows["paged-16"]["mean_batch"] > rows["contig-exact"]["mean_batch"] > rows["contig-max"]["mean_batch"]
        assert rows["paged-16"]["util"] > rows["contig-exact"]["util"] > rows["contig-max"]["util"]


def test_frag_sim_large_blocks_hurt_short_requests_more(frag):
    tool, results, _ = frag
    short, long = rows_by_policy(results, "short"), rows_by_policy(results, "long")
    utils = [short[f"paged-{bs}"]["util"] for bs in tool.BLOCK_SIZES]
    assert utils == sorted(utils, reverse=True)
    loss = {name: rows["paged-8"]["util"] - rows["paged-128"]["util"] for name, rows in
            (("short", short), ("long", long))}
    assert loss["short"] > 3 * loss["long"]
    assert short["paged-128"]["mean_batch"] < 0.6 * short["paged-8"]["mean_batch"]


def test_first_fit_reuses_the_lowest_hole():
    space = load_tool("frag_sim").FirstFit(10)
    a, b, c = space.alloc(3), space.alloc(3), space.alloc(3)
    assert (a, b, c) == (0, 3, 6)
    assert space.alloc(2) is None  # one slot left at the end
    space.free(a)
    space.free(c)
    assert space.alloc(4) == 6  # the hole at 0 holds 3 only; 6..9 holds 4
    assert space.alloc(3) == 0
