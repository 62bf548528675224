"""The snapshot reader trusts no file: hostile snapshots end in one SnapshotError, never a traceback or a hang.

Hand-written hostile files (each a reproducer of a crash, hang or wrong output the
reader once had), then hypothesis: a valid snapshot with one field replaced by a
hostile value or removed, and random JSON. Whatever the reader accepts must render.
`map`, `translate` and `inspect` on each hostile file exit 1 with one line.
"""

import copy
import json
import os
import time
import tracemalloc

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedrt.cache import PagedKVCache
from pagedrt.cli import main
from pagedrt.errors import PagedRTError, SnapshotError
from pagedrt.render import block_tables, chain, chain_lines, chunk_table, pool_map
from pagedrt.snapshot import MAX_SNAPSHOT_BYTES, load_snapshot, validate_snapshot

FAST = settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.too_slow])


def make_valid():
    """A snapshot with mapped and released chunks, a fork sharing blocks, an empty sequence, cached blocks, a host
    tier holding the fork's own block (swapped out)."""
    with PagedKVCache(2, 2, 64, 16, max_tokens=2048, chunk_bytes=32768, backend="host", host_tokens=512) as cache:
        a, gone = cache.add_sequence(), cache.add_sequence()
        cache.append([a, gone], [40, 200])
        b = cache.fork(a)
        cache.append(b, 3)
        cache.swap_out([b])
        cache.free([gone])
        cache.trim()
        cache.add_sequence()
        cached = cache.add_sequence()
        cache.append(cached, 32, token_ids=list(range(32)))  # two cached blocks
        cache.free(cached)
        cache.add_sequence(list(range(20)))  # holds the first; the second stays cached-free
        return json.loads(json.dumps(cache.snapshot()))


VALID = make_valid()
DEVICE_BLOCKS = ((VALID["layout"]["chunks_per_plane"] - VALID["layout"]["host_chunks"])
                 * VALID["blocks"]["blocks_per_chunk"])


def test_the_valid_snapshot_covers_the_cases():
    chunks, seqs = VALID["pool"]["chunks"], VALID["sequences"]
    assert {c["state"] for c in chunks} == {"mapped", "released"}
    assert max(VALID["blocks"]["ref_counts"]) == 2 and any(s["length"] == 0 for s in seqs)
    refs = VALID["blocks"]["ref_counts"]
    assert sorted({refs[b] for b in VALID["blocks"]["cached"]}) == [0, 1]  # held and cached-free
    assert {c["location"] for c in chunks} == {"device", "host"} and any(s["swapped"] for s in seqs)
    assert validate_snapshot(copy.deepcopy(VALID)) == VALID


def renders(snap):
    """Everything the CLI shows of a snapshot, as it would; a named error is an answer too."""
    lines = chunk_table(snap) + block_tables(snap) + pool_map(snap)
    for entry in snap["sequences"]:
        for pos in (0, entry["length"] - 1, entry["length"]):
            try:
                lines += chain_lines(snap, chain(snap, entry["seq"], pos, 1, "v", 1))
            except PagedRTError:
                assert pos in (entry["length"], -1)
    assert sum(len(line) for line in lines) < 1 << 20
    return lines


def with_value(path, value, snap=VALID):
    """A copy of ``snap`` with the field at ``path`` (keys and indices) set to ``value``, or removed."""
    snap = copy.deepcopy(snap)
    *parents, last = path
    node = snap
    for key in parents:
        node = node[key]
    if value is REMOVE:
        del node[last]
    else:
        node[last] = value
    return snap


REMOVE = object()
SEQ_BLOCKS = ("sequences", 0, "blocks")

