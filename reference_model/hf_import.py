"""Hugging Face checkpoints -> seq2trt checkpoints: Marian, BART, mBART and M2M100/NLLB as configs of our one model.

Each family is a `Seq2SeqConfig` (positions, norms, activation, logits bias, decoding rules) plus a table that
renames its weights onto ours; nothing here is a model class. `import_hf` reads the source directory without
any network access (`.bin` weights through `torch.load(weights_only=True)`), builds our model, has
`hf_verify.verify` prove it equal to transformers' own model and `generate` on the same directory, and only then
writes the checkpoint: config.json + model.safetensors, the source's tokenizer files under `tokenizer/`, its
generation settings in `generation.json` and the proof in `import.json`.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from seq2trt.reference_model.checkpoint import _read_pt, _read_safetensors, load_state_dict_checked, save_checkpoint
from seq2trt.reference_model.config import Seq2SeqConfig, memory_parts, physical_memory
from seq2trt.reference_model.errors import CheckFailed, CheckpointError, ConfigError
from seq2trt.reference_model.atomic_files import sha256_file
from seq2trt.reference_model.model import Seq2SeqTransformer

logger = logging.getLogger(__name__)

FAMILIES = ("marian", "bart", "mbart", "m2m_100")
from seq2trt.reference_model.layout import GENERATION, IMPORT_RECORD, TOKENIZER_DIR  # noqa: F401  (re-exported)
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
_NEUTRAL_GENERATION = {"encoder_no_repeat_ngram_size": 0, "encoder_repetition_penalty": 1.0, "num_beam_groups": 1,
                       "diversity_penalty": 0.0, "forced_decoder_ids": None, "begin_suppress_tokens": None,
                       "sequence_bias": None, "exponential_decay_length_penalty": None, "constraints": None,
                       "force_words_ids": None, "penalty_alpha": None, "guidance_scale": None,
                       "renormalize_logits": False, "remove_invalid_values": False}
# Sampling warpers we do not reproduce: they change the search only when do_sample is true.
_NEUTRAL_SAMPLING = {"typical_p": 1.0, "min_p": None, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}
# Options the decoding reproduces (decoding.GENERATION_OPTIONS): (kind, least value, transformers' default).
_OPTIONS = {"min_length": ("int", 0, 0), "min_new_tokens": ("int", 0, None), "no_repeat_ngram_size": ("int", 0, 0),
            "repetition_penalty": ("positive", None, 1.0), "num_return_sequences": ("int", 1, 1),
            "do_sample": ("bool", None, False), "temperature": ("positive", None, 1.0), "top_k": ("int", 0, 50),
            "top_p": ("fraction", None, 1.0)}


_SIZES = ("vocab_size", "d_model", "encoder_layers", "decoder_layers", "encoder_attention_heads",
          "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim")
_REQUIRED = _SIZES + ("pad_token_id", "eos_token_id")
# What a part of the model's memory (config.memory_parts) is sized by, in the source's own keys.
_PART_KEYS = {"embeddings": "vocab_size, d_model", "positions": "max_position_embeddings, d_model",
              "encoder": "encoder_layers, d_model, encoder_ffn_dim", "decoder": "decoder_layers, d_model, decoder_ffn_dim"}


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} not found; a Hugging Face model directory holds config.json "
                              "(as save_pretrained or a hub download writes it)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); re-save or re-download the model") from None
    except OSError as exc:
        raise _unreadable(path, exc) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _unreadable(path: Path, exc: OSError) -> CheckpointError:
    if exc.errno == errno.ELOOP:
        return CheckpointError(f"{path} is a symlink loop (too many levels of symbolic links); point it at the real "
                               "file or folder")
    if exc.errno == errno.EISDIR or path.is_dir():
        return CheckpointError(f"{path} is a directory, not a file; re-save or re-download the model")
    return CheckpointError(f"cannot read {path}: {exc.strerror or exc}; check the file and its permissions")


def check_source_dir(src: Path) -> None:
    """Refuse a source that is not a readable directory (missing, a file, a symlink loop) before any work."""
    try:
        os.stat(src)
    except FileNotFoundError:
        raise CheckpointError(f"{src} not found; give the folder save_pretrained wrote (no downloads)") from None
    except OSError as exc:
        raise _unreadable(src, exc) from None
    if not src.is_dir():
        raise CheckpointError(f"{src} is not a directory; give the folder save_pretrained wrote (no downloads)")


def _show(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _integer(where: Path, doc: dict, key: str, minimum: int = 1, default: Any = None,
             nullable: bool = False) -> int | None:
    """`doc[key]` as an integer >= `minimum` (None when absent or null and `nullable`), else one error naming it."""
    value = doc.get(key, default)
    if value is None and nullable:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= minimum:
        return value
    what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    whole = isinstance(value, int) and not isinstance(value, bool)
    fix = f"set it to {minimum} or more" if whole else "write a whole number without quotes, as save_pretrained does"
    raise ConfigError(f"{where}: {key} must be {what}{' or null' if nullable else ''}, got {_show(value)}; {fix}")


def _flag(where: Path, doc: dict, key: str, default: bool) -> bool:
    value = doc.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: {key} must be true or false, got {_show(value)}")
    return value


def _token_ids(where: Path, key: str, value: Any, vocab: int, nested: bool = False) -> list:
    """A list of token ids (of non-empty id lists when `nested`: bad_words_ids), each inside the vocabulary."""
    rows = value if isinstance(value, list) else None
    if rows is not None and nested:
        words = [w if isinstance(w, list) and w else None for w in rows]
        rows = None if None in words else [i for w in words for i in w]
    if rows is None or any(not isinstance(i, int) or isinstance(i, bool) for i in rows):
        shape = "a list of token-id lists such as [[5], [7, 8]]" if nested else "a list of token ids such as [5]"
        raise ConfigError(f"{where}: {key} must be {shape}, got {_show(value)}")
    bad = [i for i in rows if not 0 <= i < vocab]
    if bad:
        raise ConfigError(f"{where}: {key} holds {bad[:5]}, outside the vocabulary [0, {vocab}) (vocab_size {vocab}); "
                          "remove them or fix vocab_size")
    return value if nested else rows


def _option(where: Path, key: str, value: Any) -> Any:
    """A reproduced option of `_OPTIONS` checked for its kind (null: transformers' default)."""
    kind, least, default = _OPTIONS[key]
    if value is None:
        return default
    if kind == "int":
        return _integer(where, {key: value}, key, minimum=least)
    if kind == "bool":
        return _flag(where, {key: value}, key, default)
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if number and value > 0 and (kind == "positive" or value <= 1):
        return float(value)
    rule = "a number in (0, 1] such as 0.9" if kind == "fraction" else "a finite number > 0 such as 1.2"
    raise ConfigError(f"{where}: {key} must be {rule}, got {_show(value)}")


def _gen_value(gen: dict, origin: Callable[[str], Path], key: str, default: Any) -> Any:
    """A generation setting checked for its type (null: transformers' default)."""
    value = gen.get(key)
    if value is None:
        return default
    if key == "num_beams":
        return _integer(origin(key), gen, key)
    if key == "length_penalty":
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        raise ConfigError(f"{origin(key)}: length_penalty must be a finite number such as 1.0, got {_show(value)}")
    if key == "early_stopping":
        if isinstance(value, bool) or value == "never":
            return value
        raise ConfigError(f"{origin(key)}: early_stopping must be true, false or \"never\", got {_show(value)}")
    # max_length counts the decoder start token: 2 is the least that generates anything
    return _integer(origin(key), gen, key, minimum=2 if key == "max_length" else 1)


def generation_settings(src: Path, hf: dict) -> tuple[dict[str, Any], Callable[[str], Path], list[tuple]]:
    """The source's generation settings (generation_config.json, else config.json's), checked: every option we do
    not reproduce must hold its neutral value, or the import stops naming it; the ones we do must hold values of
    their kind. Also the file each key came from (for errors), and the suppressed-token lists to check against the
    vocabulary: (file, key, value, nested)."""
    gen_path = src / "generation_config.json"
    gen_doc = _read_json(gen_path) if gen_path.exists() else {}
    gen = {**hf, **gen_doc}

    def origin(key: str) -> Path:
        return gen_path if key in gen_doc else src / "config.json"

    options = {k: _option(origin(k), k, gen.get(k)) for k in _OPTIONS}
    unsupported = []
    neutral_keys = {**_NEUTRAL_GENERATION, **(_NEUTRAL_SAMPLING if options["do_sample"] else {})}
    for k, neutral in neutral_keys.items():
        if k in gen and gen[k] != neutral and not (neutral is None and gen[k] in ([], {})):
            unsupported.append(f"{k}={gen[k]!r}")
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
    settings = {key: _gen_value(gen, origin, key, default) for key, default in
                (("num_beams", 1), ("length_penalty", 1.0), ("early_stopping", False), ("max_length", None),
                 ("max_new_tokens", None))}
    if options["do_sample"] and settings["num_beams"] > 1:
        unsupported.append(f"do_sample=True with num_beams={settings['num_beams']} (beam sampling)")
    if unsupported:
        raise ConfigError(f"generation settings of {src} use options seq2trt does not reproduce: "
                          f"{', '.join(unsupported)}; supported: greedy, beam search with length_penalty and "
                          "early_stopping, sampling with temperature/top_k/top_p, max_length/max_new_tokens, "
                          "min_length/min_new_tokens, no_repeat_ngram_size, repetition_penalty, bad_words_ids, "
                          "num_return_sequences, forced_bos/eos_token_id and suppress_tokens. Edit "
                          "generation_config.json or drop the option")
    most = settings["num_beams"] if not options["do_sample"] else None
    if most is not None and options["num_return_sequences"] > most:
        raise ConfigError(f"{origin('num_return_sequences')}: num_return_sequences {options['num_return_sequences']} "
                          f"is more than num_beams {most} (transformers' generate refuses it too); set it to at most "
                          "num_beams, or set do_sample true")
    ids = {key: _integer(origin(key), gen, key, minimum=0, nullable=True)
           for key in ("forced_bos_token_id", "decoder_start_token_id", "bos_token_id")}
    suppress = [(origin(k), k, gen[k], k == "bad_words_ids") for k in ("bad_words_ids", "suppress_tokens")
                if gen.get(k) is not None]
    return {**settings, **options, **ids, "forced_eos": forced_eos is not None}, origin, suppress


def _check_ids(src: Path, hf: dict, gen: dict, where: Callable[[str], Path], suppress_lists: list[tuple],
               vocab: int, tgt_vocab: int) -> tuple[int, int, tuple[int, ...]]:
    """(decoder start id, eos id, suppressed ids), every special id checked against the vocabularies, in the source's keys."""
    config = src / "config.json"
    pad, eos = _integer(config, hf, "pad_token_id", minimum=0), hf.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and len(eos) == 1 else eos
    eos = _integer(config, {"eos_token_id": eos}, "eos_token_id", minimum=0)
    start_key = next((k for k in ("decoder_start_token_id", "bos_token_id") if gen[k] is not None), None)
    if start_key is None:  # generate() would fail the same way
        raise ConfigError(f"{src} names neither decoder_start_token_id nor bos_token_id; set one in config.json")
    for key, value, limit, file in (("pad_token_id", pad, min(vocab, tgt_vocab), config),
                                    ("eos_token_id", eos, min(vocab, tgt_vocab), config),
                                    (start_key, gen[start_key], tgt_vocab, where(start_key)),
                                    ("forced_bos_token_id", gen["forced_bos_token_id"], tgt_vocab,
                                     where("forced_bos_token_id"))):
        if value is not None and value >= limit:
            raise ConfigError(f"{file}: {key} {value} is outside the vocabulary [0, {limit}) (vocab_size {limit}); "
                              "fix the id or vocab_size")
    if pad == eos:
        raise ConfigError(f"{config}: pad_token_id and eos_token_id are both {pad}; they must differ")
    suppress: set[int] = set()
    for file, key, value, nested in suppress_lists:
        found = _token_ids(file, key, value, tgt_vocab, nested)
        if nested:  # bad words: single ones are suppressed ids, longer ones are the search's (decoding.py)
            suppress |= {w[0] for w in found if len(w) == 1}
            gen["bad_words_ids"] = sorted({tuple(w) for w in found if len(w) > 1}) or None
        else:
            suppress |= set(found)
    if eos in suppress:
        raise ConfigError(f"{where('suppress_tokens')}: suppress_tokens / bad_words_ids hold eos_token_id {eos}: "
                          "nothing could end; remove it")
    return gen[start_key], eos, tuple(sorted(suppress))


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
    config = src / "config.json"
    hf = _read_json(config)
    family = hf.get("model_type")
    if family is None:
        raise ConfigError(f"{config} names no model_type, so it is not a Hugging Face model config "
                          "(a seq2trt checkpoint needs no import: pass it to export or translate as it is)")
    if not isinstance(family, str) or family not in FAMILIES:
        raise ConfigError(f"{src} holds a {family!r} model; seq2trt imports {', '.join(FAMILIES)} "
                          "(Marian/opus-mt, BART, mBART, M2M100 and NLLB dense)")
    missing = [k for k in _REQUIRED if hf.get(k) is None]
    if missing:
        raise CheckpointError(f"{config} lacks {missing}; is it a complete {family} config?")
    sizes = {k: _integer(config, hf, k) for k in _SIZES}
    max_pos = _integer(config, hf, "max_position_embeddings", minimum=2, default=1024)  # the start token + 1
    shared = _flag(config, hf, "share_encoder_decoder_embeddings", True)
    problems = []
    for enc, dec in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")):
        if sizes[enc] != sizes[dec]:
            problems.append(f"{enc}={sizes[enc]} differs from {dec}={sizes[dec]}")
    if sizes["d_model"] % sizes["encoder_attention_heads"]:
        problems.append(f"d_model={sizes['d_model']} is not divisible by "
                        f"encoder_attention_heads={sizes['encoder_attention_heads']}")
    for key in ("dropout", "attention_dropout", "activation_dropout"):  # transformers' eval-mode forward checks them
        value = hf.get(key, 0.0)
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1):
            raise ConfigError(f"{config}: {key} must be a number in [0, 1], got {_show(value)}")
    act = hf.get("activation_function", "gelu")
    if not isinstance(act, str) or act not in ACTIVATIONS:
        problems.append(f"activation_function={act!r} (supported: {', '.join(ACTIVATIONS)})")
    if hf.get("normalize_before", _FAMILY[family]["pre_norm"]) != _FAMILY[family]["pre_norm"]:
        problems.append(f"normalize_before={hf['normalize_before']!r} (a {family} model is "
                        f"{'pre' if _FAMILY[family]['pre_norm'] else 'post'}-LN)")
    if hf.get("add_bias_logits") or hf.get("add_final_layer_norm"):
        problems.append("add_bias_logits / add_final_layer_norm (older BART variants)")
    if problems:
        raise ConfigError(f"{src}: unsupported options in this {family} model: {'; '.join(problems)}")
    gen, origin, suppress_lists = generation_settings(src, hf)
    vocab = sizes["vocab_size"]
    tgt_vocab = vocab if shared else _integer(config, hf, "decoder_vocab_size", nullable=True) or vocab
    if abs(gen["length_penalty"]) * math.log(max_pos) > 700:  # length ** length_penalty overflows a float (and generate)
        raise ConfigError(f"{origin('length_penalty')}: length_penalty {gen['length_penalty']} overflows "
                          f"length ** length_penalty at {max_pos} positions; use a value of magnitude at most "
                          f"{700 / math.log(max_pos):.0f}")
    start, eos, suppress = _check_ids(src, hf, gen, origin, suppress_lists, vocab, tgt_vocab)
    fam = dict(_FAMILY[family])
    if fam["position_offset"] is None:  # fairseq's sinusoid: position p is row pad + 1 + p
        fam["position_offset"] = hf["pad_token_id"] + 1
    cfg = Seq2SeqConfig.from_dict(dict(
        src_vocab_size=vocab, tgt_vocab_size=tgt_vocab, d_model=sizes["d_model"],
        num_heads=sizes["encoder_attention_heads"], num_encoder_layers=sizes["encoder_layers"],
        num_decoder_layers=sizes["decoder_layers"], d_ff=sizes["encoder_ffn_dim"], dropout=0.0,
        max_src_len=max_pos, max_tgt_len=max_pos, activation=ACTIVATIONS[act],
        scale_embeddings=_flag(config, hf, "scale_embedding", False),
        tie_embeddings=_flag(config, hf, "tie_word_embeddings", True), share_vocab=shared,
        pad_id=hf["pad_token_id"], bos_id=start, eos_id=eos, forced_bos_id=gen["forced_bos_token_id"],
        forced_eos=gen["forced_eos"], suppress_ids=suppress,
        max_new_tokens=own_limit(gen, max_pos), **fam))
    gen["suppress_ids"] = list(suppress)
    _check_memory(config, cfg, gen["num_beams"], origin("num_beams"))
    return family, cfg, gen


