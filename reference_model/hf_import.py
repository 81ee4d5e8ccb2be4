"""Hugging Face checkpoints -> seq2trt checkpoints: Marian, BART, mBART and M2M100/NLLB as configs of our one model.

Each family is a `Seq2SeqConfig` (positions, norms, activation, logits bias, decoding rules) plus a table that
renames its weights onto ours; nothing here is a model class. `import_hf` reads the source directory without
any network access (`.bin` weights through `torch.load(weights_only=True)`), builds our model, has
`hf_verify.verify` prove it equal to transformers' own model and `generate` on the same directory, and only then
writes the checkpoint: config.json + model.safetensors, the source's tokenizer files under `tokenizer/`, its
generation settings in `generation.json` and the proof in `import.json`.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from .checkpoint import _read_pt, _read_safetensors, load_state_dict_checked, save_checkpoint
from .config import Seq2SeqConfig
from .errors import CheckFailed, CheckpointError, ConfigError
from .io import sha256_file
from .model import Seq2SeqTransformer

logger = logging.getLogger(__name__)

FAMILIES = ("marian", "bart", "mbart", "m2m_100")
TOKENIZER_DIR, GENERATION, IMPORT_RECORD = "tokenizer", "generation.json", "import.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "source.spm", "target.spm", "sentencepiece.bpe.model", "spm.model",
                   "sentencepiece.model", "target_vocab.json")
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
               "silu": "silu", "swish": "silu"}

# Family -> its architecture fields of Seq2SeqConfig (position_offset None: the pad id + 1, fairseq's rule)
_FAMILY = {
    "marian": dict(positions="sinusoid_halves", position_offset=0, embed_norm=False, pre_norm=False, logits_bias=True),
    "bart": dict(positions="learned", position_offset=2, embed_norm=True, pre_norm=False, logits_bias=True),
    "mbart": dict(positions="learned", position_offset=2, embed_norm=True, pre_norm=True, logits_bias=True),
    "m2m_100": dict(positions="sinusoid_fairseq", position_offset=None, pad_position_zero=True, embed_norm=False,
                    pre_norm=True, logits_bias=False),
}

# Generation settings we reproduce, and the neutral value of every other one we know to change the search.
_NEUTRAL_GENERATION = {"do_sample": False, "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0,
                       "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "min_length": 0,
                       "min_new_tokens": None, "num_beam_groups": 1, "diversity_penalty": 0.0,
                       "forced_decoder_ids": None, "begin_suppress_tokens": None, "sequence_bias": None,
                       "exponential_decay_length_penalty": None, "constraints": None, "force_words_ids": None,
                       "penalty_alpha": None, "guidance_scale": None, "renormalize_logits": False,
                       "remove_invalid_values": False, "num_return_sequences": 1}


_REQUIRED = ("vocab_size", "d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads",
             "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim", "pad_token_id", "eos_token_id")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} not found; a Hugging Face model directory holds config.json "
                              "(as save_pretrained or a hub download writes it)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); re-save or re-download the model") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def generation_settings(src: Path, hf: dict) -> dict[str, Any]:
    """The source's generation settings (generation_config.json, else config.json's), checked: every option we do
    not reproduce must hold its neutral value, or the import stops naming it."""
    gen_path = src / "generation_config.json"
    gen = {**hf, **_read_json(gen_path)} if gen_path.exists() else dict(hf)
    unsupported = [f"{k}={gen[k]!r}" for k, neutral in _NEUTRAL_GENERATION.items()
                   if k in gen and gen[k] != neutral and not (neutral is None and gen[k] in ([], {}))]
    bad_words = gen.get("bad_words_ids") or []
    if any(not isinstance(w, list) or len(w) != 1 for w in bad_words):
        unsupported.append(f"bad_words_ids={bad_words!r} (only single-token entries are supported)")
    eos = gen.get("eos_token_id")
    if isinstance(eos, list):
        if len(eos) != 1:
            unsupported.append(f"eos_token_id={eos!r} (one end-of-sequence id is supported)")
        gen["eos_token_id"] = eos[0] if eos else None
    forced_eos = gen.get("forced_eos_token_id")
    if isinstance(forced_eos, list):
        forced_eos = forced_eos[0] if len(forced_eos) == 1 else forced_eos
    if forced_eos is not None and forced_eos != gen.get("eos_token_id"):
        unsupported.append(f"forced_eos_token_id={forced_eos!r} (only the eos id is supported)")
    if unsupported:
        raise ConfigError(f"generation settings of {src} use options seq2trt does not reproduce: "
                          f"{', '.join(unsupported)}; supported: greedy and beam search with length_penalty, "
                          "early_stopping, max_length/max_new_tokens, forced_bos/eos_token_id, bad_words_ids of "
                          "single tokens and suppress_tokens. Edit generation_config.json or drop the option")
    suppress = sorted({w[0] for w in bad_words} | set(gen.get("suppress_tokens") or []))
    return {"num_beams": int(gen.get("num_beams") or 1), "length_penalty": float(gen.get("length_penalty", 1.0)),
            "early_stopping": gen.get("early_stopping", False), "max_length": gen.get("max_length"),
            "max_new_tokens": gen.get("max_new_tokens"), "forced_bos_token_id": gen.get("forced_bos_token_id"),
            "forced_eos": forced_eos is not None, "suppress_ids": suppress,
            "decoder_start_token_id": gen.get("decoder_start_token_id"), "bos_token_id": gen.get("bos_token_id")}


def own_limit(gen: dict[str, Any], max_positions: int) -> int | None:
    """The generated tokens (eos included) the source's own settings allow, as transformers' generate counts them:
    max_new_tokens wins; max_length counts the decoder start token. At most what the decoder's positions hold
    (transformers would index past its position table there). None when the source sets neither."""
    if gen.get("max_new_tokens") is not None:
        limit = gen["max_new_tokens"]
    elif gen.get("max_length") is not None:
        limit = gen["max_length"] - 1
    else:
        return None
    return min(limit, max_positions - 1)


def config_from_hf(src: Path) -> tuple[str, Seq2SeqConfig, dict[str, Any]]:
    """(family, our config, generation settings) of the Hugging Face model in `src`; unsupported models and
    options raise one ConfigError naming them and what is supported."""
    hf = _read_json(src / "config.json")
    family = hf.get("model_type")
    if family is None:
        raise ConfigError(f"{src / 'config.json'} names no model_type, so it is not a Hugging Face model config "
                          "(a seq2trt checkpoint needs no import: pass it to export or translate as it is)")
    if family not in FAMILIES:
        raise ConfigError(f"{src} holds a {family!r} model; seq2trt imports {', '.join(FAMILIES)} "
                          "(Marian/opus-mt, BART, mBART, M2M100 and NLLB dense)")
    missing = [k for k in _REQUIRED if hf.get(k) is None]
    if missing:
        raise CheckpointError(f"{src / 'config.json'} lacks {missing}; is it a complete {family} config?")
    problems = []
    for enc, dec in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")):
        if hf.get(enc) != hf.get(dec):
            problems.append(f"{enc}={hf.get(enc)} differs from {dec}={hf.get(dec)}")
    act = hf.get("activation_function", "gelu")
    if act not in ACTIVATIONS:
        problems.append(f"activation_function={act!r} (supported: {', '.join(ACTIVATIONS)})")
    if hf.get("normalize_before", _FAMILY[family]["pre_norm"]) != _FAMILY[family]["pre_norm"]:
        problems.append(f"normalize_before={hf['normalize_before']!r} (a {family} model is "
                        f"{'pre' if _FAMILY[family]['pre_norm'] else 'post'}-LN)")
    if hf.get("add_bias_logits") or hf.get("add_final_layer_norm"):
        problems.append("add_bias_logits / add_final_layer_norm (older BART variants)")
    if problems:
        raise ConfigError(f"{src}: unsupported options in this {family} model: {'; '.join(problems)}")
    gen = generation_settings(src, hf)
    shared = hf.get("share_encoder_decoder_embeddings", True)
    vocab = int(hf["vocab_size"])
    tgt_vocab = int(hf.get("decoder_vocab_size") or vocab) if not shared else vocab
    pad, eos = hf.get("pad_token_id"), hf.get("eos_token_id")
    start = next((v for v in (gen["decoder_start_token_id"], gen["bos_token_id"]) if v is not None), None)
    if start is None:  # generate() would fail the same way
        raise ConfigError(f"{src} names neither decoder_start_token_id nor bos_token_id; set one in config.json")
    fam = dict(_FAMILY[family])
    if fam["position_offset"] is None:  # fairseq's sinusoid: position p is row pad + 1 + p
        fam["position_offset"] = int(pad) + 1
    max_pos = int(hf.get("max_position_embeddings", 1024))
    try:
        cfg = Seq2SeqConfig.from_dict(dict(
            src_vocab_size=vocab, tgt_vocab_size=tgt_vocab, d_model=hf["d_model"],
            num_heads=hf["encoder_attention_heads"], num_encoder_layers=hf["encoder_layers"],
            num_decoder_layers=hf["decoder_layers"], d_ff=hf["encoder_ffn_dim"], dropout=0.0,
            max_src_len=max_pos, max_tgt_len=max_pos, activation=ACTIVATIONS[act],
            scale_embeddings=bool(hf.get("scale_embedding", False)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)), share_vocab=bool(shared),
            pad_id=pad, bos_id=start, eos_id=eos, forced_bos_id=gen["forced_bos_token_id"],
            forced_eos=gen["forced_eos"], suppress_ids=gen["suppress_ids"],
            max_new_tokens=own_limit(gen, max_pos), **fam))
    except KeyError as exc:
        raise CheckpointError(f"{src / 'config.json'} lacks {exc}; is it a complete {family} config?") from None
    return family, cfg, gen


def read_hf_weights(src: Path) -> tuple[dict[str, torch.Tensor], list[Path]]:
    """Every tensor of the source's weights (single file or sharded with an index), and the files read."""
    for index_name, reader in (("model.safetensors.index.json", _read_safetensors),
                               ("pytorch_model.bin.index.json", _read_pt)):
        if (src / index_name).exists():
            shards = sorted(set(_read_json(src / index_name).get("weight_map", {}).values()))
            state: dict[str, torch.Tensor] = {}
            for shard in shards:
                state.update(reader(src / shard))
            return state, [src / s for s in shards]
    for name, reader in (("model.safetensors", _read_safetensors), ("pytorch_model.bin", _read_pt)):
        if (src / name).exists():
            return reader(src / name), [src / name]
    raise CheckpointError(f"{src} holds no weights (model.safetensors, pytorch_model.bin or a sharded index); "
                          "save the model with save_pretrained")


