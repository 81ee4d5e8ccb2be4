"""`seq2trt report`: one Markdown + HTML report of everything the stages wrote."""

from __future__ import annotations

from pathlib import Path

import click



@click.command()
@click.argument("out", type=click.Path(path_type=Path))
def report(out: Path) -> None:
    """Render OUT/reports/report.md and report.html from the manifest, fusion, build, parity and latency."""
    import seq2trt

    result = seq2trt.report(out)
    click.echo(f"report: {result.markdown}\n        {result.html}")


COMMANDS = [report]
