"""Model configuration of the reference encoder-decoder Transformer (Vaswani et al., 2017).

A frozen dataclass saved as `config.json` beside the weights and rebuilt with `Seq2SeqConfig(**json)`.
The presets follow the paper: `base` is Table 3's base model (512/2048/8 heads/6+6), `big` its big model.

Every default is the paper's model. The other values of the architecture fields describe the Hugging Face families
built the same way (Marian, BART, mBART, M2M100/NLLB) and T5's (Raffel et al., 2020: RMSNorm, a gated FFN, a
bucketed relative position bias instead of a position table, heads x d_kv not d_model): a model family is a config,
not a class (`hf_import.importer` maps their configs onto this one).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any, Literal

from seq2trt.core.errors import ConfigError


class AttentionKind(IntEnum):
    """The three uses of attention in the model (each attention block knows its own); also the fused op's `kind`
    attribute (plugins.op). Here, with the config, so that the op's definition needs no torch to be imported."""
    ENCODER_SELF = 0  # padded self-attention over the source
    DECODER_SELF = 1  # causal self-attention; appends the new K/V to the past and returns the present
    CROSS = 2  # attention on the precomputed cross K/V of the source


Activation = Literal["relu", "gelu", "gelu_tanh", "silu"]
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")  # gelu is the exact (erf) GELU; gelu_tanh its tanh approximation
# How positions are encoded. sinusoid: the paper's table, sin and cos interleaved (3.5); sinusoid_halves: the same
# frequencies 10000^(-2i/d) with all sines first, then all cosines (Marian); sinusoid_fairseq: sines then cosines
# with frequencies 10000^(-i/(d/2 - 1)) (fairseq, M2M100/NLLB); learned: one trained table per stack (BART, mBART).
# none: no table (T5's positions are only its relative position bias).
Positions = Literal["sinusoid", "sinusoid_halves", "sinusoid_fairseq", "learned", "none"]
POSITIONS = ("sinusoid", "sinusoid_halves", "sinusoid_fairseq", "learned", "none")
# layer: LayerNorm (the paper); rms: T5's RMSNorm, w * x / sqrt(mean(x^2) + eps) with no mean and no bias.
Norm = Literal["layer", "rms"]
NORMS = ("layer", "rms")
# The bucketed relative position bias of T5 in self-attention (cross-attention has none): none; shared: the table
# of layer 0 serves every layer of its stack (T5, mT5); per_layer: every self-attention layer has its own (UMT5).
RelativeBias = Literal["none", "shared", "per_layer"]
RELATIVE_BIASES = ("none", "shared", "per_layer")


