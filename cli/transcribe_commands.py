"""`seq2trt transcribe`: speech to text with a Whisper checkpoint or export, through any backend with a step model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from seq2trt.cli.options import decode_options
from seq2trt.core.errors import InputError
from seq2trt.runtime.transcription import MAX_SECONDS, TRANSCRIBE_BACKENDS

FORMATS = ("text", "json", "srt", "vtt")


def _clock(seconds: float, separator: str) -> str:
    """HH:MM:SS,mmm (SubRip) or HH:MM:SS.mmm (WebVTT)."""
    ms = int(round(max(seconds, 0.0) * 1000))
    return f"{ms // 3600000:02d}:{ms // 60000 % 60:02d}:{ms // 1000 % 60:02d}{separator}{ms % 1000:03d}"


def _text(text: str | None, tokens: list[int]) -> str:
    return text if text is not None else json.dumps(tokens)


def subtitles(transcription, fmt: str) -> str:
    """The segments of one transcription as a SubRip (srt) or WebVTT (vtt) document; without a tokenizer each cue
    holds its ids."""
    separator = "," if fmt == "srt" else "."
    cues = [f"{_clock(s.start, separator)} --> {_clock(s.end, separator)}\n{_text(s.text, s.tokens).strip()}\n"
            for s in transcription.segments]
    if fmt == "srt":
        return "".join(f"{n}\n{cue}\n" for n, cue in enumerate(cues, 1))
    return "WEBVTT\n\n" + "".join(f"{cue}\n" for cue in cues)


def as_json(name: str, transcription) -> str:
    """One file's JSON line: {file, language, text, tokens, segments: [{start, end, text, tokens}]}."""
    return json.dumps({"file": name, **transcription.as_dict()}, ensure_ascii=False)


def _check_output_path(output: Path, audio: tuple[Path, ...], read: list[Path]) -> None:
    """--output-ids must not replace an audio file or a file of the model folders (model_commands' rule for
    translate's inputs)."""
    from seq2trt.cli.model_commands import _check_output_ids

    _check_output_ids(output, None, read)
    if output.exists():
        for path in audio:
            if path.exists() and os.path.samefile(output, path):
                raise InputError(f"--output-ids {output} is the audio file {path}; writing the ids there would "
                                 "replace it; choose another file")


@click.command()
@click.argument("source", type=click.Path(path_type=Path))
@click.argument("audio", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--language", help="Language code of the speech (en, de, ...). Default: the model's, else detected "
                                 "per file.")
@click.option("--task", type=click.Choice(["transcribe", "translate"]), default=None,
              help="transcribe, or translate into English (multilingual models). Default: the model's, else "
                   "transcribe.")
@click.option("--timestamps", is_flag=True, help="Decode timestamps: segments with their times (srt, vtt, json).")
@click.option("--backend", type=click.Choice(TRANSCRIBE_BACKENDS), default="eager", show_default=True,
              help="eager runs the checkpoint's model; the others run an export directory's graphs or engines.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="text", show_default=True,
              help="text: a line a file; json: a JSON line a file; srt/vtt: subtitles of one file.")
@click.option("--output-ids", type=click.Path(path_type=Path), help="Write each file's token ids here as JSON lines.")
@click.option("--batch-size", type=int, default=16, show_default=True, help="Files decoded together.")
@click.option("--max-seconds", type=float, default=MAX_SECONDS, show_default=True,
              help="Refuse an audio file longer than this.")
@click.option("--checkpoint", type=click.Path(path_type=Path), help="The export's checkpoint, if it moved.")
@click.option("--threads", type=int, default=1, show_default=True, help="CPU threads (ONNX Runtime's and torch's).")
@click.option("--condition-on-prev-tokens", is_flag=True,
              help="Long-form: decode each window after the previous text (transformers' condition_on_prev_tokens).")
@click.option("--temperature", default=None, metavar="T[,T...]",
              help="One temperature (0: greedy; > 0: sampling) or a comma list for fallback, e.g. "
                   "0,0.2,0.4,0.6,0.8,1.0: a window failing a threshold is decoded again at the next. Default: 0.")