# name: (the file's text, a fragment the error must contain)
HOSTILE = {
    "no time": (with_value(("time",), REMOVE), "time: is missing"),
    "time a string": (with_value(("time",), "yesterday"), "time: must be a Unix time"),
    "time NaN": (json.dumps(VALID | {"time": float("nan")}), "NaN is not a JSON number"),
    "time 1e999": (json.dumps(VALID).replace(f'"time": {json.dumps(VALID["time"])}', '"time": 1e999'),
                   "time: must be"),
    "blocks_per_chunk 0": (with_value(("blocks", "blocks_per_chunk"), 0), "blocks.blocks_per_chunk: is 0"),
    "blocks_per_chunk 1e9": (with_value(("blocks", "blocks_per_chunk"), 10**9), "blocks.blocks_per_chunk"),
    "num_chunks 0": (with_value(("blocks", "num_chunks"), 0), "blocks.num_chunks: is 0"),
    "num_chunks 1e9": (with_value(("blocks", "num_chunks"), 10**9), "blocks.num_chunks"),
    "layout chunks 1e9": (with_value(("layout", "chunks_per_plane"), 10**9), "pool.max_bytes"),
    "blocks null": (with_value(SEQ_BLOCKS, None), "sequences[0].blocks: must be a list, got null"),
    "base a string": (with_value(("pool", "base"), "0x10"), "pool.base: must be an int, got str"),
    "base negative": (with_value(("pool", "base"), -1), "pool.base: must be in"),
    "base at the top": (with_value(("pool", "base"), 2**64 - 4096), "runs past a 64-bit address space"),
    "block id -1": (with_value(SEQ_BLOCKS + (0,), -1), "sequences[0].blocks[0]: must be in 0.."),
    "block id 1e9": (with_value(SEQ_BLOCKS + (0,), 10**9), "sequences[0].blocks[0]: must be in 0.."),
    "block id 1e30": (with_value(SEQ_BLOCKS + (0,), 10**30), "sequences[0].blocks[0]: must be in 0.."),
    "block id true": (with_value(SEQ_BLOCKS + (0,), True), "must be an int, got bool"),
    "block size -16": (with_value(("layout", "block_size"), -16), "layout.block_size: must be one of"),
    "block size 24": (with_value(("layout", "block_size"), 24), "layout.block_size"),
    "version 0": (with_value(("version",), 0), "snapshot version 0"),
    "version 2": (with_value(("version",), 2), "upgrade pagedrt"),
    "version 1.0": (with_value(("version",), 1.0), "snapshot version 1.0"),
    "version true": (with_value(("version",), True), "snapshot version True"),
    "no schema": (with_value(("schema",), REMOVE), "not a pagedrt snapshot"),
    "a list": ("[1, 2, 3]", "not a pagedrt snapshot"),
    "empty": ("", "cannot read snapshot"),
    "not utf-8": (b"\xff\xfe{}", "cannot read snapshot"),
    "deep nesting": ("[" * 100_000, "nest deeper than"),
    "deep objects": ('{"a": ' * 50_000, "nest deeper than"),
    "brackets in strings": (json.dumps(VALID | {"note": "[" * 100}), None),  # valid: strings hold anything
    "huge int": ('{"schema": "pagedrt-snapshot", "version": ' + "9" * 5000 + "}", "cannot read snapshot"),
    "length past blocks": (with_value(("sequences", 0, "length"), VALID["sequences"][0]["length"] + 16),
                           "sequences[0].blocks: has"),
    "block in a hole": (with_value(SEQ_BLOCKS + (0,), DEVICE_BLOCKS - 1), "which is not mapped"),
    "host block, not swapped": (with_value(SEQ_BLOCKS + (0,), DEVICE_BLOCKS), "not swapped out"),
    "block held twice": (with_value(SEQ_BLOCKS + (1,), VALID["sequences"][0]["blocks"][0]), "holds a block twice"),
    "ref count off": (with_value(("blocks", "ref_counts", VALID["sequences"][0]["blocks"][0]), 7),
                      "blocks.ref_counts["),
    "free off": (with_value(("blocks", "free"), VALID["blocks"]["free"] + 1), "blocks.free: is"),
    "chunk not mapped": (with_value(("blocks", "chunk_mapped", 0), False), "blocks.chunk_mapped[0]"),
    "chunk record twice": (with_value(("pool", "chunks", 1), VALID["pool"]["chunks"][0]), "out of order"),
    "chunk va wrong": (with_value(("pool", "chunks", 0, "va_start"), 16), "pool.chunks[0].va_start"),
    "seq twice": (with_value(("sequences", 1, "seq"), VALID["sequences"][0]["seq"]), "appears twice"),
    "seq past the table": (with_value(("sequences", 0, "seq"), 10**6), "sequences[0].seq: must be in"),
    "itemsize wrong": (with_value(("layout", "itemsize"), 4), "layout.itemsize"),
    "itemsize 2.0": (with_value(("layout", "itemsize"), 2.0), "layout.itemsize: is 2.0"),
    "chunk va a float": (with_value(("pool", "chunks", 0, "va_start"), float(VALID["pool"]["chunks"][0]["va_start"])),
                         "pool.chunks[0].va_start: is"),
    "pool page size": (with_value(("pool", "page_bytes"), 1), "pool.page_bytes"),
    "newline in a field": (with_value(("pool", "chunks", 1, "va_start"), "\n"), "pool.chunks[1].va_start: is '\\n'"),
    "a long string": (with_value(("pool", "backend"), "x" * 1_000_000), "pool.backend: must be one of"),
    "a long int": (with_value(("max_seqs",), 10**4000), "max_seqs: must be in"),
    "sequences a dict": (with_value(("sequences",), {}), "sequences: must be a list"),
    "layout a list": (with_value(("layout",), []), "layout: must be an object"),
}


