"""`seq2trt train` and `seq2trt translate`: training on a built-in task, and decoding through any backend (a thin layer
over `seq2trt.Translator`, opened to name its options by these flags: what is decoded, checked and refused is the
API's)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from seq2trt.cli.options import SEED, decode_options
from seq2trt.reference_model.config import PRESETS
from seq2trt.core.errors import InputError
from seq2trt.reference_model.tasks import TASKS
from seq2trt.reference_model.train import TrainSettings
from seq2trt.runtime.registry import DECODE_BACKENDS
from seq2trt.runtime.decode_jobs import check_decode_options


@click.command()
@click.option("-o", "--out", "out", type=click.Path(path_type=Path), required=True, help="Checkpoint directory to write.")
@click.option("--task", default="numbers", show_default=True, help=f"Built-in task: {', '.join(TASKS)}.")
@click.option("--preset", default="demo", show_default=True, help=f"Model size: {', '.join(PRESETS)}.")
@click.option("--steps", type=int, default=TrainSettings.steps, show_default=True)
@click.option("--batch-size", type=int, default=TrainSettings.batch_size, show_default=True)
@click.option("--lr", type=float, default=TrainSettings.lr, show_default=True)
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--eval-examples", type=int, default=TrainSettings.eval_examples, show_default=True,
              help="Held-out examples decoded for heldout_exact_match.")
@click.option("--force", is_flag=True, help="Replace an existing checkpoint directory.")
def train(out: Path, task: str, preset: str, steps: int, batch_size: int, lr: float, seed: int,
          eval_examples: int, force: bool) -> None:
    """Train a model on a built-in task (CPU) and write its checkpoint and metrics.json."""
    import seq2trt
    from seq2trt.reference_model.config import preset as make_preset
    from seq2trt.reference_model.tasks import get_task

    from seq2trt.cli.progress import progress_bar

    get_task(task), make_preset(preset)  # a bad name fails before the progress bar opens
    with progress_bar(f"training {preset} on {task}", steps) as update:
        metrics = seq2trt.train(out, task=task, preset=preset, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                                eval_examples=eval_examples, force=force,
                                progress=lambda step, loss: update(step, f"loss {loss:.3f}")).metrics
    click.echo(f"held-out exact match {metrics['heldout_exact_match']:.4f} on {eval_examples} examples "
               f"({metrics['train_seconds']:.0f} s of training); checkpoint in {out}")


def _read_ids_file(path: Path) -> list[list[int]]:
    """JSON lines, one list of source token ids per line (used as given: include eos where the model expects it)."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read --ids-file {path}: {exc}") from None
    sources = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            ids = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{number} is not JSON ({exc.msg}); each line is a list of token ids") from None
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise InputError(f"{path}:{number} must be a JSON list of integer token ids, got {line[:80]!r}")
        sources.append(ids)
    if not sources:
        raise InputError(f"--ids-file {path} holds no sources")
    return sources


def _check_utf8(texts: tuple[str, ...]) -> None:
    """Refuse a text holding bytes that are not UTF-8: Python hands them over from argv as lone surrogates
    (byte 0xff as U+DCFF), which the tokenizers cannot take (sentencepiece raised a RuntimeError)."""
    for n, text in enumerate(texts, 1):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            code = ord(text[exc.start])
            what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"the lone surrogate U+{code:04X}"
            raise InputError(f"source {n} holds {what} at character {exc.start + 1}, which is not UTF-8; give UTF-8 "
                             "text (re-encode it, e.g. with iconv -t UTF-8)") from None


def _check_output_ids(output: Path, ids_file: Path | None, read: list[Path]) -> None:
    """Refuse an --output-ids that is a folder, the --ids-file (by any spelling, link or hard link), or an existing
    file inside a folder this command reads (the checkpoint, the export): writing it would replace an input."""
    if output.is_dir():
        raise InputError(f"--output-ids {output} is a directory; give a file path")
    if not output.exists():
        return
    if ids_file is not None and ids_file.exists() and os.path.samefile(output, ids_file):
        raise InputError(f"--output-ids {output} is the --ids-file {ids_file}; writing the ids there would replace "
                         "the sources; choose another file")
    real = output.resolve()
    for folder in read:
        if folder.resolve() in real.parents:
            raise InputError(f"--output-ids {output} is a file of {folder}, which this command reads; writing there "
                             "would replace it; choose another file")


