"""Text views of a snapshot (``PagedKVCache.snapshot()``): chunk table, block tables, pool map, chain.

Pure functions from the snapshot dict to lines; ``style`` (``click.style`` or a
no-op) adds colour. Everything here works as well on a snapshot read from a file
written by another process as on a live cache.
"""

import math
from dataclasses import replace
from typing import Any, Callable, Dict, List, Tuple

from .layout import Layout, Translation, translate
from .errors import InvalidPositionError, UnknownSequenceError, UnsupportedConfigError

SYMBOLS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
COLOURS = ("red", "green", "yellow", "blue", "magenta", "cyan", "bright_red", "bright_green",
           "bright_yellow", "bright_blue", "bright_magenta", "bright_cyan")
MAP_WIDTH, MAP_ROWS = 64, 24
Style = Callable[..., str]  # click.style or plain: (text, fg=..., bold=...) -> the text, styled or not


def plain(text: str, **_: Any) -> str:
    """``text`` as it is: the style of uncoloured output (click.style's keywords ignored)."""
    return text


def size(n: float) -> str:
    """A byte count for a person to read, in the unit (B to TiB) that keeps it below 1024: "512 B", "2 MiB", "1.5 GiB"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.1f} {unit}"
        n /= 1024


def seq_symbol(seq: int, style: Style = plain) -> str:
    """The letter (and colour) that stands for sequence ``seq`` in the tables and the pool map."""
    return style(SYMBOLS[seq % len(SYMBOLS)], fg=COLOURS[seq % len(COLOURS)], bold=True)


def where(record: dict) -> str:
    """Where a chunk record's memory lives, in words: "device 0", "host node 1", or the bare tier."""
    location, node = record["location"], record["location_id"]
    if node is None:
        return location
    return f"device {node}" if location == "device" else f"host node {node}"


def shard_line(shard: dict) -> str:
    """What a sharded cache's snapshot describes: one device's pool, under the tables every shard shares."""
    first, end = shard["kv_heads"]
    return (f"shard  {shard['index']} of {shard['of']}, on device {shard['device']}: KV heads {first}..{end - 1} of "
            f"{shard['num_kv_heads']} in this pool; the block tables below are every shard's")


