"""`seq2trt demo`: the whole pipeline on the built-in demo model, as one command with progress.

train (or reuse the cached model) -> export -> fuse (trt, ort) -> quantize (int8 for ORT) -> build (when a
TensorRT flavour is installed) -> validate (plain, fused ORT, plugin graphs on CPU, int8) -> bench -> report.
"""

from __future__ import annotations

import time
from pathlib import Path

import click


def _step(title: str):
    click.secho(f"\n▶ {title}", bold=True, err=True)
    return time.perf_counter()


def _done(start: float, message: str) -> None:
    click.echo(f"  {message} ({time.perf_counter() - start:.0f} s)", err=True)


@click.command()
@click.option("-o", "--out", "out", type=click.Path(path_type=Path), default=Path("runs/demo"), show_default=True,
              help="Artifact directory (export, fused graphs, engines, reports).")
@click.option("--samples", type=int, default=200, show_default=True,
              help="Held-out sources decoded end to end per validated graph set (`seq2trt validate` uses 1000).")
@click.option("--force", is_flag=True, help="Replace an existing artifact directory.")
def demo(out: Path, samples: int, force: bool) -> None:
    """Run the whole pipeline on the demo model (numbers -> words) and write a report."""
    from seq2trt.core.atomic_files import refuse_existing
    from seq2trt.exporters.manifest import MANIFEST

    refuse_existing(out, force, "demo", kind=MANIFEST)  # before any work
    start = time.perf_counter()
    checkpoint = _train()
    _export(checkpoint, out, force)
    _fuse(out, force)
    _quantize(out, force)
    _build(out, force)
    _validate(out, samples)
    _bench(out)
    html = _report(out)
    click.echo(f"demo finished in {time.perf_counter() - start:.0f} s: open {html}")


def _train() -> Path:
    from seq2trt.cli.progress import progress_bar
    from seq2trt.reference_model.train import demo_checkpoint

    t = _step("train the demo model (cached after the first run)")
    with progress_bar("training", 500) as update:
        checkpoint = demo_checkpoint(progress=lambda step, loss: update(step, f"loss {loss:.3f}"))
    metrics = (checkpoint / "metrics.json").read_text()
    _done(t, f"checkpoint {checkpoint}; " + metrics.split('"heldout_exact_match":')[1].split(",")[0].strip()
          + " held-out exact match")
    return checkpoint


def _export(checkpoint: Path, out: Path, force: bool) -> None:
    from seq2trt.cli.export_commands import quiet_exporters
    from seq2trt.exporters.onnx_export import export
    from seq2trt.reference_model.checkpoint import load_checkpoint, source_record

    t = _step("export encoder.onnx + decoder.onnx (fp32)")
    quiet_exporters()
    model, _ = load_checkpoint(checkpoint)
    export(model, out, dtype="fp32", force=force, source=source_record(checkpoint))
    _done(t, f"graphs in {out}")


def _fuse(out: Path, force: bool) -> None:
    from seq2trt.exporters.fuse import Target, fuse_artifacts

    for target in Target:
        t = _step(f"fuse attention for {target.value}")
        audit = fuse_artifacts(out, target, force=force)
        _done(t, "; ".join(f"{g.graph} {sum(g.fused.values())}/{sum(g.expected.values())} blocks, "
                           f"{g.nodes_before} -> {g.nodes_after} nodes" for g in audit.graphs))


def _quantize(out: Path, force: bool) -> None:
    from seq2trt.exporters.quantize import quantize_artifacts

    t = _step("quantize the fused ORT graphs to int8 (opt-in CPU path)")
    graphs = quantize_artifacts(out, force=force)["graphs"]
    _done(t, "; ".join(f"{name} {g['quantized']}/{g['matmuls']} MatMuls int8, {g['bytes_before'] / 2**20:.1f} -> "
                       f"{g['bytes_after'] / 2**20:.1f} MiB" for name, g in graphs.items()))


def _build(out: Path, force: bool) -> None:
    from seq2trt.exporters.tensorrt import trt_compat

    t = _step("build TensorRT engines")
    flavour = next((f for f in trt_compat.Flavour if trt_compat.available(f)), None)
    if flavour is None:
        _done(t, "skipped: no TensorRT installed (pip install 'seq2trt[rtx]' builds engines without a GPU)")
        return
    from seq2trt.exporters.tensorrt.engines import EngineRequest, build_engines

    target = "current" if trt_compat.has_gpu() else "sm_86"
    engine_dir = build_engines(out, EngineRequest(flavour.value, trt_compat.parse_targets(flavour, target),
                                                  force=force))
    _done(t, f"{flavour.value} engines for {target} in {engine_dir}")


def _validate(out: Path, samples: int) -> None:
    from seq2trt.validation.sampling import sampling_summary
    from seq2trt.validation.validate import ValidateSettings, run_validation

    for graphs in ("plain", "fused-ort", "fused-trt", "int8-ort"):
        t = _step(f"validate {graphs} graphs on ONNX Runtime CPU against the eager model (float64)")
        doc = run_validation(out, ValidateSettings(backend="ort", graphs=graphs, samples=samples))
        e2e = doc["end_to_end"]
        metric = e2e.get("task_metric") or {}
        _done(t, f"passed: {doc['cases']} graph cases; greedy token agreement "
                 f"{e2e['greedy']['token_agreement']:.4f}, beam {e2e['beam']['token_agreement']:.4f} on "
                 f"{e2e['samples']} held-out sources" +
                 (f"; exact match {metric['candidate']:.3f}" if metric else "") +
                 (f"; {s}" if (s := sampling_summary(doc.get("sampling"))) else ""))


def _bench(out: Path) -> None:
    from seq2trt.runtime import registry
    from seq2trt.validation.bench.measure import run_bench
    from seq2trt.validation.bench.settings import BenchSettings, unavailable

    t = _step("bench (interleaved, 1 thread)")
    wanted = registry.names(demo=True)
    skipped = unavailable(wanted)
    backends = tuple(b for b in wanted if b not in skipped)
    run_bench(out, BenchSettings(backends=backends, batch_sizes=(1, 8), repeats=3, warmup=1, step_calls=1))
    _done(t, "latency.json, latency.md and plots" + "".join(f"; {b} skipped: {why}" for b, why in skipped.items()))


def _report(out: Path) -> Path:
    from seq2trt.validation.reports.report import write_report

    t = _step("report")
    md, html = write_report(out)
    _done(t, f"{md} and {html}")
    return html

COMMANDS = [demo]