@dataclass(frozen=True)
class Seq2SeqConfig:
    src_vocab_size: int = 32000
    tgt_vocab_size: int = 32000
    d_model: int = 512  # the paper's base width
    num_heads: int = 8  # d_model / heads = 64 per head, as in the paper
    d_kv: int | None = None  # the width of one head (the paper's d_k = d_v); None: d_model / num_heads, as there
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    d_ff: int = 2048  # 4 x d_model, the paper's inner FFN size
    dropout: float = 0.1  # the paper's P_drop for the base model
    max_src_len: int = 256  # positions the encoder accepts, eos included
    max_tgt_len: int = 256  # positions the decoder accepts, bos included
    activation: Activation = "relu"  # the paper's FFN: max(0, xW1 + b1)W2 + b2
    gated_ffn: bool = False  # the paper's FFN; True: W2(act(x W1) * x W1') (T5 v1.1's gated GELU)
    norm: Norm = "layer"  # the paper's LayerNorm
    pre_norm: bool = False  # the paper is post-LN: LayerNorm(x + Sublayer(x))
    scale_embeddings: bool = True  # the paper multiplies embeddings by sqrt(d_model)
    tie_embeddings: bool = True  # target embedding shared with the output projection (paper, 3.4)
    share_vocab: bool = False  # source embedding shared too; needs one vocabulary for both sides
    layer_norm_eps: float = 1e-5  # torch's default
    positions: Positions = "sinusoid"  # the paper's interleaved sinusoid table
    position_offset: int = 0  # position p reads row p + offset of its table (BART and M2M100 use 2)
    pad_position_zero: bool = False  # a pad token gets no position vector (fairseq's table has a zero pad row: M2M100)
    embed_norm: bool = False  # a LayerNorm right after embeddings + positions in each stack (BART, mBART)
    logits_bias: bool = False  # a bias added to the output logits (Marian's and BART's final_logits_bias)
    bias: bool = True  # attention and FFN projections with biases (the paper); tutorial models often have none
    scale_attention: bool = True  # scores q k^T / sqrt(d_k), the paper's (3.2.1); T5 has no scaling
    scale_logits: bool = False  # the decoder output times d_model^-0.5 before the output projection (tied T5)
    relative_bias: RelativeBias = "none"  # the paper has absolute positions only
    relative_buckets: int = 32  # buckets of the relative bias (T5's default): half exact, half log-spaced
    relative_max_distance: int = 128  # distances from here on share the last bucket (T5's default)
    # The source kind. 0: token ids through src_embed (every text model); > 0: log-mel audio features with this many
    # bins, read by Whisper's convolutional front end (two Conv1d + GELU, the second of stride 2), so the encoder
    # takes exactly 2 x max_src_len frames and its positions are a stored table of max_src_len rows.
    n_mels: int = 0
    pad_id: int = 0
    bos_id: int = 1  # the decoder's first input token (Hugging Face's decoder_start_token_id)
    eos_id: int = 2
    # Decoding rules that come with a model (Hugging Face's generation settings), applied by every search:
    forced_bos_id: int | None = None  # the first generated token is forced to this id (mBART/NLLB language codes)
    forced_eos: bool = False  # the last token allowed by the length limit is forced to eos
    suppress_ids: tuple[int, ...] = ()  # never generated (Marian never emits its pad id)
    begin_suppress_ids: tuple[int, ...] = ()  # not generated as the first token after the prompt (Whisper)
    # The model's own limit on generated tokens, eos included (Hugging Face's max_new_tokens, or max_length - 1):
    # the default of every search. None: every position the decoder has.
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        # JSON has no tuples: config.json gives suppress_ids back as a list.
        for name in ("suppress_ids", "begin_suppress_ids"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        problems = self._type_problems()
        if problems:
            raise ConfigError("invalid model config: " + "; ".join(problems))
        problems = self._value_problems()
        if not problems:
            problems = self._id_problems()
        if problems:
            raise ConfigError("invalid model config: " + "; ".join(problems))

    def _value_problems(self) -> list[str]:
        """Every size, rate and choice outside its range or its set, named."""
        problems = []
        for name in ("src_vocab_size", "tgt_vocab_size", "d_model", "num_heads", "num_encoder_layers",
                     "num_decoder_layers", "d_ff", "max_src_len", "max_tgt_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if self.d_kv is not None and (not isinstance(self.d_kv, int) or self.d_kv < 1):
            problems.append(f"d_kv must be null or a positive integer, got {self.d_kv!r}")
        if not problems and self.d_kv is None and self.d_model % self.num_heads:
            problems.append(f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads}), "
                            "or d_kv set")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout!r}")
        if self.activation not in ACTIVATIONS:
            problems.append(f"activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")
        if self.positions not in POSITIONS:
            problems.append(f"positions must be one of {', '.join(POSITIONS)}, got {self.positions!r}")
        if self.norm not in NORMS:
            problems.append(f"norm must be one of {', '.join(NORMS)}, got {self.norm!r}")
        if self.relative_bias not in RELATIVE_BIASES:
            problems.append(f"relative_bias must be one of {', '.join(RELATIVE_BIASES)}, got {self.relative_bias!r}")
        # The log-spaced half needs at least one exact bucket per direction and a max_distance beyond the exact ones.
        if self.relative_buckets < 4:
            problems.append(f"relative_buckets must be >= 4, got {self.relative_buckets}")
        elif self.relative_max_distance <= self.relative_buckets // 2:
            problems.append(f"relative_max_distance must be > relative_buckets / 2 ({self.relative_buckets // 2}), "
                            f"got {self.relative_max_distance}")
        if not isinstance(self.n_mels, int) or self.n_mels < 0:
            problems.append(f"n_mels must be 0 (token ids) or a positive number of mel bins, got {self.n_mels!r}")
        elif self.n_mels and self.positions != "learned":
            problems.append(f"an audio source (n_mels {self.n_mels}) reads a stored encoder position table: "
                            f"positions must be learned, got {self.positions!r}")
        if self.position_offset < 0:
            problems.append(f"position_offset must be >= 0, got {self.position_offset}")
        if not self.layer_norm_eps > 0:
            problems.append(f"layer_norm_eps must be > 0, got {self.layer_norm_eps!r}")
        if self.share_vocab and self.src_vocab_size != self.tgt_vocab_size:
            problems.append(f"share_vocab needs src_vocab_size == tgt_vocab_size, "
                            f"got {self.src_vocab_size} and {self.tgt_vocab_size}")
        return problems

    def _id_problems(self) -> list[str]:
        """Every special id that is no valid id of its vocabulary, or that contradicts another (once the sizes are
        valid)."""
        problems = []
        ids = {"pad_id": self.pad_id, "bos_id": self.bos_id, "eos_id": self.eos_id}
        for name, value in ids.items():
            if not 0 <= value < min(self.src_vocab_size, self.tgt_vocab_size):
                problems.append(f"{name} ({value}) must be a valid id in both vocabularies")
        # bos may equal pad (Marian starts decoding with its pad id) or eos (BART starts with eos). An audio
        # source is never padded with ids, so there pad may be eos (Whisper's pad is its <|endoftext|>).
        if self.pad_id == self.eos_id and not self.n_mels:
            problems.append(f"pad_id and eos_id must differ, got {ids}")
        for name, value in (("forced_bos_id", self.forced_bos_id), *(("suppress_ids", i) for i in self.suppress_ids),
                            *(("begin_suppress_ids", i) for i in self.begin_suppress_ids)):
            if value is not None and not 0 <= value < self.tgt_vocab_size:
                problems.append(f"{name} ({value}) must be a valid target id")
        if self.max_new_tokens is not None and not 1 <= self.max_new_tokens <= self.max_tgt_len - 1:
            problems.append(f"max_new_tokens must be null or in [1, {self.max_tgt_len - 1}] (max_tgt_len - 1), "
                            f"got {self.max_new_tokens}")
        if self.eos_id in self.suppress_ids:
            problems.append(f"suppress_ids must not hold eos_id ({self.eos_id}): nothing could end")
        return problems

    def _type_problems(self) -> list[str]:
        """Every field whose value has the wrong JSON type, named (checked before any comparison)."""
        problems = []
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), _FIELD_TYPES.get(f.name)
            if f.name in ("forced_bos_id", "max_new_tokens", "d_kv") and value is None:
                continue
            if f.name in ("suppress_ids", "begin_suppress_ids"):
                ok = isinstance(value, tuple) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
            elif kind is bool:
                ok = isinstance(value, bool)
            elif kind is int:
                ok = isinstance(value, int) and not isinstance(value, bool)
            elif kind is float:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            else:
                ok = isinstance(value, str)
            if not ok:
                problems.append(f"{f.name} must be {_TYPE_WORDS[f.name]}, got {value!r}")
        return problems

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads if self.d_kv is None else self.d_kv

    @property
    def inner_dim(self) -> int:
        """Width of the attention's projected queries, keys and values: heads x head_dim (d_model in the paper)."""
        return self.num_heads * self.head_dim

    @property
    def audio(self) -> bool:
        """Whether the encoder reads log-mel features (`n_mels` > 0) rather than token ids."""
        return self.n_mels > 0

    @property
    def source_frames(self) -> int:
        """Feature frames an audio encoder takes: its front end halves them into max_src_len positions."""
        return 2 * self.max_src_len

    @property
    def max_positions(self) -> int:
        """Rows a position table needs: every position either stack accepts."""
        return max(self.max_src_len, self.max_tgt_len)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Seq2SeqConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}; known keys are {sorted(known)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(f"invalid model config: {exc}") from None

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> "Seq2SeqConfig":
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {path} is not valid JSON ({exc}); re-save the checkpoint") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a JSON object, got {type(data).__name__}")
        return cls.from_dict(data)


