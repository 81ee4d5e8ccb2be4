"""A Hugging Face model's generation settings (generation_config.json, else config.json's), checked: the options
the decoding reproduces hold values of their kind, every other one that changes the search its neutral value."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

from seq2trt.core.errors import ConfigError
from seq2trt.hf_import.families.values import flag, integer, read_json, show

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


def _option(where: Path, key: str, value: Any) -> Any:
    """A reproduced option of `_OPTIONS` checked for its kind (null: transformers' default)."""
    kind, least, default = _OPTIONS[key]
    if value is None:
        return default
    if kind == "int":
        return integer(where, {key: value}, key, minimum=least)
    if kind == "bool":
        return flag(where, {key: value}, key, default)
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if number and value > 0 and (kind == "positive" or value <= 1):
        return float(value)
    rule = "a number in (0, 1] such as 0.9" if kind == "fraction" else "a finite number > 0 such as 1.2"
    raise ConfigError(f"{where}: {key} must be {rule}, got {show(value)}")


def _gen_value(gen: dict, origin: Callable[[str], Path], key: str, default: Any) -> Any:
    """A generation setting checked for its type (null: transformers' default)."""
    value = gen.get(key)
    if value is None:
        return default
    if key == "num_beams":
        return integer(origin(key), gen, key)
    if key == "length_penalty":
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        raise ConfigError(f"{origin(key)}: length_penalty must be a finite number such as 1.0, got {show(value)}")
    if key == "early_stopping":
        if isinstance(value, bool) or value == "never":
            return value
        raise ConfigError(f"{origin(key)}: early_stopping must be true, false or \"never\", got {show(value)}")
    # max_length counts the decoder start token: 2 is the least that generates anything
    return integer(origin(key), gen, key, minimum=2 if key == "max_length" else 1)


def generation_settings(src: Path, hf: dict, own_keys: tuple[str, ...] = ()
                        ) -> tuple[dict[str, Any], Callable[[str], Path], list[tuple]]:
    """The source's generation settings (generation_config.json, else config.json's), checked: every option we do
    not reproduce must hold its neutral value, or the import stops naming it; the ones we do must hold values of
    their kind. Also the file each key came from (for errors), and the suppressed-token lists to check against the
    vocabulary: (file, key, value, nested). `own_keys`: settings the family reads itself (Whisper's prompt tokens),
    left out of the check and returned under "raw"."""
    gen_path = src / "generation_config.json"
    gen_doc = read_json(gen_path) if gen_path.exists() else {}
    gen = {**hf, **gen_doc}

    def origin(key: str) -> Path:
        return gen_path if key in gen_doc else src / "config.json"

    options = {k: _option(origin(k), k, gen.get(k)) for k in _OPTIONS}
    unsupported = []
    neutral_keys = {k: v for k, v in {**_NEUTRAL_GENERATION, **(_NEUTRAL_SAMPLING if options["do_sample"] else {})
                                      }.items() if k not in own_keys}
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
    ids = {key: integer(origin(key), gen, key, minimum=0, nullable=True)
           for key in ("forced_bos_token_id", "decoder_start_token_id", "bos_token_id")}
    suppress = [(origin(k), k, gen[k], k == "bad_words_ids") for k in ("bad_words_ids", "suppress_tokens")
                if gen.get(k) is not None]
    raw = {k: gen[k] for k in own_keys if k in gen}
    return {**settings, **options, **ids, "forced_eos": forced_eos is not None, "raw": raw}, origin, suppress
