"""`seq2trt bench`: every backend timed side by side on one export, with ratios (validation.bench does the work)."""

from __future__ import annotations

from pathlib import Path

import click

from seq2trt.cli.options import renamed_flag
from seq2trt.reference_model.decoding import GNMT_ALPHA
from seq2trt.validation.bench.settings import BENCH_DEFAULT, KNOWN_BACKENDS, SEARCHES, BenchSettings


@click.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--backends", default=",".join(BENCH_DEFAULT), show_default=True,
              help=f"Comma-separated, from: {', '.join(KNOWN_BACKENDS)}. hf (transformers' generate) and optimum "
              "(Optimum's ONNX Runtime export) run on the Hugging Face directory the checkpoint was imported from "
              "(`seq2trt import hf`); for such a checkpoint ct2 converts that directory with CTranslate2's converter.")
@click.option("--batch-sizes", default="1,8,32", show_default=True, help="Comma-separated batch sizes.")
@click.option("--threads", default="1", show_default=True,
              help="CPU threads per backend; comma-separated to measure several (e.g. 1,2). ct2-int8 always uses 1.")
@click.option("--repeats", type=int, default=BenchSettings.repeats, show_default=True,
              help="Measured repetitions (each one round-robin over the backends).")
@click.option("--warmup", type=int, default=BenchSettings.warmup, show_default=True, help="Unmeasured repetitions first.")
@click.option("--src-len", type=int, default=None,
              help="Source length of the decoding runs of a text model (default 32, clipped to the export's limit).")
@click.option("--clip-seconds", default=None,
              help="A Whisper export: comma-separated lengths of the synthetic clips, each within one 30 s window "
                   "(default 10,30).")
@click.option("--new-tokens", type=int, default=BenchSettings.new_tokens, show_default=True,
              help="Tokens decoded per source (eos does not stop a row, so every backend does the same work).")
@click.option("--curves/--no-curves", default=True, show_default=True,
              help="Also time the encoder by source length and the decoder step by past length (up to the export's "
              "limits; each past is built by a prefill, slow with a large vocabulary).")
@click.option("--checkpoint", type=click.Path(path_type=Path), default=None,
              help="The checkpoint OUT was exported from (default: the one its manifest names).")
@click.option("--search", type=click.Choice(SEARCHES), default="greedy", show_default=True,
              help="greedy: forced length (above); beam: a real beam search of --beam-size K on held-out sources, at "
                   "most --new-tokens, every backend (CTranslate2 too) with --length-penalty (score / length ** "
                   "penalty). Exports for beam need max_batch >= B x K. sample: forced-length sampling with "
                   "--temperature, --top-k, --top-p (CTranslate2: sampling_temperature/topk/topp), each backend's "
                   "greedy decode of the same rows timed in the same turn: sampling's extra cost per step.")
@click.option("--beam-size", "beam", type=int, default=4, show_default=True, help="Beam size of --search beam.")
@renamed_flag("--beam", "--beam-size", "beam")
@click.option("--length-penalty", type=float, default=GNMT_ALPHA, show_default=True, help="Length penalty of --search beam.")
@click.option("--temperature", type=float, default=BenchSettings.temperature, show_default=True,
              help="Sampling temperature of --search sample.")
@click.option("--top-k", type=int, default=BenchSettings.top_k, show_default=True,
              help="Top-k of --search sample (Hugging Face's default 50; 0: the whole vocabulary).")
@click.option("--top-p", type=float, default=BenchSettings.top_p, show_default=True, help="Top-p of --search sample.")
@click.option("--fast-sampling", is_flag=True, help="--search sample: our loops draw by the inverse CDF over the "
              "kept tokens (translate --fast-sampling), not transformers' stream.")
@click.option("--n-best", type=int, default=1, show_default=True,
              help="Sequences returned a source, with their scores: --search beam's n-best (num_return_sequences; "
                   "CTranslate2's num_hypotheses, return_scores), or --search sample's samples a source.")