@click.command()
@click.argument("source", type=click.Path(path_type=Path))
@click.argument("texts", nargs=-1)
@click.option("--backend", type=click.Choice(DECODE_BACKENDS), default="eager", show_default=True,
              help="eager runs the checkpoint's model; the others run an export directory's graphs or engines.")
@click.option("--ids-file", type=click.Path(path_type=Path), help="JSON lines: one list of source token ids each.")
@click.option("--output-ids", type=click.Path(path_type=Path), help="Write the generated ids here as JSON lines (a device or FIFO in place, a symlink "
                   "through to its target).")
@click.option("--src-lang", help="Source language code (mBART-50, M2M100/NLLB tokenizers).")
@click.option("--tgt-lang", help="Target language code, forced as the first generated token.")
@click.option("--batch-size", type=int, default=32, show_default=True, help="Sources decoded together.")
@click.option("--checkpoint", type=click.Path(path_type=Path), help="The export's checkpoint, if it moved.")
@click.option("--threads", type=int, default=1, show_default=True,
              help="CPU threads: ONNX Runtime's, and torch's (the eager model, the beam search's arithmetic).")
@decode_options("translate")
def translate(source: Path, texts: tuple[str, ...], backend: str, ids_file: Path | None, output_ids: Path | None,
              src_lang: str | None, tgt_lang: str | None, batch_size: int, checkpoint: Path | None, threads: int,
              beam_size: int | None, max_new_tokens: int | None, alpha: float, **options) -> None:
    """Decode TEXTS (or --ids-file) with SOURCE: a checkpoint (eager) or an export directory (any --backend).

    Prints one line per source (text when the checkpoint has a tokenizer, else the ids), in input order, as
    each batch finishes; --output-ids also writes the ids as JSON lines. With --n-best N, N lines a source; with
    --scores each line starts with its score and a tab; either way the JSON lines are {"ids": [...], "scores":
    [...]}, with --token-logprobs also "token_logprobs": [[...]]. Without the search flags, an imported model's
    own generation settings apply."""
    from seq2trt.core.atomic_files import write_plain_output
    from seq2trt.translator import Translator

    _check_translate_inputs(texts, ids_file, output_ids, options["output_token_logprobs"])
    check_decode_options(alpha, batch_size)
    with Translator(source, backend, threads, checkpoint, src_lang, tgt_lang, spelling="flag",
                    speech=False) as translator:
        if texts:
            translator.check_text()
        if output_ids is not None:  # before any decode
            _check_output_ids(output_ids, ids_file, [source, translator.folder])
        sources = [translator.encode(t) for t in texts] if texts else _read_ids_file(ids_file)
        settings, decoded = translator.stream(sources, "source" if texts else f"{ids_file} line", beam_size,
                                              max_new_tokens, alpha, batch_size, options)
        outputs = [_echo_translation(translator, settings, out) for out in decoded]
    if output_ids is not None:
        write_plain_output(output_ids, "".join(o + "\n" for o in outputs).encode(), "--output-ids")


def _check_translate_inputs(texts: tuple[str, ...], ids_file: Path | None, output_ids: Path | None,
                            token_logprobs: bool) -> None:
    """The sources given one way, non-empty and UTF-8; --token-logprobs with a file to write them to."""
    if bool(texts) == bool(ids_file):
        raise InputError("give either TEXTS or --ids-file F (JSON lines of source ids), not both or neither")
    if token_logprobs and output_ids is None:
        raise InputError("--token-logprobs writes each token's log-probability to --output-ids (the printed lines "
                         "hold the text alone); add --output-ids FILE")
    if any(not t.strip() for t in texts):
        raise InputError("empty source text; give at least one symbol")
    _check_utf8(texts)


def _echo_translation(translator, settings, out) -> str:
    """Print a source's lines (its hypotheses, each after its score with --scores); returns its --output-ids line."""
    for tokens, score, *_ in [(out, None)] if settings.plain else out:
        line = translator.text(tokens) if translator.has_tokenizer else json.dumps(tokens)
        click.echo(f"{score:.6g}\t{line}" if settings.output_scores else line)
    return json.dumps(out if settings.plain else {
        "ids": [h.tokens for h in out], "scores": [h.score for h in out],
        **({"token_logprobs": [list(h.token_logprobs) for h in out]} if settings.output_token_logprobs else {})})


COMMANDS = [train, translate]
