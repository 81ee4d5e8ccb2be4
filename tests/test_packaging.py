"""The wheel holds every package folder on disk as seq2trt.<folder> (api/ as `seq2trt` itself), and no generic
top-level module."""

import ast
import tomllib
from importlib.metadata import distribution
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = ["core", "reference_model", "hf_import", "exporters", "plugins", "runtime", "validation", "serving", "cli",
             "hf", "api"]
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


# The layering, lowest first: a module may import its own layer and those below it, never one above (imports inside
# functions included). core/ (errors, layout, atomic files, dtypes) is the floor and imports no other package; the
# Hugging Face import stands on the model alone (the model never imports it); api/ (`seq2trt`) and hf/ sit above
# serving/ and below cli/.
LAYERS = ["core", "reference_model", "hf_import", "plugins", "exporters", "runtime", "validation", "serving", "api", "hf",
          "cli"]


def layer_of_module(name: str) -> int | None:
    if name == "seq2trt":
        return LAYERS.index("api")
    if not name.startswith("seq2trt."):
        return None
    top = name.split(".")[1]
    return LAYERS.index(top) if top in LAYERS else LAYERS.index("api")


def imported_modules(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def upward_imports(folder: str, root: Path = ROOT) -> list[str]:
    own = LAYERS.index(folder)
    bad = []
    for path in sorted((root / folder).rglob("*.py")):
        for line, name in imported_modules(path):
            layer = layer_of_module(name)
            if layer is not None and layer > own:
                bad.append(f"{path.relative_to(root)}:{line} imports {name} ({LAYERS[layer]} is above {folder})")
    return bad


def test_no_package_imports_a_layer_above_it():
    bad = [line for folder in LAYERS for line in upward_imports(folder)]
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_the_layering_check_catches_an_upward_import(tmp_path):
    """The check itself can fail: a reference_model module importing the runtime is reported."""
    fake = tmp_path / "reference_model"
    fake.mkdir()
    (fake / "bad.py").write_text("def f():\n    from seq2trt.runtime import registry\n")
    assert upward_imports("reference_model", tmp_path) == [
        "reference_model/bad.py:2 imports seq2trt.runtime (runtime is above reference_model)"]
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "bad.py").write_text("from seq2trt.reference_model.config import preset\n")
    assert upward_imports("core", tmp_path) == [
        "core/bad.py:1 imports seq2trt.reference_model.config (reference_model is above core)"]


def test_relative_imports_are_not_used():
    """Every import names its package (seq2trt.<layer>...), so the layering above sees all of them."""
    rel = [f"{p.relative_to(ROOT)}:{n.lineno}" for top in TOP_LEVEL for p in (ROOT / top).rglob("*.py")
           for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ImportFrom) and n.level]
    assert not rel, rel


def _module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Library module -> the library modules it imports (inside functions too). A package's __init__ importing its
    own submodules (a registry filling itself) is not counted: the submodules may import the package."""
    modules = {}
    for top in TOP_LEVEL:
        for path in (root / top).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_init = parts[-1] == "__init__"
            parts = parts[:-1] if is_init else parts
            modules[".".join([package_name(parts[0]), *parts[1:]])] = (path, is_init)
    graph = {}
    for name, (path, is_init) in modules.items():
        found = set()
        for _line, imported in imported_modules(path):
            found.add(imported)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found |= {f"{node.module}.{alias.name}" for alias in node.names}
        graph[name] = {m for m in found if m in modules and m != name
                       and not (is_init and m.startswith(name + "."))}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    assert import_cycles(_module_graph()) == []
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check can fail
