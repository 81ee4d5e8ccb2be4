"""`seq2trt serve`: an export behind Triton Inference Server (the bundled one here, or a repository for a GPU host)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from seq2trt.cli.options import renamed_flag
from seq2trt.reference_model.decoding import GNMT_ALPHA
from seq2trt.runtime.registry import SERVE_BACKENDS


@click.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--backend", type=click.Choice(SERVE_BACKENDS), default="ort-fused", show_default=True)
@click.option("--http-port", type=int, default=8000, show_default=True)
@click.option("--grpc-port", type=int, default=8001, show_default=True)
@click.option("--metrics-port", type=int, default=8002, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--max-batch", type=int, default=None, help="Requests per server batch (default: the export's max_batch).")
@click.option("--max-queue-delay-us", type=int, default=2000, show_default=True,
              help="How long the dynamic batcher waits for more requests.")
@click.option("--instances", type=int, default=1, show_default=True, help="Model instances (processes) per model.")
@click.option("--threads", type=int, default=1, show_default=True,
              help="CPU threads per instance: ONNX Runtime's, and torch's (the eager model, the search's arithmetic).")
@click.option("--length-penalty", "alpha", type=float, default=GNMT_ALPHA, show_default=True,
              help="GNMT length penalty (alpha) of beam search for models trained here.")
@renamed_flag("--alpha", "--length-penalty", "alpha", float)
@click.option("--max-request-mb", type=float, default=64.0, show_default=True,
              help="The largest HTTP request body (MiB); larger ones get 413 (file bytes carry more audio than JSON).")
@click.option("--checkpoint", type=click.Path(path_type=Path), help="The export's checkpoint, if it moved.")
@click.option("--write-repository", type=click.Path(path_type=Path),
              help="Write a Triton model repository for a GPU host into this folder instead of serving.")
@click.option("--repository-backend", type=click.Choice(["onnxruntime", "tensorrt_plan", "python"]),
              default="onnxruntime", show_default=True,
              help="With --write-repository: how the encoder and decoder are served (python: ONNX Runtime inside the "
              "Python backend, for servers without the onnxruntime backend, such as the one nvidia-pytriton bundles).")
@click.option("--repository", type=click.Path(path_type=Path, exists=True, file_okay=False),
              help="Serve this model repository (one written with --repository-backend python) instead of OUT's models.")
@click.option("--log", type=click.Path(path_type=Path), help="Append the server's own log to this file.")
@click.option("--force", is_flag=True, help="With --write-repository: replace an existing folder.")
def serve(out: Path, backend: str, http_port: int, grpc_port: int, metrics_port: int, host: str, max_batch: int | None,
          max_queue_delay_us: int, instances: int, threads: int, alpha: float, max_request_mb: float,
          checkpoint: Path | None,
          write_repository: Path | None, repository_backend: str, repository: Path | None, log: Path | None,
          force: bool) -> None:
    """Serve the export in OUT with Triton: model `generate` (input_ids -> output_ids, optional max_new_tokens and
    beam_size per request) and, when the checkpoint has a tokenizer, `translate` (text -> text); a Whisper export
    gets `transcribe` alone (audio file bytes, or samples and sampling_rate -> text, segments, language, tokens).
    Requests are batched dynamically; each gets what `seq2trt translate --ids-file` (`seq2trt transcribe`) gives.
    SIGINT/SIGTERM drain the server, then exit 0."""
    from seq2trt.serving.server import ServeSettings, check_counts, serve as run_server

    check_counts(threads, instances, max_batch, max_queue_delay_us, lambda field: "--" + field.replace("_", "-"))
    settings = ServeSettings(out, backend, checkpoint, threads, max_batch, max_queue_delay_us, instances, alpha, host,
                             http_port, grpc_port, metrics_port, max_request_mb)
    if write_repository is not None:
        from seq2trt.serving.repository import write_repository as write

        folder = write(settings, write_repository, repository_backend, force)
        click.echo(f"wrote a Triton model repository to {folder}; start it as {folder / 'README.md'} says")
        return

    code = run_server(settings, _announce(settings), log=log, repository=repository)
    click.echo(f"drained and stopped (tritonserver exit code {code})")
    sys.exit(0 if code == 0 else 1)


def _announce(settings):
    """The callback that prints the served models and their endpoints once the server is ready."""
    def ready(models: list[str], endpoints: dict[str, str]) -> None:
        click.echo(f"serving {', '.join(models)} from {settings.out} ({settings.backend}, {settings.instances} "
                   f"instance(s) x {settings.threads} thread(s))")
        for name, url in endpoints.items():
            click.echo(f"  {name:8} {url}")
        click.echo("ready; Ctrl-C or SIGTERM drains and stops", nl=True)
        sys.stdout.flush()

    return ready


COMMANDS = [serve]
