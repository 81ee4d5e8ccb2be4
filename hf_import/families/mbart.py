"""mBART (and mBART-50): BART made pre-LN, with a final layer norm on each stack; a sentencepiece tokenizer."""

from __future__ import annotations

from seq2trt.hf_import.families import COMMON_TOKENIZER_FILES, register
from seq2trt.hf_import.families.bart_like import (EMBED_NORMS, FINAL_NORMS, LAYER_RENAMES, LEARNED_POSITIONS,
                                                  BartLikeAdapter)


@register
class MBartAdapter(BartLikeAdapter):
    model_type = "mbart"
    title = "mBART"
    architecture = dict(positions="learned", position_offset=2, embed_norm=True, pre_norm=True, logits_bias=True)
    renames = LAYER_RENAMES + EMBED_NORMS + FINAL_NORMS + LEARNED_POSITIONS
    tokenizer_files = COMMON_TOKENIZER_FILES + ("sentencepiece.bpe.model",)
