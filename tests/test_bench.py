"""The benchmarks' pure parts (pagedrt.bench): the event timer on a fake CUDA clock, the standard cases,
tables, JSON records, and every benchmark's command line (all run without a GPU)."""

import ast
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedrt.attention.planner import SplitPlan
from pagedrt.bench import cases, groups, harness, partition, prefix, step, step_layers, transfer

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ("decode", "generate", "groups", "launch", "layers", "partition", "pool", "prefill", "prefix", "step",
              "step_layers", "swap", "transfer")


class FakeCuda:
    """Events stamped with a clock that each timed call advances by the next of ``durations_ms``."""

    def __init__(self, durations_ms):
        self.now, self.durations, self.calls = 0.0, list(durations_ms), 0
        clock = self

        class Event:
            def record(self):
                self.t = clock.now

            def synchronize(self):
                pass

        self.cuda = SimpleNamespace(Event=Event, get_elapsed_time=lambda a, b: b.t - a.t)

    def call(self):
        self.calls += 1
        self.now += self.durations.pop(0)


def test_event_seconds_is_the_median_of_the_timed_calls_after_the_warmup():
    cp = FakeCuda([100.0, 100.0, 4.0, 2.0, 9.0, 3.0, 5.0])  # two warm-up calls, then five timed ones
    assert harness.event_seconds(cp, cp.call, repeats=5, warmup=2) == 4.0e-3  # median of 4, 2, 9, 3, 5 ms
    assert cp.calls == 7 and not cp.durations


# --- the standard cases, against WORKLOADS.md's tables ---------------------------------------------------------

def test_decode_cases_are_the_standard_ones():
    expected = {"long-1": (1, 32768), "b8": (8, 8192), "b32": (32, 4096), "b64": (64, 2048), "b128": (128, 1024),
                "b256": (256, 512), "big": (64, 8192), "big-bf16": (64, 8192)}
    assert list(cases.DECODE_CASES) == ["long-1", "b8", "b32", "b64", "b128", "b256", "big", "var", "big-bf16"]
    for name, (batch, length) in expected.items():
        case = cases.DECODE_CASES[name]
        assert case.batch == batch and case.lengths == (length,) * batch
        assert case.dtype == ("bfloat16" if name == "big-bf16" else "float16")
    var = cases.DECODE_CASES["var"]
    assert var.dtype == "float16" and var.batch == 64
    assert var.lengths == tuple(np.random.default_rng(0).integers(1, 8193, 64).tolist())
    assert var.lengths[:4] == (6969, 5218, 4188, 2211) and sum(var.lengths) == 267327
    assert (cases.Q_HEADS, cases.KV_HEADS, cases.HEAD_DIM, cases.BLOCK_SIZE) == (32, 8, 128, 16)


def test_skew_is_a_heavy_tailed_case_beside_the_standard_ones():
    skew = cases.BENCH_DECODE_CASES["skew"]
    assert "skew" not in cases.DECODE_CASES and list(cases.BENCH_DECODE_CASES)[:-1] == list(cases.DECODE_CASES)
    lognormal = np.random.default_rng(0).lognormal(np.log(2560), 1.0, 64).astype(np.int64)
    assert skew.dtype == "float16" and skew.lengths == tuple(np.clip(lognormal, 1, 16384).tolist())
    assert sum(skew.lengths) == 260819 and max(skew.lengths) == 16384  # var: 267,327 tokens


def test_prefill_cases_are_the_standard_ones():
    p = cases.PREFILL_CASES
    assert list(p) == ["p1", "p16", "chunk", "mixed", "var"]
    assert (p["p1"].prefix, p["p1"].new) == ((0,), (8192,))
    assert (p["p16"].prefix, p["p16"].new) == ((0,) * 16, (1024,) * 16)
    assert (p["chunk"].prefix, p["chunk"].new) == ((6144,) * 4, (2048,) * 4)
    assert p["mixed"].prefix == (0,) + (2048,) * 127 and p["mixed"].new == (1024,) + (1,) * 127
    lognormal = np.random.default_rng(0).lognormal(np.log(512), 1.0, 32)
    assert p["var"].prefix == (0,) * 32
    assert p["var"].new == tuple(int(min(max(int(x), 1), 8192)) for x in lognormal)
    assert all(c.dtype == "float16" for c in p.values())


