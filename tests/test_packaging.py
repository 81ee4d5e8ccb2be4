"""The wheel holds every package folder on disk as seq2trt.<folder>, and no generic top-level module."""

import tomllib
from importlib.metadata import distribution
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = ["reference_model", "exporters", "plugins", "validation", "cli"]


def packages_on_disk() -> set[str]:
    found = set()
    for top in TOP_LEVEL:
        for init in (ROOT / top).rglob("__init__.py"):
            if "__pycache__" not in init.parts:
                rel = init.parent.relative_to(ROOT)
                found.add("seq2trt." + ".".join(rel.parts))
    return found


def test_pyproject_lists_every_package_folder():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert set(config["packages"]) == packages_on_disk()
    for package in config["packages"]:
        top = package.split(".")[1]
        assert config["package-dir"][f"seq2trt.{top}"] == top


def test_installed_distribution_has_no_generic_top_level_names():
    dist = distribution("seq2trt")
    top = (dist.read_text("top_level.txt") or "").split()
    assert not set(top) & set(TOP_LEVEL), f"generic top-level modules installed: {top}"
    import seq2trt.cli.main  # noqa: F401  the console script's module is importable under the package name
