"""`seq2trt fuse`: every attention block of the exported graphs becomes one node, with an audit; `seq2trt quantize`:
the opt-in int8 graphs for ONNX Runtime on CPU."""

from __future__ import annotations

from pathlib import Path

import click

from seq2trt.exporters.fuse import Target
from seq2trt.exporters.quantize import quantized_dir


@click.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--target", type=click.Choice([t.value for t in Target]), default="trt", show_default=True,
              help="trt: the seq2trt plugin node; ort: com.microsoft.MultiHeadAttention for ONNX Runtime.")
@click.option("--allow-partial", is_flag=True, help="Write the graphs even if some blocks were not fused "
                                                    "(experiments only).")
@click.option("--force", is_flag=True, help="Replace existing fused graphs for this target.")
def fuse(out: Path, target: str, allow_partial: bool, force: bool) -> None:
    """Fuse the attention blocks of the export in OUT into OUT/fused/<target>/ and audit the result."""
    import seq2trt

    from seq2trt.cli.progress import progress_lines

    result = seq2trt.fuse(out, target, allow_partial=allow_partial, force=force, progress=progress_lines("fuse"))
    for name, graph in result.audit.items():
        blocks = ", ".join(f"{kind} {graph['fused'][kind]}/{n}" for kind, n in graph["expected"].items())
        click.echo(f"{name}: {blocks} fused; {graph['nodes_before']} -> {graph['nodes_after']} nodes")
    if not result.complete:
        unfused = [f"{name}:{block}" for name, graph in result.audit.items() for block in graph["unfused_blocks"]]
        click.echo(f"warning: partial fusion, unfused: {', '.join(unfused)}", err=True)
    click.echo(f"fused graphs and fusion.json in {result.folder}")


@click.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--per-channel", is_flag=True, help="One weight scale per output channel instead of per tensor "
                                                  "(finer; ~10% slower at batch 1 on our CPU).")
@click.option("--reduce-range/--full-range", default=None,
              help="7-bit weights, for x86 CPUs without VNNI where uint8 x int8 products saturate (default: chosen "
                   "for this CPU).")
@click.option("--force", is_flag=True, help="Replace existing int8 graphs.")
def quantize(out: Path, per_channel: bool, reduce_range: bool | None, force: bool) -> None:
    """Quantize the fused ORT graphs of OUT to int8 (dynamic) into OUT/quantized/ort-int8/.

    Opt-in: weights become int8 and activations are quantized at run time; check the accuracy cost with
    `seq2trt validate OUT --graphs int8-ort` and the speed with `seq2trt bench OUT --backends ort-fused,ort-int8`.
    """
    import seq2trt

    from seq2trt.cli.progress import progress_lines

    doc = seq2trt.quantize(out, per_channel=per_channel, reduce_range=reduce_range, force=force,
                           progress=progress_lines("quantize")).report
    for graph, g in doc["graphs"].items():
        click.echo(f"{graph}: {g['quantized']}/{g['matmuls']} MatMuls int8; {g['bytes_before'] / 2**20:.1f} -> "
                   f"{g['bytes_after'] / 2**20:.1f} MiB")
    click.echo(f"int8 graphs and quantization.json in {quantized_dir(out)}; accuracy: "
               f"`seq2trt validate {out} --graphs int8-ort`")


COMMANDS = [fuse, quantize]
