"""Text <-> token ids for a checkpoint: its own vocab.json (models trained here), or the Hugging Face tokenizer an
import copied into `tokenizer/` (sentencepiece or tokenizer.json, loaded by transformers), target-language codes
included (mBART-50, M2M100/NLLB: `--src-lang`, `--tgt-lang`)."""

from __future__ import annotations

import contextlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

from seq2trt.core import layout
from seq2trt.core.layout import TOKENIZER_DIR
from seq2trt.core.errors import CheckpointError, DependencyError, InputError, first_line


@dataclass
class TextCodec:
    """encode(text) -> source ids (eos included, as the model was trained); decode(ids) -> text. `forced_bos_id`:
    the target-language token to force first, when a language was asked for."""
    source: object  # a Hugging Face tokenizer (both sides) or our source Vocab
    target: object
    hf: bool
    eos_id: int
    forced_bos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        if self.hf:
            return list(self.source(text)["input_ids"])
        return self.source.encode(text.strip()) + [self.eos_id]

    def decode(self, ids: list[int]) -> str:
        if self.hf:
            return self.target.decode(ids, skip_special_tokens=True)
        return self.target.decode(ids)


def _language_id(tokenizer, lang: str, folder: Path) -> int:
    """The id of language code `lang`: M2M100's get_lang_id, or a special token of that name (mBART-50 / NLLB
    codes are added special tokens: "de_DE", "deu_Latn"). An ordinary piece that spells a code ("de" in a Marian or
    T5 vocabulary) is no language token, and forcing it first would decode garbage: refused as any unknown code."""
    ids = []
    if hasattr(tokenizer, "get_lang_id"):  # M2M100: "de" -> "__de__"
        try:
            ids.append(tokenizer.get_lang_id(lang))
        except KeyError:
            pass
    if lang in set(tokenizer.all_special_tokens):
        ids.append(tokenizer.convert_tokens_to_ids(lang))
    valid = [i for i in ids if i is not None and i != tokenizer.unk_token_id]
    if not valid:
        known = getattr(tokenizer, "lang_code_to_id", None) or getattr(tokenizer, "lang_token_to_id", None) or {}
        raise InputError(f"language {lang!r} is not in the tokenizer of {folder}"
                         + (f"; it knows {', '.join(list(known)[:20])}{' ...' if len(known) > 20 else ''}" if known else
                            "; this tokenizer has no language codes: drop --src-lang/--tgt-lang"))
    return int(valid[0])


def load_codec(checkpoint: Path, eos_id: int, src_lang: str | None = None, tgt_lang: str | None = None
               ) -> TextCodec:
    """The checkpoint's codec; a missing one is an error that says `--ids-file` works without it."""
    from seq2trt.reference_model.vocab import load_vocabs

    checkpoint = Path(checkpoint)
    folder = checkpoint / TOKENIZER_DIR
    if folder.is_dir():
        tokenizer = load_tokenizer(folder)
        if tokenizer is not None:
            if src_lang is not None:
                _language_id(tokenizer, src_lang, folder)  # a clear error for an unknown code
                tokenizer.src_lang = src_lang
            forced = _language_id(tokenizer, tgt_lang, folder) if tgt_lang is not None else None
            return TextCodec(tokenizer, tokenizer, True, eos_id, forced)
    if (checkpoint / layout.VOCAB).exists():
        if src_lang or tgt_lang:
            raise InputError(f"{checkpoint} has no language codes (a seq2trt vocabulary); drop --src-lang/--tgt-lang")
        return TextCodec(*load_vocabs(checkpoint / layout.VOCAB), False, eos_id)
    raise CheckpointError(f"{checkpoint} has no tokenizer (no {TOKENIZER_DIR}/ and no vocab.json), so text cannot "
                          "be encoded; give token ids with --ids-file F (JSON lines, one list of source ids per line)")


@contextlib.contextmanager
def quiet_transformers():
    """transformers' own notes while it loads and generates (Whisper's generate logs several per call about settings
    it moved or took from its config; transformers 5 draws a progress bar for every load and save): not the user's
    business during a proof or a bench; errors still raise."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def load_tokenizer(folder: Path):
    """The Hugging Face tokenizer saved in `folder`, or None when it holds no tokenizer file: the one loader of
    tokenizers (the import and its proof, every codec, CTranslate2's conversion in bench)."""
    from transformers import AutoTokenizer

    from seq2trt.hf_import.families import vocabulary_files

    if not vocabulary_files(folder):  # none, or a feature extractor's settings alone
        return None
    # transformers' notes on every load are not the user's business (Marian's recommends sacremoses; a T5 tokenizer
    # saved by 4.x records add_prefix_space, and 4.x's fast T5 class logs that it converts from the slow one)
    with quiet_transformers():
        try:
            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except ImportError as exc:  # a library the tokenizer class needs (FSMT's: sacremoses)
            raise DependencyError(f"the tokenizer in {folder} needs a library that is not installed "
                                  f"({first_line(exc)}); install it, or pip install 'seq2trt[hf]'") from None
        except Exception as exc:  # tokenizer classes raise anything from OSError to AttributeError on bad files
            first = exc
        # A sentencepiece model without tokenizer.json (T5's spiece.model) is converted to a fast tokenizer first,
        # which needs a protobuf runtime matching sentencepiece's; 4.x's slow tokenizer reads the model itself. So is
        # one whose tokenizer_config.json sets add_prefix_space (4.x's fast T5 class then ignores tokenizer.json and
        # converts the slow tokenizer): the slow one is what the fast one would have been made from.
        try:
            converts = json.loads((folder / "tokenizer_config.json").read_text()).get("add_prefix_space") is not None
        except (OSError, ValueError, AttributeError):
            converts = False
        if (folder / "tokenizer.json").is_file() and not converts:
            raise _bad_tokenizer(folder, first) from None
        try:
            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, use_fast=False)
        except Exception:
            raise _bad_tokenizer(folder, first) from None


def _bad_tokenizer(folder: Path, exc: BaseException) -> CheckpointError:
    from seq2trt.hf_import.families import vocabulary_files

    detail = f"{type(exc).__name__}: {str(exc).splitlines()[0]}" if str(exc).strip() else type(exc).__name__
    return CheckpointError(f"the tokenizer files in {folder} ({', '.join(vocabulary_files(folder))}) cannot be loaded "
                           f"({detail}); re-save them with tokenizer.save_pretrained, or remove them to import "
                           "without a tokenizer")
