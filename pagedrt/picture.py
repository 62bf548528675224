"""Pictures of a snapshot: both mapping layers in one SVG (written by hand) or PNG (matplotlib).

:func:`picture` reduces a checked snapshot (``load_snapshot``/``validate_snapshot``) to a
:class:`Picture`: the reserved range as a grid of cells, one row a whole number of allocator
chunks, each cell the blocks it covers, coloured by what most of them are (held by a
sequence, shared, cached-free, free, or in a chunk released or never mapped); one mark per
row of chunks (mapped, released, on the host tier or never mapped); and the block tables as
rows pointing into the grid. Aggregation is vectorised: one bincount over the blocks up to the
highest mapped chunk, and cumulative counts per chunk beyond it (a range may reserve far more blocks
than any list in the file holds), so the cost grows with the file, not with the reservation.
:func:`svg` and :func:`write_png` draw the same model.
"""

import io
import math
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

import numpy as np

from .errors import UnsupportedConfigError
from .render import plural
from .snapshot import PathLike

MAX_COLS, MAX_ROWS = 128, 128  # cells across, rows of chunks down: at most 16,384 cells before merging runs
MAX_TABLE_ROWS, POINTERS = 32, 4  # block-table rows drawn; blocks of each row pointed at in the grid
GRID_PX = 768                  # the grid's width in pixels (cells are square, 4 to 16 px)
# what a cell can be: the blocks of a chunk never mapped or released, free, cached-free, shared, held by one sequence
CATEGORIES = ("reserved", "released", "free", "cached", "shared", "held")
RESERVED, RELEASED, FREE, CACHED, SHARED, HELD = range(len(CATEGORIES))
COLOURS = {"reserved": "#ffffff", "released": "#f3c4c4", "free": "#d4d4d4", "cached": "#f2b701", "shared": "#222222"}
LABELS = {"reserved": "reserved, never mapped", "released": "released (no memory)", "free": "free",
          "cached": "cached-free (evictable)", "shared": "shared (fork or prefix)",
          "held": "held: one colour a sequence"}
SEQ_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf",
               "#bcbd22", "#7f7f7f", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94")
# a row of chunks, by what most of its chunks are
CHUNK_STATES = ("reserved", "released", "mapped", "host")
CHUNK_COLOURS = {"reserved": "#eeeeee", "released": "#c62828", "mapped": "#2e7d32", "host": "#1565c0"}
CHUNK_LABELS = {"reserved": "chunks never mapped", "released": "chunks released", "mapped": "chunks mapped (device)",
                "host": "chunks on the host tier"}


@dataclass(frozen=True)
class Picture:
    """What a picture of a snapshot shows; every array is NumPy.

    Attributes
    ----------
    title : str
        The counts: chunks mapped, released, on the host tier; blocks held, shared, cached-free, free; sequences.
    chunks_per_row, blocks_per_cell : int
        Allocator chunks in one row of the grid; blocks in one cell (the last cell of a row may hold fewer).
    cells : ndarray, int16, shape (rows, cols)
        A cell's colour: an index into :attr:`palette`; -1 past the range's end.
    palette : tuple of str
        ``#rrggbb`` colours: one for each of CATEGORIES (``held``'s unused: a held cell takes the colour of
        the sequence holding most of its blocks), then SEQ_COLOURS.
    row_state : ndarray, int8, shape (rows,)
        What most chunks of a row are: an index into CHUNK_STATES.
    row_counts : ndarray, int64, shape (rows, len(CHUNK_STATES))
        How many chunks of each state a row holds.
    tables : list of (seq, length, blocks, swapped, colour, cells)
        The block-table rows drawn: ``cells`` the (row, col) of up to POINTERS of its blocks, spread over it.
    more_tables : int
        Sequences not drawn.
    """

    title: str
    chunks_per_row: int
    blocks_per_cell: int
    cells: np.ndarray
    palette: tuple
    row_state: np.ndarray
    row_counts: np.ndarray
    tables: list
    more_tables: int


