"""Plots of benchmark records (matplotlib: the ``plot`` extra): what each benchmark's table says, as a picture.

:func:`draw` takes a record (``--out``'s JSON, or the run a benchmark just made with ``--plot``) and
draws it by its ``benchmark``: decode and prefill per case beside the peers' figures
(``peers.json``, copied from shared/WORKLOADS.md with its source), a model's decode step by kind of
launch, pool growth against a contiguous cache's reallocation. :func:`draw_fragmentation` draws
``tools/frag_sim.py``'s rows. Figures are read from the record, never written here.
"""

import io
import json
from pathlib import Path

from ..errors import UnsupportedConfigError
from ..supported import FP8

PEERS = Path(__file__).with_name("peers.json")
OURS = "#1565c0"
PEER_COLOURS = ("#f2a541", "#9e9e9e", "#6d4c41")
SIZE = (7.0, 3.4)  # inches at 80 dpi: pictures of a few tens of KB


def figure(size=SIZE):
    """A matplotlib Figure without pyplot (no display, no global state); UnsupportedConfigError without
    matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UnsupportedConfigError("plots need matplotlib: pip install 'pagedrt[plot]'") from None
    return Figure(figsize=size, dpi=80, layout="constrained")


def save(fig, path):
    """Write ``fig`` as a PNG at ``path``; an OSError names ``path``."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    Path(path).write_bytes(buffer.getvalue())


def peers():
    return json.loads(PEERS.read_text())


def where(rec):
    """The device a record was measured on, or its backend's words (host-backend runs)."""
    return rec["device"].get("device") or rec["device"].get("backend", "unknown device")