def _check_memory(config: Path, cfg: Seq2SeqConfig, beams: int, beams_file: Path) -> None:
    """Refuse sizes the machine cannot hold before anything is allocated: the import holds our model and
    transformers' at once; one source's beam search holds num_beams rows of logits and K/V."""
    total, parts = physical_memory(), memory_parts(cfg)
    need = 2 * sum(parts.values())
    if need > total:
        biggest = max(parts, key=parts.get)
        raise ConfigError(f"{config} describes a model of about {need / 8:.2g} parameters ({need / 2**30:,.0f} GiB "
                          f"to import), more than this machine's {total / 2**30:,.0f} GiB of memory; most of it is "
                          f"the {biggest} ({_PART_KEYS[biggest]}): check those values")
    per_beam = 4 * (4 * cfg.tgt_vocab_size + 2 * cfg.num_decoder_layers * 2 * cfg.max_positions * cfg.d_model)
    if beams * per_beam > total // 2:
        raise ConfigError(f"{beams_file}: num_beams {beams} needs about {beams * per_beam / 2**30:,.0f} GiB for one "
                          f"source's beam search, over half this machine's {total / 2**30:,.0f} GiB of memory; "
                          "set a smaller num_beams")


def read_hf_weights(src: Path) -> tuple[dict[str, torch.Tensor], list[Path]]:
    """Every tensor of the source's weights (single file or sharded with an index), and the files read; each a
    floating-point tensor."""
    for index_name, reader in (("model.safetensors.index.json", _read_safetensors),
                               ("pytorch_model.bin.index.json", _read_pt)):
        if (src / index_name).exists():
            weight_map = _weight_map(src, index_name)
            files = [src / name for name in sorted(set(weight_map.values()))]
            state: dict[str, torch.Tensor] = {}
            for shard in files:
                tensors = _read_weights(shard, reader)
                absent = sorted(k for k, name in weight_map.items() if src / name == shard and k not in tensors)
                if absent:  # transformers would leave those weights at random: its model would not be this one
                    raise CheckpointError(f"{src / index_name}: weight_map puts {_few(absent)} in {shard.name}, which "
                                          "does not hold them; re-save the model with save_pretrained")
                state.update(tensors)
            return state, files
    for name, reader in (("model.safetensors", _read_safetensors), ("pytorch_model.bin", _read_pt)):
        if (src / name).exists():
            return _read_weights(src / name, reader), [src / name]
    raise CheckpointError(f"{src} holds no weights (model.safetensors, pytorch_model.bin or a sharded index); "
                          "save the model with save_pretrained")


