"""Checked reading of a Hugging Face directory's JSON files and values: each fault is one error naming the file, the
key and the value, in the source's own key names."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

from seq2trt.core.errors import CheckpointError, ConfigError


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} not found; a Hugging Face model directory holds config.json "
                              "(as save_pretrained or a hub download writes it)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); re-save or re-download the model") from None
    except OSError as exc:
        raise unreadable(path, exc) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def unreadable(path: Path, exc: OSError) -> CheckpointError:
    if exc.errno == errno.ELOOP:
        return CheckpointError(f"{path} is a symlink loop (too many levels of symbolic links); point it at the real "
                               "file or folder")
    if exc.errno == errno.EISDIR or path.is_dir():
        return CheckpointError(f"{path} is a directory, not a file; re-save or re-download the model")
    return CheckpointError(f"cannot read {path}: {exc.strerror or exc}; check the file and its permissions")


def show(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def integer(where: Path, doc: dict, key: str, minimum: int = 1, default: Any = None,
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
    raise ConfigError(f"{where}: {key} must be {what}{' or null' if nullable else ''}, got {show(value)}; {fix}")


def flag(where: Path, doc: dict, key: str, default: bool) -> bool:
    value = doc.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: {key} must be true or false, got {show(value)}")
    return value


def token_ids(where: Path, key: str, value: Any, vocab: int, nested: bool = False) -> list:
    """A list of token ids (of non-empty id lists when `nested`: bad_words_ids), each inside the vocabulary."""
    rows = value if isinstance(value, list) else None
    if rows is not None and nested:
        words = [w if isinstance(w, list) and w else None for w in rows]
        rows = None if None in words else [i for w in words for i in w]
    if rows is None or any(not isinstance(i, int) or isinstance(i, bool) for i in rows):
        shape = "a list of token-id lists such as [[5], [7, 8]]" if nested else "a list of token ids such as [5]"
        raise ConfigError(f"{where}: {key} must be {shape}, got {show(value)}")
    bad = [i for i in rows if not 0 <= i < vocab]
    if bad:
        raise ConfigError(f"{where}: {key} holds {bad[:5]}, outside the vocabulary [0, {vocab}) (vocab_size {vocab}); "
                          "remove them or fix vocab_size")
    return value if nested else rows
