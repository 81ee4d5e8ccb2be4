"""T5 (v1.0 and v1.1/Flan), mT5 and UMT5: pre-norm RMSNorm blocks without biases, no position table, a bucketed
relative position bias in self-attention (block 0's table shared by its stack; UMT5: a table in every block), no
1/sqrt(d) attention scale, head width d_kv independent of d_model, a relu or gated FFN (`feed_forward_proj` "ACT" or
"gated-ACT"), and the decoder output scaled by d_model**-0.5 where the installed transformers scales it
(`scales_decoder_output`). Sentencepiece tokenizer, no BOS, inputs end with </s>; the decoder starts with pad (0).

T5 has no maximum position: the checkpoint's limits are config.json's n_positions where an old config still names it,
else `DEFAULT_MAX_LEN` (the T5 paper's training length). The model refuses longer inputs with a message saying how to
raise the limit; distances beyond relative_attention_max_distance share the last bucket, as in transformers.
A model type registered with transformers whose model class subclasses one of these three reads as that one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from seq2trt.core.errors import ConfigError
from seq2trt.hf_import.families import (ACTIVATIONS, COMMON_TOKENIZER_FILES, FamilyAdapter, register,
                                        transformers_major)
from seq2trt.hf_import.families.values import flag, integer, show

DEFAULT_MAX_LEN = 512  # source and target tokens (eos / the start token included) when config.json names no limit

_FFN = {"wi": "fc1", "wi_0": "fc1", "wi_1": "fc1_linear", "wo": "fc2"}  # v1.0's wi; v1.1's gate wi_0, linear wi_1
_BLOCK = r"(encoder|decoder)\.block\.(\d+)\.layer\."
RENAMES = (  # transformers' T5 parameter names -> ours, for T5, mT5 and UMT5 alike
    (_BLOCK + r"0\.SelfAttention\.relative_attention_bias\.", r"\1_layers.\2.self_attn.relative_bias."),
    (_BLOCK + r"0\.SelfAttention\.([qkv])\.", r"\1_layers.\2.self_attn.\3_proj."),
    (_BLOCK + r"0\.SelfAttention\.o\.", r"\1_layers.\2.self_attn.out_proj."),
    (r"decoder\.block\.(\d+)\.layer\.1\.EncDecAttention\.([qkv])\.", r"decoder_layers.\1.cross_attn.\2_proj."),
    (r"decoder\.block\.(\d+)\.layer\.1\.EncDecAttention\.o\.", r"decoder_layers.\1.cross_attn.out_proj."),
    (r"encoder\.block\.(\d+)\.layer\.0\.layer_norm\.", r"encoder_layers.\1.attn_block.norm."),
    (r"encoder\.block\.(\d+)\.layer\.1\.layer_norm\.", r"encoder_layers.\1.ffn_block.norm."),
    (r"decoder\.block\.(\d+)\.layer\.0\.layer_norm\.", r"decoder_layers.\1.self_block.norm."),
    (r"decoder\.block\.(\d+)\.layer\.1\.layer_norm\.", r"decoder_layers.\1.cross_block.norm."),
    (r"decoder\.block\.(\d+)\.layer\.2\.layer_norm\.", r"decoder_layers.\1.ffn_block.norm."),
    *((rf"encoder\.block\.(\d+)\.layer\.1\.DenseReluDense\.{name}\.", rf"encoder_layers.\1.ffn.{ours}.")
      for name, ours in _FFN.items()),
    *((rf"decoder\.block\.(\d+)\.layer\.2\.DenseReluDense\.{name}\.", rf"decoder_layers.\1.ffn.{ours}.")
      for name, ours in _FFN.items()),
    (r"(encoder|decoder)\.final_layer_norm\.", r"\1_norm."),
)
# Checkpoints from older transformers carry a relative bias table in block 0's cross-attention that no version uses.
UNUSED_CROSS_TABLE = ("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",)


def feed_forward(config: Path, hf: dict, default: str) -> tuple[str, bool]:
    """(activation, gated) as transformers' T5Config resolves them: from feed_forward_proj ("ACT" or "gated-ACT",
    "gated-gelu" meaning the tanh GELU), where config.json's own dense_act_fn / is_gated_act win when present."""
    proj = hf.get("feed_forward_proj", default)
    parts = proj.split("-") if isinstance(proj, str) else []
    if not parts or len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise ConfigError(f"{config}: feed_forward_proj must be \"ACT\" or \"gated-ACT\" such as \"relu\" or "
                          f"\"gated-gelu\", got {show(proj)}")
    act = "gelu_new" if proj == "gated-gelu" else parts[-1]
    act = hf.get("dense_act_fn", act)
    gated = flag(config, hf, "is_gated_act", parts[0] == "gated")
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise ConfigError(f"{config}: the FFN activation {show(act)} (feed_forward_proj / dense_act_fn) is not "
                          f"supported; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[act], gated


class T5LikeAdapter(FamilyAdapter):
    sizes: ClassVar[dict[str, str]] = {"vocab_size": "src_vocab_size", "d_model": "d_model", "d_kv": "d_kv",
                                       "num_heads": "num_heads", "num_layers": "num_encoder_layers", "d_ff": "d_ff"}
    required = tuple(sizes)
    other_keys = {"tgt_vocab_size": "vocab_size", "num_decoder_layers": "num_decoder_layers",
                  "max_src_len": "n_positions", "max_tgt_len": "n_positions"}
    part_keys = {"embeddings": "vocab_size, d_model", "positions": "(none)",
                 "encoder": "num_layers, d_model, d_kv, num_heads, d_ff",
                 "decoder": "num_decoder_layers, d_model, d_kv, num_heads, d_ff"}
    embeddings = {"encoder": "encoder.embed_tokens.weight", "decoder": "decoder.embed_tokens.weight"}
    derived = UNUSED_CROSS_TABLE
    renames = RENAMES
    tokenizer_files = COMMON_TOKENIZER_FILES + ("spiece.model",)
    # The config class's defaults for the keys a config.json may leave out.
    default_ffn: ClassVar[str] = "gated-gelu"
    default_tie: ClassVar[bool]
    relative_bias: ClassVar[str] = "shared"
    scales_in_5: ClassVar[bool] = True  # transformers 5's class still scales the decoder output (mT5's never does)

    def scales_decoder_output(self, config: Path, hf: dict, tied: bool) -> bool:
        """Whether the decoder output is scaled by d_model**-0.5 before the head, as the installed transformers
        reads config.json. 4.x scales whenever tie_word_embeddings is true. 5.x writes tie_word_embeddings true for
        every T5 (it ties the head unless the weights hold a different one) and reads the scaling from its own key
        scale_decoder_outputs, else from tie_word_embeddings as 4.x did; its mT5 never scales."""
        if transformers_major() < 5:
            return tied
        return self.scales_in_5 and flag(config, hf, "scale_decoder_outputs", tied)

    def config_fields(self, src: Path, hf: dict) -> dict[str, Any]:
        config = src / "config.json"
        fields, _ = self.read_sizes(config, hf)
        decoder_layers = integer(config, hf, "num_decoder_layers", nullable=True) or fields["num_encoder_layers"]
        activation, gated = feed_forward(config, hf, self.default_ffn)
        tied = flag(config, hf, "tie_word_embeddings", self.default_tie)
        scaled = self.scales_decoder_output(config, hf, tied)
        max_len = integer(config, hf, "n_positions", minimum=4, default=DEFAULT_MAX_LEN)
        eps = hf.get("layer_norm_epsilon", 1e-6)
        if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps > 0):
            raise ConfigError(f"{config}: layer_norm_epsilon must be a number > 0 such as 1e-06, got {show(eps)}")
        value = hf.get("dropout_rate", 0.0)  # unused in eval; transformers' own model checks it at load
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1):
            raise ConfigError(f"{config}: dropout_rate must be a number in [0, 1], got {show(value)}")
        buckets = integer(config, hf, "relative_attention_num_buckets", minimum=4, default=32)
        distance = integer(config, hf, "relative_attention_max_distance", minimum=buckets // 2 + 1, default=128)
        return {**fields, "tgt_vocab_size": fields["src_vocab_size"], "num_decoder_layers": decoder_layers,
                "max_src_len": max_len, "max_tgt_len": max_len, "activation": activation, "gated_ffn": gated,
                "norm": "rms", "pre_norm": True, "scale_embeddings": False, "tie_embeddings": tied,
                "share_vocab": True, "layer_norm_eps": float(eps), "positions": "none", "bias": False,
                "scale_attention": False, "scale_logits": scaled, "relative_bias": self.relative_bias,
                "relative_buckets": buckets, "relative_max_distance": distance}


@register
class T5Adapter(T5LikeAdapter):
    model_type = "t5"
    transformers_class = "T5ForConditionalGeneration"
    title = "T5 v1.0, v1.1 and Flan-T5"
    default_ffn = "relu"
    default_tie = True


@register
class MT5Adapter(T5LikeAdapter):
    model_type = "mt5"
    transformers_class = "MT5ForConditionalGeneration"
    title = "mT5"
    default_tie = False
    scales_in_5 = False


@register
class UMT5Adapter(T5LikeAdapter):
    model_type = "umt5"
    transformers_class = "UMT5ForConditionalGeneration"
    title = "UMT5"
    default_tie = True
    relative_bias = "per_layer"
