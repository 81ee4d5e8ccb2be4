"""Pegasus (the summarization checkpoints): mBART's pre-LN layers with a final layer norm on each stack, Marian's
sinusoid positions (sines | cosines, from position 0, not stored as weights we read), embeddings scaled by
sqrt(d_model) where scale_embedding says so, no embedding norm, a logits bias; one vocabulary, the head tied to it.
Sentencepiece tokenizer (spiece.model) with Pegasus's reserved ids before the pieces; the decoder starts with pad."""

from __future__ import annotations

from seq2trt.hf_import.families import COMMON_TOKENIZER_FILES, register
from seq2trt.hf_import.families.bart_like import FINAL_NORMS, LAYER_RENAMES, SINUSOID_TABLES, BartLikeAdapter


@register
class PegasusAdapter(BartLikeAdapter):
    model_type = "pegasus"
    title = "Pegasus"
    architecture = dict(positions="sinusoid_halves", position_offset=0, embed_norm=False, pre_norm=True,
                        logits_bias=True)
    derived = SINUSOID_TABLES
    renames = LAYER_RENAMES + FINAL_NORMS
    tokenizer_files = COMMON_TOKENIZER_FILES + ("spiece.model",)
