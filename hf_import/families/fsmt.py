"""FSMT (fairseq's WMT19 translation models): BART's post-LN layers with fairseq's sinusoid positions (position p is
row pad + 1 + p, a pad token reads the zero row), embeddings scaled by sqrt(d_model), no embedding norm, no final
norms, no logits bias; a source and a target vocabulary of their own sizes (src_vocab_size, tgt_vocab_size), the
head (decoder.output_projection) a table of its own. Moses + BPE tokenizer (sacremoses) with a vocabulary per side.

What ties: tie_word_embeddings makes one table of the source embedding, the target embedding and the head (then
the two vocabularies are one); otherwise transformers 5.x keeps the three apart.

transformers computes the decoder position of a pad token the model itself generates differently in its cached
generate (the previous step's position) than in a whole-sequence forward (the zero row); fairseq never generates
pad. Ours gives it the zero row: where a model generates pad, the proof fails on that source.

transformers 4.x cannot judge an FSMT import: its cached generate embeds the position of the newest token alone, so
every step reads the first position (its own forward, fairseq and 5.x count them); the import needs 5.x.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from seq2trt.core.errors import ConfigError
from seq2trt.hf_import.families import COMMON_TOKENIZER_FILES, register, transformers_major
from seq2trt.hf_import.families.bart_like import LAYER_RENAMES, SINUSOID_TABLES, BartLikeAdapter
from seq2trt.hf_import.families.values import flag, integer


@register
class FSMTAdapter(BartLikeAdapter):
    model_type = "fsmt"
    title = "FSMT (fairseq WMT19)"
    sizes: ClassVar[dict[str, str]] = {
        "src_vocab_size": "src_vocab_size", "d_model": "d_model", "encoder_layers": "num_encoder_layers",
        "decoder_layers": "num_decoder_layers", "encoder_attention_heads": "num_heads",
        "decoder_attention_heads": "num_heads", "encoder_ffn_dim": "d_ff", "decoder_ffn_dim": "d_ff"}
    required = tuple(sizes) + ("tgt_vocab_size",)
    other_keys = {"tgt_vocab_size": "tgt_vocab_size", "max_tgt_len": "max_position_embeddings"}
    part_keys = {"embeddings": "src_vocab_size, tgt_vocab_size, d_model",
                 "positions": "max_position_embeddings, d_model",
                 "encoder": "encoder_layers, d_model, encoder_ffn_dim",
                 "decoder": "decoder_layers, d_model, decoder_ffn_dim"}
    architecture = dict(positions="sinusoid_fairseq", pad_position_zero=True, embed_norm=False, pre_norm=False,
                        logits_bias=False)
    logits_bias = None
    default_scale_embedding = True
    lm_head = "decoder.output_projection.weight"
    derived = SINUSOID_TABLES
    renames = LAYER_RENAMES
    tokenizer_files = COMMON_TOKENIZER_FILES + ("vocab-src.json", "vocab-tgt.json", "merges.txt")

    def vocabularies(self, config: Path, hf: dict, fields: dict[str, Any]) -> dict[str, Any]:
        tgt = integer(config, hf, "tgt_vocab_size")
        tied = flag(config, hf, "tie_word_embeddings", False)
        if tied and tgt != fields["src_vocab_size"]:  # transformers could not tie them either
            raise ConfigError(f"{config}: tie_word_embeddings is true but src_vocab_size {fields['src_vocab_size']} "
                              f"differs from tgt_vocab_size {tgt}; one table cannot be both")
        return {"tgt_vocab_size": tgt, "share_vocab": tied, "tie_embeddings": tied}

    def config_fields(self, src: Path, hf: dict) -> dict[str, Any]:
        if transformers_major() < 5:
            raise ConfigError(f"{src} holds an fsmt model, which seq2trt imports with transformers 5 or newer as its "
                              "judge: transformers 4.x's FSMT generate gives every decoder step the first position "
                              "(unlike its own forward and fairseq), so it cannot prove the import; pip install "
                              "'transformers>=5,<6'")
        pad = integer(src / "config.json", hf, "pad_token_id", minimum=0)
        return {**super().config_fields(src, hf), "position_offset": pad + 1}
