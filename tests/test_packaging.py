"""The wheel holds every package folder on disk as seq2trt.<folder> (api/ as `seq2trt` itself), and no generic
top-level module."""

import ast
import tomllib
from importlib.metadata import distribution
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = ["reference_model", "exporters", "plugins", "validation", "cli", "hf", "api"]
PACKAGE_OF = {"api": "seq2trt"}  # folder -> package, where it is not seq2trt.<folder>


def package_name(folder: str) -> str:
    return PACKAGE_OF.get(folder, f"seq2trt.{folder}")


def packages_on_disk() -> set[str]:
    found = set()
    for top in TOP_LEVEL:
        for init in (ROOT / top).rglob("__init__.py"):
            if "__pycache__" not in init.parts:
                folder, *rest = init.parent.relative_to(ROOT).parts
                found.add(".".join([package_name(folder), *rest]))
    return found


def test_pyproject_lists_every_package_folder():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(config["packages"]) == packages_on_disk()
    for top in TOP_LEVEL:
        assert config["package-dir"][package_name(top)] == top
    assert "py.typed" in config["package-data"]["seq2trt"] and (ROOT / "api" / "py.typed").is_file()


def test_installed_distribution_has_no_generic_top_level_names():
    dist = distribution("seq2trt")
    top = (dist.read_text("top_level.txt") or "").split()
    assert not set(top) & set(TOP_LEVEL), f"generic top-level modules installed: {top}"
    import seq2trt.cli.main  # noqa: F401  the console script's module is importable under the package name
    import seq2trt

    # the package itself is api/ (an editable install points at it, a wheel holds a copy of it)
    assert Path(seq2trt.__file__).read_bytes() == (ROOT / "api" / "__init__.py").read_bytes()
    assert all(getattr(seq2trt, name) is not None for name in seq2trt.__all__)


def test_the_library_layers_never_import_the_cli():
    """api/ and hf/ sit above validation/ and below cli/: the CLI may call them, never the reverse."""
    for folder in ("api", "hf"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                assert not any(n == "seq2trt.cli" or n.startswith("seq2trt.cli.") for n in names), (path, names)
