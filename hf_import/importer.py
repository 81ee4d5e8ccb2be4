"""Hugging Face checkpoints -> seq2trt checkpoints: each family a `Seq2SeqConfig` of our one model, read by its
registered adapter (`families`).

`import_hf` reads the source directory without any network access (`.bin` weights through
`torch.load(weights_only=True)`), has `proof.judge` run transformers' own model and `generate` on the same directory,
builds our model, has `proof.verify` prove it equal to transformers' outputs, and only then writes the checkpoint:
config.json + model.safetensors, the source's tokenizer files under `tokenizer/`, its generation settings in
`generation.json` and the proof in `import.json`.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from seq2trt.hf_import import proof
from seq2trt.hf_import import speech_proof
from seq2trt.core.atomic_files import sha256_file
from seq2trt.reference_model.checkpoint import _read_pt, _read_safetensors, load_state_dict_checked, save_checkpoint
from seq2trt.reference_model.config import Seq2SeqConfig, beam_bytes, memory_parts, physical_memory
from seq2trt.core.errors import CheckFailed, CheckpointError, ConfigError
from seq2trt.hf_import.families import (FAMILIES, REFUSED, SUPPORTED_LAYERS, FamilyAdapter, adapter_for,
                                                 transformers_major)
from seq2trt.hf_import.families.generation import generation_settings
from seq2trt.hf_import.families.values import integer, read_json, show, token_ids, unreadable
from seq2trt.core.layout import GENERATION, IMPORT_RECORD, TOKENIZER_DIR
from seq2trt.reference_model.memory import import_peak
from seq2trt.reference_model.model import Seq2SeqTransformer

logger = logging.getLogger(__name__)


def check_source_dir(src: Path) -> None:
    """Refuse a source that is not a readable directory (missing, a file, a symlink loop) before any work."""
    try:
        os.stat(src)
    except FileNotFoundError:
        raise CheckpointError(f"{src} not found; give the folder save_pretrained wrote (no downloads)") from None
    except OSError as exc:
        raise unreadable(src, exc) from None
    if not src.is_dir():
        raise CheckpointError(f"{src} is not a directory; give the folder save_pretrained wrote (no downloads)")


def _check_ids(src: Path, hf: dict, gen: dict, where: Callable[[str], Path], suppress_lists: list[tuple],
               vocab: int, tgt_vocab: int, audio: bool = False) -> tuple[int, int, tuple[int, ...]]:
    """(decoder start id, eos id, suppressed ids), every special id checked against the vocabularies, in the source's keys."""
    config = src / "config.json"
    pad, eos = integer(config, hf, "pad_token_id", minimum=0), hf.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and len(eos) == 1 else eos
    eos = integer(config, {"eos_token_id": eos}, "eos_token_id", minimum=0)
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
    if pad == eos and not audio:  # an audio source is never padded with ids (Whisper's pad is its eos)
        raise ConfigError(f"{config}: pad_token_id and eos_token_id are both {pad}; they must differ")
    suppress: set[int] = set()
    for file, key, value, nested in suppress_lists:
        found = token_ids(file, key, value, tgt_vocab, nested)
        if nested:  # bad words: single ones are suppressed ids, longer ones are the search's (reference_model/decoding/greedy.py)
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
    hf = read_json(config)
    family = hf.get("model_type")
    if family is None:
        raise ConfigError(f"{config} names no model_type, so it is not a Hugging Face model config "
                          "(a seq2trt checkpoint needs no import: pass it to export or translate as it is)")
    if isinstance(family, str) and family in REFUSED:
        raise ConfigError(f"{src} holds a {family!r} model, which seq2trt does not import: {REFUSED[family]}; "
                          f"seq2trt imports {', '.join(FAMILIES)}")
    adapter = adapter_for(family) if isinstance(family, str) else None
    if adapter is None:
        raise ConfigError(f"{src} holds a {family!r} model; seq2trt imports {', '.join(FAMILIES)} "
                          f"({', '.join(a.title for a in FAMILIES.values())}): {SUPPORTED_LAYERS}; "
                          "if this model's layers are one of those, set model_type in config.json to that family's")
    family = adapter.model_type  # a type registered with transformers under another name reads as its family
    missing = [k for k in adapter.required + ("pad_token_id", "eos_token_id") if hf.get(k) is None]
    if missing:
        raise CheckpointError(f"{config} lacks {missing}; is it a complete {family} config?")
    fields = adapter.config_fields(src, hf)
    gen, origin, suppress_lists = generation_settings(src, hf, adapter.generation_keys)
    raw = gen.pop("raw")
    max_pos = fields["max_tgt_len"]
    if abs(gen["length_penalty"]) * math.log(max_pos) > 700:  # length ** length_penalty overflows a float (and generate)
        raise ConfigError(f"{origin('length_penalty')}: length_penalty {gen['length_penalty']} overflows "
                          f"length ** length_penalty at {max_pos} positions; use a value of magnitude at most "
                          f"{700 / math.log(max_pos):.0f}")
    start, eos, suppress = _check_ids(src, hf, gen, origin, suppress_lists, fields["src_vocab_size"],
                                      fields["tgt_vocab_size"], audio=bool(fields.get("n_mels")))
    begin_suppress: tuple[int, ...] = ()
    if adapter.speech_settings is not None:  # an audio family: its prompt tokens, and what its first token may not be
        begin = raw.get("begin_suppress_tokens")
        if begin is not None:
            found = token_ids(origin("begin_suppress_tokens"), "begin_suppress_tokens", begin, fields["tgt_vocab_size"],
                              False)
            begin_suppress = tuple(sorted(set(found)))  # eos among them: the text may not end before it starts
        gen["speech"] = adapter.speech_settings(origin("lang_to_id"), raw, fields["tgt_vocab_size"])
    cfg = Seq2SeqConfig.from_dict(dict(
        **fields, dropout=0.0, pad_id=hf["pad_token_id"], bos_id=start, eos_id=eos,
        forced_bos_id=gen["forced_bos_token_id"], forced_eos=gen["forced_eos"], suppress_ids=suppress,
        begin_suppress_ids=begin_suppress, max_new_tokens=own_limit(gen, max_pos)))
    gen["suppress_ids"] = list(suppress)
    _check_memory(config, adapter, cfg, gen["num_beams"], origin("num_beams"))
    return family, cfg, gen


