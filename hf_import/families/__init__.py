"""How each Hugging Face model type reads as our one model: one registered `FamilyAdapter` per `model_type`.

An adapter maps its family's config.json keys onto `Seq2SeqConfig` fields, its parameter names onto ours, and names
its tokenizer files; `hf_import` looks it up in `FAMILIES`. A new family is one module here that registers its
adapter (imported at the bottom), plus the config fields it needs.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar

from seq2trt.hf_import.families.values import integer

# transformers' activation names -> ours
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
               "silu": "silu", "swish": "silu"}
# What every fast or slow tokenizer's save_pretrained may write besides its family's vocabulary files.
COMMON_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


class FamilyAdapter:
    """One model type's reading. A subclass sets the class attributes and `config_fields`; the weights need only
    the names (the import core moves the tensors and checks the tied copies)."""

    model_type: ClassVar[str]
    title: ClassVar[str]  # how the refusal of an unknown model type names the family
    required: ClassVar[tuple[str, ...]]  # config.json keys without which it is no complete config
    sizes: ClassVar[dict[str, str]]  # config.json key -> our field, read as a positive integer; keys of one field agree
    other_keys: ClassVar[dict[str, str]] = {}  # our field -> the config.json key behind it, beyond `sizes`
    part_keys: ClassVar[dict[str, str]]  # a part of the model's memory (config.memory_parts) -> the keys sizing it
    architecture: ClassVar[dict[str, Any]]  # the Seq2SeqConfig fields the family fixes

    # The source's parameter names (after `prefix`) of the embeddings, the head and the logits bias.
    prefix: ClassVar[str] = ""
    shared_embedding: ClassVar[str] = "shared.weight"
    embeddings: ClassVar[dict[str, str]] = {"encoder": "encoder.embed_tokens.weight",
                                            "decoder": "decoder.embed_tokens.weight"}
    lm_head: ClassVar[str] = "lm_head.weight"
    logits_bias: ClassVar[str | None] = None
    derived: ClassVar[tuple[str, ...]] = ()  # tensors ours rebuild (sinusoid tables): dropped, the proof checks them
    renames: ClassVar[tuple[tuple[str, str], ...]]  # (pattern matching a name's start, its replacement): re.sub
    tokenizer_files: ClassVar[tuple[str, ...]]
    # transformers' model class of the family when a model type registered with transformers under another name
    # reads as this family too (its model class a subclass of this one); None: only `model_type` reads as it.
    transformers_class: ClassVar[str | None] = None
    # Our parameters (a pattern matching a name's start) the source does not store because they are zero: filled
    # with zeros (Whisper's k_proj has no bias). None: every parameter comes from the source.
    zero_biases: ClassVar[str | None] = None
    # Generation settings the family reads itself (`speech_settings`), not checked by the generic reading.
    generation_keys: ClassVar[tuple[str, ...]] = ()
    speech_settings = None  # (where, generation settings, vocab size) -> the speech record, for audio families

    def config_fields(self, src: Path, hf: dict) -> dict[str, Any]:
        """Our config's size and architecture fields from config.json (no ids, no generation settings), at least
        src_vocab_size, tgt_vocab_size and max_tgt_len, which the core checks the ids and lengths against; an option
        the family supports differently raises one ConfigError naming it."""
        raise NotImplementedError

    def read_sizes(self, config: Path, hf: dict) -> tuple[dict[str, int], list[str]]:
        """`sizes` read into our fields, and a problem for each key that disagrees with another of its field."""
        fields: dict[str, int] = {}
        first: dict[str, str] = {}
        problems = []
        for key, field in self.sizes.items():
            value = integer(config, hf, key)
            if field not in fields:
                fields[field], first[field] = value, key
            elif value != fields[field]:
                problems.append(f"{first[field]}={fields[field]} differs from {key}={value}")
        return fields, problems

    def key(self, field: str) -> str:
        """The config.json key behind our `field`, for messages in the source's own words."""
        return next((k for k, f in self.sizes.items() if f == field), None) or self.other_keys[field]

    def rename(self, name: str) -> str | None:
        """Our name for a source parameter (after `prefix`), or None when no rename applies."""
        for pattern, repl in self.renames:
            if re.match(pattern, name):
                return re.sub(pattern, repl, name, count=1)
        return None

    def tokenizer_files_in(self, src: Path) -> list[str]:
        return [name for name in self.tokenizer_files if (Path(src) / name).is_file()]


