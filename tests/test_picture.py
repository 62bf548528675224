"""Pictures of both layers (pagedrt.picture, `pagedrt map --svg/--png`) and plots of benchmark records.

The SVG is parsed as XML and read back: its title's counts, one mark per row of chunks, every cell's
colour against each block's state computed here block by block (a loop, not the picture's bincounts),
the legend. Synthetic snapshots (tools/make_pictures.py) are checked by validate_snapshot first.
"""

import importlib.util
import json
import math
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from pagedrt import picture as P
from pagedrt.cli import main
from pagedrt.errors import UnsupportedConfigError
from pagedrt.snapshot import load_snapshot, validate_snapshot

ROOT = Path(__file__).resolve().parents[1]
SVG = "{http://www.w3.org/2000/svg}"
TINY = ["--preset", "tiny", "--steps", "24", "--max-tokens", "2048", "--backend", "host"]


def load_tool(name):
    spec = importlib.util.spec_from_file_location(f"tools_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOOL = load_tool("make_pictures")


def run(*args, code=0):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return result.output


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    path = tmp_path_factory.mktemp("snap") / "state.json"
    run("demo", *TINY, "--no-color", "--snapshot", path)
    return path


def expected_title(snap):
    """The title's counts, computed from the snapshot's own lists."""
    n = snap["blocks"]["num_chunks"]
    host_from = n - snap["layout"]["host_chunks"]
    mapped = [c["chunk"] % n for c in snap["pool"]["chunks"] if c["state"] == "mapped"]
    released = {c["chunk"] % n for c in snap["pool"]["chunks"]} - set(mapped)
    refs, sequences = snap["blocks"]["ref_counts"], len(snap["sequences"])
    return (f"pagedrt pool: {n} chunk{'s' * (n != 1)} ({len({k for k in mapped if k < host_from})} mapped, "
            f"{len(released)} "
            f"released, {len({k for k in mapped if k >= host_from})} on the host tier); "
            f"{snap['blocks']['max_blocks']} blocks: {sum(r > 0 for r in refs)} held ({sum(r > 1 for r in refs)} "
            f"shared), {sum(refs[b] == 0 for b in snap['blocks']['cached'])} cached-free, {snap['blocks']['free']} "
            f"free; {sequences} sequence{'s' * (sequences != 1)}")


def block_colours(snap):
    """Each block's colour, one block at a time: what a cell of one block must show."""
    blocks, n = snap["blocks"], snap["blocks"]["num_chunks"]
    bpc, refs = blocks["blocks_per_chunk"], blocks["ref_counts"]
    ever = {c["chunk"] % n for c in snap["pool"]["chunks"]}
    owner = {b: e["seq"] for e in snap["sequences"] for b in e["blocks"]}
    colours = []
    for b in range(blocks["max_blocks"]):
        k = b // bpc
        if not blocks["chunk_mapped"][k]:
            colours.append(P.COLOURS["released" if k in ever else "reserved"])
        elif refs[b] > 1:
            colours.append(P.COLOURS["shared"])
        elif refs[b] == 1:
            colours.append(P.SEQ_COLOURS[owner[b] % len(P.SEQ_COLOURS)])
        else:
            colours.append(P.COLOURS["cached" if b in blocks["cached"] else "free"])
    return colours


def cells_of(root, pic):
    """The grid's colours read back from the SVG's merged runs: {(row, col): colour}."""
    px, gx, gy, rows, cols = P._geometry(pic)
    found = {}
    for rect in root.find(f"{SVG}g[@id='blocks']"):
        x, y, w = (int(float(rect.get(k))) for k in ("x", "y", "width"))
        for col in range((x - gx) // px, (x - gx + w) // px):
            found[(y - gy) // px, col] = rect.get("fill")
    return found


def test_svg_of_a_demo_shows_every_block_chunk_and_count(snapshot, tmp_path):
    out = run("map", snapshot, "--svg", tmp_path / "pool.svg")
    snap = load_snapshot(snapshot)
    root = ET.parse(tmp_path / "pool.svg").getroot()
    title = root.find(f"{SVG}title").text
    assert title == expected_title(snap) and title in out
    pic = P.picture(snap)
    assert pic.blocks_per_cell == 1 and pic.chunks_per_row == 1  # a demo's pool: no aggregation
    cells = cells_of(root, pic)
    bpc = snap["blocks"]["blocks_per_chunk"]
    assert cells == {(b // bpc, b % bpc): c for b, c in enumerate(block_colours(snap))}
    marks = root.findall(f".//{SVG}rect[@class='chunk']")
    assert len(marks) == snap["blocks"]["num_chunks"]
    mapped = [m for m in marks if m.get("fill") == P.CHUNK_COLOURS["mapped"]]
    assert len(mapped) == sum(snap["blocks"]["chunk_mapped"])
    legend = [item.find(f"{SVG}text").text for item in root.find(f"{SVG}g[@id='legend']")]
    assert legend[:len(P.CATEGORIES)] == [P.LABELS[c] for c in P.CATEGORIES] and len(legend) == 10
    tables = root.findall(f".//{SVG}rect[@class='table']")
    assert [t.find(f"{SVG}title").text.split(":")[0] for t in tables] == [f"sequence {e['seq']}"
                                                                          for e in snap["sequences"]]


@pytest.mark.parametrize("host_blocks", [0, None])
def test_aggregated_cells_show_what_most_of_their_blocks_are(host_blocks):
    """20,000 blocks: cells of several blocks, rows of several chunks, chunks released and never mapped past the
    highest mapped one (without a host tier) or before it; every cell against a per-cell count done here."""
    snap = validate_snapshot(TOOL.synthetic_snapshot(20_000, seed=3, host_blocks=host_blocks))
    pic = P.picture(snap)
    assert pic.blocks_per_cell > 1 and pic.chunks_per_row > 1
    colours = np.array(block_colours(snap))
    bpc, n = snap["blocks"]["blocks_per_chunk"], snap["blocks"]["num_chunks"]
    rows, cols = pic.cells.shape
    assert rows == math.ceil(n / pic.chunks_per_row) and cols <= P.MAX_COLS and rows <= P.MAX_ROWS
    order = list(P.COLOURS.values())  # reserved, released, free, cached, shared: ties go to the later
    for r in range(rows):
        for c in range(cols):
            start = r * pic.chunks_per_row * bpc + c * pic.blocks_per_cell
            end = min(start + pic.blocks_per_cell, (r + 1) * pic.chunks_per_row * bpc, n * bpc)
            if start >= end:
                assert pic.cells[r, c] == -1
                continue
            values, counts = np.unique(colours[start:end], return_counts=True)
            held = {v: k for v, k in zip(values, counts) if v in P.SEQ_COLOURS}
            by_kind = {v: k for v, k in zip(values, counts) if v not in P.SEQ_COLOURS}
            by_kind["held"] = sum(held.values())
            best = max(by_kind.values())
            kind = max((k for k in by_kind if by_kind[k] == best), key=lambda k: 5 if k == "held" else order.index(k))
            shown = pic.palette[pic.cells[r, c]]
            if kind == "held":
                top = max(held.values())
                assert shown in [v for v in held if held[v] == top], (r, c)
            else:
                assert shown == kind, (r, c)


def test_a_large_pool_draws_one_mark_per_row_of_chunks_and_a_bounded_document():
    snap = validate_snapshot(TOOL.synthetic_snapshot(100_000))
    text = P.svg(P.picture(snap))
    root = ET.fromstring(text)
    assert root.find(f"{SVG}title").text == expected_title(snap)
    marks = root.findall(f".//{SVG}rect[@class='chunk']")
    per_row = math.ceil(snap["blocks"]["num_chunks"] / P.MAX_ROWS)
    assert len(marks) == math.ceil(snap["blocks"]["num_chunks"] / per_row)
    counted = sum(int(part.split()[0]) for m in marks for part in m.find(f"{SVG}title").text.split(": ")[1].split(", "))
    assert counted == snap["blocks"]["num_chunks"]
    assert len(root.find(f"{SVG}g[@id='blocks']")) <= P.MAX_ROWS * P.MAX_COLS
    assert len(root.findall(f".//{SVG}rect[@class='table']")) == P.MAX_TABLE_ROWS


def test_a_pool_with_nothing_mapped_and_one_with_a_swapped_sequence():
    from pagedrt.cache import PagedKVCache
    with PagedKVCache(2, 2, 64, 16, max_tokens=4096, backend="host", host_tokens=1024, growth=False) as cache:
        empty = validate_snapshot(cache.snapshot())
        seq = cache.add_sequence()
        cache.append(seq, 100)
        cache.swap_out([seq])
        swapped = validate_snapshot(cache.snapshot())
    pic = P.picture(empty)
    assert pic.title == expected_title(empty) and "0 sequences" in pic.title
    device_rows = pic.cells[:len(pic.row_state) - 1] if empty["layout"]["host_chunks"] else pic.cells
    assert set(np.unique(device_rows)) <= {P.RESERVED, -1}
    pic = P.picture(swapped)
    assert pic.title == expected_title(swapped) and pic.tables[0][3]  # drawn as swapped out
    assert P.CHUNK_STATES[pic.row_state[-1]] == "host"
    root = ET.fromstring(P.svg(pic))
    assert "(swapped)" in "".join(root.find(f"{SVG}g[@id='tables']").itertext())
    cells = cells_of(root, pic)
    colour = P.SEQ_COLOURS[swapped["sequences"][0]["seq"] % len(P.SEQ_COLOURS)]
    host_row = len(pic.row_state) - 1
    assert [c for (r, _), c in cells.items() if r == host_row].count(colour) > 0


def test_png_renders(snapshot, tmp_path):
    image = pytest.importorskip("matplotlib.image")
    run("map", snapshot, "--png", tmp_path / "pool.png")
    pixels = image.imread(tmp_path / "pool.png")
    assert pixels.ndim == 3 and pixels.shape[0] > 300 and pixels.shape[1] > 600
    assert len(np.unique(pixels.reshape(-1, pixels.shape[2]), axis=0)) > 10  # drawn, not blank


def test_bad_input_is_one_line(snapshot, tmp_path, monkeypatch):
    hostile = tmp_path / "hostile.json"
    snap = json.loads(snapshot.read_text())
    snap["blocks"]["ref_counts"][0] = -1
    hostile.write_text(json.dumps(snap))
    try:
        import matplotlib.figure  # noqa: F401
        plot = True
    except ImportError:
        plot = False
    for args, words in (((hostile, "--svg", tmp_path / "x.svg"), "SnapshotError"),
                        ((snapshot, "--svg", tmp_path / "no" / "x.svg"), "FileNotFoundError"),
                        ((snapshot, "--html", tmp_path / "no" / "x.html"), "FileNotFoundError"),
                        ((snapshot, "--png", tmp_path / "no" / "x.png"), "FileNotFoundError" if plot else "[plot]")):
        out = run("map", *args, code=1)
        assert words in out and len(out.strip().splitlines()) == 1
    assert not (tmp_path / "x.svg").exists()
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if matplotlib were not installed
    out = run("map", snapshot, "--png", tmp_path / "y.png", "--svg", tmp_path / "y.svg", code=1)
    assert "pagedrt[plot]" in out and len(out.strip().splitlines()) == 1
    assert not (tmp_path / "y.svg").exists()


# --- plots of the benchmarks --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TOOL.PLOTS))
def test_every_canonical_record_plots(name, tmp_path):
    pytest.importorskip("matplotlib")
    from pagedrt.bench import plots
    plots.draw(json.loads((ROOT / "benchmarks" / "results" / TOOL.PLOTS[name]).read_text()), tmp_path / name)
    assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_record_without_a_plot_is_refused():
    from pagedrt.bench import plots
    with pytest.raises(UnsupportedConfigError, match="no plot for benchmark 'launch'"):
        plots.draw({"benchmark": "launch", "rows": []}, "unused.png")


def test_peers_are_the_workloads_figures():
    """peers.json holds shared/WORKLOADS.md's figures: where that file is here, every one of them appears in it."""
    from pagedrt.bench import plots
    workloads = ROOT.parent / "shared" / "WORKLOADS.md"
    if not workloads.exists():
        pytest.skip("shared/WORKLOADS.md is not beside this checkout")
    text = workloads.read_text()
    peers = plots.peers()
    for table in ("decode", "decode_fp8", "prefill_tflops", "generate_step_ms"):
        for values in peers[table].values():
            for value in values.values():
                assert f"{value:g}" in text, (table, value)
    assert all(f"{us:g}" in text for us in peers["prefill_mixed_us"].values())


def test_plot_is_an_option_of_the_benchmarks_it_draws(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from pagedrt.bench import harness, plots, pool
    for name in ("decode", "prefill", "generate", "pool"):
        assert "--plot" in harness.parser(f"pagedrt.bench.{name}", "doc").format_help()
    assert "--plot" not in harness.parser("pagedrt.bench.launch", "doc").format_help()
    pool.main(["--backend", "host", "--repeats", "1", "--plot", str(tmp_path / "pool.png"),
               "--out", str(tmp_path / "pool.json")])
    assert (tmp_path / "pool.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "pool.json").read_text())["benchmark"] == "pool"
    assert plots.DRAWERS.keys() == {"decode", "prefill", "generate", "pool"}


def test_fragmentation_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from pagedrt.bench import plots
    rows = [{"policy": p, "used": u, "util": u} for p, u in
            (("contig-max", 0.2), ("contig-exact", 0.5), ("paged-8", 0.99), ("paged-16", 0.98), ("paged-128", 0.9))]
    plots.draw_fragmentation({"long": rows, "short": rows}, tmp_path / "frag.png")
    assert (tmp_path / "frag.png").read_bytes()[:4] == b"\x89PNG"


# --- the HTML page: its script's chain against render.chain ------------------------------------------------


def page_translations(page, cases):
    """Run the page's own script under node for (row, pos, layer, kv, head) cases; its translations."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the page's script cannot be run here")
    data = re.search(r"<script type='application/json' id='data'>(.*?)</script>", page, re.S).group(1)
    script = re.search(r"<script>(.*?)</script>", page, re.S).group(1)
    program = (script + "\nconst d = JSON.parse(" + json.dumps(data.replace("<\\/", "</")) + ");\n"
               "const ts = " + json.dumps(cases) + ".map(c => translation(d, ...c));\n"
               "console.log(JSON.stringify([ts, chainText(d, ts[0])]));")
    out = subprocess.run([node, "-e", program], capture_output=True, text=True, timeout=60, check=True).stdout
    translations, text = json.loads(out)
    first = translations[0]
    assert f"block id {first['block_id']}" in text and hex(int(first["virtual_address"])) in text
    return translations


@pytest.mark.parametrize("source", ["plane", "block", "synthetic"])
def test_the_page_follows_a_token_as_translate_does(source, tmp_path):
    from pagedrt.render import chain
    if source == "synthetic":  # block-major, a host tier holding a swapped-out sequence, a base past 2^40
        snap = validate_snapshot(TOOL.synthetic_snapshot(5_000))
    else:
        run("demo", *TINY, "--placement", source, "--snapshot", tmp_path / "s.json")
        snap = load_snapshot(tmp_path / "s.json")
    pic = P.picture(snap)
    run_args = ("map", tmp_path / "s.json", "--html", tmp_path / "p.html")
    if source != "synthetic":
        run(*run_args)
        page = (tmp_path / "p.html").read_text()
        ET.fromstring(re.search(r"<svg.*</svg>", page, re.S).group(0))  # the page's picture is well-formed
    else:
        from pagedrt.page import html
        page = html(pic, snap)
    lay = snap["layout"]
    drawn = [e for e in snap["sequences"] if e["seq"] in {t[0] for t in pic.tables}]
    cases = [(i, pos, layer, kv, head) for i, e in enumerate(drawn) for pos in {0, e["length"] // 2, e["length"] - 1}
             for layer, kv, head in ((0, "k", 0), (lay["num_layers"] - 1, "v", lay["num_kv_heads"] - 1))]
    got = page_translations(page, cases)
    assert any(t["location"] == "host" for t in got) == (source == "synthetic")
    for (i, pos, layer, kv, head), t in zip(cases, got):
        want = chain(snap, drawn[i]["seq"], pos, layer, kv, head).as_dict()
        assert {k: (int(v) if k in ("pool_offset", "virtual_address", "chunk", "chunk_offset", "page") else v)
                for k, v in t.items()} == want
