"""Text <-> token ids for a checkpoint: its own vocab.json (models trained here), or the Hugging Face tokenizer an
import copied into `tokenizer/` (sentencepiece or tokenizer.json, loaded by transformers), target-language codes
included (mBART-50, M2M100/NLLB: `--src-lang`, `--tgt-lang`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from seq2trt.core import layout
from seq2trt.core.errors import CheckpointError, InputError


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
    from seq2trt.hf_import.importer import TOKENIZER_DIR
    from seq2trt.reference_model.vocab import load_vocabs

    checkpoint = Path(checkpoint)
    folder = checkpoint / TOKENIZER_DIR
    if folder.is_dir():
        from seq2trt.hf_import.proof import load_tokenizer

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