def _chunk_states(snap):
    """Per allocator chunk, an index into CHUNK_STATES."""
    blocks, n = snap["blocks"], snap["blocks"]["num_chunks"]
    ever = np.zeros(n, bool)
    ever[[c["chunk"] % n for c in snap["pool"]["chunks"]]] = True
    mapped = np.array(blocks["chunk_mapped"], bool)
    state = np.where(mapped, 2, np.where(ever, 1, 0)).astype(np.int8)
    state[n - snap["layout"]["host_chunks"]:][mapped[n - snap["layout"]["host_chunks"]:]] = 3
    return state


def _block_categories(snap, chunk_state, detailed):
    """The category of every block below ``detailed`` (the highest mapped chunk's end) and the colour of a
    sequence holding it (-1 for blocks no sequence holds)."""
    bpc = snap["blocks"]["blocks_per_chunk"]
    refs = np.array(snap["blocks"]["ref_counts"], np.int64)
    by_chunk = np.array((RESERVED, RELEASED, FREE, FREE), np.int8)[chunk_state[:detailed // bpc]]
    category = np.repeat(by_chunk, bpc)
    cached = np.array(snap["blocks"]["cached"], np.int64)
    category[cached[refs[cached] == 0]] = CACHED
    category[refs == 1] = HELD
    category[refs > 1] = SHARED
    colour = np.full(detailed, -1, np.int64)
    for entry in snap["sequences"]:
        colour[entry["blocks"]] = entry["seq"] % len(SEQ_COLOURS)
    return category, colour


def _grid(n_chunks, bpc):
    """(chunks per row, blocks per cell, cells per row) for a range of ``n_chunks`` chunks of ``bpc`` blocks."""
    per_row = math.ceil(n_chunks / MAX_ROWS)
    row_blocks = per_row * bpc
    cell = math.ceil(row_blocks / MAX_COLS)
    return per_row, cell, math.ceil(row_blocks / cell)


def _cell_counts(snap, chunk_state, per_row, cell, cols):
    """Per cell, blocks of each category (shape (cells, len(CATEGORIES))) and of each sequence colour."""
    n, bpc = len(chunk_state), snap["blocks"]["blocks_per_chunk"]
    rows = math.ceil(n / per_row)
    row_start = np.arange(rows, dtype=np.int64) * per_row * bpc
    offsets = np.minimum(np.arange(cols + 1, dtype=np.int64) * cell, per_row * bpc)
    edges = np.minimum(row_start[:, None] + offsets[None, :], n * bpc)  # (rows, cols + 1): every cell's [start, end)
    mapped = np.flatnonzero(chunk_state >= 2)
    detailed = (int(mapped.max()) + 1) * bpc if mapped.size else 0
    counts = np.zeros((rows * cols, len(CATEGORIES)), np.int64)
    colours = np.zeros((rows * cols, len(SEQ_COLOURS)), np.int64)
    if detailed:
        category, colour = _block_categories(snap, chunk_state, detailed)
        blocks = np.arange(detailed, dtype=np.int64)
        row = blocks // (per_row * bpc)
        at = row * cols + (blocks - row * per_row * bpc) // cell
        counts += np.bincount(at * len(CATEGORIES) + category, minlength=counts.size).reshape(counts.shape)
        held = category == HELD  # a shared block's colour is no one sequence's
        colours += np.bincount(at[held] * len(SEQ_COLOURS) + colour[held],
                               minlength=colours.size).reshape(colours.shape)
    for cat in (RESERVED, RELEASED):  # the chunks past the highest mapped one: counted per chunk, not per block
        is_cat = (chunk_state == cat) & (np.arange(n) * bpc >= detailed)
        cumulative = np.concatenate(([0], np.cumsum(is_cat) * bpc))
        chunk = np.minimum(edges // bpc, n - 1)
        below = cumulative[chunk] + np.where(is_cat[chunk], edges % bpc, 0)
        below = np.where(edges >= n * bpc, cumulative[-1], below)
        counts[:, cat] += np.diff(below, axis=1)[:, :cols].reshape(-1)
    return counts, colours, rows


def picture(snap: dict) -> Picture:
    """The :class:`Picture` of a checked snapshot (``load_snapshot`` or ``validate_snapshot`` first).

    Parameters
    ----------
    snap : dict
        A snapshot (docs/SNAPSHOT.md) that passed ``validate_snapshot``.

    Returns
    -------
    Picture
    """
    blocks = snap["blocks"]
    chunk_state = _chunk_states(snap)
    per_row, cell, cols = _grid(blocks["num_chunks"], blocks["blocks_per_chunk"])
    counts, colours, rows = _cell_counts(snap, chunk_state, per_row, cell, cols)
    winner = np.argmax(counts[:, ::-1], axis=1)  # ties go to the later category: held, then shared, cached, ...
    winner = len(CATEGORIES) - 1 - winner
    cells = np.where(winner == HELD, len(CATEGORIES) + np.argmax(colours, axis=1), winner)
    empty = counts.sum(axis=1) == 0  # cells past the range's end (the last row's tail)
    cells = np.where(empty, -1, cells).reshape(rows, cols).astype(np.int16)
    palette = tuple(COLOURS.get(c, "#000000") for c in CATEGORIES) + SEQ_COLOURS
    padded = np.concatenate((chunk_state, np.full(rows * per_row - len(chunk_state), -1, np.int8)))
    row_counts = np.stack([(padded.reshape(rows, per_row) == s).sum(axis=1) for s in range(len(CHUNK_STATES))], 1)
    row_state = np.argmax(row_counts[:, ::-1], axis=1)
    row_state = (len(CHUNK_STATES) - 1 - row_state).astype(np.int8)
    return Picture(_title(snap, chunk_state), per_row, cell, cells, palette, row_state, row_counts,
                   _tables(snap, per_row, cell, cols), max(0, len(snap["sequences"]) - MAX_TABLE_ROWS))


def _title(snap, chunk_state):
    blocks = snap["blocks"]
    refs = np.array(blocks["ref_counts"], np.int64)
    cached = np.array(blocks["cached"], np.int64)
    states = np.bincount(chunk_state, minlength=len(CHUNK_STATES))
    return (f"pagedrt pool: {plural(blocks['num_chunks'], 'chunk')} ({states[2]} mapped, {states[1]} released, "
            f"{states[3]} on the host tier); {plural(blocks['max_blocks'], 'block')}: {blocks['held']} held "
            f"({int((refs > 1).sum())} shared), {int((refs[cached] == 0).sum())} cached-free, {blocks['free']} free; "
            f"{plural(len(snap['sequences']), 'sequence')}")


def _tables(snap, per_row, cell, cols):
    bpc = snap["blocks"]["blocks_per_chunk"]
    rows = []
    for entry in snap["sequences"][:MAX_TABLE_ROWS]:
        ids = np.array(entry["blocks"], np.int64)
        picked = ids[np.unique(np.linspace(0, ids.size - 1, min(POINTERS, ids.size)).astype(np.int64))]
        row = picked // (per_row * bpc)
        col = (picked - row * per_row * bpc) // cell
        rows.append((entry["seq"], entry["length"], ids.size, entry["swapped"], entry["seq"] % len(SEQ_COLOURS),
                     list(zip(row.tolist(), col.tolist()))))
    return rows


# --- SVG ---------------------------------------------------------------------------------------------------


def _geometry(pic):
    rows, cols = pic.cells.shape
    px = max(4, min(16, GRID_PX // cols))
    return px, 120, 56, rows, cols  # cell size, grid left, grid top


def svg(pic: Picture) -> str:
    """The picture as an SVG document (a str): in ``<g id="blocks">`` one ``<rect>`` a run of equal cells in a
    row, one ``<rect class="chunk">`` a row of chunks (with a ``<title>`` of its counts), a legend and the block
    tables.

    Written by hand, not through a library: the document is a few kinds of rectangles, paths and text, and
    the package then needs nothing beyond NumPy to draw it.
    """
    px, gx, gy, rows, cols = _geometry(pic)
    table_x = gx + cols * px + 40
    height = max(gy + rows * px, gy + 18 * (len(pic.tables) + 2)) + 40 + 18 * (len(CATEGORIES) + len(CHUNK_STATES))
    width = max(table_x + 360, 16 + 8 * len(pic.title))  # room for the table's labels and the title (13 px bold)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f"<title>{escape(pic.title)}</title>",
           f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
           f'<text x="8" y="18" font-size="13" font-weight="bold">{escape(pic.title)}</text>',
           f'<text x="8" y="36">one row = {pic.chunks_per_row} chunk{"s" if pic.chunks_per_row > 1 else ""}, '
           f'one cell = {pic.blocks_per_cell} block{"s" if pic.blocks_per_cell > 1 else ""} (the colour of most of '
           f'them); hover a row\'s mark for its chunks</text>']
    out.append('<g id="chunks">')
    for r in range(rows):
        first, n = r * pic.chunks_per_row, int(pic.row_counts[r].sum())
        counts = ", ".join(f"{int(c)} {s}" for s, c in zip(CHUNK_STATES, pic.row_counts[r]) if c)
        label = f"chunk {first}" if n == 1 else f"chunks {first}-{first + n - 1}"
        out.append(f'<rect class="chunk" x="{gx - 14}" y="{gy + r * px}" width="10" height="{px}" '
                   f'fill="{CHUNK_COLOURS[CHUNK_STATES[pic.row_state[r]]]}"><title>{label}: {counts}</title></rect>')
        if px >= 10 and (r % max(1, 14 // px) == 0):
            out.append(f'<text x="{gx - 18}" y="{gy + r * px + px - 2}" text-anchor="end" font-size="9">'
                       f'{first}</text>')
    out.append("</g>")
    out.append('<g id="blocks" stroke="none">')
    for r in range(rows):
        line = pic.cells[r]
        starts = np.flatnonzero(np.concatenate(([True], line[1:] != line[:-1])))
        for start, end in zip(starts, np.append(starts[1:], cols)):
            if line[start] >= 0:
                out.append(f'<rect x="{gx + start * px}" y="{gy + r * px}" width="{(end - start) * px}" '
                           f'height="{px}" fill="{pic.palette[line[start]]}"/>')
    out.append("</g>")
    out.append(f'<g id="grid-lines" stroke="#ffffff" stroke-width="{0.5 if px < 8 else 1}">'
               f'<path d="{_grid_path(gx, gy, rows, cols, px)}"/></g>')
    out.append(f'<rect x="{gx}" y="{gy}" width="{cols * px}" height="{rows * px}" fill="none" stroke="#999999" '
               f'stroke-width="0.5"/>')
    out += _svg_tables(pic, px, gx, gy, table_x)
    out += _svg_legend(8, max(gy + rows * px, gy + 18 * (len(pic.tables) + 2)) + 24)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _grid_path(gx, gy, rows, cols, px):
    """Horizontal lines between rows of chunks (where cells are large enough to separate)."""
    if px < 6:
        return f"M{gx} {gy}"
    return " ".join(f"M{gx} {gy + r * px}h{cols * px}" for r in range(1, rows))


def _svg_tables(pic, px, gx, gy, table_x):
    out = [f'<g id="tables"><text x="{table_x}" y="{gy - 6}" font-weight="bold">block tables (seq, tokens, '
           f'blocks)</text>']
    longest = max((t[2] for t in pic.tables), default=1) or 1
    for i, (seq, length, n, swapped, colour, cells) in enumerate(pic.tables):
        y = gy + 18 * i
        fill = SEQ_COLOURS[colour]
        points = " ".join(f"M{table_x} {y + 6}L{gx + c * px + px / 2:.1f} {gy + r * px + px / 2:.1f}"
                          for r, c in cells)
        out.append(f'<path class="pointer" d="{points}" fill="none" stroke="{fill}" '
                   f'stroke-opacity="0.45" stroke-width="1"/>')
        out.append(f'<rect class="table" x="{table_x}" y="{y}" width="{max(2, 120 * n // longest)}" height="12" '
                   f'fill="{fill}"><title>sequence {seq}: {length} tokens in {n} blocks'
                   f'{", swapped out" if swapped else ""}</title></rect>')
        out.append(f'<text x="{table_x + 126}" y="{y + 10}">seq {seq}, {length} tok, {n} blocks'
                   f'{" (swapped)" if swapped else ""}</text>')
    if pic.more_tables:
        out.append(f'<text x="{table_x}" y="{gy + 18 * len(pic.tables) + 10}">and {pic.more_tables} more '
                   f'sequences</text>')
    out.append("</g>")
    return out


def _svg_legend(x, y):
    out = ['<g id="legend">']
    items = [(COLOURS.get(c, SEQ_COLOURS[0]), LABELS[c]) for c in CATEGORIES]
    items += [(CHUNK_COLOURS[s], CHUNK_LABELS[s] + " (row mark)") for s in CHUNK_STATES]
    for i, (colour, label) in enumerate(items):
        out.append(f'<g class="legend-item"><rect x="{x}" y="{y + 18 * i}" width="12" height="12" fill="{colour}" '
                   f'stroke="#888888" stroke-width="0.5"/><text x="{x + 18}" y="{y + 18 * i + 10}">{label}</text></g>')
    out.append("</g>")
    return out


def write_svg(pic: Picture, path: PathLike) -> None:
    """Write :func:`svg` of ``pic`` to ``path`` (an OSError names the path)."""
    Path(path).write_text(svg(pic), encoding="utf-8")


# --- PNG ---------------------------------------------------------------------------------------------------


def _rgb(colours):
    """``#rrggbb`` strings as an (n, 3) float array."""
    return np.array([[int(c[i:i + 2], 16) / 255 for i in (1, 3, 5)] for c in colours])


def write_png(pic: Picture, path: PathLike, dpi: float = 100) -> None:
    """Draw ``pic`` as a PNG at ``path`` through matplotlib (the ``plot`` extra): the same grid, row marks,
    block tables and legend as :func:`svg`. UnsupportedConfigError without matplotlib; an OSError names ``path``."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise UnsupportedConfigError("a PNG needs matplotlib: pip install 'pagedrt[plot]' (or draw an SVG)") from None
    fig = Figure(figsize=(10, 6.4), dpi=dpi)
    fig.suptitle(pic.title.replace("); ", ")\n", 1), fontsize=9)
    grid = fig.add_axes((0.07, 0.08, 0.5, 0.78))
    marks = fig.add_axes((0.04, 0.08, 0.02, 0.78), sharey=grid)
    grid.imshow(_rgb(pic.palette + ("#ffffff",))[pic.cells], aspect="auto", interpolation="nearest")
    marks.imshow(_rgb([CHUNK_COLOURS[s] for s in CHUNK_STATES])[pic.row_state][:, None, :], aspect="auto",
                 interpolation="nearest")
    marks.set_xticks([])
    marks.set_ylabel(f"rows of {pic.chunks_per_row} chunk{'s' if pic.chunks_per_row > 1 else ''}")
    grid.set_yticks([])
    grid.set_xlabel(f"cells of {pic.blocks_per_cell} block{'s' if pic.blocks_per_cell > 1 else ''}")
    _png_tables(fig, grid, pic)
    handles = [Patch(facecolor=COLOURS.get(c, SEQ_COLOURS[0]), edgecolor="#888888", label=LABELS[c])
               for c in CATEGORIES]
    handles += [Patch(facecolor=CHUNK_COLOURS[s], label=CHUNK_LABELS[s]) for s in CHUNK_STATES]
    fig.legend(handles=handles, loc="lower right", bbox_to_anchor=(0.98, 0.04), fontsize=7, ncol=2, frameon=False)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    Path(path).write_bytes(buffer.getvalue())


def _png_tables(fig, grid, pic, shown=16):
    """The first ``shown`` block-table rows as bars of their block counts, each with lines to some of its blocks."""
    from matplotlib.patches import ConnectionPatch
    tables = fig.add_axes((0.64, 0.42, 0.34, 0.44))
    rows = pic.tables[:shown]
    tables.barh(range(len(rows)), [t[2] for t in rows], color=[SEQ_COLOURS[t[4]] for t in rows])
    for i, (seq, length, n, swapped, colour, cells) in enumerate(rows):
        tables.text(0, i, f" seq {seq}, {length} tok" + (" (swapped)" if swapped else ""), va="center", fontsize=6.5)
        for r, c in cells:
            fig.add_artist(ConnectionPatch((0, i), (c, r), "data", "data", axesA=tables, axesB=grid,
                                           color=SEQ_COLOURS[colour], alpha=0.35, linewidth=0.7))
    tables.set_yticks([])
    tables.invert_yaxis()
    tables.set_xlabel("blocks in the table; lines: where some of them lie", fontsize=8)
    tables.tick_params(labelsize=7)
    more = len(pic.tables) - len(rows) + pic.more_tables
    tables.set_title("block tables" + (f" ({more} more sequences)" if more else ""), fontsize=9)
