"""A self-contained HTML page of a snapshot's picture: hover a token of a block-table row, see its whole chain.

The page is the SVG of :mod:`pagedrt.picture` with the data the chain needs (the layout, the pool's base,
the drawn rows' block ids and lengths, the cached blocks among them) as JSON, and a short script that
follows one token as :func:`pagedrt.layout.translate` does: logical block and slot, table entry, pool
offset, virtual address, pool chunk and page (addresses as BigInt: they pass 2^53). No server and no
network: everything is in the file. In a shard's snapshot the heads are the shard's own, 0 to its count.
"""

import json
from dataclasses import asdict
from pathlib import Path
from xml.sax.saxutils import escape

from .layout import Layout
from .picture import Picture, _geometry, svg
from .snapshot import PathLike

SCRIPT = r"""
function translation(d, row, pos, layer, kv, head) {
  const L = d.layout, B = BigInt, seq = d.rows[row];
  const logical = Math.floor(pos / L.block_size), slot = pos % L.block_size, block = seq.blocks[logical];
  const planeBlock = B(L.num_kv_heads * L.block_size * L.head_dim * L.itemsize);
  const stride = L.placement === "plane" ? planeBlock : B(2 * L.num_layers) * planeBlock;
  const index = B(2 * layer + (kv === "k" ? 0 : 1));
  const plane = L.placement === "plane" ? index * B(L.chunks_per_plane) * B(L.chunk_bytes) : index * planeBlock;
  const inner = B((head * L.block_size + slot) * L.head_dim * L.itemsize);
  const offset = plane + B(block) * stride + inner, chunkBytes = B(L.chunk_bytes);
  const within = offset % chunkBytes;
  return {seq: seq.seq, pos: pos, layer: layer, kv: kv, kv_head: head, logical_block: logical, slot: slot,
          block_id: block, pool_offset: offset.toString(), virtual_address: (B(d.base) + offset).toString(),
          chunk: (offset / chunkBytes).toString(), chunk_offset: within.toString(),
          page: (within / B(L.page_bytes)).toString(), nbytes: L.head_dim * L.itemsize,
          cached: d.cached.includes(block),
          location: block >= (L.chunks_per_plane - L.host_chunks) * d.blocks_per_chunk ? "host" : "device"};
}

function chainText(d, t) {
  const hex = n => "0x" + BigInt(n).toString(16);
  const where = t.location === "host" ? "pinned host" : "physical";
  return [`token    sequence ${t.seq}, position ${t.pos}, layer ${t.layer}, ${t.kv.toUpperCase()}, ` +
    `kv head ${t.kv_head}`,
    `block    logical block ${t.logical_block} = ${t.pos} // ${d.layout.block_size}, slot ${t.slot}`,
    `table    block_table[${t.seq}][${t.logical_block}] = block id ${t.block_id}   (software layer)`,
    `cache    block ${t.block_id} is ${t.cached ? "" : "not "}in the prefix cache`,
    `pool     offset ${t.pool_offset} bytes from the base`,
    `address  virtual address ${hex(t.virtual_address)} = base ${hex(d.base)} + offset`,
    `MMU      pool chunk ${t.chunk}, offset ${t.chunk_offset} in it, page ${t.page}   (hardware layer)`,
    `memory   ${t.nbytes} contiguous bytes in chunk ${t.chunk}'s ${where} memory`
  ].join("\n");
}

if (typeof document !== "undefined") {
  const d = JSON.parse(document.getElementById("data").textContent);
  const out = document.getElementById("chain"), mark = document.getElementById("mark");
  const value = id => document.getElementById(id).value;
  document.querySelectorAll("rect.table").forEach((bar, row) => {
    bar.addEventListener("mousemove", ev => {
      const box = bar.getBoundingClientRect(), length = d.rows[row].length;
      const pos = Math.min(length - 1, Math.max(0, Math.floor((ev.clientX - box.left) / box.width * length)));
      const t = translation(d, row, pos, Number(value("layer")), value("kv"), Number(value("head")));
      out.textContent = chainText(d, t);
      const rowBlocks = d.chunks_per_row * d.blocks_per_chunk, r = Math.floor(t.block_id / rowBlocks);
      const c = Math.floor((t.block_id - r * rowBlocks) / d.blocks_per_cell);
      mark.setAttribute("x", d.gx + c * d.px - 1); mark.setAttribute("y", d.gy + r * d.px - 1);
      mark.setAttribute("visibility", "visible");
    });
  });
}
"""


def html(pic: Picture, snap: dict) -> str:
    """The page (a str): the picture's SVG, the chain panel and the data and script that fill it.

    Parameters
    ----------
    pic : Picture
        ``picture(snap)``.
    snap : dict
        The checked snapshot ``pic`` was made from.
    """
    lay = Layout(**snap["layout"])
    px, gx, gy, _, _ = _geometry(pic)
    drawn = {seq for seq, *_ in pic.tables}
    rows = [{"seq": e["seq"], "length": e["length"], "blocks": e["blocks"]}
            for e in snap["sequences"] if e["seq"] in drawn]
    held = {b for row in rows for b in row["blocks"]}
    data = {"layout": asdict(lay), "base": str(snap["pool"]["base"]), "rows": rows,
            "cached": [b for b in snap["blocks"]["cached"] if b in held],
            "blocks_per_chunk": lay.blocks_per_chunk, "chunks_per_row": pic.chunks_per_row,
            "blocks_per_cell": pic.blocks_per_cell, "px": px, "gx": gx, "gy": gy}
    picture = svg(pic).replace("</svg>", f'<rect id="mark" width="{px + 2}" height="{px + 2}" fill="none" '
                               f'stroke="#e00000" stroke-width="2" visibility="hidden"/></svg>')
    controls = ("layer <input id='layer' type='number' min='0' max='{0}' value='0'> "
                "<select id='kv'><option value='k'>K</option><option value='v'>V</option></select> "
                "kv head <input id='head' type='number' min='0' max='{1}' value='0'>"
                ).format(lay.num_layers - 1, lay.num_kv_heads - 1)
    payload = json.dumps(data).replace("</", "<\\/")
    return (f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{escape(pic.title)}</title></head>\n"
            f"<body style='font-family:sans-serif'>\n<p>Hover a block-table row (right) to follow one of its "
            f"tokens, by its place along the row, through both layers. {controls}</p>\n"
            f"<pre id='chain' style='background:#f4f4f4;padding:6px;min-height:9em'></pre>\n{picture}"
            f"<script type='application/json' id='data'>{payload}</script>\n<script>{SCRIPT}</script>\n"
            f"</body></html>\n")


def write_html(pic: Picture, snap: dict, path: PathLike) -> None:
    """Write :func:`html` to ``path`` (an OSError names the path)."""
    Path(path).write_text(html(pic, snap), encoding="utf-8")