_LAYER_RENAMES = [  # Hugging Face layer parameter -> ours, per stack
    (r"(encoder|decoder)\.layers\.(\d+)\.self_attn\.(q|k|v|out)_proj\.", r"\1_layers.\2.self_attn.\3_proj."),
    (r"decoder\.layers\.(\d+)\.encoder_attn\.(q|k|v|out)_proj\.", r"decoder_layers.\1.cross_attn.\2_proj."),
    (r"encoder\.layers\.(\d+)\.self_attn_layer_norm\.", r"encoder_layers.\1.attn_block.norm."),
    (r"decoder\.layers\.(\d+)\.self_attn_layer_norm\.", r"decoder_layers.\1.self_block.norm."),
    (r"decoder\.layers\.(\d+)\.encoder_attn_layer_norm\.", r"decoder_layers.\1.cross_block.norm."),
    (r"(encoder|decoder)\.layers\.(\d+)\.(fc1|fc2)\.", r"\1_layers.\2.ffn.\3."),
    (r"(encoder|decoder)\.layers\.(\d+)\.final_layer_norm\.", r"\1_layers.\2.ffn_block.norm."),
    (r"encoder\.layernorm_embedding\.", "src_embed_norm."),
    (r"decoder\.layernorm_embedding\.", "tgt_embed_norm."),
    (r"encoder\.layer_norm\.", "encoder_norm."),
    (r"decoder\.layer_norm\.", "decoder_norm."),
    (r"encoder\.embed_positions\.weight", "src_positions.weight"),
    (r"decoder\.embed_positions\.weight", "tgt_positions.weight"),
]


