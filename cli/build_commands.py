"""`seq2trt build`: TensorRT engines of an export (exporters.tensorrt.engines does the work)."""

from __future__ import annotations

from pathlib import Path

import click

from seq2trt.exporters.tensorrt import trt_compat


@click.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--backend", type=click.Choice([f.value for f in trt_compat.Flavour]), default="tensorrt-rtx",
              show_default=True, help="TensorRT flavour; tensorrt-rtx builds without a GPU.")
@click.option("--target", "target", default=None,
              help="Comma-separated compute capabilities (sm_86,sm_89) or 'current' (the GPU here). "
                   "Default: current; sm_86 for tensorrt-rtx on a machine without a GPU.")
@click.option("--dtype", type=click.Choice(["fp32", "fp16", "bf16"]), default=None,
              help="Engine precision; must match the export's (networks are strongly typed). Default: the export's.")
@click.option("--max-batch", type=int, default=None, help="Profile maximum batch. Default: the export's limit.")
@click.option("--max-src-len", type=int, default=None, help="Profile maximum source length. Default: the export's.")
@click.option("--max-tgt-len", type=int, default=None, help="Profile maximum target length. Default: the export's.")
@click.option("--no-plugin", is_flag=True, help="Build the unfused graphs (TensorRT's own fusion) for comparison.")
@click.option("--opt-level", type=click.IntRange(0, 5), default=3, show_default=True,
              help="Builder optimization level.")
@click.option("--workspace-mib", type=click.IntRange(min=1), default=None, help="Workspace limit in MiB.")
@click.option("--timing-cache", type=click.Path(path_type=Path), default=None,
              help="Timing cache file to read and update (enterprise TensorRT only; TensorRT-RTX has none).")
@click.option("--force", is_flag=True, help="Replace an existing engine directory.")
def build(out: Path, backend: str, target: str | None, dtype: str | None, max_batch: int | None,
          max_src_len: int | None, max_tgt_len: int | None, no_plugin: bool, opt_level: int,
          workspace_mib: int | None, timing_cache: Path | None, force: bool) -> None:
    """Build encoder and decoder engines of the export in OUT into OUT/engines/<backend>-<target>-<dtype>/."""
    from seq2trt.exporters import spec
    from seq2trt.exporters.tensorrt.engines import build_engines
    from seq2trt.stages import engine_request

    from seq2trt.cli.progress import progress_bar

    request = engine_request(out, backend, target, dtype, max_batch, max_src_len, max_tgt_len, not no_plugin,
                             opt_level, workspace_mib, timing_cache, force)
    targets = request.targets
    with progress_bar(f"building {backend} engines ({trt_compat.target_tag(targets)})", len(spec.GraphKind)) as update:
        engine_dir = build_engines(out, request, lambda graph, phase, done: update(done, f"{graph} {phase}".strip()))
    from seq2trt.exporters.tensorrt.engines import read_build

    info = read_build(engine_dir, verify=False)
    for name, graph in info["graphs"].items():
        click.echo(f"{name}: {graph['plan_bytes'] / 1e6:.2f} MB in {graph['build_seconds']:.1f} s, "
                   f"{graph['plugin_layers']} plugin layer(s)")
    click.echo(f"engines in {engine_dir}")


COMMANDS = [build]