# Fields added with the Hugging Face families (2026-11-30). Their defaults are what every earlier config meant,
# so records written before them (export manifests) may lack them; every other field must be present.
LATER_FIELDS = ("positions", "position_offset", "pad_position_zero", "embed_norm", "logits_bias", "bias",
                "forced_bos_id", "forced_eos", "suppress_ids", "max_new_tokens",
                # and with T5's
                "d_kv", "gated_ffn", "norm", "scale_attention", "scale_logits", "relative_bias", "relative_buckets",
                "relative_max_distance",
                # and with Whisper's
                "n_mels", "begin_suppress_ids")

_FIELD_TYPES = {"dropout": float, "layer_norm_eps": float, "activation": str, "positions": str, "norm": str,
                "relative_bias": str, "pre_norm": bool, "scale_embeddings": bool, "tie_embeddings": bool,
                "share_vocab": bool, "embed_norm": bool, "logits_bias": bool, "pad_position_zero": bool, "bias": bool,
                "forced_eos": bool, "gated_ffn": bool, "scale_attention": bool, "scale_logits": bool,
                "suppress_ids": tuple, "begin_suppress_ids": tuple}
_FIELD_TYPES.update({f.name: int for f in dataclasses.fields(Seq2SeqConfig) if f.name not in _FIELD_TYPES})
_TYPE_WORDS = {name: {float: "a finite number", bool: "true or false", str: "a string", int: "an integer",
                      tuple: "a list of integers"}[kind] for name, kind in _FIELD_TYPES.items()}
