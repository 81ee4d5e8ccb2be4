"""`manifest.json` of an artifact directory: what was exported, how, with what tools, and the sha256 of
every file, so later stages can refuse a tampered or half-copied directory (docs/design.md, "The artifact directory").
"""

from __future__ import annotations

import dataclasses
import datetime
import contextlib
import hashlib
import json
import platform
import uuid
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Iterator

from seq2trt.reference_model.config import LATER_FIELDS, Seq2SeqConfig
from seq2trt.core.errors import ArtifactError
from seq2trt.core.atomic_files import atomic_write_text, sha256_file
from seq2trt.core.swap import recover_tree, replacements_paused

from seq2trt.exporters import spec
from seq2trt.exporters.graph_files import data_name
from seq2trt.core.layout import MANIFEST



def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def write_manifest(out: Path, cfg: Seq2SeqConfig, settings: dict[str, Any], files: list[str],
                   source: dict | None = None) -> Path:
    """Hash `files` (relative to `out`) and write `out/manifest.json` atomically."""
    out = Path(out)
    manifest = {
        "seq2trt_version": _version("seq2trt"),
        "spec_revision": spec.SPEC_REVISION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": cfg.to_dict(),
        "dtype": settings["dtype"],
        "opset": settings["opset"],
        "settings": settings,
        "source": source,
        "tools": {"python": platform.python_version(), **{p: _version(p) for p in ("torch", "onnx", "onnxscript")}},
        "files": {name: {"sha256": sha256_file(out / name), "bytes": (out / name).stat().st_size} for name in files},
        "generation": uuid.uuid4().hex,  # this export and no other: readers compare it before they write (generation)
    }
    manifest["checksum"] = _checksum(manifest)
    path = out / MANIFEST
    atomic_write_text(path, json.dumps(manifest, indent=2) + "\n")
    return path


def _checksum(data: dict) -> str:
    """sha256 of the manifest's content without its own checksum: a hand edit (limits, config, a file's hash) shows."""
    body = {k: v for k, v in data.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def generation(out: Path) -> str | None:
    """The sha256 of `out`'s manifest.json as it is now, or None without one. Every export writes a new one (a fresh
    id, its time, its files' hashes): a reader takes it when it starts and hands it to `writing_into`."""
    try:
        return sha256_file(Path(out) / MANIFEST)
    except (FileNotFoundError, NotADirectoryError):
        return None


@contextlib.contextmanager
def writing_into(out: Path, started: str | None, what: str) -> Iterator[None]:
    """Write a reader's results (validate, bench, report) into the export `out` only if it is still the export the
    reader started on (`started`: its `generation`); replacements of `out` wait until the write is done. An
    export replaced meanwhile (`export --force` in another shell) is an ArtifactError, and nothing is written:
    the results describe graphs that are gone."""
    with replacements_paused(out):
        if generation(out) != started:
            raise ArtifactError(f"{out} was replaced while {what} ran (its manifest.json changed); the results "
                                f"describe the previous export and were not written; run `seq2trt {what} {out}` "
                                "again")
        yield


@dataclass(frozen=True)
class Manifest:
    root: Path
    data: dict[str, Any]

    @property
    def config(self) -> Seq2SeqConfig:
        return Seq2SeqConfig.from_dict(self.data["config"])

    @property
    def dtype(self) -> str:
        return self.data["dtype"]

    @property
    def limits(self) -> spec.Limits:
        return spec.Limits(**self.data["settings"]["limits"])

    def path(self, name: str) -> Path:
        return self.root / name


def read_manifest(out: Path) -> Manifest:
    recover_tree(out)  # a replacement of this export or of a folder in it that a killed run left half done
    path = Path(out) / MANIFEST
    if not path.exists():
        raise ArtifactError(f"{path} not found; {out} is not an export directory (run `seq2trt export` first)")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path} is not valid JSON ({exc}); re-run `seq2trt export --force`") from None
    if not isinstance(data, dict):
        raise ArtifactError(f"{path} must hold a JSON object, got {type(data).__name__}; "
                            "re-run `seq2trt export --force`")
    missing = [k for k in ("spec_revision", "config", "dtype", "settings", "files") if k not in data]
    if missing:
        raise ArtifactError(f"{path} lacks {missing}; re-run `seq2trt export --force`")
    if data["spec_revision"] != spec.SPEC_REVISION:
        raise ArtifactError(f"{out} was exported under graph spec revision {data['spec_revision']!r}, this seq2trt "
                            f"reads revision {spec.SPEC_REVISION}; re-export it")
    problems = _schema_problems(data)
    if problems:
        raise ArtifactError(f"{path} is malformed: {'; '.join(problems)}; re-run `seq2trt export --force`")
    if "checksum" in data and data["checksum"] != _checksum(data):  # manifests before the checksum have none
        raise ArtifactError(f"{path} was changed after the export (its checksum no longer matches its content: "
                            "limits, config or file hashes edited by hand); re-run `seq2trt export --force`")
    return Manifest(Path(out), data)


