"""`seq2trt train` and `seq2trt translate`: training on a built-in task, and decoding through any backend."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from seq2trt.cli.options import SEED
from seq2trt.reference_model.decoding import GNMT_ALPHA
from seq2trt.reference_model.config import PRESETS
from seq2trt.core.errors import InputError
from seq2trt.reference_model.tasks import TASKS
from seq2trt.reference_model.train import TrainSettings
from seq2trt.runtime.registry import DECODE_BACKENDS
from seq2trt.runtime.decode_jobs import check_decode_options
from seq2trt.runtime.decode_jobs import decode_job, has_tokenizer, open_decoder
from seq2trt.runtime.transcription import refuse_speech_model


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


def _codec(folder: Path, eos_id: int, texts: bool, src_lang: str | None, tgt_lang: str | None):
    """The checkpoint's codec: required for texts and languages, used to print words when it has one, else None."""
    from seq2trt.hf_import.text import load_codec

    if not texts and (src_lang or tgt_lang) and not has_tokenizer(folder):
        flag, lang = ("--tgt-lang", tgt_lang) if tgt_lang else ("--src-lang", src_lang)
        raise InputError(f"{flag} {lang} needs the model's tokenizer (its language codes), and {folder} has none "
                         f"(no tokenizer/ and no vocab.json); drop {flag}, or import the model with its tokenizer "
                         "files")
    if texts or src_lang or tgt_lang:
        return load_codec(folder, eos_id, src_lang, tgt_lang)
    return load_codec(folder, eos_id) if has_tokenizer(folder) else None


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
@click.option("--beam", type=int, default=None,
              help="Beam size; 1 is greedy. Default: the imported model's num_beams, else 1.")
@click.option("--alpha", type=float, default=GNMT_ALPHA, show_default=True,
              help="GNMT length penalty of beam search for models trained here (imported ones use their own); "
                   "with --backend ort-generate, Hugging Face's length_penalty (score / length ** alpha).")
@click.option("--src-lang", help="Source language code (mBART-50, M2M100/NLLB tokenizers).")
@click.option("--tgt-lang", help="Target language code, forced as the first generated token.")
@click.option("--max-new-tokens", type=int, default=None, help="Tokens to generate at most, eos included.")
@click.option("--batch-size", type=int, default=32, show_default=True, help="Sources decoded together.")
@click.option("--checkpoint", type=click.Path(path_type=Path), help="The export's checkpoint, if it moved.")
@click.option("--threads", type=int, default=1, show_default=True,
              help="CPU threads: ONNX Runtime's, and torch's (the eager model, the beam search's arithmetic).")
@click.option("--sample/--no-sample", default=None,
              help="Sample (one beam) instead of searching. Default: the imported model's do_sample, else search.")
@click.option("--temperature", type=float, help="Sampling temperature (default: the model's, else 1.0).")
@click.option("--top-k", type=int, help="Sample among the k likeliest tokens; 0: all (default: the model's, else 50).")
@click.option("--top-p", type=float, help="Sample within top-p probability mass (default: the model's, else 1.0).")
@click.option("--seed", type=SEED, help="Seed of the sampling (transformers' torch.manual_seed). Default: random.")
@click.option("--n-best", type=int, help="Hypotheses a source: at most --beam, or this many samples "
                   "(default: the model's num_return_sequences, else 1).")
@click.option("--scores", is_flag=True, help="Print each hypothesis's score (beam: Hugging Face's sequences_scores, "
                   "GNMT's for models trained here; greedy and sampling: the sum of its tokens' log-probabilities).")
@click.option("--fast-sampling", is_flag=True, help="With --sample: draw by the inverse CDF, one number a row and "
                   "step (the same distribution; not transformers' samples for a seed; much cheaper over a large "
                   "vocabulary).")
@click.option("--token-logprobs", is_flag=True, help="Also write each hypothesis's per-token log-probabilities to "
                   "--output-ids (transformers' compute_transition_scores; the closing eos has one).")