def contents(spec):
    text = spec if isinstance(spec, (str, bytes)) else json.dumps(spec)
    return text.encode() if isinstance(text, str) else text


@pytest.fixture(scope="module")
def hostile_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    for i, (text, _) in enumerate(HOSTILE.values()):
        (d / f"{i}.json").write_bytes(contents(text))
    os.mkfifo(d / "fifo.json")
    os.symlink("/dev/zero", d / "zero.json")
    with open(d / "big.json", "wb") as f:
        f.truncate(MAX_SNAPSHOT_BYTES + 1)  # sparse: no disk
    return d


SPECIAL = {"fifo.json": "is a FIFO", "zero.json": "is a character device", "big.json": "larger than"}
CASES = [(f"{i}.json", fragment) for i, (_, fragment) in enumerate(HOSTILE.values())] + list(SPECIAL.items())
IDS = list(HOSTILE) + list(SPECIAL)


@pytest.mark.parametrize("name, fragment", CASES, ids=IDS)
def test_hostile_file_is_one_named_error(hostile_dir, name, fragment):
    path = hostile_dir / name
    tracemalloc.start()
    start = time.monotonic()
    try:
        if fragment is None:
            renders(load_snapshot(path))
            return
        with pytest.raises(SnapshotError) as info:
            load_snapshot(path)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert time.monotonic() - start < 5 and peak < 8 * MAX_SNAPSHOT_BYTES
    assert fragment in str(info.value) and str(path) in str(info.value)
    assert "\n" not in str(info.value) and len(str(info.value)) < 400 + len(str(path))


@pytest.mark.parametrize("name, fragment", CASES, ids=IDS)
def test_commands_on_hostile_file_exit_1_with_one_line(hostile_dir, name, fragment):
    if fragment is None:
        return
    path = str(hostile_dir / name)
    for args in (["map", path], ["translate", "0", "0", path], ["inspect", path]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1, (args, result.output)
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
        assert result.output.count("\n") == 1 and result.output.startswith("Error: SnapshotError:")


def paths(node, prefix=()):
    """Every key path in a JSON value, inner nodes included (long lists: a few entries)."""
    yield prefix
    items = (node.items() if isinstance(node, dict)
             else [(i, node[i]) for i in sorted({0, 1, len(node) - 1} & set(range(len(node))))]
             if isinstance(node, list) else [])
    for key, child in items:
        yield from paths(child, prefix + (key,))


PATHS = [p for p in paths(VALID) if p]
HOSTILE_VALUES = st.one_of(
    st.none(), st.booleans(), st.sampled_from([0, -1, 1, 2, 10**9, 2**31, 2**63, 2**64, -(2**63), 10**30]),
    st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.lists(st.integers(-3, 10**9), max_size=8), st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
    st.just(REMOVE))
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
                    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner,
                                                                                max_size=5), max_leaves=30)


def check(tmp, snap):
    """Load ``snap`` from a file: a SnapshotError, or a snapshot that renders; quickly either way."""
    path = tmp / "fuzz.json"
    path.write_text(json.dumps(snap))
    start = time.monotonic()
    try:
        renders(load_snapshot(path))
    except SnapshotError as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 400 + len(str(path))
    assert time.monotonic() - start < 1.5


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@FAST
@given(path=st.sampled_from(PATHS), value=HOSTILE_VALUES)
def test_one_field_hostile(tmp, path, value):
    check(tmp, with_value(path, value))


@FAST
@given(first=st.sampled_from(PATHS), second=st.sampled_from(PATHS), a=HOSTILE_VALUES, b=HOSTILE_VALUES)
def test_two_fields_hostile(tmp, first, second, a, b):
    snap = with_value(first, a)
    try:
        snap = with_value(second, b, snap)
    except (KeyError, IndexError, TypeError):
        pass  # the first change removed the second's parent
    check(tmp, snap)


@FAST
@given(value=JSON)
def test_random_json(tmp, value):
    check(tmp, value)


@FAST
@given(layout=st.fixed_dictionaries({k: JSON for k in VALID["layout"]}))
def test_random_layout(tmp, layout):
    check(tmp, VALID | {"layout": layout})
