"""`seq2trt fuse`: every attention block of the exported graphs becomes one node, with an audit."""

from __future__ import annotations

from pathlib import Path

import click

from seq2trt.exporters.fuse import Target, fuse_artifacts, fused_dir


@click.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--target", type=click.Choice([t.value for t in Target]), default="trt", show_default=True,
              help="trt: the seq2trt plugin node; ort: com.microsoft.MultiHeadAttention for ONNX Runtime.")
@click.option("--allow-partial", is_flag=True, help="Write the graphs even if some blocks were not fused "
                                                    "(experiments only).")
@click.option("--force", is_flag=True, help="Replace existing fused graphs for this target.")
def fuse(out: Path, target: str, allow_partial: bool, force: bool) -> None:
    """Fuse the attention blocks of the export in OUT into OUT/fused/<target>/ and audit the result."""
    audit = fuse_artifacts(out, Target(target), allow_partial=allow_partial, force=force)
    for graph in audit.graphs:
        blocks = ", ".join(f"{kind} {graph.fused[kind]}/{n}" for kind, n in graph.expected.items())
        click.echo(f"{graph.graph}: {blocks} fused; {graph.nodes_before} -> {graph.nodes_after} nodes")
    if not audit.complete:
        click.echo(f"warning: partial fusion, unfused: {', '.join(audit.unfused())}", err=True)
    click.echo(f"fused graphs and fusion.json in {fused_dir(out, Target(target))}")


COMMANDS = [fuse]