def _schema_problems(data: dict) -> list[str]:
    """Every field a later stage reads, with the type it must have (config and limits are rebuilt to check them).

    Never raises on a damaged document: each damage is a message (a JSON document can hold any type anywhere)."""
    problems = []
    dtype = data["dtype"]
    if not isinstance(dtype, str) or dtype not in spec.DTYPES:
        problems.append(f"dtype {dtype!r} is not one of {list(spec.DTYPES)}")
    files = data["files"]
    if not isinstance(files, dict) or not all(
            isinstance(f, dict) and isinstance(f.get("sha256"), str) and isinstance(f.get("bytes"), int)
            for f in files.values()):
        problems.append("'files' must map each file name to its 'sha256' and 'bytes'")
    elif missing := [kind.filename for kind in spec.GraphKind if kind.filename not in files]:
        problems.append(f"'files' does not list {missing}")  # else verify(out) would check nothing
    source = data.get("source")
    if source is not None and not isinstance(source, dict):
        problems.append("'source' must be an object naming the checkpoint, or null")
    elif source is not None:
        wrong = [k for k in ("checkpoint", "weights_sha256", "task") if not isinstance(source.get(k), (str, type(None)))]
        if wrong:  # readers open source.checkpoint as a path and compare the hash as text
            problems.append(f"'source' fields {wrong} must be strings or null")
    config = data["config"]
    if not isinstance(config, dict):
        problems.append("'config' must be an object")
    else:
        missing = sorted({f.name for f in dataclasses.fields(Seq2SeqConfig)} - set(config) - set(LATER_FIELDS))
        if missing:  # the export wrote every field (but those added later); a default would describe another model
            problems.append(f"'config' lacks {missing}")
        else:
            try:
                Seq2SeqConfig.from_dict(config)
            except (TypeError, ValueError) as exc:  # ConfigError is a ValueError
                problems.append(str(exc))
    settings = data["settings"]
    limits = settings.get("limits") if isinstance(settings, dict) else None
    if not isinstance(limits, dict):
        problems.append("'settings' must hold a 'limits' object")
    else:
        try:
            parsed = spec.Limits(**limits)
            if not problems:  # the config is sound: the limits must also fit a TensorRT profile of it
                parsed.check_fits(Seq2SeqConfig.from_dict(config))
        except (TypeError, ValueError) as exc:  # unknown or missing keys are TypeErrors
            problems.append(f"'settings.limits': {exc}")
    return problems


def verify(out: Path, names: list[str] | None = None) -> Manifest:
    """Read the manifest and check the sha256 of `names` (default: every listed file); one error lists all."""
    manifest = read_manifest(out)
    files = manifest.data["files"]
    # a graph's data file is checked with its graph (graph_files: missing, truncated or another model's)
    names = list(files) if names is None else [n for name in names for n in (name, data_name(name))
                                                if n == name or n in files]
    problems = []
    for name in names:
        path = manifest.path(name)
        if name not in files:
            problems.append(f"{name} is not listed in the manifest")
        elif not path.is_file():
            problems.append(f"{name} is missing")
        elif sha256_file(path) != files[name]["sha256"]:
            problems.append(f"{name} does not match its sha256 (modified or truncated since export)")
    if problems:
        raise ArtifactError(f"{out} failed its manifest check: " + "; ".join(problems) +
                            "; re-run `seq2trt export --force`")
    return manifest


def checkpoint_folder(out: Path, manifest: Manifest, checkpoint: Path | None = None) -> Path:
    """The folder holding an export's tokenizer and generation settings: the one given, else the one it was exported
    from."""
    recorded = (manifest.data.get("source") or {}).get("checkpoint")
    return Path(checkpoint or recorded or out)