def chunk_table(snap: dict, style: Style = plain) -> List[str]:
    """One line per allocator chunk ever mapped: place, VA range, size, state, (with a host tier) where its memory
    lives, blocks held."""
    lay, pool, blocks = Layout(**snap["layout"]), snap["pool"], snap["blocks"]
    planes, per_plane = lay.num_planes, blocks["num_chunks"]
    records = {c["chunk"]: c for c in pool["chunks"]}
    bpc = blocks["blocks_per_chunk"]
    held_in_chunk: Dict[int, int] = {}
    for b in _block_owners(snap):
        held_in_chunk[b // bpc] = held_in_chunk.get(b // bpc, 0) + 1
    lines = [] if "shard" not in snap else [shard_line(snap["shard"])]
    lines += [f"pool   {pool['backend']} range at {pool['base']:#x}, {size(pool['max_bytes'])} reserved, "
             f"{size(sum(c['size'] for c in pool['chunks'] if c['state'] == 'mapped'))} mapped; "
             f"page {size(pool['page_bytes'])}, chunk {size(pool['chunk_bytes'])}"]
    if planes > 1:
        lines.append(f"       plane-major: {planes} planes (K and V of {lay.num_layers} layers), "
                     f"{size(per_plane * pool['chunk_bytes'])} each; chunk k of the table is chunk k of every plane")
    tiers = lay.host_chunks > 0  # the column only where there are two tiers to tell apart
    column = f"{'where':<12}  " if tiers else ""
    lines.append(f"{'chunk':>5}  {'virtual range (plane 0)':<33} {'size':>12}  {'state':<8}  {column}"
                 f"blocks held/total")
    for k in range(per_plane):
        record = records.get(k)
        if record is None:
            continue
        mapped = record["state"] == "mapped"
        n_held = held_in_chunk.get(k, 0) if mapped else 0
        span = f"{record['va_start']:#x}-{record['va_end']:#x}"
        total = size(record["size"]) + (f" x{planes}" if planes > 1 else "")
        state = style(record["state"], fg="green" if mapped else "bright_black")
        place = f"{where(record):<12}  " if tiers else ""
        lines.append(f"{k:>5}  {span:<33} {total:>12}  {state:<8}  {place}{n_held}/{bpc}" if mapped
                     else f"{k:>5}  {span:<33} {total:>12}  {state:<8}  {place}(hole: no physical memory)")
    return lines


def block_tables(snap: dict, limit: int = 8, per_line: int = 12, style: Style = plain) -> List[str]:
    """Sequence, length, and logical -> block id for up to ``limit`` sequences."""
    seqs = snap["sequences"]
    lines = [f"block tables ({min(limit, len(seqs))} of {len(seqs)} sequences; block size "
             f"{snap['layout']['block_size']})", f"{'seq':>5} {'len':>5}  logical:block id"]
    for entry in seqs[:limit]:
        pairs = [f"{i}:{b}" for i, b in enumerate(entry["blocks"])]
        shown = " ".join(pairs[:per_line]) + (f" ... ({len(pairs)} blocks)" if len(pairs) > per_line else "")
        lines.append(f"{entry['seq']:>3} {seq_symbol(entry['seq'], style)} {entry['length']:>5}  {shown}")
    return lines


def _block_owners(snap):
    """block id -> list of sequences holding it."""
    owners = {}
    for entry in snap["sequences"]:
        for b in entry["blocks"]:
            owners.setdefault(b, []).append(entry["seq"])
    return owners


def pool_map(snap: dict, style: Style = plain, width: int = MAP_WIDTH, max_rows: int = MAP_ROWS) -> List[str]:
    """A grid of blocks up to the frontier: owner letter, '*' shared, '+' cached-free, '.' free, blank unmapped."""
    blocks = snap["blocks"]
    bpc, mapped = blocks["blocks_per_chunk"], blocks["chunk_mapped"]
    frontier = max((c["chunk"] % blocks["num_chunks"] + 1 for c in snap["pool"]["chunks"]), default=0)
    if frontier == 0:
        return ["pool map: nothing mapped yet"]
    chunks_per_row = math.ceil(frontier / max_rows)
    row_blocks = chunks_per_row * bpc
    cell = math.ceil(row_blocks / width)
    owners = _block_owners(snap)
    idle = set(blocks["cached"]) - owners.keys()  # cached-free: kept for prompts that begin alike
    host_from = blocks["num_chunks"] - snap["layout"]["host_chunks"]  # the host tier's first chunk
    lines = [f"pool map: {frontier} chunks of {bpc} blocks; one cell = {cell} block{'s' if cell > 1 else ''}, "
             f"one row = {chunks_per_row} chunk{'s' if chunks_per_row > 1 else ''}",
             "  letters: owning sequence, *: shared (copy-on-write or a cached prefix), +: cached, held by no "
             "sequence (evictable), .: free, blank: not mapped (hole)"]
    for first in range(0, frontier, chunks_per_row):
        cells = []
        for start in range(first * bpc, min(frontier, first + chunks_per_row) * bpc, cell):
            cells.append(_cell(range(start, start + cell), owners, idle, mapped, bpc, style))
            if cell <= bpc and (start + cell) % bpc == 0 and start + cell < (first + chunks_per_row) * bpc:
                cells.append("|")
        label = f"{first}" if chunks_per_row == 1 else f"{first}-{min(frontier, first + chunks_per_row) - 1}"
        tier = "  host tier" if first + chunks_per_row > host_from else ""
        lines.append(f"chunk {label:>7} [{''.join(cells)}]{tier}")
    return lines


def _cell(block_range, owners, idle, mapped, bpc, style):
    if not mapped[block_range.start // bpc]:
        return " "
    held = [owners[b] for b in block_range if b in owners]
    if not held:
        if any(b in idle for b in block_range):
            return style("+", fg="bright_white")
        return style(".", fg="bright_black")
    if any(len(o) > 1 for o in held):
        return style("*", fg="white", bold=True)
    counts = {}
    for o in held:
        counts[o[0]] = counts.get(o[0], 0) + 1
    return seq_symbol(max(counts, key=counts.get), style)


def chain(snap: dict, seq: int, pos: Any, layer: Any = 0, kv: Any = "k", head: Any = 0) -> Translation:
    """The Translation of token ``pos`` of ``seq`` from a snapshot."""
    entry = next((e for e in snap["sequences"] if e["seq"] == seq), None)
    if entry is None:
        raise UnknownSequenceError(f"sequence {seq} does not exist in this snapshot: it holds "
                                   f"{[e['seq'] for e in snap['sequences']]}")
    if not 0 <= pos < entry["length"]:
        raise InvalidPositionError(f"position {pos} is out of range: sequence {seq} holds {entry['length']} "
                                   f"tokens" + (f", positions 0..{entry['length'] - 1}" if entry["length"] else ""))
    shard = snap.get("shard")
    if shard is None:
        return translate(Layout(**snap["layout"]), snap["pool"]["base"], entry["blocks"], entry["length"],
                         seq, pos, layer, kv, head, cached=set(snap["blocks"]["cached"]))
    first, end = shard["kv_heads"]  # a shard's snapshot: the cache's heads, those of this shard
    if not isinstance(head, int) or not first <= head < end:
        raise UnsupportedConfigError(f"kv head {head!r:.40} is not in this snapshot: shard {shard['index']} (device "
                                     f"{shard['device']}) holds KV heads {first}..{end - 1} of {shard['num_kv_heads']}")
    tr = translate(Layout(**snap["layout"]), snap["pool"]["base"], entry["blocks"], entry["length"],
                   seq, pos, layer, kv, head - first, cached=set(snap["blocks"]["cached"]))
    return replace(tr, kv_head=head, shard=shard["index"], device=shard["device"])


def chain_lines(snap: dict, tr: Translation, style: Style = plain) -> List[str]:
    """One line per step, token -> physical memory (HBM on the GPU, host memory on the host backend)."""
    lay = Layout(**snap["layout"])
    gpu = snap["pool"]["backend"] == "cuda"
    mapper, memory = ("the GPU MMU", "HBM") if gpu else ("the OS page tables", "host memory")
    if gpu and tr.location == "host":
        memory = "pinned host memory (host tier)"
    bold = lambda text: style(str(text), bold=True)
    plane = lay.plane_offset(tr.layer, tr.kv)
    inner = tr.pool_offset - plane - tr.block_id * lay.block_stride_bytes
    where = (f" (chunk {tr.chunk % lay.chunks_per_plane} of plane {tr.chunk // lay.chunks_per_plane})"
             if lay.num_planes > 1 else "")
    shard = [] if tr.shard is None else [f"shard    kv head {tr.kv_head} is shard {bold(tr.shard)}'s, on device "
                                         f"{bold(tr.device)}: the addresses below are in that device's pool"]
    return [
        f"token    sequence {tr.seq}, position {tr.pos}, layer {tr.layer}, {tr.kv.upper()}, kv head {tr.kv_head}",
        *shard,
        f"block    logical block {bold(tr.logical_block)} = {tr.pos} // {lay.block_size}, "
        f"slot {bold(tr.slot)} = {tr.pos} % {lay.block_size}",
        f"table    block_table[{tr.seq}][{tr.logical_block}] = block id {bold(tr.block_id)}   "
        "(software layer: the kernel reads this)",
        f"cache    block {tr.block_id} is " + ("in the prefix cache (named by its tokens' hash chain; prompts that "
                                              "begin alike share it)" if tr.cached else "not in the prefix cache"),
        f"pool     offset {bold(tr.pool_offset)} = plane {plane} + {tr.block_id} x {lay.block_stride_bytes} "
        f"(block stride) + {inner} (head, slot)",
        f"address  virtual address {bold(hex(tr.virtual_address))} = base {snap['pool']['base']:#x} + offset",
        f"MMU      pool chunk {bold(tr.chunk)}{where}, offset {tr.chunk_offset} in it, page {bold(tr.page)} of "
        f"{size(lay.page_bytes)}   (hardware layer: {mapper} map{'s' if gpu else ''} it)",
        f"{'HBM' if memory == 'HBM' else 'memory':<8} {tr.nbytes} contiguous bytes ({lay.head_dim} x {lay.dtype}) in "
        f"chunk {tr.chunk}'s physical {memory}",
    ]


def plural(count: int, noun: str) -> str:
    """``count`` and ``noun``, plural (an "s" added) unless ``count`` is 1: "1 block", "3 blocks"."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def demo_report(figures: Dict[str, Any], steps: int, growth: Tuple[int, int, int], seq_tokens: int, dtype: str,
                style: Style = plain) -> List[str]:
    """The demo's figures (``DemoResult.figures()``) in words, a line per topic; the last says whether
    attention through the block tables agreed with contiguous attention (``figures["max_error"]`` within
    ``figures["tolerance"]``). ``steps``: the demo's; ``growth``: (low_blocks, high_blocks, release_after) of
    the cache's growth; ``seq_tokens``: the most tokens a sequence holds (what a contiguous cache reserves);
    ``dtype``: the cache's."""
    f, n = figures, plural
    low, high, release_after = growth
    ok = f["max_error"] <= f["tolerance"]
    verdict = style("ok" if ok else "TOO LARGE", fg="green" if ok else "red", bold=True)
    return [
        f"workload   {f['arrived']} arrived, {f['forked']} forked, {f['finished']} finished; "
        f"{n(f['sequences'], 'sequence')} hold {n(f['tokens'], 'token')} now",
        f"steps      {n(f['prompt_tokens'], 'prompt token')} computed in chunks, "
        f"{n(f['decode_tokens'], 'decode token')}; {f['mixed_steps']} of {n(steps, 'step')} mixed "
        f"prompt chunks with decode tokens",
        f"sharing    {n(f['prefix_hit_tokens'], 'prompt token')} found in the prefix cache (not computed); "
        f"{n(f['shared_blocks'], 'block')} shared now (*), {f['blocks_copied']} copied on write; "
        f"{n(f['cached_blocks'], 'cached block')}, {f['evictable_blocks']} of them held by no sequence "
        f"(+), {f['evictions']} evicted",
        f"growth     {n(f['chunks_ahead'], 'chunk')} mapped ahead of need, between steps (keeping "
        f"{low}-{high} blocks spare); {n(f['sync_grows'], 'grow')} inside a step; "
        f"{n(f['chunks_released'], 'chunk')} released after {release_after} idle steps",
        f"memory     {f['stored_tokens']} stored tokens (shared ones once) fill {size(f['token_bytes'])} "
        f"of {size(f['mapped_bytes'])} mapped ({f['utilisation_of_mapped']:.1%}) and of "
        f"{size(f['held_bytes'])} in held blocks ({f['utilisation_of_held']:.1%})",
        f"contiguous reserving {seq_tokens} tokens per sequence would need "
        f"{size(f['contiguous_bytes'])} now, {size(f['peak_contiguous_bytes'])} at the peak "
        f"(paged peak mapped: {size(f['peak_mapped_bytes'])})",
        f"attention  max relative error {f['max_error']:.2e} over {f['checks']} checks "
        f"(tolerance {f['tolerance']:.0e} for {dtype}): {verdict}",
    ]