@click.option("--min-length", type=int, help="transformers' min_length: no eos before it (the start token counts).")
@click.option("--min-new-tokens", type=int, help="No eos before this many generated tokens.")
@click.option("--no-repeat-ngram-size", type=int, help="No n-gram of this size twice in a hypothesis; 0: off.")
@click.option("--repetition-penalty", type=float, help="CTRL's penalty on tokens already in the hypothesis; 1: off.")
def translate(source: Path, texts: tuple[str, ...], backend: str, ids_file: Path | None, output_ids: Path | None,
              beam: int | None, alpha: float, src_lang: str | None, tgt_lang: str | None,
              max_new_tokens: int | None, batch_size: int, checkpoint: Path | None, threads: int,
              **flags) -> None:
    """Decode TEXTS (or --ids-file) with SOURCE: a checkpoint (eager) or an export directory (any --backend).

    Prints one line per source (text when the checkpoint has a tokenizer, else the ids), in input order, as
    each batch finishes; --output-ids also writes the ids as JSON lines. With --n-best N, N lines a source; with
    --scores each line starts with its score and a tab; either way the JSON lines are {"ids": [...], "scores":
    [...]}, with --token-logprobs also "token_logprobs": [[...]]. Without the search flags, an imported model's
    own generation settings apply."""
    from seq2trt.core.atomic_files import write_plain_output

    if bool(texts) == bool(ids_file):
        raise InputError("give either TEXTS or --ids-file F (JSON lines of source ids), not both or neither")
    if flags["token_logprobs"] and output_ids is None:
        raise InputError("--token-logprobs writes each token's log-probability to --output-ids (the printed lines "
                         "hold the text alone); add --output-ids FILE")
    check_decode_options(alpha, batch_size)
    if any(not t.strip() for t in texts):
        raise InputError("empty source text; give at least one symbol")
    _check_utf8(texts)
    with open_decoder(source, backend, checkpoint, threads) as opened:
        refuse_speech_model(opened.config)
        cfg, folder = opened.config, opened.folder
        codec = _codec(folder, cfg.eos_id, bool(texts), src_lang, tgt_lang)
        if output_ids is not None:  # before any decode
            _check_output_ids(output_ids, ids_file, [source, folder])
        sources = [codec.encode(t) for t in texts] if texts else _read_ids_file(ids_file)
        settings, decoded = decode_job(opened, backend, sources, "source" if texts else f"{ids_file} line", beam,
                                       alpha, max_new_tokens, batch_size,
                                       codec.forced_bos_id if codec is not None else None, _search_options(flags))
        outputs: list[str] = []
        for out in decoded:
            outputs.append(json.dumps(out if settings.plain else {
                "ids": [h.tokens for h in out], "scores": [h.score for h in out],
                **({"token_logprobs": [list(h.token_logprobs) for h in out]} if settings.output_token_logprobs
                   else {})}))
            for tokens, score, *_ in [(out, None)] if settings.plain else out:
                line = codec.decode(tokens) if codec is not None else json.dumps(tokens)
                click.echo(f"{score:.6g}\t{line}" if settings.output_scores else line)
    if output_ids is not None:
        write_plain_output(output_ids, "".join(o + "\n" for o in outputs).encode(), "--output-ids")


def _search_options(flags: dict) -> dict:
    """translate's search flags as DecodeSettings fields (decode_jobs.OPTION_FLAGS); None: the model's default."""
    named = ("temperature", "top_k", "top_p", "seed", "min_length", "min_new_tokens", "no_repeat_ngram_size",
             "repetition_penalty")
    return {"do_sample": flags["sample"], "num_return_sequences": flags["n_best"],
            "output_scores": flags["scores"] or None, "output_token_logprobs": flags["token_logprobs"] or None,
            "fast_sampling": flags["fast_sampling"] or None,
            **{k: flags[k] for k in named}}


COMMANDS = [train, translate]
