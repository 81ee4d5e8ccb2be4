"""Model configuration of the reference encoder-decoder Transformer (Vaswani et al., 2017).

A frozen dataclass saved as `config.json` beside the weights and rebuilt with `Seq2SeqConfig(**json)`.
The presets follow the paper: `base` is Table 3's base model (512/2048/8 heads/6+6), `big` its big model.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .errors import ConfigError

Activation = Literal["relu", "gelu"]


@dataclass(frozen=True)
class Seq2SeqConfig:
    src_vocab_size: int = 32000
    tgt_vocab_size: int = 32000
    d_model: int = 512  # the paper's base width
    num_heads: int = 8  # d_model / heads = 64 per head, as in the paper
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    d_ff: int = 2048  # 4 x d_model, the paper's inner FFN size
    dropout: float = 0.1  # the paper's P_drop for the base model
    max_src_len: int = 256  # positions the encoder accepts, eos included
    max_tgt_len: int = 256  # positions the decoder accepts, bos included
    activation: Activation = "relu"  # the paper's FFN: max(0, xW1 + b1)W2 + b2
    pre_norm: bool = False  # the paper is post-LN: LayerNorm(x + Sublayer(x))
    scale_embeddings: bool = True  # the paper multiplies embeddings by sqrt(d_model)
    tie_embeddings: bool = True  # target embedding shared with the output projection (paper, 3.4)
    share_vocab: bool = False  # source embedding shared too; needs one vocabulary for both sides
    layer_norm_eps: float = 1e-5  # torch's default
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2

    def __post_init__(self) -> None:
        problems = []
        for name in ("src_vocab_size", "tgt_vocab_size", "d_model", "num_heads", "num_encoder_layers",
                     "num_decoder_layers", "d_ff", "max_src_len", "max_tgt_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if not problems and self.d_model % self.num_heads:
            problems.append(f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout!r}")
        if self.activation not in ("relu", "gelu"):
            problems.append(f"activation must be 'relu' or 'gelu', got {self.activation!r}")
        if not self.layer_norm_eps > 0:
            problems.append(f"layer_norm_eps must be > 0, got {self.layer_norm_eps!r}")
        if self.share_vocab and self.src_vocab_size != self.tgt_vocab_size:
            problems.append(f"share_vocab needs src_vocab_size == tgt_vocab_size, "
                            f"got {self.src_vocab_size} and {self.tgt_vocab_size}")
        if not problems:
            ids = {"pad_id": self.pad_id, "bos_id": self.bos_id, "eos_id": self.eos_id}
            for name, value in ids.items():
                if not 0 <= value < min(self.src_vocab_size, self.tgt_vocab_size):
                    problems.append(f"{name} ({value}) must be a valid id in both vocabularies")
            if len(set(ids.values())) != 3:
                problems.append(f"pad_id, bos_id and eos_id must differ, got {ids}")
        if problems:
            raise ConfigError("invalid model config: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

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
