"""`seq2trt report`: one Markdown + HTML report of everything the stages wrote."""

from __future__ import annotations

from pathlib import Path

import click

from seq2trt.validation.reports.report import write_report


@click.command()
@click.argument("out", type=click.Path(path_type=Path))
def report(out: Path) -> None:
    """Render OUT/reports/report.md and report.html from the manifest, fusion, build, parity and latency."""
    md, html = write_report(out)
    click.echo(f"report: {md}\n        {html}")


COMMANDS = [report]