def bench(out: Path, backends: str, batch_sizes: str, threads: str, repeats: int, warmup: int, src_len: int | None,
          clip_seconds: str | None, new_tokens: int, curves: bool, checkpoint: Path | None, search: str, beam: int,
          length_penalty: float, temperature: float, top_k: int, top_p: float, fast_sampling: bool,
          n_best: int) -> None:
    """Time the backends on the export in OUT; write OUT/reports/latency.json, latency.md and plots."""
    from seq2trt.validation.bench.settings import parse_backends, parse_ints, parse_seconds

    settings = BenchSettings(backends=parse_backends(backends), batch_sizes=parse_ints(batch_sizes, "--batch-sizes"),
                             threads=parse_ints(threads, "--threads"), repeats=repeats, warmup=warmup,
                             src_len=src_len, new_tokens=new_tokens, curves=curves, search=search, beam=beam,
                             length_penalty=length_penalty, temperature=temperature, top_k=top_k, top_p=top_p,
                             n_best=n_best, fast_sampling=fast_sampling,
                             clip_seconds=None if clip_seconds is None else parse_seconds(clip_seconds, "--clip-seconds"))
    doc = _run(out, settings, checkpoint)
    for name, why in doc.get("not_measured", {}).items():  # a peer that cannot run here: the rest was measured
        click.echo(f"not measured: {name}: {why}", err=True)
    if doc.get("kind") == "speech":
        _echo_speech(doc)
        click.echo(f"reports in {out / 'reports'} (latency.json, latency.md)")
        return
    _echo_text(doc)
    click.echo(f"reports in {out / 'reports'} (latency.json, latency.md, plots)")


def _run(out: Path, settings: BenchSettings, checkpoint: Path | None) -> dict:
    """`run_bench` under a progress bar counting its repetitions."""
    from seq2trt.cli.progress import progress_bar
    from seq2trt.validation.bench.measure import run_bench

    total = len(settings.threads) * (settings.warmup + settings.repeats)
    with progress_bar("bench", total) as update:
        done = [0]

        def progress(message: str) -> None:
            if "repetition" in message:
                done[0] += 1
            update(min(done[0], total), message)

        return run_bench(out, settings, checkpoint, progress)


def _echo_text(doc: dict) -> None:
    for t, by_backend in doc["results"].items():
        for backend, by_batch in by_backend.items():
            for batch, r in by_batch.items():
                ratio = doc["ratios"][t][backend][batch]
                vs = ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items() if v is not None)
                steps = f", step p50 {r['step_ms_p50']:.3f} ms, p99 {r['step_ms_p99']:.3f} ms" \
                    if r.get("step_ms_p50") is not None else ""  # a whole search (beam, ort-generate) has no steps
                extra = f", sampling +{r['sampling_extra_fraction']:.1%} of a greedy step " \
                    f"({r['sampling_extra_ms_per_step'] * 1e3:.1f} us)" if "sampling_extra_fraction" in r else ""
                click.echo(f"{t} thread(s) {backend:>12} B={batch:>3}" + (f" beam {r['beam']}" if "beam" in r else "") +
                           (" sample" if r["search"] == "sample" else "") +
                           (f" n-best {r['n_best']}" if "n_best" in r else "") +
                           f": {r['tokens_per_s']:9.1f} tokens/s, decode p50 {r['decode_ms_p50']:.2f} ms{steps}{extra}"
                           + (f" ({vs})" if vs else ""))


def _echo_speech(doc: dict) -> None:
    for r in doc["rows"]:
        vs = ", ".join(f"{k[3:]} {r[k]:.2f}x" for k in r if k.startswith("vs_") and r[k] is not None
                       and not k.endswith("_with_front_end"))
        search = "greedy" if r["beam"] == 1 else f"beam {r['beam']}"
        click.echo(f"{r['threads']} thread(s) {r['backend']:>9} {r['clip_seconds']:>4g} s B={r['batch']:>2} {search}: "
                   f"{r['tokens_per_s']:8.1f} tokens/s, RTF {r['rtf']:.4f} ({r['rtf_with_front_end']:.4f} with "
                   f"{r['front_end']})" + (f" ({vs})" if vs else ""))


COMMANDS = [bench]