def test_prefill_flops_count_the_bottom_right_causal_mask():
    one = cases.PrefillCase("t", (3,), (2,))  # new tokens at positions 3 and 4 see 4 and 5 keys
    assert one.attended_keys == 9 and one.flops == 4 * 32 * 128 * 9
    assert cases.PREFILL_CASES["p1"].attended_keys == 8192 * 8193 // 2
    assert cases.PREFILL_CASES["chunk"].attended_keys == 4 * (2048 * 6144 + 2048 * 2049 // 2)
    assert cases.PREFILL_CASES["mixed"].attended_keys == 1024 * 1025 // 2 + 127 * 2049


@pytest.mark.parametrize("name", ["p16", "mixed"])
def test_prefill_case_arrays_hold_the_same_tokens_under_both_tables(name):
    from pagedrt.bench import prefill
    case = cases.PREFILL_CASES[name]
    a = prefill.case_arrays(np, case)  # NumPy stands in for CuPy: the host copy of what the GPU gets
    (k, v), (k_in_order, v_in_order) = a["planes"]
    scattered, ordered = a["tables"]
    lens = np.asarray(case.prefix) + np.asarray(case.new)
    assert a["q"].shape == (sum(case.new), cases.Q_HEADS, cases.HEAD_DIM) and a["lens"].tolist() == lens.tolist()
    assert a["qo"].tolist() == [0, *np.cumsum(case.new).tolist()] and a["d_qo"].dtype == np.int32
    assert ordered[ordered >= 0].tolist() == list(range(k.shape[0])) != scattered[scattered >= 0].tolist()
    for b, n in enumerate(a["blocks"]):
        assert n * cases.BLOCK_SIZE >= lens[b] > (n - 1) * cases.BLOCK_SIZE and (scattered[b, n:] == -1).all()
        assert np.array_equal(k[scattered[b, :n]], k_in_order[ordered[b, :n]])
        assert np.array_equal(v[scattered[b, :n]], v_in_order[ordered[b, :n]])


def test_scattered_table_is_the_seeded_permutation_of_the_blocks_each_sequence_needs():
    table, n = cases.scattered_table([33, 16, 1])
    assert n == 3 + 1 + 1 and table.dtype == np.int32 and table.shape == (3, 3)
    perm = np.random.default_rng(cases.TABLE_SEED).permutation(5)
    assert table.tolist() == [perm[:3].tolist(), [perm[3], -1, -1], [perm[4], -1, -1]]
    ordered, _ = cases.scattered_table([33, 16, 1], shuffle=False)
    assert ordered.tolist() == [[0, 1, 2], [3, -1, -1], [4, -1, -1]]


# --- tables and records ------------------------------------------------------------------------------------

def test_format_table_aligns_formats_and_marks_missing_values():
    cols = (harness.Column("case", "case", width=6, left=True), harness.Column("us", "us", "{:.1f}", 7),
            harness.Column("pct", "paging", "{:+.1f}%", 7))
    text = harness.format_table(cols, [{"case": "b8", "us": 68.64, "pct": 1.55}, {"case": "long-1", "us": None,
                                                                                  "pct": -0.2}])
    assert text.splitlines() == ["case        us  paging",
                                 "----------------------",
                                 "b8        68.6   +1.6%",
                                 "long-1       -   -0.2%"]


def test_a_record_says_what_ran_where_and_holds_rows_and_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["decode.py", "--cases", "b8"])
    info = {"device": "NVIDIA H200", "driver": "13.0", "commit": "abc1234"}
    rows, bandwidth = [{"case": "b8", "us": 68.6}], {"copy": 4.3e12, "stream": 4.54e12}
    harness.publish("decode", tmp_path / "run.json", info, rows, "a table", repeats=100, ceilings=bandwidth)
    assert capsys.readouterr().out == "a table\n"
    back = json.loads((tmp_path / "run.json").read_text())
    assert back == harness.record("decode", info, rows, "a table", repeats=100, ceilings=bandwidth)
    assert list(back) == ["benchmark", "command", "device", "repeats", "ceilings", "rows", "table"]
    assert back["command"] == "python3 -m pagedrt.bench.decode --cases b8"