FAMILIES: dict[str, FamilyAdapter] = {}


def register(cls: type[FamilyAdapter]) -> type[FamilyAdapter]:
    """Class decorator: the adapter reads config.json files whose model_type is `cls.model_type`."""
    FAMILIES[cls.model_type] = cls()
    return cls


def adapter_for(model_type: str) -> FamilyAdapter | None:
    """The adapter reading `model_type`: its own, else (when transformers is installed and knows the type) the
    family whose transformers model class the type's class subclasses, so its layers are that family's; else None."""
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    try:
        import transformers
        from transformers import AutoConfig, AutoModelForSeq2SeqLM
    except ImportError:
        return None
    try:
        model_class = AutoModelForSeq2SeqLM._model_mapping[type(AutoConfig.for_model(model_type))]
    except (KeyError, ValueError):  # a type transformers does not know, or no seq2seq model of it
        return None
    for adapter in FAMILIES.values():
        base = getattr(transformers, adapter.transformers_class, None) if adapter.transformers_class else None
        if isinstance(model_class, type) and base is not None and issubclass(model_class, base):
            return adapter
    return None


def transformers_major() -> int:
    """The installed transformers' major version (4 or 5): the judge whose reading the import follows where the two
    read one checkpoint differently (docs/families.md). 5 when transformers is not installed, the newest reading (the
    proof then stops with a DependencyError anyway)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return int(version("transformers").split(".")[0])
    except (PackageNotFoundError, ValueError):
        return 5


def tokenizer_files(folder: Path) -> list[str]:
    """The files of any family's tokenizer in `folder` (what an import copies beside the model)."""
    names = dict.fromkeys(name for adapter in FAMILIES.values() for name in adapter.tokenizer_files)
    return [name for name in names if (Path(folder) / name).is_file()]


# Files copied with a tokenizer that hold no vocabulary (Whisper's feature extractor settings and its English text
# normalizer): a folder holding only these has no tokenizer.
NOT_VOCABULARY = ("preprocessor_config.json", "normalizer.json")


def vocabulary_files(folder: Path) -> list[str]:
    """The tokenizer files in `folder` that make a tokenizer: whether it holds one at all."""
    return [name for name in tokenizer_files(folder) if name not in NOT_VOCABULARY]


# Model types whose transformers code differs from every registered family in the layers themselves: what differs.
REFUSED = {
    "longt5": "LongT5 replaces T5's full self-attention with local or transient-global attention over blocks of the "
              "source",
    "switch_transformers": "Switch Transformers replace T5's dense FFN with routed mixture-of-experts layers",
    "t5gemma": "T5Gemma's layers are Gemma's (rotary positions, grouped-query attention, soft-capped logits), not T5's",
    "pegasus_x": "PEGASUS-X replaces Pegasus's full encoder self-attention with staggered block-local attention and "
                 "global tokens",
    "bigbird_pegasus": "BigBird-Pegasus replaces Pegasus's full encoder self-attention with block-sparse attention",
}
# What an unknown model type's refusal says the import reads, beyond the type names.
SUPPORTED_LAYERS = ("it reads an encoder-decoder whose layers are BART's (Marian, BART, mBART, M2M100/NLLB, Pegasus, "
                    "FSMT), T5's (T5, mT5, UMT5) or Whisper's under one of those model types, or a type registered "
                    "with transformers whose model class subclasses T5's, mT5's or UMT5's")

# Each module registers its adapter; this order is the order an unknown model type's refusal names them.
from seq2trt.hf_import.families import (marian, bart, mbart, m2m_100, pegasus, fsmt, t5,  # noqa: E402, F401
                                        whisper)
