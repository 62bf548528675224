"""The command line: every command, its JSON, and every bad input (exit 2 or 1, never a traceback)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from pagedrt.cli import main

TINY = ["--preset", "tiny", "--steps", "16", "--max-tokens", "2048", "--backend", "host"]


def run(*args, code=0):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    if code:
        assert result.exception is None or isinstance(result.exception, SystemExit)
    return result.output if code else result.stdout  # stdout alone: the progress bar is on stderr


def pool_cells(out):
    """The cells of the pool map in ``out``."""
    return set("".join(line.split("[", 1)[1] for line in out.splitlines() if line.startswith("chunk ") and "[" in line))


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    path = tmp_path_factory.mktemp("snap") / "state.json"
    run("demo", *TINY, "--no-color", "--snapshot", path)
    return path


def test_info():
    out = run("info", "--backend", "host", "--no-color")
    assert "backend     host" in out and "page size" in out
    report = json.loads(run("info", "--backend", "host", "--json"))
    assert report["backend"] == "host" and report["page_bytes"] > 0 and "usable" in report["cuda"]


def test_demo_shows_both_layers(snapshot):
    out = run("demo", *TINY, "--no-color")
    for text in ("chunk", "block tables", "pool map", "virtual address", "MMU", "max relative error", ": ok",
                 "found in the prefix cache", "shared now (*)", "copied on write", "held by no sequence (+)",
                 "mapped ahead of need", "mixed prompt chunks with decode tokens"):
        assert text in out
    assert set("*+.") <= pool_cells(out)  # shared, cached and held by no sequence, free (mapped ahead)
    assert snapshot.exists()


def test_demo_json_is_consistent():
    report = json.loads(run("demo", *TINY, "--json", "--dtype", "float32"))
    assert (report["schema"], report["version"]) == ("pagedrt-demo", 1)
    f, snap, tr = report["figures"], report["snapshot"], report["translation"]
    assert f["checks"] > 0 and 0 <= f["max_error"] <= f["tolerance"] == 1e-5
    mapped = [c for c in snap["pool"]["chunks"] if c["state"] == "mapped"]
    assert f["mapped_bytes"] == len(mapped) * snap["pool"]["chunk_bytes"]
    assert tr["virtual_address"] == snap["pool"]["base"] + tr["pool_offset"]
    assert 0 < f["utilisation_of_mapped"] <= 1 and 0 < f["utilisation_of_held"] <= 1
    refs, cached = snap["blocks"]["ref_counts"], snap["blocks"]["cached"]
    assert f["shared_blocks"] == sum(r > 1 for r in refs) > 0 and f["cached_blocks"] == len(cached)
    assert f["evictable_blocks"] == sum(refs[b] == 0 for b in cached) > 0
    for key in ("arrived", "forked", "finished", "prefix_hit_tokens", "blocks_copied", "mixed_steps", "chunks_ahead"):
        assert f[key] > 0, key
    docs = (Path(__file__).parent.parent / "docs" / "SNAPSHOT.md").read_text()
    assert [key for key in f if f"`{key}`" not in docs] == []


def test_map_from_snapshot_and_from_demo(snapshot):
    out = run("map", snapshot, "--no-color")
    assert "pool map" in out and "block tables" in out and "virtual range" in out
    assert set("*+.") <= pool_cells(out)
    assert json.loads(run("map", snapshot, "--json")) == json.loads(snapshot.read_text())
    out = run("map", "--from-demo", *TINY, "--no-color", "--placement", "block")
    assert "pool map" in out and "plane-major" not in out


def test_translate(snapshot):
    snap = json.loads(snapshot.read_text())
    entry = snap["sequences"][0]
    pos = entry["length"] - 1
    tr = json.loads(run("translate", entry["seq"], pos, snapshot, "--layer", 1, "--kv", "v", "--json"))
    assert tr["block_id"] == entry["blocks"][pos // snap["layout"]["block_size"]]
    assert tr["virtual_address"] == snap["pool"]["base"] + tr["pool_offset"]
    out = run("translate", entry["seq"], pos, snapshot, "--no-color")
    assert len(out.strip().splitlines()) == 8 and "block_table[" in out
    assert f"block {tr['block_id']} is {'in' if tr['cached'] else 'not in'} the prefix cache" in out
    from_demo = json.loads(run("translate", entry["seq"], 0, "--from-demo", *TINY, "--json"))
    from_file = json.loads(run("translate", entry["seq"], 0, snapshot, "--json"))
    for record in (from_demo, from_file):  # a new run's pool has its own base address
        record.pop("virtual_address")
    assert from_demo == from_file  # the seeded demo reaches the same state


def test_inspect(snapshot):
    out = run("inspect", snapshot, "--no-color")
    assert "written" in out and "pool map" in out
    assert json.loads(run("inspect", snapshot, "--json"))["schema"] == "pagedrt-snapshot"


def test_bad_input(snapshot, tmp_path):
    assert "'gpt-5' is not one of" in run("demo", "--preset", "gpt-5", code=2)
    assert "must divide" in run("demo", *TINY, "--q-heads", "6", "--kv-heads", "4", code=2)
    assert "'100' is not one of '64'" in run("demo", *TINY, "--head-dim", "100", code=2)
    assert "'12' is not one of '8'" in run("demo", *TINY, "--block-size", "12", code=2)
    assert "no snapshot" in run("map", tmp_path / "missing.json", code=1)
    (tmp_path / "corrupt.json").write_text("{\"schema\": ")
    assert "cannot read" in run("inspect", tmp_path / "corrupt.json", code=1)
    newer = json.loads(snapshot.read_text()) | {"version": 99}
    (tmp_path / "newer.json").write_text(json.dumps(newer))
    assert "version 99" in run("map", tmp_path / "newer.json", code=1)
    assert "sequence 999 does not exist" in run("translate", 999, 0, snapshot, code=1)
    seq = json.loads(snapshot.read_text())["sequences"][0]["seq"]
    assert "position 100000 is out of range" in run("translate", seq, 100000, snapshot, code=1)
    assert "layer 99 does not exist" in run("translate", seq, 0, snapshot, "--layer", 99, code=1)
    assert "SNAPSHOT file" in run("map", code=2)
    assert "not both" in run("map", snapshot, "--from-demo", code=2)


def test_installed_console_script(tmp_path):
    exe = shutil.which("pagedrt")
    if exe is None:
        pytest.skip("the pagedrt console script is not installed (pip install . first)")
    proc = subprocess.run([exe, "demo", *TINY, "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    f = report["figures"]
    assert f["max_error"] <= f["tolerance"]
    assert report["translation"]["virtual_address"] == report["snapshot"]["pool"]["base"] + \
        report["translation"]["pool_offset"]
    assert f["mapped_bytes"] == sum(c["size"] for c in report["snapshot"]["pool"]["chunks"]
                                    if c["state"] == "mapped")


@pytest.mark.parametrize("args, message", [
    (["demo", *TINY, "--block-size", "0"], "'--block-size': '0' is not one of"),
    (["map", "--from-demo", *TINY, "--block-size", "0"], "'--block-size': '0' is not one of"),
    (["translate", "0", "0", "--from-demo", *TINY, "--block-size", "0"], "'--block-size': '0' is not one of"),
    (["demo", *TINY, "--layers", "0"], "'--layers': 0 is not in the range"),
    (["demo", *TINY, "--kv-heads", "0"], "'--kv-heads': 0 is not in the range"),
    (["demo", *TINY, "--q-heads", "0"], "'--q-heads': 0 is not in the range"),
    (["demo", *TINY, "--head-dim", "0"], "'--head-dim': '0' is not one of"),
    (["demo", *TINY, "--seed", "-5"], "'--seed': -5 is not in the range x>=0"),
    (["demo", *TINY, "--max-tokens", "99999999999999"], "'--max-tokens': 99999999999999 is not in the range"),
    (["demo", *TINY, "--layers", "100000"], "'--layers': 100000 is not in the range"),
    (["demo", *TINY, "--max-seqs", "10000000000"], "'--max-seqs'"),
    (["demo", *TINY, "--steps", "10000000000"], "'--steps'"),
    (["demo", "--preset", "llama2-70b", "--max-tokens", "16777216"], "the demo reserves at most 1024 GiB"),
    (["demo", "--layers", "256", "--kv-heads", "128", "--q-heads", "128", "--head-dim", "256"],
     "at most 4 GiB"),
    (["demo", *TINY, "--snapshot", "/nonexistent/dir/s.json"], "directory /nonexistent/dir does not exist"),
])
def test_absurd_numbers_are_usage_errors(args, message):
    assert message in run(*args, code=2)


def test_translate_positions(snapshot):
    snap = json.loads(snapshot.read_text())
    seq, length = snap["sequences"][0]["seq"], snap["sequences"][0]["length"]
    assert "'POS': -1 is not in the range x>=0" in run("translate", seq, -1, snapshot, code=2)
    assert "'SEQ': -3 is not in the range x>=0" in run("translate", -3, 0, snapshot, code=2)
    assert "'--layer': -1 is not in the range" in run("translate", seq, 0, snapshot, "--layer", -1, code=2)
    assert "'--head': -1 is not in the range" in run("translate", seq, 0, snapshot, "--head=-1", code=2)
    assert "No such option '--layr'" in run("translate", seq, 0, "--layr", snapshot, code=2)
    out = run("translate", seq, length, snapshot, code=1)
    assert f"InvalidPositionError: position {length} is out of range: sequence {seq} holds {length} tokens" in out
    assert out.count("\n") == 1
    assert "does not exist" in run("translate", 999, 0, snapshot, code=1)  # the sequence, not the position


def test_snapshot_write_failure_names_the_path(tmp_path, monkeypatch):
    def refuse(**_):
        raise PermissionError(13, "Permission denied", str(tmp_path / ".snapshot-x.json"))
    monkeypatch.setattr("pagedrt.snapshot.tempfile.mkstemp", refuse)
    out = run("demo", *TINY, "--snapshot", tmp_path / "s.json", code=1)
    assert out.splitlines()[-1] == f"Error: cannot write the snapshot {tmp_path / 's.json'}: Permission denied"


def test_host_translation_names_the_os_and_host_memory(snapshot):
    seq = json.loads(snapshot.read_text())["sequences"][0]["seq"]
    out = run("translate", seq, 0, snapshot, "--no-color")
    assert "the OS page tables map it" in out and "physical host memory" in out
    assert "GPU" not in out and "HBM" not in out


def test_json_records_carry_schema_and_version(snapshot):
    seq = json.loads(snapshot.read_text())["sequences"][0]["seq"]
    tr = json.loads(run("translate", seq, 0, snapshot, "--json"))
    assert (tr["schema"], tr["version"]) == ("pagedrt-translation", 1)
    info = json.loads(run("info", "--backend", "host", "--json"))
    assert (info["schema"], info["version"]) == ("pagedrt-info", 1)
    docs = (Path(__file__).parent.parent / "docs" / "SNAPSHOT.md").read_text()
    for schema in ("pagedrt-translation", "pagedrt-info", "pagedrt-demo"):
        assert f'`"{schema}"`' in docs


def test_demo_json_names_the_backend_used():
    report = json.loads(run("demo", *TINY[:-2], "--backend", "auto", "--json"))
    assert report["config"]["backend"] == report["snapshot"]["pool"]["backend"] in ("cuda", "host")


def test_no_color_env(snapshot):
    seq = json.loads(snapshot.read_text())["sequences"][0]["seq"]
    coloured = CliRunner().invoke(main, ["translate", str(seq), "0", str(snapshot)], color=True)
    assert "\x1b[" in coloured.output
    plain = CliRunner(env={"NO_COLOR": "1"}).invoke(main, ["translate", str(seq), "0", str(snapshot)], color=True)
    assert plain.exit_code == 0 and "\x1b[" not in plain.output and "block id" in plain.output


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_snapshot_file_mode_follows_the_umask(tmp_path, umask, mode):
    from pagedrt.snapshot import write_snapshot
    old = os.umask(umask)
    try:
        write_snapshot({"schema": "pagedrt-snapshot"}, tmp_path / "s.json")
    finally:
        os.umask(old)
    assert (tmp_path / "s.json").stat().st_mode & 0o777 == mode


def test_inspect_watch_waits_for_the_file(snapshot, tmp_path, monkeypatch):
    path = tmp_path / "live.json"
    steps = iter([
        lambda: path.write_text('{"schema": "pagedrt-snapshot", "ver'),  # a writer caught mid-write
        lambda: path.write_text(snapshot.read_text()),
        path.unlink,
        lambda: path.write_text(snapshot.read_text()),
    ])

    def sleep(_):
        step = next(steps, None)
        if step is None:
            raise KeyboardInterrupt
        step()
    monkeypatch.setattr("pagedrt.cli.time.sleep", sleep)
    result = CliRunner().invoke(main, ["inspect", str(path), "--watch", "0.1", "--no-color"])
    assert result.exit_code == 0, result.output
    waits = [line for line in result.stderr.splitlines() if line.startswith("waiting: ")]
    assert len(waits) == 3 and "no snapshot" in waits[0] and "cannot read" in waits[1] and "no snapshot" in waits[2]
    assert result.stdout.count("pool map") == 2
    assert "no snapshot" in run("inspect", path.with_name("never.json"), code=1)  # without --watch: exit 1


@pytest.mark.parametrize("args", [["demo", *TINY, "--no-color"], ["map", "--from-demo", *TINY, "--no-color"],
                                  ["translate", "0", "0", "--from-demo", *TINY, "--json"]])
def test_a_closed_pipe_ends_quietly(args):
    """``pagedrt demo | head -2``: the reader goes before the command writes; it stops, says nothing, exits 0."""
    proc = subprocess.Popen([sys.executable, "-m", "pagedrt", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the first write
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0, stderr
    assert "Error" not in stderr and "Traceback" not in stderr and "Exception ignored" not in stderr


def test_a_demo_in_which_no_prompt_fits_says_so():
    assert "holds no demo request: the shortest needs 69 tokens" in run("demo", *TINY, "--max-tokens", "16", code=2)
    # 80 tokens hold the shortest request possible, not those this seed draws: the run says nothing arrived
    out = run("demo", *TINY, "--max-tokens", "80", code=1)
    assert "no request arrived in 16 steps" in out and "checks" not in out


def test_help_names_the_snapshot_argument_and_the_demo_options_follow_from_demo():
    for command in ("map", "translate"):
        out = run(command, "--help")
        assert "SNAPSHOT: a snapshot file" in out
        assert out.index("--from-demo") < out.index("--preset") and "its options below" in out


def test_translate_json_names_the_backend(snapshot):
    seq = json.loads(snapshot.read_text())["sequences"][0]["seq"]
    tr = json.loads(run("translate", seq, 0, snapshot, "--json"))
    assert tr["backend"] == "host" and tr["location"] == "device"  # the device tier, memfds on the host backend
