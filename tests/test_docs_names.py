"""Every name the documentation points at exists: a dotted name (`seq2trt.runtime.registry.DECODE_BACKENDS`, or the
short `decode_jobs.open_decoder` / `reference_model/decoding.GNMT_ALPHA` forms) imports and resolves to an attribute,
and a repository path (`validation/ties.py`, `tests/serving`) is a file or folder. Read: README.md, docs/*.md,
benchmarks/README.md, and every docstring and string constant of the library, scripts and benchmark scripts (a string
constant can be printed into a report, as "validation.beam_ties" once was). A rename that leaves a doc behind fails
here; the planted names below show the check can fail.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from functools import lru_cache
from pathlib import Path

import pytest

import seq2trt

ROOT = Path(__file__).resolve().parents[1]
# The folders that install as seq2trt's packages (pyproject's package-dir), and those that only hold files.
PACKAGES = {"api": "seq2trt", "core": "seq2trt.core", "reference_model": "seq2trt.reference_model",
            "hf_import": "seq2trt.hf_import",
            "plugins": "seq2trt.plugins", "exporters": "seq2trt.exporters", "runtime": "seq2trt.runtime",
            "validation": "seq2trt.validation", "serving": "seq2trt.serving", "cli": "seq2trt.cli", "hf": "seq2trt.hf"}
FOLDERS = (*PACKAGES, "tests", "scripts", "benchmarks", "docs", ".ci")
# A name followed by one of these is a file name ("manifest.json", "spec.py"), not an attribute.
FILE_SUFFIXES = {"py", "json", "jsonl", "md", "onnx", "plan", "html", "png", "txt", "sh", "toml", "wav", "flac",
                 "ogg", "safetensors", "pt", "bin", "model", "yaml", "pbtxt", "data", "lock", "csv", "srt", "vtt",
                 "partial", "old", "tmp"}

SEQ2TRT_NAME = re.compile(r"(?<![\w.])seq2trt(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"(?<![\w./<-])(?:" + "|".join(re.escape(f) for f in FOLDERS) + r")/[\w./-]*")
LINK = re.compile(r"\]\((?!https?:|#|mailto:)([^)#\s]+)")  # a Markdown link to a file beside the document
SHORT_NAME = re.compile(r"(?<![\w./])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")  # a.b(.c), read from its start
# Module names that the docs mostly use as variables ("model.generate", "settings.plain"): a short name starting
# with one is not checked (the seq2trt.-prefixed and path forms still are).
VARIABLES = {"model", "settings", "sampling", "translator", "whisper", "child"}
# Libraries that a seq2trt module is also named after (runtime/backends/onnxruntime.py, tensorrt.py): their dotted
# names (`onnxruntime.quantization.quantize_dynamic`) are the library's, not ours.
LIBRARIES = {"onnxruntime", "tensorrt", "tensorrt_rtx", "ctranslate2", "transformers", "optimum", "triton", "torch"}


@lru_cache(maxsize=None)
def modules() -> dict[str, list[str]]:
    """Each seq2trt module's and package's last name -> their full names."""
    found: dict[str, list[str]] = {}
    for full in PACKAGES.values():
        found.setdefault(full.rsplit(".", 1)[-1], []).append(full)
        for info in pkgutil.walk_packages(importlib.import_module(full).__path__, f"{full}."):
            found.setdefault(info.name.rsplit(".", 1)[1], []).append(info.name)
    return {name: sorted(set(homes)) for name, homes in found.items()}


def resolves(module: str, attrs: list[str]) -> bool:
    """Whether `module` imports and `attrs` lead to an attribute of it (a submodule counts)."""
    try:
        value = importlib.import_module(module)
    except ImportError:
        return False
    for n, attr in enumerate(attrs):
        if attr in FILE_SUFFIXES:
            return True
        if not hasattr(value, attr):
            try:
                value = importlib.import_module(f"{module}.{'.'.join(attrs[:n + 1])}")
                continue
            except ImportError:
                return False
        value = getattr(value, attr)
    return True


def seq2trt_name_ok(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):  # the longest prefix that imports, then attributes
        try:
            importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        return resolves(".".join(parts[:cut]), parts[cut:])
    return False


def path_ok(text: str) -> bool:
    """A repository path, exactly or as `folder/module.attr...` (the attribute of that module)."""
    text = text.rstrip(".,;:/-") or text
    if (ROOT / text).exists() or (ROOT / text.split("/", 1)[0]).is_file():
        return True
    folder, _, rest = text.rpartition("/")
    stem, *attrs = rest.split(".")
    module = ROOT / folder / f"{stem}.py"
    package = ROOT / folder / stem / "__init__.py"
    if not attrs or not (module.is_file() or package.is_file()) or folder.split("/")[0] not in PACKAGES:
        return False
    top, *inner = folder.split("/")
    return resolves(".".join([PACKAGES[top], *inner, stem]), attrs)


def short_name_ok(name: str) -> bool | None:
    """`module.attr` where `module` is one seq2trt module's last name: whether it resolves; None when the first
    part names no seq2trt module (a variable, another library) or several."""
    first, *attrs = name.split(".")
    homes = modules().get(first, [])
    if len(homes) != 1 or first in VARIABLES or first in LIBRARIES:
        return None
    return resolves(homes[0], attrs)


def bad_names(text: str, folder: Path = ROOT) -> list[str]:
    """The names in `text` that do not resolve; Markdown links are read from `folder`, the document's."""
    bad = [link for link in LINK.findall(text) if not (folder / link).exists()]
    bad += [n for n in SEQ2TRT_NAME.findall(text) if not seq2trt_name_ok(n)]
    bad += [p for p in PATH.findall(text) if not path_ok(p)]
    bad += [n for n in SHORT_NAME.findall(text) if short_name_ok(n) is False]
    return bad


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]