def test_header_names_device_driver_commit_and_ceilings():
    info = {"device": "NVIDIA H200", "sms": 132, "l2_bytes": 60 << 20, "driver": "13.0", "runtime": "13.0",
            "cupy": "14.2.0", "commit": None}
    line = harness.header(info, {"copy": 4.30e12, "stream": 4.54e12})
    assert line.startswith("NVIDIA H200: 132 SMs, L2 60 MiB; driver 13.0")
    assert "commit unknown" in line and "copy 4.30 TB/s" in line and "stream 4.54 TB/s" in line


# --- the paged-read bound's chunks ---------------------------------------------------------------------------

def chunks_one_by_one(table, lengths, block_size, kv_heads, chunk_bytes):
    out = []
    for row, length in zip(table, lengths):
        for head in range(kv_heads):
            for j in range(-(-length // block_size)):
                out.append(int(row[j]) * kv_heads * chunk_bytes + head * chunk_bytes)
    return out


def test_chunk_offsets_walk_each_sequence_head_by_head_through_its_blocks():
    table = np.array([[7, 3, -1], [5, -1, -1]], np.int32)  # 17 tokens: two blocks, the second with one token
    offsets = harness.chunk_offsets(table, [17, 16], block_size=16, kv_heads=2, chunk_bytes=4096)
    assert offsets.dtype == np.int64
    assert offsets.tolist() == [7 * 8192, 3 * 8192, 7 * 8192 + 4096, 3 * 8192 + 4096, 5 * 8192, 5 * 8192 + 4096]
    one, _ = cases.scattered_table([33])  # a batch of one
    assert harness.chunk_offsets(one, [33], 16, 8, 4096).tolist() == chunks_one_by_one(one, [33], 16, 8, 4096)


@given(lengths=st.lists(st.integers(1, 200), min_size=1, max_size=8), block_size=st.sampled_from([1, 4, 16, 32]),
       kv_heads=st.integers(1, 8), itemsize=st.sampled_from([1, 2]), shuffle=st.booleans(), spare=st.integers(0, 3))
@settings(max_examples=80, deadline=None)
def test_chunk_offsets_are_the_chunks_read_one_by_one(lengths, block_size, kv_heads, itemsize, shuffle, spare):
    table, _ = cases.scattered_table(lengths, block_size, shuffle)
    table = np.pad(table, ((0, 0), (0, spare)), constant_values=-1)  # a table wider than the longest sequence
    chunk_bytes = block_size * cases.HEAD_DIM * itemsize
    offsets = harness.chunk_offsets(table, lengths, block_size, kv_heads, chunk_bytes)
    assert offsets.tolist() == chunks_one_by_one(table, lengths, block_size, kv_heads, chunk_bytes)


# --- the commands ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_documents_its_command_without_cupy(name):
    done = subprocess.run([sys.executable, "-m", f"pagedrt.bench.{name}", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"python3 -m pagedrt.bench.{name}" in done.stdout


def test_generate_counts_the_gemm_flops_of_the_synthetic_model():
    pytest.importorskip("gguf", reason="the engine reads GGUF with the gguf package")
    from pagedrt.bench import generate
    model = generate.synthetic_model()
    c, w = model.config, model.weights
    params = sum(layer[k].size for layer in w.layers for k in ("qkv", "o", "gate_up", "down")) + w.output.size
    assert generate.gemm_flops(c, 256) == 2 * 256 * params
    assert (c.num_layers, c.q_heads, c.kv_heads, c.head_dim, c.vocab_size) == (30, 9, 3, 64, 49152)


def test_prefix_trace_hits_evicts_and_is_seeded():
    first = prefix.run(200, 0, 8192, "host")
    assert first["backend"] == "host" and first["requests"] > 10
    assert 0.3 < first["hit_rate"] < 1 and first["blocks_saved"] * 16 == first["hit_tokens"]
    assert first["evictions"] > 0 and first["peak_held_blocks"] < first["peak_unshared_blocks"]
    again = prefix.run(200, 0, 8192, "host")
    assert {k: v for k, v in again.items() if not k.endswith("_us")} == \
        {k: v for k, v in first.items() if not k.endswith("_us")}


def test_step_runs_on_the_host_backend_and_maps_ahead():
    for placement in ("plane", "block"):
        backend, times, grows = step.run(64, 32, "host", placement, "decode", "steady")
        assert backend == "host" and times.shape == (32,) and grows == 0
        _, _, grows = step.run(64, 32, "host", placement, "mixed", "demand")
        assert grows > 0
        _, _, ahead = step.run(64, 32, "host", placement, "mixed", "ahead", gap_us=2000)
        assert ahead < grows


def imports(path):
    """(module, names) of every import in a file: ``import a.b`` -> ("a.b", []); ``from .x import y`` ->
    (".x", ["y"]), relative modules kept relative."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append(("." * node.level + (node.module or ""), [alias.name for alias in node.names]))
    return out


def test_the_benchmarks_sit_on_top():
    """Nothing in the runtime imports the benchmarks, and they import nothing private from it."""
    for path in (ROOT / "pagedrt").rglob("*.py"):
        found = imports(path)
        if path.parent.name != "bench":
            assert not [m for m, names in found if "bench" in m.split(".") or "bench" in names], path
        else:
            assert not [m for m, names in found if any(n.startswith("_") for n in names)], path
            assert "sys.path" not in path.read_text(), path


# --- the split plan's partition, on the host -----------------------------------------------------------------

@given(lens=st.lists(st.integers(1, 5000), min_size=1, max_size=6), num_splits=st.integers(1, 12),
       segment=st.sampled_from([64, 128, 1024]))
@settings(max_examples=60, deadline=None)
def test_partition_segments_cover_every_token_once_as_the_plan_cuts_them(lens, num_splits, segment):
    split = SplitPlan(num_splits, segment, "standard")
    tokens = partition.segments(lens, split)
    assert tokens.shape == (num_splits, len(lens), cases.KV_HEADS)
    assert (tokens.sum(axis=0) == np.asarray(lens)[:, None]).all()
    for b, length in enumerate(lens):
        assert tokens[:, b, 0].tolist() == [end - begin for begin, end in split.segments(length)]


def test_schedule_hands_blocks_in_order_to_the_first_free_slot():
    ends, where = partition.schedule([3.0, 1.0, 1.0, 2.0], slots=2)
    assert where.tolist() == [0, 1, 1, 1] and ends.tolist() == [3.0, 4.0]


def test_partition_of_var_and_skew_on_the_h200():
    var, skew = (partition.partition(cases.BENCH_DECODE_CASES[n]) for n in ("var", "skew"))
    assert (var["num_splits"], var["segment_tokens"], var["geometry"]) == (8, 1024, "standard")
    assert (skew["num_splits"], skew["segment_tokens"], skew["geometry"]) == (16, 1024, "standard")
    assert var["live_blocks"] == 8 * sum(-(-n // 1024) for n in cases.DECODE_CASES["var"].lengths)
    assert skew["grid_blocks"] == 64 * 8 * 16 and skew["resident_blocks"] == 264
    forced = partition.partition(cases.BENCH_DECODE_CASES["skew"], num_splits=32)
    assert forced["segment_tokens"] == 512 and forced["live_blocks"] > skew["live_blocks"]


@pytest.mark.parametrize("argv, message", [
    (["--splits", "0"], "--sms, --per-sm and --splits must be at least 1"),
    (["--splits", "-3"], "--sms, --per-sm and --splits must be at least 1"),
    (["--sms", "0"], "--sms, --per-sm and --splits must be at least 1"),
    (["--per-sm", "-1"], "--sms, --per-sm and --splits must be at least 1"),
    (["--stream-tb-s", "0"], "--stream-tb-s must be positive"),
    (["--start-us", "-1"], "--start-us and --empty-us not negative"),
    (["--empty-us", "-0.5"], "--start-us and --empty-us not negative"),
    (["--cases", "long-1,nope"], "unknown cases ['nope']")])
def test_partition_refuses_bad_arguments_with_a_usage_error(argv, message, capsys):
    """bench.partition's numbers that would divide by zero or index nothing stop with a usage error naming
    them, not a traceback."""
    with pytest.raises(SystemExit) as stop:
        partition.main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_partition_of_one_long_sequence_streams_at_the_whole_ceiling():
    """long-1's 8 KV heads x 16 equal segments fill half the H200's 264 resident slots (the split plan's one
    block an SM at head_dim 128): those 128 blocks share the whole ceiling, so one wave ends a start after the
    floor, and the busiest slot holds what every slot that ran holds."""
    long1 = partition.partition(cases.BENCH_DECODE_CASES["long-1"])
    assert (long1["num_splits"], long1["live_blocks"], long1["resident_blocks"]) == (16, 128, 264)
    assert long1["model_us"] == pytest.approx(long1["floor_us"] + 1.0)
    assert long1["critical_over_mean"] == pytest.approx(1.0)


# --- the 32-layer step's pure parts ---------------------------------------------------------------------------

def test_step_layers_writes_each_sequences_newest_token_and_counts_its_bytes():
    table = np.array([[7, 3, -1], [5, -1, -1]], np.int32)
    slots = step_layers.new_token_slots(table, [17, 16])  # positions 16 (block 1, slot 0) and 15 (block 0, 15)
    assert slots.tolist() == [3 * 16, 5 * 16 + 15] and slots.dtype == np.int64
    per_token = cases.KV_HEADS * cases.HEAD_DIM * 2
    assert step_layers.step_bytes([17, 16], 2, 2) == 2 * 33 * per_token + 2 * 2 * 32 * 128 * 2 + 4 * 2 * per_token
    # FP8: K/V one byte a value, read and stored; q, out and the new tokens read in fp16
    assert step_layers.step_bytes([17, 16], 2, 2, 1) == (2 * 33 * per_token // 2 + 2 * 2 * 32 * 128 * 2
                                                         + 2 * 2 * 8 * 128 * 3)
    assert "skew" in step_layers.CASES and "big-bf16" not in step_layers.CASES


@pytest.mark.parametrize("argv, message", [(["--groups", "0,4"], "groups run from 1 to 64"),
                                           (["--groups", "65"], "groups run from 1 to 64"),
                                           (["--batch", "0"], "--batch and --length must be positive"),
                                           (["--cases", "b8,nope"], None)])
def test_groups_and_case_lists_are_checked_before_any_device_work(argv, message, capsys):
    """Bad group widths (bench.groups) and unknown case names (harness.case_names, bench.step_layers) stop with a
    usage error naming them, before CuPy is imported."""
    main = groups.main if message else step_layers.main
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert (message or "unknown cases ['nope']") in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [(["--cases", "p1,nope"], "unknown cases ['nope']"),
                                           (["--repeats", "0"], "--repeats must be at least 1")])
def test_prefill_checks_its_cases_and_repeats_before_any_device_work(argv, message, capsys):
    from pagedrt.bench import prefill
    with pytest.raises(SystemExit) as stop:
        prefill.main(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_transfer_counts_whole_blocks_of_k_and_v_and_refuses_other_sizes(capsys):
    assert transfer.transfer_bytes(16, 1) == 2 * 16 * 8 * 128 * 2  # one block of one layer's K and V: 64 KiB
    assert transfer.transfer_bytes(32768, 32) == 4 << 30
    args = transfer.parse(["--tokens", "16,4096", "--layers", "32", "--repeats", "3"])
    assert (args.tokens, args.layers, args.repeats, args.out) == ([16, 4096], [32], 3, None)
    assert transfer.parse([]).tokens == [16, 256, 4096, 32768] and transfer.parse([]).layers == [1, 32]
    for argv, words in ((["--tokens", "16,24"], "--tokens [24]"), (["--tokens", "0"], "--tokens [0]"),
                        (["--layers", "33"], "--layers [33]"), (["--repeats", "0"], "--repeats")):
        with pytest.raises(SystemExit):
            transfer.parse(argv)
        assert words in capsys.readouterr().err
    assert transfer.devices(2) == (0, 1, "device 0 to device 1")
    assert transfer.devices(1) == (0, 0, "one GPU: device 0 to device 0")


@pytest.mark.parametrize("text,why", [(None, "No such file"), ("{bad", "Expecting property name"),
                                      ('{"a": 1}', "not a list of records"),
                                      ('[{"peer": "fi", "case": "1 by 547"}]', "not a list of records")])
def test_generate_refuses_a_peers_file_before_any_device_work(tmp_path, capsys, text, why):
    """Read first, so a bad file costs no device time; one usage line, no traceback."""
    from pagedrt.bench import generate
    path = tmp_path / "peers.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        generate.read_peers(generate.parser(), str(path))
    assert exit_.value.code == 2 and why in capsys.readouterr().err


def test_generate_reads_the_peers_records(tmp_path):
    import json
    from pagedrt.bench import generate
    records = [{"peer": "flashinfer", "case": "1x547", "step_ms": 1.9}]
    path = tmp_path / "peers.json"
    path.write_text(json.dumps(records))
    assert generate.read_peers(generate.parser(), str(path)) == records
