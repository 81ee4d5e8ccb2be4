"""M2M100 and NLLB (dense; both model_type m2m_100): pre-LN with a final layer norm on each stack, fairseq's
sinusoid positions (position p is row pad + 1 + p, the pad row zero), no embedding norm, no logits bias."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from seq2trt.hf_import.families import COMMON_TOKENIZER_FILES, register
from seq2trt.hf_import.families.bart_like import FINAL_NORMS, LAYER_RENAMES, SINUSOID_TABLES, BartLikeAdapter
from seq2trt.hf_import.families.values import integer


@register
class M2M100Adapter(BartLikeAdapter):
    model_type = "m2m_100"
    title = "M2M100 and NLLB dense"
    architecture = dict(positions="sinusoid_fairseq", pad_position_zero=True, embed_norm=False, pre_norm=True,
                        logits_bias=False)
    derived = SINUSOID_TABLES
    renames = LAYER_RENAMES + FINAL_NORMS
    tokenizer_files = COMMON_TOKENIZER_FILES + ("vocab.json", "sentencepiece.bpe.model")

    def config_fields(self, src: Path, hf: dict) -> dict[str, Any]:
        pad = integer(src / "config.json", hf, "pad_token_id", minimum=0)
        return {**super().config_fields(src, hf), "position_offset": pad + 1}