def code_files() -> list[Path]:
    return sorted(p for folder in (*PACKAGES, "scripts", "benchmarks") for p in (ROOT / folder).rglob("*.py"))


def strings(path: Path) -> list[str]:
    """The prose of a Python file: its docstrings and the texts it prints or writes (string constants holding a
    space; one without is a key or an identifier, such as the ONNX domain "seq2trt.marked")."""
    tree = ast.parse(path.read_text(), str(path))
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and " " in node.value]


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_documents_name_what_exists(path):
    assert bad_names(path.read_text(), path.parent) == [], f"{path.relative_to(ROOT)} names what does not exist"


def test_code_strings_name_what_exists():
    bad = {str(p.relative_to(ROOT)): found for p in code_files() if (found := bad_names("\n".join(strings(p))))}
    assert bad == {}


@pytest.mark.parametrize("planted", ["seq2trt.runtime.registry.NO_SUCH_TABLE", "seq2trt.no_such_module.x",
                                     "validation/no_such_file.py", "reference_model/decoding.NO_SUCH_DEFAULT",
                                     "`decode_jobs.no_such_function`", "`validation.beam_ties`",
                                     "[the guide](docs/no_such_guide.md)"])
def test_a_planted_stale_name_is_caught(planted):
    assert bad_names(f"See {planted} for details.") != []


@pytest.mark.parametrize("good", ["seq2trt.runtime.registry.DECODE_BACKENDS", "seq2trt.Translator",
                                  "validation/ties.py:12", "reference_model/decoding.GNMT_ALPHA",
                                  "`decode_jobs.open_decoder`", "tests/serving", "the `manifest.json` file",
                                  "`model.cfg` of a variable", "settings.plain", "OUT/fused/ort/encoder.onnx", "[design](docs/design.md)",
                                  "[benchmarks](benchmarks/README.md#gpu-the-h200-test-machine)", "[web](https://x.org/a)"])
def test_existing_names_pass(good):
    assert bad_names(f"See {good} for details.") == []
