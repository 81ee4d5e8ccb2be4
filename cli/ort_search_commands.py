"""`seq2trt ort-search`: the whole search (greedy or beam) in one ONNX Runtime graph, built from the fused ORT graphs.
`seq2trt generate`, its old name, is kept as a hidden deprecated alias ("generate" also names transformers'
`generate`, the served ids model and `Translator.generate`)."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("ort-search")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--int8", is_flag=True, help="Build OUT/generate/ort-int8 from the int8 graphs of `seq2trt quantize` "
                                          "(backend ort-generate-int8) instead.")
@click.option("--no-repeat-ngram-size", type=int, default=None,
              help="Ban repeating any n-gram of this size (0: off), fixed in the graph (an attribute of BeamSearch). "
                   "Default: the model's own generation settings, else 0. Decodes asking another value are refused.")
@click.option("--force", is_flag=True, help="Replace an existing generation graph.")
def ort_search(out: Path, int8: bool, no_repeat_ngram_size: int | None, force: bool) -> None:
    """Write OUT/generate/ort/generate.onnx: ONNX Runtime's BeamSearch op around the fused ORT graphs of OUT
    (`seq2trt fuse OUT --target ort` first), with generate.json (the hashes of the graphs it was built from).

    Run it with `seq2trt translate OUT --backend ort-generate [--beam-size K]`: Hugging Face's beam search with
    early_stopping=True and --length-penalty as length_penalty (score / length ** alpha); one beam is greedy. It applies
    min_length / min_new_tokens, repetition_penalty (beam), no_repeat_ngram_size (this graph's), --n-best and
    --scores (beam); other options are refused. Exports for beam need max_batch >= B x K."""
    import seq2trt

    result = seq2trt.ort_search(out, int8=int8, force=force, no_repeat_ngram_size=no_repeat_ngram_size)
    record, semantics = result.record, result.record["semantics"]
    ngram = semantics["no_repeat_ngram_size"]
    click.echo(f"{result.graph}: com.microsoft.BeamSearch (onnxruntime {record['onnxruntime']}), "
               f"eos {semantics['eos_id']}, start {semantics['decoder_start_token_id']}, "
               f"no_repeat_ngram_size {ngram}{' (off)' if ngram == 0 else ''}, "
               f"at most {record['max_rows']} rows (batch x beam) and {record['max_length'] - 1} new tokens")


def _deprecated_generate(**kwargs) -> None:
    click.echo("warning: `seq2trt generate` is deprecated; use `seq2trt ort-search`", err=True)
    ort_search.callback(**kwargs)


generate = click.Command("generate", params=ort_search.params, callback=_deprecated_generate, hidden=True,
                         help="Deprecated: `seq2trt ort-search`.")

COMMANDS = [ort_search, generate]
