"""What transformers' BART and its copies (Marian, mBART, M2M100, Pegasus; their modeling code is BART's) and FSMT
(fairseq's layers, named as BART names them) share: the config.json keys and the names of a layer's parameters. Each
family's module adds what differs: positions, norms, logits bias, vocabularies, tokenizer files."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from seq2trt.core.errors import ConfigError
from seq2trt.hf_import.families import ACTIVATIONS, FamilyAdapter
from seq2trt.hf_import.families.values import flag, integer, show

LAYER_RENAMES = (  # a layer's parameter -> ours, per stack
    (r"(encoder|decoder)\.layers\.(\d+)\.self_attn\.(q|k|v|out)_proj\.", r"\1_layers.\2.self_attn.\3_proj."),
    (r"decoder\.layers\.(\d+)\.encoder_attn\.(q|k|v|out)_proj\.", r"decoder_layers.\1.cross_attn.\2_proj."),
    (r"encoder\.layers\.(\d+)\.self_attn_layer_norm\.", r"encoder_layers.\1.attn_block.norm."),
    (r"decoder\.layers\.(\d+)\.self_attn_layer_norm\.", r"decoder_layers.\1.self_block.norm."),
    (r"decoder\.layers\.(\d+)\.encoder_attn_layer_norm\.", r"decoder_layers.\1.cross_block.norm."),
    (r"(encoder|decoder)\.layers\.(\d+)\.(fc1|fc2)\.", r"\1_layers.\2.ffn.\3."),
    (r"(encoder|decoder)\.layers\.(\d+)\.final_layer_norm\.", r"\1_layers.\2.ffn_block.norm."),
)
EMBED_NORMS = ((r"encoder\.layernorm_embedding\.", "src_embed_norm."),
               (r"decoder\.layernorm_embedding\.", "tgt_embed_norm."))
FINAL_NORMS = ((r"encoder\.layer_norm\.", "encoder_norm."), (r"decoder\.layer_norm\.", "decoder_norm."))
LEARNED_POSITIONS = ((r"encoder\.embed_positions\.weight", "src_positions.weight"),
                     (r"decoder\.embed_positions\.weight", "tgt_positions.weight"))
SINUSOID_TABLES = tuple(f"{side}.embed_positions.{name}" for side in ("encoder", "decoder")
                        for name in ("weight", "_float_tensor"))


def layer_options(config: Path, hf: dict, problems: list[str]) -> str:
    """BART-style config.json's dropouts checked (transformers' eval forward checks them: a bad one raises) and its
    activation_function, returned; an unsupported activation is appended to `problems`."""
    for key in ("dropout", "attention_dropout", "activation_dropout"):
        value = hf.get(key, 0.0)
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1):
            raise ConfigError(f"{config}: {key} must be a number in [0, 1], got {show(value)}")
    act = hf.get("activation_function", "gelu")
    if not isinstance(act, str) or act not in ACTIVATIONS:
        problems.append(f"activation_function={act!r} (supported: {', '.join(ACTIVATIONS)})")
    return act


class BartLikeAdapter(FamilyAdapter):
    sizes: ClassVar[dict[str, str]] = {
        "vocab_size": "src_vocab_size", "d_model": "d_model", "encoder_layers": "num_encoder_layers",
        "decoder_layers": "num_decoder_layers", "encoder_attention_heads": "num_heads",
        "decoder_attention_heads": "num_heads", "encoder_ffn_dim": "d_ff", "decoder_ffn_dim": "d_ff"}
    required = tuple(sizes)
    other_keys = {"tgt_vocab_size": "vocab_size", "max_tgt_len": "max_position_embeddings"}
    part_keys = {"embeddings": "vocab_size, d_model", "positions": "max_position_embeddings, d_model",
                 "encoder": "encoder_layers, d_model, encoder_ffn_dim",
                 "decoder": "decoder_layers, d_model, decoder_ffn_dim"}
    prefix = "model."
    logits_bias = "final_logits_bias"
    default_scale_embedding: ClassVar[bool] = False  # the config class's scale_embedding

    def config_fields(self, src: Path, hf: dict) -> dict[str, Any]:
        config = src / "config.json"
        fields, problems = self.read_sizes(config, hf)
        max_pos = integer(config, hf, "max_position_embeddings", minimum=2, default=1024)  # the start token + 1
        if fields["d_model"] % fields["num_heads"]:
            problems.append(f"d_model={fields['d_model']} is not divisible by "
                            f"encoder_attention_heads={fields['num_heads']}")
        act = layer_options(config, hf, problems)
        pre_norm = self.architecture["pre_norm"]
        if hf.get("normalize_before", pre_norm) != pre_norm:
            problems.append(f"normalize_before={hf['normalize_before']!r} (a {self.model_type} model is "
                            f"{'pre' if pre_norm else 'post'}-LN)")
        if hf.get("add_bias_logits") or hf.get("add_final_layer_norm"):
            problems.append("add_bias_logits / add_final_layer_norm (older BART variants)")
        if problems:
            raise ConfigError(f"{src}: unsupported options in this {self.model_type} model: {'; '.join(problems)}")
        return {**fields, "max_src_len": max_pos, "max_tgt_len": max_pos, "activation": ACTIVATIONS[act],
                "scale_embeddings": flag(config, hf, "scale_embedding", self.default_scale_embedding),
                **self.vocabularies(config, hf, fields), **self.architecture}

    def vocabularies(self, config: Path, hf: dict, fields: dict[str, Any]) -> dict[str, Any]:
        """tgt_vocab_size, share_vocab and tie_embeddings: one table shared by both sides unless
        share_encoder_decoder_embeddings is false (Marian's own target vocabulary), the head tied to it by
        tie_word_embeddings."""
        shared = flag(config, hf, "share_encoder_decoder_embeddings", True)
        vocab = fields["src_vocab_size"]
        target = vocab if shared else integer(config, hf, "decoder_vocab_size", nullable=True) or vocab
        return {"tgt_vocab_size": target,
                "share_vocab": shared, "tie_embeddings": flag(config, hf, "tie_word_embeddings", True)}
