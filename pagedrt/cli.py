"""The ``pagedrt`` command line: see both mapping layers."""

import json

import click

from .memory import BACKENDS

backend_option = click.option(
    "--backend", type=click.Choice(BACKENDS), default="auto", show_default=True,
    help="cuda: the GPU's VMM; host: the OS's virtual memory; auto: cuda when usable.")
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="pagedrt")
def main():
    """pagedrt: a paged KV cache over a growable virtual memory pool, and a view into both layers."""


@main.command()
@backend_option
@json_option
def info(backend, as_json):
    """Device, driver and runtime versions, VMM support, page size, and the backend in use."""
    from .driver import probe
    from .memory import select_backend
    from .errors import BackendUnavailableError
    cuda = probe()
    try:
        chosen = select_backend(backend)
    except BackendUnavailableError as exc:
        raise click.ClickException(str(exc))
    report = {"backend": chosen.name, "reason": chosen.reason, "page_bytes": chosen.page_bytes, "cuda": cuda}
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"backend     {chosen.name} ({chosen.reason})")
    click.echo(f"page size   {chosen.page_bytes} bytes")
    if cuda["usable"] or "device" in cuda:
        for key in ("device", "compute_capability", "multiprocessors", "driver_version",
                    "runtime_version", "cupy_version", "memory_total"):
            click.echo(f"{key.replace('_', ' '):<11} {cuda[key]}")
        click.echo(f"VMM         {'supported' if cuda['usable'] else 'not supported'}")
    else:
        click.echo(f"CUDA        unavailable: {cuda['reason']}")
