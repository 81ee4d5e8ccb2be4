"""Vocabularies: a character vocabulary for sources, a word vocabulary for targets, saved as `vocab.json`.

Ids 0, 1, 2 are always pad, bos and eos, matching `Seq2SeqConfig`'s defaults.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from seq2trt.core.errors import CheckpointError, InputError

SPECIALS = ("<pad>", "<s>", "</s>")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


@dataclass(frozen=True)
class Vocab:
    tokens: tuple[str, ...]
    kind: Literal["char", "word"]

    def __post_init__(self) -> None:
        if self.tokens[:3] != SPECIALS:
            raise CheckpointError(f"a vocabulary must start with {SPECIALS}, got {self.tokens[:3]}")
        if len(set(self.tokens)) != len(self.tokens):
            raise CheckpointError("a vocabulary holds a token twice")
        object.__setattr__(self, "_index", {t: i for i, t in enumerate(self.tokens)})

    @classmethod
    def build(cls, symbols: list[str], kind: Literal["char", "word"]) -> "Vocab":
        return cls(SPECIALS + tuple(symbols), kind)

    def __len__(self) -> int:
        return len(self.tokens)

    def split(self, text: str) -> list[str]:
        return list(text) if self.kind == "char" else text.split()

    def encode(self, text: str) -> list[int]:
        """Text -> ids, without bos/eos. Unknown symbols are an `InputError` naming them."""
        pieces = self.split(text)
        unknown = sorted({p for p in pieces if p not in self._index or p in SPECIALS})
        if unknown:
            allowed = "".join(self.tokens[3:]) if self.kind == "char" else " ".join(self.tokens[3:])
            raise InputError(f"text {text!r} holds symbols outside the vocabulary: {unknown}; allowed: {allowed}")
        return [self._index[p] for p in pieces]

    def decode(self, ids) -> str:
        pieces = [self.tokens[i] for i in ids if i >= len(SPECIALS)]
        return "".join(pieces) if self.kind == "char" else " ".join(pieces)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "tokens": list(self.tokens)}

    @classmethod
    def from_dict(cls, data: dict, name: str = "vocabulary") -> "Vocab":
        """`{"kind": "char" | "word", "tokens": [str, ...]}`; anything else is a CheckpointError naming the entry."""
        if not isinstance(data, dict) or not {"kind", "tokens"} <= set(data):
            raise CheckpointError(f"{name} must be an object with 'kind' and 'tokens', got {_clip(data)}")
        if data["kind"] not in ("char", "word"):
            raise CheckpointError(f"{name}.kind must be 'char' or 'word', got {_clip(data['kind'])}")
        tokens = data["tokens"]
        if not isinstance(tokens, list):
            raise CheckpointError(f"{name}.tokens must be a list of strings, got {type(tokens).__name__}")
        bad = [i for i, t in enumerate(tokens) if not isinstance(t, str) or not t]
        if bad:
            raise CheckpointError(f"{name}.tokens must be non-empty strings; entries {bad[:5]} are not (e.g. "
                                  f"{_clip(tokens[bad[0]])})")
        return cls(tuple(tokens), data["kind"])


def _clip(value: object, n: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= n else text[:n] + "…"


def save_vocabs(path: Path, source: Vocab, target: Vocab) -> None:
    Path(path).write_text(json.dumps({"source": source.to_dict(), "target": target.to_dict()}) + "\n")


def load_vocabs(path: Path) -> tuple[Vocab, Vocab]:
    try:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise TypeError(f"a JSON object with 'source' and 'target' is expected, got {type(data).__name__}")
        return Vocab.from_dict(data["source"], "source"), Vocab.from_dict(data["target"], "target")
    except FileNotFoundError:
        raise CheckpointError(f"vocabulary {path} not found; this checkpoint has no vocab.json") from None
    except IsADirectoryError:
        raise CheckpointError(f"vocabulary {path} is a directory, not a JSON file; re-save the checkpoint") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read vocabulary {path}: {exc.strerror}") from None
    except CheckpointError as exc:
        raise CheckpointError(f"vocabulary {path} is malformed: {exc}; re-save the checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"vocabulary {path} is malformed ({exc!r}); re-save the checkpoint") from None


def pad_batch(sequences: list[list[int]], pad_id: int = PAD_ID) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad id lists into (B, L) int64 ids and a 1/0 attention mask."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise InputError("cannot batch an empty sequence; every source needs at least one token")
    length = max(len(s) for s in sequences)
    ids = np.full((len(sequences), length), pad_id, dtype=np.int64)
    mask = np.zeros((len(sequences), length), dtype=np.int64)
    for i, s in enumerate(sequences):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    return ids, mask