@click.option("--compression-ratio-threshold", type=float, default=None,
              help="Fall back when a window's zlib compression ratio is above this (e.g. 2.4).")
@click.option("--logprob-threshold", type=float, default=None,
              help="Fall back when a window's average log-probability is below this (e.g. -1.0).")
@decode_options("transcribe")
def transcribe(source: Path, audio: tuple[Path, ...], language: str | None, task: str | None, timestamps: bool,
               backend: str, fmt: str, output_ids: Path | None, batch_size: int, max_seconds: float,
               checkpoint: Path | None, threads: int, condition_on_prev_tokens: bool, temperature: str | None,
               compression_ratio_threshold: float | None, logprob_threshold: float | None, beam_size: int | None,
               max_new_tokens: int | None, seed: int | None) -> None:
    """Transcribe AUDIO files (WAV, FLAC, OGG; any rate, any channels) with SOURCE: a Whisper checkpoint (eager) or
    its export directory (any --backend).

    Prints, in input order as each batch finishes: with --format text one line a file (its text, or its ids as a
    JSON list when the checkpoint has no tokenizer), with json one line a file ({file, language, text, tokens,
    segments}), with srt or vtt the subtitles of the one file given. A file past 30 s is transcribed window by
    window (long-form: with timestamps, as transformers does). Every file is read and checked before the first is
    decoded; progress goes to stderr."""
    from seq2trt.core.atomic_files import write_plain_output
    from seq2trt.runtime.transcription import open_transcriber, read_clips

    _check_transcribe_inputs(fmt, audio, max_seconds)
    long_form = dict(condition_on_prev_tokens=condition_on_prev_tokens, temperature=temperatures(temperature),
                     compression_ratio_threshold=compression_ratio_threshold, logprob_threshold=logprob_threshold,
                     seed=seed)
    with open_transcriber(source, backend, checkpoint, threads) as transcriber:
        transcriber.check(language, task, beam_size, max_new_tokens, batch_size, "--max-new-tokens", **long_form)
        if output_ids is not None:
            _check_output_path(output_ids, audio, [source, transcriber.opened.folder])
        clips = read_clips(audio, max_seconds)
        lines: list[str] = []
        with _progress(len(audio)) as update:
            for name, t in zip(audio, transcriber.transcribe(
                    clips, language=language, task=task, timestamps=timestamps, beam=beam_size,
                    max_new_tokens=max_new_tokens, batch_size=batch_size, names=[str(a) for a in audio],
                    progress=update, **long_form)):
                lines.append(json.dumps(t.tokens))
                _echo_transcript(fmt, name, t)
    if output_ids is not None:
        write_plain_output(output_ids, "".join(line + "\n" for line in lines).encode(), "--output-ids")


def _check_transcribe_inputs(fmt: str, audio: tuple[Path, ...], max_seconds: float) -> None:
    if fmt in ("srt", "vtt") and len(audio) > 1:
        raise InputError(f"--format {fmt} writes the subtitles of one file and {len(audio)} were given; give one "
                         "AUDIO file, or use --format json for many")
    if not max_seconds > 0:
        raise InputError(f"--max-seconds must be a number > 0, got {max_seconds}")


def _echo_transcript(fmt: str, name: Path, t) -> None:
    """One file's transcript in --format FMT: its text line, its JSON line, or its subtitles."""
    if fmt == "text":
        click.echo(_text(t.text, t.tokens))
    elif fmt == "json":
        click.echo(as_json(str(name), t))
    else:
        click.echo(subtitles(t, fmt), nl=False)


def temperatures(value: str | None) -> tuple[float, ...] | None:
    """--temperature's value: one number or a comma list of them (checked further by the transcriber)."""
    if value is None:
        return None
    try:
        return tuple(float(part) for part in value.split(","))
    except ValueError:
        raise InputError(f"--temperature must be a number or a comma list of numbers (0,0.2,0.4), got "
                         f"{value!r}") from None


def _progress(total: int):
    """A progress bar on stderr for many files; nothing for one."""
    import contextlib

    if total < 2:
        return contextlib.nullcontext(lambda done: None)
    from seq2trt.cli.progress import progress_bar

    return progress_bar("transcribing", total)


COMMANDS = [transcribe]
