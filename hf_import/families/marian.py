"""Marian (opus-mt): post-LN, sinusoid positions in two halves (sin | cos) from position 0, no embedding norm,
a logits bias; the decoder may have its own vocabulary (share_encoder_decoder_embeddings false)."""

from __future__ import annotations

from seq2trt.hf_import.families import COMMON_TOKENIZER_FILES, register
from seq2trt.hf_import.families.bart_like import LAYER_RENAMES, SINUSOID_TABLES, BartLikeAdapter


@register
class MarianAdapter(BartLikeAdapter):
    model_type = "marian"
    title = "Marian/opus-mt"
    architecture = dict(positions="sinusoid_halves", position_offset=0, embed_norm=False, pre_norm=False,
                        logits_bias=True)
    derived = SINUSOID_TABLES
    renames = LAYER_RENAMES
    tokenizer_files = COMMON_TOKENIZER_FILES + ("vocab.json", "source.spm", "target.spm", "target_vocab.json")