def _bars(ax, cases, series, colours):
    """Grouped bars: ``series`` a list of (label, {case: value}); a missing value leaves a gap."""
    width = 0.8 / len(series)
    for i, ((label, values), colour) in enumerate(zip(series, colours)):
        xs = [j + (i - (len(series) - 1) / 2) * width for j, c in enumerate(cases) if c in values]
        ax.bar(xs, [values[c] for c in cases if c in values], width, label=label, color=colour)
    ax.set_xticks(range(len(cases)), cases)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def decode(rec, fig):
    """% of the run's streaming ceiling per case, beside the peers' % of theirs (``peers.json``'s
    ``decode_ceiling_tb_s``)."""
    rows = rec["rows"]
    fp8 = any(r.get("kv_dtype") == FP8 for r in rows)
    cases = [r["case"] for r in rows]
    ours = {r["case"]: r["pct_stream"] for r in rows}
    p = peers()
    series = [("pagedrt", ours)] + list(p["decode_fp8" if fp8 else "decode"].items())
    ax = fig.add_subplot()
    _bars(ax, cases, series, (OURS,) + PEER_COLOURS)
    ax.set_ylabel("% of the read-only ceiling" + (" (FP8 bytes)" if fp8 else ""))
    ax.set_ylim(0, 110)
    ax.set_title(f"decode{' over FP8 K/V' if fp8 else ''}, {where(rec)}: pagedrt against its run's "
                 f"{rec['ceilings']['stream'] / 1e12:.2f} TB/s, peers against {p['decode_ceiling_tb_s']} TB/s",
                 fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    fig.legend(fontsize=7, loc="outside lower center", ncols=len(series))


def prefill(rec, fig):
    """TFLOP/s per case beside the peers' (left); the mixed step's time against its floor and the peers' (right)."""
    rows = {r["case"]: r for r in rec["rows"]}
    p = peers()
    left, right = fig.subplots(1, 2, width_ratios=(3, 1))
    cases = [c for c in rows if c != "mixed"]
    series = [("pagedrt", {c: rows[c]["tflops"] for c in cases})] + list(p["prefill_tflops"].items())
    _bars(left, cases, series, (OURS,) + PEER_COLOURS)
    left.set_ylabel("TFLOP/s")
    left.set_title(f"prefill ({rec.get('kv_dtype') or 'float16'} K/V), {where(rec)}", fontsize=10)
    left.legend(fontsize=7, loc="lower left")
    if "mixed" in rows:
        mixed = rows["mixed"]
        labels = ["floor", "pagedrt"] + list(p["prefill_mixed_us"])
        values = [mixed["floor_us"], mixed["us"]] + list(p["prefill_mixed_us"].values())
        right.barh(labels, values, color=["#cfd8dc", OURS] + list(PEER_COLOURS[:len(values) - 2]))
        right.invert_yaxis()
        right.set_xlabel("us")
        right.set_title("mixed step", fontsize=10)
        right.tick_params(labelsize=7)


def generate(rec, fig):
    """Per batch, the decode step's GPU time split by kind of launch, beside its floor and the peers' steps."""
    steps = [r for r in rec["rows"] if "step_ms" in r]
    kinds = [r for r in rec["rows"] if "kind" in r]
    names = list(dict.fromkeys(r["kind"] for r in kinds))
    ax = fig.add_subplot()
    labels = [f"{s['batch']} x {s['context']}" for s in steps]
    import matplotlib
    cmap = matplotlib.colormaps["tab20"]
    for i, s in enumerate(steps):
        left = 0.0
        for j, name in enumerate(names):
            us = next((k["us"] for k in kinds if k["batch"] == s["batch"] and k["kind"] == name), 0.0)
            ax.barh(i, us / 1e3, left=left, color=cmap(j), label=name if i == 0 else None)
            left += us / 1e3
        ax.plot([s["step_ms"]], [i], "k|", markersize=18, label="whole step" if i == 0 else None)
        ax.plot([s["floor_ms"]], [i], "kx", label="floor" if i == 0 else None)
        for m, (peer, values) in enumerate(peers()["generate_step_ms"].items()):
            key = f"{s['batch']}x{s['context']}"
            if key in values:
                ax.plot([values[key]], [i], marker="v^"[m], color=PEER_COLOURS[m], linestyle="none",
                        label=peer if i == 0 else None)
    ax.set_yticks(range(len(steps)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms of GPU time per decode step (kinds timed alone, stacked)")
    ax.set_ylabel("batch x context")
    ax.set_title(f"{Path(rec.get('model', 'model')).name} decode step by kind of launch", fontsize=10)
    ax.legend(fontsize=6.5, loc="center left", bbox_to_anchor=(1.0, 0.5))


def pool(rec, fig):
    """Growing by 1 GiB: per chunk size the driver calls' time, stacked, against a contiguous cache's
    reallocation (allocate, copy, free) from each size."""
    rows = rec["rows"]
    ax = fig.add_subplot()
    labels = [f"{r['chunk_mib']} MiB" if r["chunk_mib"] < 1024 else f"{r['chunk_mib'] >> 10} GiB" for r in rows]
    left = [0.0] * len(rows)
    for part, colour in (("create", "#90caf9"), ("map", "#1565c0"), ("set_access", "#0d47a1")):
        values = [r[f"gib_{part}_us"] / 1e3 for r in rows]
        ax.barh(labels, values, left=left, color=colour, label=f"pool: {part.replace('_', ' ')}")
        left = [a + b for a, b in zip(left, values)]
    regrow = rec.get("contiguous_regrow_us", {})  # CUDA runs only
    for i, (gib, us) in enumerate(sorted(regrow.items(), key=lambda kv: int(kv[0]))):
        ax.axvline(us / 1e3, color=PEER_COLOURS[i % len(PEER_COLOURS)], linestyle="--",
                   label=f"contiguous: regrow from {gib} GiB")
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("ms to grow by 1 GiB (log)")
    ax.set_ylabel("pool chunk")
    ax.set_title(f"pool growth against contiguous reallocation, {where(rec)}", fontsize=10)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))


DRAWERS = {"decode": decode, "prefill": prefill, "generate": generate, "pool": pool}


def draw(rec, path):
    """Draw a benchmark record (``harness.record``) at ``path`` as a PNG.

    Parameters
    ----------
    rec : dict
        A record of one of the benchmarks in DRAWERS (its ``benchmark`` field names it).
    path : str or Path
        Where the PNG goes.
    """
    name = rec.get("benchmark")
    if name not in DRAWERS:
        raise UnsupportedConfigError(f"no plot for benchmark {name!r}: plots exist for {', '.join(DRAWERS)}")
    fig = figure()
    DRAWERS[name](rec, fig)
    save(fig, path)


def draw_fragmentation(results, path):
    """``tools/frag_sim.py``'s rows, one panel a trace: the budget's used share and the held slots' use against
    block size for the paged rows, the contiguous policies' used share as lines.

    Parameters
    ----------
    results : dict
        trace name -> list of the tool's row dicts (``policy``, ``used``, ``util``, ...).
    path : str or Path
        Where the PNG goes.
    """
    fig = figure()
    axes = fig.subplots(1, len(results), sharey=True)
    for ax, (trace, rows) in zip(axes, results.items()):
        paged = [r for r in rows if r["policy"].startswith("paged-")]
        sizes = [int(r["policy"].split("-")[1]) for r in paged]
        ax.plot(sizes, [100 * r["used"] for r in paged], "o-", color=OURS, label="paged: used share of budget")
        ax.plot(sizes, [100 * r["util"] for r in paged], "s--", color=OURS, alpha=0.5, label="paged: used/held")
        for r, colour in zip([r for r in rows if r["policy"].startswith("contig")], PEER_COLOURS):
            ax.axhline(100 * r["used"], color=colour, linestyle=":", label=f"{r['policy']}: used share")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("block size (tokens)")
        ax.set_title(f"trace {trace}", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("% of the KV budget")
    axes[0].set_ylim(0, 102)
    axes[-1].legend(fontsize=6.5, loc="lower left")
    save(fig, path)