def map_weights(cfg: Seq2SeqConfig, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename the source's tensors onto our parameter names. Copies that ours derive (tied embeddings, sinusoid
    tables) are dropped after a check that they hold what ours will; anything unknown is reported."""
    state = {k.removeprefix("model."): v for k, v in hf_state.items()}
    out: dict[str, torch.Tensor] = {}
    problems: list[str] = []

    def take(key: str, ours: str, transform: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> None:
        if key in state:
            out[ours] = transform(state.pop(key)).float()

    take("shared.weight", "tgt_embed.weight")
    for side, ours in (("encoder", "src_embed.weight"), ("decoder", "tgt_embed.weight")):
        key = f"{side}.embed_tokens.weight"
        if key in state:
            tensor = state.pop(key)
            if ours in out or (cfg.share_vocab and "tgt_embed.weight" in out):
                if not torch.equal(tensor.float(), out["tgt_embed.weight"]):
                    problems.append(f"{key} differs from the shared embedding the config ties it to")
            else:
                out[ours] = tensor.float()
    if cfg.share_vocab:
        out.pop("src_embed.weight", None)
    take("final_logits_bias", "logits_bias", lambda t: t.reshape(-1))
    lm_head = state.pop("lm_head.weight", None)
    if lm_head is not None and not cfg.tie_embeddings:
        out["lm_head.weight"] = lm_head.float()
    elif lm_head is not None and not torch.equal(lm_head.float(), out.get("tgt_embed.weight", lm_head.float())):
        problems.append("lm_head.weight differs from the embedding tie_word_embeddings ties it to")
    if cfg.positions != "learned":  # sinusoid tables are rebuilt from the formula; the logits check proves them
        for side in ("encoder", "decoder"):
            state.pop(f"{side}.embed_positions.weight", None)
            state.pop(f"{side}.embed_positions._float_tensor", None)
    for key in list(state):
        for pattern, repl in _LAYER_RENAMES:
            if re.fullmatch(pattern + r".*", key):
                out[re.sub(pattern, repl, key, count=1)] = state.pop(key).float()
                break
    if problems or state:
        leftovers = f"unknown tensors {sorted(state)[:8]}{' ...' if len(state) > 8 else ''}" if state else ""
        raise CheckpointError("cannot map the source's weights onto the model: " + "; ".join(problems + [leftovers]).strip("; ")
                              + "; is the directory a complete save_pretrained of a supported family?")
    return out


def tokenizer_files(src: Path) -> list[str]:
    return [name for name in TOKENIZER_FILES if (Path(src) / name).is_file()]


def _copy_tokenizer(src: Path, dest: Path) -> None:
    names = tokenizer_files(src)
    if names:  # the tokenizer classes also read the model type from config.json
        (dest / TOKENIZER_DIR).mkdir()
        for name in names + ["config.json"]:
            shutil.copyfile(src / name, dest / TOKENIZER_DIR / name)


def load_hf_as_model(src: Path) -> tuple[str, Seq2SeqTransformer, dict[str, Any], list[Path]]:
    """(family, our eager model with the source's weights, generation settings, weight files read)."""
    src = Path(src)
    if not src.is_dir():
        raise CheckpointError(f"{src} is not a directory; give the folder save_pretrained wrote (no downloads)")
    family, cfg, gen = config_from_hf(src)
    hf_state, files = read_hf_weights(src)
    model = Seq2SeqTransformer(cfg)
    load_state_dict_checked(model, map_weights(cfg, hf_state), str(src))
    return family, model.eval(), gen, files


def import_hf(src: Path, out: Path, force: bool = False, progress: Callable[[str], None] = lambda msg: None) -> dict:
    """Import, verify against transformers, then write the checkpoint atomically; returns the import record.
    A failed verification raises CheckFailed (exit 1) and writes nothing."""
    from .hf_verify import verify

    src = Path(src)
    progress("reading the source model")
    family, model, gen, files = load_hf_as_model(src)
    progress(f"verifying the {family} model against transformers")
    report = verify(src, model, gen, progress)
    record = {"family": family, "source": {"path": str(src.resolve()),
                                           "weights_sha256": {f.name: sha256_file(f) for f in files}},
              "tokenizer_files": tokenizer_files(src), "verification": report}
    if not report["passed"]:
        raise CheckFailed(f"import of {src} failed its verification against transformers (nothing written): "
                          + "; ".join(report["failures"]))
    progress("writing the checkpoint")
    extra = {GENERATION: json.dumps(gen, indent=2) + "\n", IMPORT_RECORD: json.dumps(record, indent=2) + "\n"}
    save_checkpoint(out, model, force=force, extra_files=extra, extra_writer=lambda tmp: _copy_tokenizer(src, tmp),
                    protect=(src,))
    return record
