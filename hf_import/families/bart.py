"""BART: post-LN, learned positions offset by 2, a layer norm on the embeddings, a logits bias; byte-level BPE."""

from __future__ import annotations

from seq2trt.hf_import.families import COMMON_TOKENIZER_FILES, register
from seq2trt.hf_import.families.bart_like import (EMBED_NORMS, LAYER_RENAMES, LEARNED_POSITIONS, BartLikeAdapter)


@register
class BartAdapter(BartLikeAdapter):
    model_type = "bart"
    title = "BART"
    architecture = dict(positions="learned", position_offset=2, embed_norm=True, pre_norm=False, logits_bias=True)
    renames = LAYER_RENAMES + EMBED_NORMS + LEARNED_POSITIONS
    tokenizer_files = COMMON_TOKENIZER_FILES + ("vocab.json", "merges.txt")
