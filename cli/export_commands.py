"""`seq2trt export`: the ONNX graphs of a checkpoint."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import click

from seq2trt.exporters.spec import DEFAULT_OPSET, DTYPES

# The exporter's libraries log every graph pass at INFO and warn about optional torchvision ops.
_CHATTY = ("onnxscript", "onnx_ir", "torch.onnx", "torch.export", "torch._export")


def quiet_exporters() -> None:
    for name in _CHATTY:
        logging.getLogger(name).setLevel(logging.ERROR)


@click.command()
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("-o", "--out", "out", type=click.Path(path_type=Path), required=True, help="Export directory to write.")
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="fp32", show_default=True)
@click.option("--opset", type=int, default=DEFAULT_OPSET, show_default=True)
@click.option("--max-batch", type=int, default=32, show_default=True, help="Largest batch the profiles serve.")
@click.option("--max-src-len", type=int, default=None, help="Longest source (default: the model's max_src_len).")
@click.option("--max-tgt-len", type=int, default=None, help="Longest target (default: the model's max_tgt_len).")
@click.option("--force", is_flag=True, help="Replace an existing export directory.")
def export(checkpoint: Path, out: Path, dtype: str, opset: int, max_batch: int, max_src_len: int | None,
           max_tgt_len: int | None, force: bool) -> None:
    """Export CHECKPOINT to OUT/encoder.onnx, OUT/decoder.onnx and OUT/manifest.json."""
    import seq2trt

    quiet_exporters()
    start = time.perf_counter()
    from seq2trt.cli.progress import progress_lines

    result = seq2trt.export(checkpoint, out, dtype=dtype, opset=opset, max_batch=max_batch, max_src_len=max_src_len,
                            max_tgt_len=max_tgt_len, force=force, progress=progress_lines("export"))
    files = result.manifest["files"]
    sizes = ", ".join(f"{name} {info['bytes'] / 2**20:.1f} MiB" for name, info in files.items())
    click.echo(f"exported {dtype} graphs in {time.perf_counter() - start:.1f} s: {sizes}; in {out}")


COMMANDS = [export]