def _check_memory(config: Path, adapter: FamilyAdapter, cfg: Seq2SeqConfig, beams: int, beams_file: Path) -> None:
    """Refuse sizes the machine cannot hold before anything is allocated: the import holds our model and
    transformers' at once; one source's beam search holds num_beams rows of logits and K/V."""
    total, parts = physical_memory(), memory_parts(cfg)
    need = import_peak(sum(parts.values()))
    if need > total:
        biggest = max(parts, key=parts.get)
        raise ConfigError(f"{config} describes a model of about {need / 8:.2g} parameters ({need / 2**30:,.0f} GiB "
                          f"to import), more than this machine's {total / 2**30:,.0f} GiB of memory; most of it is "
                          f"the {biggest} ({adapter.part_keys[biggest]}): check those values")
    per_beam = beam_bytes(cfg)
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
    doc = read_json(index)
    if not isinstance(doc.get("metadata", {}), (dict, type(None))):
        raise CheckpointError(f"{index}: metadata must be an object, got {show(doc['metadata'])[:80]}; re-save the "
                              "model with save_pretrained")
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        got = f"a list of {len(weight_map)}" if isinstance(weight_map, list) else show(weight_map)[:80]
        raise CheckpointError(f"{index}: weight_map must be an object of tensor name -> shard file, got {got}; "
                              "re-save the model with save_pretrained")
    names = set()
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name:
            raise CheckpointError(f"{index}: weight_map[{key!r}] must name a shard file, got {show(name)[:80]}; "
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
        raise unreadable(path, exc) from None
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


def untie_head(adapter: FamilyAdapter, cfg: Seq2SeqConfig, hf_state: dict[str, torch.Tensor]) -> Seq2SeqConfig:
    """`cfg` untied where the installed transformers unties it: 5.x ties the head to the embedding only when the
    weights do not hold both with different values (it keeps both then, with a warning; its T5s all say
    tie_word_embeddings true, a Flan-T5's head its own). 4.x ties them regardless, dropping the stored head: such a
    source is refused in `map_weights`, as that model is not the one the weights hold."""
    state = {k.removeprefix(adapter.prefix): v for k, v in hf_state.items()}  # as map_weights names them
    head = state.get(adapter.lm_head)
    embed = next((state[k] for k in (adapter.shared_embedding, adapter.embeddings["decoder"]) if k in state), None)
    if (not cfg.tie_embeddings or head is None or embed is None or transformers_major() < 5
            or torch.equal(head.float(), embed.float())):
        return cfg
    return dataclasses.replace(cfg, tie_embeddings=False)


def map_weights(adapter: FamilyAdapter, cfg: Seq2SeqConfig, hf_state: dict[str, torch.Tensor]
                ) -> dict[str, torch.Tensor]:
    """Rename the source's tensors onto our parameter names by the family's adapter. Copies that ours derive (tied
    embeddings, sinusoid tables) are dropped after a check that they hold what ours will; anything unknown is
    reported."""
    state = {k.removeprefix(adapter.prefix): v for k, v in hf_state.items()}
    out: dict[str, torch.Tensor] = {}
    problems: list[str] = []

    def take(key: str | None, ours: str, transform: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> None:
        if key in state:
            out[ours] = transform(state.pop(key)).float()

    take(adapter.shared_embedding, "tgt_embed.weight")
    for side, ours in (("encoder", "src_embed.weight"), ("decoder", "tgt_embed.weight")):
        key, ours = adapter.embeddings[side], "tgt_embed.weight" if cfg.share_vocab else ours
        if key in state:
            tensor = state.pop(key)
            if ours in out:
                if not torch.equal(tensor.float(), out[ours]):
                    problems.append(f"{key} differs from the shared embedding the config ties it to")
            else:
                out[ours] = tensor.float()
    take(adapter.logits_bias, "logits_bias", lambda t: t.reshape(-1))
    lm_head = state.pop(adapter.lm_head, None)
    if lm_head is not None and not cfg.tie_embeddings:
        out["lm_head.weight"] = lm_head.float()
    elif lm_head is not None and not torch.equal(lm_head.float(), out.get("tgt_embed.weight", lm_head.float())):
        problems.append(f"{adapter.lm_head} differs from the embedding transformers "
                        f"{'4.x ties it to (5.x would keep both)' if transformers_major() < 5 else 'ties it to'}")
    for key in adapter.derived:  # rebuilt from the formula; the logits check proves them
        state.pop(key, None)
    for key in list(state):
        if (ours := adapter.rename(key)) is not None:
            out[ours] = state.pop(key).float()
    if adapter.zero_biases is not None:  # parameters the family has no tensor for because they are zero
        for name in [k for k in out if re.match(adapter.zero_biases, k) and k.endswith(".weight")]:
            out.setdefault(name.removesuffix("weight") + "bias", torch.zeros(out[name].shape[0]))
    if problems or state:
        leftovers = f"unknown tensors {sorted(state)[:8]}{' ...' if len(state) > 8 else ''}" if state else ""
        raise CheckpointError("cannot map the source's weights onto the model: " + "; ".join(problems + [leftovers]).strip("; ")
                              + "; is the directory a complete save_pretrained of a supported family?")
    return out


def _copy_tokenizer(adapter: FamilyAdapter, src: Path, dest: Path) -> None:
    names = adapter.tokenizer_files_in(src)
    if names:  # the tokenizer classes also read the model type from config.json
        (dest / TOKENIZER_DIR).mkdir()
        for name in names + ["config.json"]:
            shutil.copyfile(src / name, dest / TOKENIZER_DIR / name)


def _check_sizes(adapter: FamilyAdapter, src: Path, cfg: Seq2SeqConfig, state: dict[str, torch.Tensor],
                 files: list[Path]) -> None:
    """The config's layer counts and embedding size against the weights, in config.json's keys, before the model is
    built (a config asking for 100,000 layers would take minutes to build only to find them missing)."""
    weights, config = ", ".join(f.name for f in files), src / "config.json"
    for side, want in (("encoder", cfg.num_encoder_layers), ("decoder", cfg.num_decoder_layers)):
        key = adapter.key(f"num_{side}_layers")
        found = {int(m.group(1)) for k in state if (m := re.match(rf"{side}_layers\.(\d+)\.", k))}
        if len(found) != want:
            raise CheckpointError(f"{config}: {key} is {want} but {weights} holds weights for "
                                  f"{len(found)} {side} layers; fix {key} or re-save the model with save_pretrained")
    table = state.get("tgt_positions.weight")
    if table is not None and table.shape[0] != cfg.max_tgt_len + cfg.position_offset:
        key = adapter.key("max_tgt_len")
        raise CheckpointError(f"{config}: {key} {cfg.max_tgt_len} does not fit the position table in {weights} "
                              f"({table.shape[0]} rows, {cfg.position_offset} of them offset); fix {key} or re-save "
                              "the model with save_pretrained")
    embed = state.get("tgt_embed.weight")
    if embed is not None and tuple(embed.shape) != (cfg.tgt_vocab_size, cfg.d_model):
        raise CheckpointError(f"{config}: {adapter.key('tgt_vocab_size')} {cfg.tgt_vocab_size} and "
                              f"{adapter.key('d_model')} {cfg.d_model} do not fit the embedding in {weights} "
                              f"({tuple(embed.shape)}); fix config.json or re-save the model with save_pretrained")


def _few(keys: list[str], n: int = 4) -> str:
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


def _checked_weights(src: Path, progress: Callable[[str], None] = lambda msg: None, say: str = "reading"
                     ) -> tuple[str, Seq2SeqConfig, dict[str, Any], dict[str, torch.Tensor], list[Path]]:
    """(family, our config, generation settings, the source's weights on our names, weight files read), every check
    of the source's config and weights made; `say` begins the progress line."""
    src = Path(src)
    check_source_dir(src)
    family, cfg, gen = config_from_hf(src)
    adapter = FAMILIES[family]
    progress(f"{say} the {family} model's weights")
    hf_state, files = read_hf_weights(src)
    cfg = untie_head(adapter, cfg, hf_state)
    state = map_weights(adapter, cfg, hf_state)
    del hf_state  # what map_weights transformed goes now; the rest lives on in `state` until copied into the model
    _check_sizes(adapter, src, cfg, state, files)
    return family, cfg, gen, state, files


def load_hf_as_model(src: Path, progress: Callable[[str], None] = lambda msg: None
                     ) -> tuple[str, Seq2SeqTransformer, dict[str, Any], list[Path]]:
    """(family, our eager model with the source's weights, generation settings, weight files read); `progress`
    hears when the checked config's weights start to be read (a refused config prints nothing before its error)."""
    family, cfg, gen, state, files = _checked_weights(src, progress)
    model = Seq2SeqTransformer(cfg)
    load_state_dict_checked(model, state, str(src))
    return family, model.eval(), gen, files


def import_hf(src: Path, out: Path, force: bool = False, progress: Callable[[str], None] = lambda msg: None) -> dict:
    """Import, verify against transformers, then write the checkpoint atomically; returns the import record.
    A failed verification raises CheckFailed (exit 1) and writes nothing."""
    src = Path(src)
    check_source_dir(src)
    _, cfg, settings = config_from_hf(src)
    # The proof runs transformers' side first and frees its model before ours is built: one model in memory at a
    # time (a whisper-large-v3 is 6 GB of fp32 weights a copy).
    if cfg.audio:
        judged = speech_proof.judge_speech(src, cfg, settings, progress)
    else:  # so is a text model's, after the source's weights pass our checks (read, checked and let go: its errors
        # stay ours, not transformers' loader's); its config is the one ours is built from (a head untied)
        judged = proof.judge(src, _checked_weights(src, progress, "checking")[1], settings, progress)
    family, model, gen, files = load_hf_as_model(src, progress)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    progress(f"read {family}: {sum(p.numel() for p in model.parameters()) / 1e6:,.0f} M parameters, "
             f"{weights / 2**30:.2f} GiB; proving it equal to transformers' own model")
    report = (speech_proof.verify_speech(judged, model, gen, progress) if cfg.audio
              else proof.verify(judged, model, gen, progress))
    del judged
    gc.collect()  # the float64 re-judge's transformers model, if one ran: freed before the checkpoint's write
    adapter = FAMILIES[family]
    record = {"family": family, "source": {"path": str(src.resolve()),
                                           "weights_sha256": {f.name: sha256_file(f) for f in files}},
              "tokenizer_files": adapter.tokenizer_files_in(src), "verification": report}
    if not report["passed"]:
        raise CheckFailed(f"import of {src} failed its verification against transformers (nothing written): "
                          + "; ".join(report["failures"]))
    progress(f"proof passed; writing the checkpoint to {out}")
    extra = {GENERATION: json.dumps(gen, indent=2) + "\n", IMPORT_RECORD: json.dumps(record, indent=2) + "\n"}
    save_checkpoint(out, model, force=force, extra_files=extra,
                    extra_writer=lambda tmp: _copy_tokenizer(adapter, src, tmp), protect=(src,))
    return record
