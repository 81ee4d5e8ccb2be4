"""Checkpoints: `model.safetensors` + `config.json` (+ `vocab.json`), or a plain PyTorch state dict `.pt`.

`.pt` files are read with `torch.load(weights_only=True)`: a file that needs code to unpickle is refused.
Every mismatch between the weights and the config (missing or unexpected keys, wrong shapes) is collected
and raised as one `CheckpointError` that lists them all.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from collections.abc import Mapping
from typing import Callable

import torch

from seq2trt.reference_model.config import Seq2SeqConfig, memory_parts, physical_memory
from seq2trt.core.errors import CheckpointError
from seq2trt.core.swap import staged_directory
from seq2trt.reference_model.model import Seq2SeqTransformer
from seq2trt.reference_model.vocab import Vocab, load_vocabs, save_vocabs

from seq2trt.core.layout import CONFIG, GENERATION, LEGACY_WEIGHTS, METRICS, VOCAB, WEIGHTS


def _aliases(cfg: Seq2SeqConfig) -> dict[str, str]:
    """Keys that name the same tensor as another key (tied / shared embeddings): alias -> canonical."""
    aliases = {}
    if cfg.tie_embeddings:
        aliases["lm_head.weight"] = "tgt_embed.weight"
    if cfg.share_vocab:
        aliases["src_embed.weight"] = "tgt_embed.weight"
    return aliases


def canonical_state_dict(model: Seq2SeqTransformer) -> dict[str, torch.Tensor]:
    aliases = _aliases(model.cfg)
    return {k: v.detach().contiguous() for k, v in model.state_dict().items() if k not in aliases}


def is_checkpoint(folder: Path) -> bool:
    """A seq2trt checkpoint directory: its config and its weights (what `--force` may replace)."""
    return (folder / CONFIG).is_file() and any((folder / n).is_file() for n in (WEIGHTS, LEGACY_WEIGHTS))


def save_checkpoint(out: Path, model: Seq2SeqTransformer, vocabs: tuple[Vocab, Vocab] | None = None,
                    force: bool = False, extra_files: dict[str, str] | None = None,
                    extra_writer: Callable[[Path], None] | None = None, protect: tuple[Path, ...] = ()) -> Path:
    """Write a checkpoint directory atomically (refusing to replace an existing one without `force`, or anything
    but a checkpoint, or a folder holding `protect`); `extra_writer(staging_dir)` adds files of its own before the
    directory is renamed into place."""
    from safetensors.torch import save_file

    with staged_directory(out, force, "checkpoint", kind=is_checkpoint, protect=protect) as tmp:
        _save_weights(save_file, canonical_state_dict(model), tmp / WEIGHTS)
        model.cfg.save(tmp / CONFIG)
        if vocabs is not None:
            save_vocabs(tmp / VOCAB, *vocabs)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        if extra_writer is not None:
            extra_writer(tmp)
    return Path(out)


def _save_weights(save_file: Callable, state: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' writer, its I/O failures (a full disk) as the OSError they are, for the usual write error."""
    from safetensors import SafetensorError

    from seq2trt.core.atomic_files import write_error

    try:
        save_file(state, str(path), metadata={"format": "pt"})
    except SafetensorError as exc:
        code = re.search(r"\(os error (\d+)\)", str(exc))
        error = write_error(OSError(int(code.group(1)), str(exc)), path) if code else None
        if error is None:
            raise
        raise error from exc


BLOCK_BYTES = 64 * 2**20  # a checkpoint tensor is checked and copied into the model this many bytes at a time


def _pieces(state: Mapping[str, torch.Tensor], key: str):
    """(shape, (first row, rows) pieces) of one tensor in row blocks of ~64 MiB: read straight from the file from a
    `LazySafetensors`, views of a dict's tensor (a Hugging Face source's, mapped from its file by safetensors), so
    that the finiteness check's mask and the pages read are one block's, not a 2 GB embedding's."""
    if isinstance(state, LazySafetensors):
        return state.shape(key), state.row_blocks(key)
    tensor = state[key]
    rows = _block_rows(tuple(tensor.shape), BLOCK_BYTES)
    return tuple(tensor.shape), iter([(0, tensor)] if tensor.dim() < 2 else
                                     ((start, tensor[start:start + rows]) for start in range(0, len(tensor), rows)))


