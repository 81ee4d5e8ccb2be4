"""Whisper (and distil-whisper, and the `.en` models): BART's pre-LN layers behind an audio front end. The encoder
reads log-mel features (num_mel_bins x 2 max_source_positions frames) through two Conv1d + GELU and adds a stored
position table (sinusoids, loaded as they are); the decoder has a learned table of max_target_positions rows, a
final LayerNorm, no embedding scale, and `proj_out` tied to its embedding. Attention `k_proj` has no bias (ours is
zero-filled: exact). The decoder starts with <|startoftranscript|>; pad is eos (<|endoftext|>).

The special tokens of the prompt (language, task, <|notimestamps|>, the timestamps that follow it) come from
generation_config.json and are written to the checkpoint's generation.json under "speech" (`speech_settings`);
`begin_suppress_tokens` becomes the config's begin_suppress_ids. The tokenizer folder also takes
preprocessor_config.json, the feature extractor's settings (its mel filters), and normalizer.json.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from seq2trt.core.errors import ConfigError
from seq2trt.hf_import.families import ACTIVATIONS, COMMON_TOKENIZER_FILES, FamilyAdapter, register
from seq2trt.hf_import.families.bart_like import FINAL_NORMS, LAYER_RENAMES, layer_options
from seq2trt.hf_import.families.values import flag, integer, show

FEATURE_EXTRACTOR = "preprocessor_config.json"
# Generation settings only Whisper has, read by `speech_settings` instead of the generic check.
SPEECH_KEYS = ("lang_to_id", "task_to_id", "no_timestamps_token_id", "is_multilingual", "alignment_heads",
               "max_initial_timestamp_index", "prev_sot_token_id", "return_timestamps", "forced_decoder_ids",
               "begin_suppress_tokens", "language", "task", "suppress_tokens", "no_speech_threshold")


@register
class WhisperAdapter(FamilyAdapter):
    model_type = "whisper"
    transformers_class = "WhisperForConditionalGeneration"
    title = "Whisper"
    sizes: ClassVar[dict[str, str]] = {
        "vocab_size": "src_vocab_size", "d_model": "d_model", "encoder_layers": "num_encoder_layers",
        "decoder_layers": "num_decoder_layers", "encoder_attention_heads": "num_heads",
        "decoder_attention_heads": "num_heads", "encoder_ffn_dim": "d_ff", "decoder_ffn_dim": "d_ff",
        "num_mel_bins": "n_mels", "max_source_positions": "max_src_len", "max_target_positions": "max_tgt_len"}
    required = tuple(sizes)
    other_keys = {"tgt_vocab_size": "vocab_size"}
    part_keys = {"embeddings": "vocab_size, d_model", "positions": "max_source_positions, max_target_positions, d_model",
                 "encoder": "encoder_layers, d_model, encoder_ffn_dim, num_mel_bins",
                 "decoder": "decoder_layers, d_model, decoder_ffn_dim"}
    prefix = "model."
    lm_head = "proj_out.weight"
    embeddings = {"encoder": "encoder.embed_tokens.weight", "decoder": "decoder.embed_tokens.weight"}
    renames = LAYER_RENAMES + FINAL_NORMS + (
        (r"encoder\.conv([12])\.", r"frontend.conv\1."),
        (r"encoder\.embed_positions\.weight", "src_positions.weight"),
        (r"decoder\.embed_positions\.weight", "tgt_positions.weight"))
    zero_biases = r"(encoder|decoder)_layers\.\d+\.(self_attn|cross_attn)\.k_proj\."  # k_proj has no bias
    generation_keys = SPEECH_KEYS
    tokenizer_files = COMMON_TOKENIZER_FILES + ("vocab.json", "merges.txt", "normalizer.json", FEATURE_EXTRACTOR)

    def config_fields(self, src: Path, hf: dict) -> dict[str, Any]:
        config = src / "config.json"
        fields, problems = self.read_sizes(config, hf)
        if fields["d_model"] % fields["num_heads"]:
            problems.append(f"d_model={fields['d_model']} is not divisible by "
                            f"encoder_attention_heads={fields['num_heads']}")
        act = layer_options(config, hf, problems)
        if flag(config, hf, "scale_embedding", False):
            problems.append("scale_embedding=true (no released Whisper scales its embeddings)")
        if flag(config, hf, "use_weighted_layer_sum", False):
            problems.append("use_weighted_layer_sum=true (an audio-classification head)")
        if problems:
            raise ConfigError(f"{src}: unsupported options in this whisper model: {'; '.join(problems)}")
        return {**fields, "tgt_vocab_size": fields["src_vocab_size"], "activation": ACTIVATIONS[act],
                "pre_norm": True, "positions": "learned", "position_offset": 0, "scale_embeddings": False,
                "tie_embeddings": flag(config, hf, "tie_word_embeddings", True), "share_vocab": True,
                "embed_norm": False, "logits_bias": False, "bias": True}

    def speech_settings(self, where: Path, gen: dict, vocab: int) -> dict[str, Any]:
        """The prompt's special tokens from the generation settings, checked against the vocabulary:
        languages {code: id}, tasks {name: id}, the no-timestamps id (timestamps are the ids after it), whether the
        model is multilingual, the default language and task (older checkpoints' forced_decoder_ids), and
        max_initial_timestamp_index, and <|startofprev|> (prev_sot_token_id, else suppress_tokens[-2] as
        transformers takes it, else null: condition_on_prev_tokens's first token)."""
        def token(key: str, value: Any) -> int:
            if not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab):
                raise ConfigError(f"{where}: {key} must be an id in [0, {vocab}), got {show(value)}")
            return value

        def table(key: str, strip: bool) -> dict[str, int]:
            value = gen.get(key) or {}
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: {key} must be an object of token -> id, got {show(value)[:80]}")
            return {(name.strip("<|>") if strip else name): token(f"{key}[{name!r}]", i) for name, i in value.items()}

        if gen.get("no_speech_threshold") is not None:  # else transformers' generate runs it, and fails without
            raise ConfigError(f"{where}: no_speech_threshold {show(gen['no_speech_threshold'])} is not supported "
                              "(transformers' no-speech detection is not reproduced, and its generate needs "
                              "logprob_threshold beside it); remove it")
        languages, tasks = table("lang_to_id", True), table("task_to_id", False)
        no_timestamps = gen.get("no_timestamps_token_id")
        no_timestamps = None if no_timestamps is None else token("no_timestamps_token_id", no_timestamps)
        multilingual = flag(where, gen, "is_multilingual", bool(languages))
        if multilingual and not (languages and {"transcribe", "translate"} <= set(tasks)):
            raise ConfigError(f"{where}: a multilingual Whisper needs lang_to_id and task_to_id (transcribe, "
                              "translate); add them or set is_multilingual false")
        default_language = default_task = None
        by_id = {i: code for code, i in languages.items()}
        for pair in gen.get("forced_decoder_ids") or []:  # [[1, <|en|> or null], [2, <|transcribe|>], [3, ...]]
            if isinstance(pair, list) and len(pair) == 2 and pair[1] is not None:
                default_language = by_id.get(pair[1], default_language)
                default_task = next((t for t, i in tasks.items() if i == pair[1]), default_task)
        if isinstance(gen.get("language"), str):
            default_language = gen["language"].strip("<|>")
        if isinstance(gen.get("task"), str):
            default_task = gen["task"]
        initial = integer(where, gen, "max_initial_timestamp_index", minimum=0, nullable=True)
        # <|startofprev|>: prev_sot_token_id, else suppress_tokens[-2] as transformers' generate takes it
        prev_sot = gen.get("prev_sot_token_id")
        suppressed = gen.get("suppress_tokens") or []
        if prev_sot is None and isinstance(suppressed, list) and len(suppressed) >= 2:
            prev_sot = suppressed[-2]
        prev_sot = None if prev_sot is None else token("prev_sot_token_id", prev_sot)
        return {"languages": languages, "tasks": tasks, "no_timestamps_id": no_timestamps,
                "multilingual": multilingual, "default_language": default_language, "default_task": default_task,
                "max_initial_timestamp_index": initial, "prev_sot_id": prev_sot}
