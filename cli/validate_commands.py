"""`seq2trt validate`: the parity of an export's graphs or engines with the eager model."""

from __future__ import annotations

import time
from pathlib import Path

import click

from seq2trt.cli.options import SEED, renamed_flag
from seq2trt.validation.validate import BACKENDS, GRAPH_SETS


@click.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--backend", type=click.Choice(list(BACKENDS)), default="ort", show_default=True,
              help="ort: ONNX Runtime runs the graphs; ort-cuda: on ONNX Runtime's CUDA provider, the KV cache on the GPU "
                   "(its graphs: fused-ort unless --graphs plain; docs/gpu.md); tensorrt / tensorrt-rtx: the engines "
                   "of `seq2trt build` (an NVIDIA GPU), judged against the graphs they were built from.")
@click.option("--graphs", type=click.Choice(list(GRAPH_SETS)), default=None,
              help="Which graphs of OUT: plain (the default: the export), fused-ort / fused-trt (`seq2trt fuse`), "
                   "int8-ort (`seq2trt quantize`), generate / generate-int8 (`seq2trt ort-search [--int8]`: the whole "
                   "search, end to end only). With a TensorRT backend: the graphs its engines were built from.")
@click.option("--samples", type=int, default=1000, show_default=True,
              help="Held-out sources decoded end to end (0 skips end-to-end parity).")
@click.option("--beam-size", "beam_size", type=int, default=4, show_default=True,
              help="Beam size of the beam-search check.")
@renamed_flag("--beam", "--beam-size", "beam_size")
@click.option("--max-new-tokens", type=int, default=None, help="Decoding length cap (default: from the limits).")
@click.option("--checkpoint", type=click.Path(path_type=Path), default=None,
              help="Eager reference (default: the checkpoint recorded in the manifest).")
@click.option("--device", type=click.Choice(["cpu", "cuda", "auto"]), default="cpu", show_default=True,
              help="ONNX Runtime provider: CPU, CUDA, or CUDA when present.")
@click.option("--threads", type=int, default=1, show_default=True,
              help="ONNX Runtime intra-op threads (0: one per core).")
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--localize", is_flag=True,
              help="Also localise the worst clean case of each graph (failing and near-tie cases always are): which "
                   "layer and sub-block first exceeds the tolerance, error growth by layer, that block's op types.")
@click.option("--localize-budget", "localize_budget_s", type=float, default=120.0, show_default=True,
              help="Seconds the per-layer localisation pass may take (0: skip it).")
def validate(out: Path, backend: str, graphs: str, samples: int, beam_size: int, max_new_tokens: int | None,
             checkpoint: Path | None, device: str, threads: int, seed: int, localize: bool,
             localize_budget_s: float) -> None:
    """Check OUT's graphs against the eager model: graph-level parity over the spec's shape sweep, then greedy
    and beam decoding end to end. Writes OUT/reports/parity.json and parity.md; exits 1 on any failure."""
    import seq2trt
    from seq2trt.validation.sampling import sampling_summary

    start = time.perf_counter()
    doc = seq2trt.validate(out, backend=backend, graphs=graphs, samples=samples, beam_size=beam_size,
                           max_new_tokens=max_new_tokens, checkpoint=checkpoint, device=device, threads=threads,
                           seed=seed, localize=localize, localize_budget_s=localize_budget_s,
                           progress=lambda msg: click.echo(msg, err=True)).document
    e2e = doc["end_to_end"]
    summary = "" if e2e is None else (
        f"; end to end on {e2e['samples']} sources: token_agreement {e2e['token_agreement']:.6f}, "
        f"sequence_match {e2e['sequence_match']:.6f}, max_logit_abs_err {e2e['max_logit_abs_err']:.3g}"
        + "".join(f", {s} near-ties {a['near_ties']} (judged token_agreement {a['judged_token_agreement']:.6f})"
                  for s in ("greedy", "beam") if (a := e2e.get(s) or {}).get("near_ties"))
        + (f", {m['name']} {m['candidate']:.4f} (eager {m['reference']:.4f})" if (m := e2e.get("task_metric")) else "")
        + (f", {s}" if (s := sampling_summary(doc.get("sampling"))) else ""))
    click.echo(f"parity passed ({doc['cases']} graph cases{summary}) in {time.perf_counter() - start:.0f} s; "
               f"report in {out}/reports/{doc.get('report', 'parity.md')}")


COMMANDS = [validate]