def _weight_map(src: Path, index_name: str) -> dict[str, str]:
    """An index's tensor -> shard file map, checked: relative names inside `src` (symlinks may point anywhere, as a
    hub download's do; the names themselves may not leave the folder)."""
    index = src / index_name
    doc = _read_json(index)
    if not isinstance(doc.get("metadata", {}), (dict, type(None))):
        raise CheckpointError(f"{index}: metadata must be an object, got {_show(doc['metadata'])[:80]}; re-save the "
                              "model with save_pretrained")
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        got = f"a list of {len(weight_map)}" if isinstance(weight_map, list) else _show(weight_map)[:80]
        raise CheckpointError(f"{index}: weight_map must be an object of tensor name -> shard file, got {got}; "
                              "re-save the model with save_pretrained")
    names = set()
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"{index}: weight_map[{key!r}] must name a shard file, got {_show(name)[:80]}; "
                                  "re-save the model with save_pretrained")
        names.add(name)
    for name in sorted(names):
        parts = Path(name).parts
        if Path(name).is_absolute() or ".." in parts or "\0" in name:
            raise CheckpointError(f"{index}: shard {name!r} lies outside {src}; an index may only name files in "
                                  "its own folder: refusing to read it")
    return weight_map


def _read_weights(path: Path, reader: Callable[[Path], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    try:
        os.stat(path)
    except OSError as exc:
        raise _unreadable(path, exc) from None
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory, not a weights file; re-save or re-download the model")
    state = reader(path)
    wrong = {k: v.dtype for k, v in state.items() if not v.is_floating_point()}
    if wrong:
        key = min(wrong)
        raise CheckpointError(f"{path}: {key} holds {str(wrong[key]).removeprefix('torch.')} values"
                              f"{f' (and {len(wrong) - 1} more tensors)' if len(wrong) > 1 else ''}; a model's weights "
                              "are floating point: re-save the model with save_pretrained")
    return state


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


def _check_sizes(src: Path, cfg: Seq2SeqConfig, state: dict[str, torch.Tensor], files: list[Path]) -> None:
    """The config's layer counts and embedding size against the weights, in config.json's keys, before the model is
    built (a config asking for 100,000 layers would take minutes to build only to find them missing)."""
    weights = ", ".join(f.name for f in files)
    for side, key, want in (("encoder", "encoder_layers", cfg.num_encoder_layers),
                            ("decoder", "decoder_layers", cfg.num_decoder_layers)):
        found = {int(m.group(1)) for k in state if (m := re.match(rf"{side}_layers\.(\d+)\.", k))}
        if len(found) != want:
            raise CheckpointError(f"{src / 'config.json'}: {key} is {want} but {weights} holds weights for "
                                  f"{len(found)} {side} layers; fix {key} or re-save the model with save_pretrained")
    table = state.get("tgt_positions.weight")
    if table is not None and table.shape[0] != cfg.max_tgt_len + cfg.position_offset:
        raise CheckpointError(f"{src / 'config.json'}: max_position_embeddings {cfg.max_tgt_len} does not fit the "
                              f"position table in {weights} ({table.shape[0]} rows, {cfg.position_offset} of them "
                              "offset); fix max_position_embeddings or re-save the model with save_pretrained")
    embed = state.get("tgt_embed.weight")
    if embed is not None and tuple(embed.shape) != (cfg.tgt_vocab_size, cfg.d_model):
        raise CheckpointError(f"{src / 'config.json'}: vocab_size {cfg.tgt_vocab_size} and d_model {cfg.d_model} "
                              f"do not fit the embedding in {weights} ({tuple(embed.shape)}); fix config.json or "
                              "re-save the model with save_pretrained")


def _few(keys: list[str], n: int = 4) -> str:
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


def load_hf_as_model(src: Path) -> tuple[str, Seq2SeqTransformer, dict[str, Any], list[Path]]:
    """(family, our eager model with the source's weights, generation settings, weight files read)."""
    src = Path(src)
    check_source_dir(src)
    family, cfg, gen = config_from_hf(src)
    hf_state, files = read_hf_weights(src)
    state = map_weights(cfg, hf_state)
    _check_sizes(src, cfg, state, files)
    model = Seq2SeqTransformer(cfg)
    load_state_dict_checked(model, state, str(src))
    return family, model.eval(), gen, files


def import_hf(src: Path, out: Path, force: bool = False, progress: Callable[[str], None] = lambda msg: None) -> dict:
    """Import, verify against transformers, then write the checkpoint atomically; returns the import record.
    A failed verification raises CheckFailed (exit 1) and writes nothing."""
    from seq2trt.reference_model.hf_verify import verify

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