def _block_rows(shape: tuple[int, ...], block_bytes: int) -> int:
    """Rows of a (rows, ...) fp32 tensor in a block of `block_bytes`."""
    return max(1, block_bytes // max(1, 4 * int(torch.tensor(shape[1:]).prod())))


class LazySafetensors(Mapping):
    """A safetensors file as a read-only mapping that reads each tensor when asked (safe_open): a checkpoint is
    loaded into the model one tensor at a time (`load_state_dict_checked`), not held whole beside it."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = path
        try:
            self._file = safe_open(str(path), framework="pt")
            self._keys = list(self._file.keys())
        except Exception as exc:  # SafetensorError, OSError, ValueError: the file is not what it claims
            raise _unreadable(path, exc) from None

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        try:
            return self._file.get_tensor(key)
        except Exception as exc:
            raise _unreadable(self.path, exc) from None

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._file.get_slice(key).get_shape())

    def row_blocks(self, key: str, block_bytes: int | None = None):
        """(first row, rows) blocks of one tensor, each read when reached."""
        shape = self.shape(key)
        if len(shape) < 2:
            yield 0, self[key]
            return
        part = self._file.get_slice(key)
        rows = _block_rows(shape, block_bytes or BLOCK_BYTES)
        for start in range(0, shape[0], rows):
            try:
                block = part[start:start + rows]
            except Exception as exc:
                raise _unreadable(self.path, exc) from None
            yield start, block

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def _unreadable(path: Path, exc: BaseException) -> CheckpointError:
    return CheckpointError(f"cannot read {path}: {exc} (truncated or not a safetensors file); "
                           "re-save or re-download the checkpoint")


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise _unreadable(path, exc) from None


def _read_pt(path: Path) -> dict[str, torch.Tensor]:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"refusing {path}: it holds pickled code or objects, not plain tensors "
                              f"({first}); save a state dict with torch.save(model.state_dict(), ...)") from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}; re-save the checkpoint") from None
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{path} does not hold a state dict of tensors; "
                              "save one with torch.save(model.state_dict(), ...)")
    return obj


def _few(keys: list[str], n: int = 8) -> str:
    """At most `n` keys, then how many more (a config with 100,000 layers must not make a 70 MB message)."""
    return str(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


def load_state_dict_checked(model: Seq2SeqTransformer, state: Mapping[str, torch.Tensor], source: str) -> None:
    """Load `state` into `model`, or raise one error listing every missing, unexpected or misshapen key. Each tensor
    is read from `state` once, checked and copied, then let go (`state` may read lazily: `LazySafetensors`), so the
    weights are held twice one tensor at a time, never whole."""
    aliases = _aliases(model.cfg)
    expected = {k: v for k, v in model.state_dict().items() if k not in aliases}
    problems = []
    for alias, canonical in aliases.items():
        if alias in state and canonical in state and not torch.equal(state[alias], state[canonical]):
            problems.append(f"{alias} must equal {canonical} (tied in the config) but differs")
    keys = [k for k in state.keys() if k not in aliases]
    missing = sorted(set(expected) - set(keys))
    unexpected = sorted(set(keys) - set(expected))
    if missing:
        problems.append(f"missing keys {_few(missing)}")
    if unexpected:
        problems.append(f"unexpected keys {_few(unexpected)}")
    non_finite = []
    with torch.no_grad():
        for key in sorted(set(expected) & set(keys)):
            shape, pieces = _pieces(state, key)
            if shape != tuple(expected[key].shape):
                problems.append(f"{key}: weights have shape {shape}, config expects {tuple(expected[key].shape)}")
                continue
            for start, piece in pieces:  # a failed check raises below: the half-filled model is dropped
                if not piece.is_floating_point():
                    problems.append(f"{key}: expected a floating-point tensor, got {piece.dtype}")
                    break
                if not torch.isfinite(piece).all():
                    non_finite.append(key)
                    break
                (expected[key][start:start + len(piece)] if piece.dim() else expected[key]).copy_(piece)
            if isinstance(state, dict):
                state.pop(key, None)  # the caller's dict lets each tensor go once copied
    if non_finite:  # every output of such a model is NaN or inf: exports, engines and translations would be garbage
        shown = ", ".join(non_finite[:8]) + (f" and {len(non_finite) - 8} more" if len(non_finite) > 8 else "")
        raise CheckpointError(f"checkpoint {source} holds NaN or infinite weights in {len(non_finite)} tensor(s): "
                              f"{shown}; the training diverged or the file was damaged: retrain, or use an earlier "
                              "checkpoint")
    if problems:
        raise CheckpointError(f"checkpoint {source} does not match its config: " + "; ".join(problems) +
                              "; load the weights with the config.json they were saved with, or re-save the checkpoint")


def weights_path(path: Path) -> Path:
    """The weights file of a checkpoint directory (safetensors first), or `path` itself when it is a file."""
    path = Path(path)
    if not path.is_dir():
        return path
    weights = next((path / n for n in (WEIGHTS, LEGACY_WEIGHTS) if (path / n).exists()), None)
    if weights is None:
        raise CheckpointError(f"checkpoint directory {path} holds neither {WEIGHTS} nor {LEGACY_WEIGHTS}")
    return weights


def source_record(path: Path) -> dict:
    """What an export records of its checkpoint: path, sha256 of the weights, and the task it was trained on."""
    import json

    from seq2trt.core.atomic_files import sha256_file

    path = Path(path)
    metrics = (path if path.is_dir() else path.parent) / METRICS
    try:
        task = json.loads(metrics.read_text()).get("task") if metrics.exists() else None
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        task = None
    return {"checkpoint": str(path.resolve()), "weights_sha256": sha256_file(weights_path(path)), "task": task}


_PART_FIELDS = {"embeddings": "src_vocab_size, tgt_vocab_size, d_model", "positions": "max_src_len, max_tgt_len",
                "encoder": "num_encoder_layers, d_model, d_ff", "decoder": "num_decoder_layers, d_model, d_ff"}


def _check_fits(config: Path, cfg: Seq2SeqConfig) -> None:
    """Refuse a config the machine cannot hold before anything is allocated."""
    parts, total = memory_parts(cfg), physical_memory()
    if sum(parts.values()) > total:
        biggest = max(parts, key=parts.get)
        raise CheckpointError(f"{config} describes a model of {sum(parts.values()) / 2**30:,.0f} GiB, more than this "
                              f"machine's {total / 2**30:,.0f} GiB of memory; most of it is the {biggest} "
                              f"({_PART_FIELDS[biggest]}): check those values")


def _check_layers(config: Path, cfg: Seq2SeqConfig, state: dict[str, torch.Tensor], weights: Path) -> None:
    """The config's layer counts against the weights before the model is built (100,000 layers take minutes)."""
    for side, want in (("encoder", cfg.num_encoder_layers), ("decoder", cfg.num_decoder_layers)):
        found = {int(m.group(1)) for k in state if (m := re.match(rf"{side}_layers\.(\d+)\.", k))}
        if len(found) != want:
            raise CheckpointError(f"{config}: num_{side}_layers is {want} but {weights} holds weights for {len(found)} "
                                  f"{side} layers; load the weights with the config.json they were saved with")


def load_checkpoint(path: Path) -> tuple[Seq2SeqTransformer, tuple[Vocab, Vocab] | None]:
    """Load a checkpoint directory (or a `.safetensors` / `.pt` file with `config.json` beside it)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} not found; train one with `seq2trt train -o {path}`")
    weights, folder = weights_path(path), path if path.is_dir() else path.parent
    if not (folder / CONFIG).exists():
        raise CheckpointError(f"{folder / CONFIG} not found; a checkpoint needs its config beside the weights")
    try:
        cfg = Seq2SeqConfig.load(folder / CONFIG)
    except CheckpointError:
        raise
    except Exception as exc:  # ConfigError and friends: re-raise as a checkpoint problem with the same text
        raise CheckpointError(f"{folder / CONFIG}: {exc}") from None
    _check_fits(folder / CONFIG, cfg)
    state = _read_pt(weights) if weights.suffix in (".pt", ".pth", ".bin") else LazySafetensors(weights)
    _check_layers(folder / CONFIG, cfg, state, weights)
    model = Seq2SeqTransformer(cfg)
    load_state_dict_checked(model, state, str(weights))
    vocabs = load_vocabs(folder / VOCAB) if (folder / VOCAB).exists() else None
    if vocabs is not None and (len(vocabs[0]) != cfg.src_vocab_size or len(vocabs[1]) != cfg.tgt_vocab_size):
        raise CheckpointError(f"{folder / VOCAB} has {len(vocabs[0])}/{len(vocabs[1])} source/target tokens, "
                              f"the config {cfg.src_vocab_size}/{cfg.tgt_vocab_size}")
    return model.eval(), vocabs


def generation_config(folder: Path) -> dict | None:
    """An imported model's generation settings (num_beams, length_penalty, early_stopping, ...), or None for a model
    trained here."""
    path = Path(folder) / GENERATION
    if not path.exists():
        return None
    try:
        settings = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is malformed ({exc}); re-import the model") from None
    if not isinstance(settings, dict):
        raise CheckpointError(f"{path} holds {type(settings).__name__}, not the settings object; re-import the model")
    return settings