_TYPE_WORDS["forced_bos_id"] = _TYPE_WORDS["max_new_tokens"] = _TYPE_WORDS["d_kv"] = "an integer or null"


def memory_parts(cfg: Seq2SeqConfig) -> dict[str, int]:
    """Bytes the eager model of `cfg` allocates (fp32 weights; a sinusoid table is built in float64 first), by part:
    what a size check names when a config asks for more memory than the machine has. Biases are counted whether
    the config has them or not, and a relative bias table in every layer."""
    d, ff, inner = cfg.d_model, cfg.d_ff, cfg.inner_dim
    tables = 1 + (not cfg.share_vocab) + (not cfg.tie_embeddings)
    rows = cfg.max_positions + cfg.position_offset
    positions = {"learned": 4 * 2 * rows * d, "none": 0}.get(cfg.positions, 12 * rows * d)
    ffn = (2 + cfg.gated_ffn) * d * ff + (1 + cfg.gated_ffn) * ff + d
    relative = cfg.relative_buckets * cfg.num_heads if cfg.relative_bias != "none" else 0
    frontend = 3 * d * (cfg.n_mels + d) + 2 * d if cfg.n_mels else 0
    return {"embeddings": 4 * (tables * cfg.tgt_vocab_size * d + cfg.tgt_vocab_size),
            "positions": positions,
            "encoder": 4 * cfg.num_encoder_layers * (4 * d * inner + 3 * inner + d + ffn + 4 * d + relative)
            + 4 * frontend,
            "decoder": 4 * cfg.num_decoder_layers * (8 * d * inner + 6 * inner + 2 * d + ffn + 6 * d + relative)}


def beam_bytes(cfg: Seq2SeqConfig) -> int:
    """Bytes one beam of a search holds at most: float32 logits and scores over the vocabulary (4 copies) and the
    decoder's self- and cross-attention K/V at full length."""
    return 4 * (4 * cfg.tgt_vocab_size + 2 * cfg.num_decoder_layers * 2 * cfg.max_positions * cfg.d_model)


def physical_memory() -> int:
    """The machine's memory in bytes."""
    import os

    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


PRESETS: dict[str, dict[str, Any]] = {
    # Small enough to build and export in a test in well under a second.
    "tiny": dict(d_model=32, num_heads=4, num_encoder_layers=2, num_decoder_layers=2, d_ff=64,
                 max_src_len=32, max_tgt_len=32, dropout=0.0),
    # The demo model: 3+3 layers at d256, learns the demo task in about two minutes on 2 CPU cores.
    "demo": dict(d_model=256, num_heads=4, num_encoder_layers=3, num_decoder_layers=3, d_ff=1024,
                 max_src_len=64, max_tgt_len=64, dropout=0.0),
    "base": dict(d_model=512, num_heads=8, num_encoder_layers=6, num_decoder_layers=6, d_ff=2048,
                 max_src_len=256, max_tgt_len=256, dropout=0.1),
    "big": dict(d_model=1024, num_heads=16, num_encoder_layers=6, num_decoder_layers=6, d_ff=4096,
                max_src_len=256, max_tgt_len=256, dropout=0.3),
}


def preset(name: str, **overrides: Any) -> Seq2SeqConfig:
    """The named preset with `overrides` (vocabulary sizes, special ids, ...) applied."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return Seq2SeqConfig.from_dict({**PRESETS[name], **overrides})
