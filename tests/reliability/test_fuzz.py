"""Seeded fuzz over the files the CLI reads: every damaged input ends in a Seq2TrtError (or still works), never in
another exception.

Damage: truncation, bit flips (anywhere, or in the first bytes where the structure lives), random bytes, an empty
file, another valid graph; JSON that is invalid, misses a key, holds a value of the wrong type or is not an
object. Damaged ONNX is re-hashed into manifest.json / fusion.json, or the sha256 check would stop every case
before the parser. The stages run in process, as the CLI calls them; TensorRT builds only the fused-graph
cases (a real build takes seconds), and validation sweeps one shape case (the sweep is not what is fuzzed).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import random
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

from seq2trt.exporters import spec
from seq2trt.exporters.fuse import FUSION_JSON, Target, fuse_artifacts, fused_dir
from seq2trt.exporters.manifest import read_manifest, verify, write_manifest
from seq2trt.exporters.tensorrt_engines import BUILD_JSON, EngineRequest, build_engines, read_build
from seq2trt.plugins import trt_compat
from seq2trt.reference_model.checkpoint import load_checkpoint
from seq2trt.reference_model.errors import Seq2TrtError
from seq2trt.reference_model.io import sha256_file
from seq2trt.validation.report import write_report
from seq2trt.validation.validate import ValidateSettings, run_validation

SEED = 9
HAS_RTX = importlib.util.find_spec("tensorrt_rtx") is not None
ENGINES = "engines/tensorrt-rtx-sm_86-fp32"  # as conftest.artifact builds them


# --- mutations ---------------------------------------------------------------------------------------------------

def mutate_bytes(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    kind = rng.choice(["truncate", "flip", "flip-head", "random", "empty", "zero-run"])
    if kind == "truncate":
        return kind, data[: rng.randrange(len(data))]
    if kind in ("flip", "flip-head"):
        out = bytearray(data)
        span = min(len(out), 2048) if kind == "flip-head" else len(out)
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(span)] ^= 1 << rng.randrange(8)
        return kind, bytes(out)
    if kind == "random":
        return kind, rng.randbytes(rng.randint(1, 4096))
    if kind == "empty":
        return kind, b""
    start = rng.randrange(len(data))
    return kind, data[:start] + bytes(rng.randint(1, 256)) + data[start + 256:]


def mutate_graph(model, rng: random.Random) -> str:
    """Damage that still parses: attributes, nodes, names, types, shapes (in place); returns what was done."""
    import onnx

    g = model.graph
    kind = rng.choice(["attr", "plugin-attr", "plugin-attr", "drop-node", "rename-input", "elem-type", "op-type",
                       "drop-attr", "dims"])
    if kind in ("attr", "plugin-attr", "drop-attr"):
        node = rng.choice([n for n in g.node if n.attribute and (kind != "plugin-attr" or n.domain == "seq2trt")])
        attr = rng.choice(node.attribute)
        if kind == "drop-attr":
            node.attribute.remove(attr)
        elif attr.type == onnx.AttributeProto.INT:
            attr.i = rng.choice([0, -1, 3, 7, 1 << 20, attr.i + 1])
        elif attr.type == onnx.AttributeProto.FLOAT:
            attr.f = rng.choice([0.0, -1.0, float("nan"), 1e30])
        elif attr.type == onnx.AttributeProto.STRING:
            attr.s = rng.choice([b"", b"zz", b"1"])
        return f"{kind} {node.op_type}.{attr.name}"
    if kind == "drop-node":
        del g.node[rng.randrange(len(g.node))]
    elif kind == "rename-input":
        node = rng.choice([n for n in g.node if n.input])
        node.input[rng.randrange(len(node.input))] = "nope"
    elif kind == "elem-type":
        rng.choice([*g.input, *g.output]).type.tensor_type.elem_type = rng.choice([1, 6, 7, 10, 11])
    elif kind == "op-type":
        node = rng.choice(g.node)
        node.op_type = rng.choice(["Relu", "Nope", node.op_type + "X"])
    else:
        for dim in rng.choice(list(g.input)).type.tensor_type.shape.dim:
            if rng.random() < 0.5:
                dim.dim_value = rng.choice([1, 3, 999])
    return kind


WRONG_VALUES = [None, 0, -1, 1.5, 1e308, True, "", "x", [], {}, [1, "a"], {"a": None}]


def damage_graph(path: Path, rng: random.Random, raw: bool) -> str:
    """Damage a graph file in place, as bytes (`raw`) or so that it still parses; returns what was done."""
    import onnx

    if raw:
        how, data = mutate_bytes(path.read_bytes(), rng)
        path.write_bytes(data)
        return how
    model = onnx.load(path)
    while True:  # plugin-attr damage needs a plugin node, which ORT graphs have none of: draw again
        with contextlib.suppress(IndexError):
            how = mutate_graph(model, rng)
            break
    onnx.save(model, path)
    return how


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key / index path inside a JSON document."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else []
    paths = []
    for key, value in items:
        paths.append(prefix + (key,))
        paths += _paths(value, prefix + (key,))
    return paths


def mutate_json(text: str, rng: random.Random) -> tuple[str, str]:
    doc = json.loads(text)
    kind = rng.choice(["invalid", "drop-key", "wrong-type", "wrong-type", "not-object", "bytes"])
    if kind == "invalid":
        return kind, text[: rng.randrange(len(text))] + rng.choice(["", "{", "]", ",", "\x00"])
    if kind == "bytes":
        _, data = mutate_bytes(text.encode(), rng)
        return kind, data.decode("utf-8", "replace")
    if kind == "not-object":
        return kind, json.dumps(rng.choice([[], "manifest", 3, None, [doc]]))
    path = rng.choice(_paths(doc))
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if kind == "drop-key" and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        kind = "wrong-type"
        parent[path[-1]] = rng.choice(WRONG_VALUES)
    return f"{kind} {'.'.join(map(str, path))}", json.dumps(doc)


# --- the run -----------------------------------------------------------------------------------------------------

@dataclass
class Outcomes:
    counts: Counter = field(default_factory=Counter)
    crashes: list[str] = field(default_factory=list)

    def run(self, case: str, entry: Callable[[], Any]) -> None:
        try:
            entry()
        except Seq2TrtError:
            self.counts["Seq2TrtError"] += 1
        except Exception as exc:  # what the fuzz looks for
            self.crashes.append(f"{case}: {type(exc).__name__}: {str(exc)[:200]}")
        else:
            self.counts["ok"] += 1

    def check(self, minimum_errors: int) -> None:
        assert not self.crashes, "\n".join(self.crashes)
        assert self.counts["Seq2TrtError"] >= minimum_errors, self.counts


@pytest.fixture
def work(artifact, tmp_path) -> Path:
    shutil.copytree(artifact, tmp_path / "w")
    return tmp_path / "w"


@contextlib.contextmanager
def restored(*paths: Path):
    """Put the files back as they were after each case."""
    saved = {p: p.read_bytes() for p in paths}
    try:
        yield
    finally:
        for p, data in saved.items():
            p.write_bytes(data)


def damaged_json(path: Path, rng: random.Random, count: int):
    """Yield (i, how) `count` times with the JSON file at `path` replaced by a mutation of its original text; each
    case's file is put back before the next one (and when the loop ends)."""
    text = path.read_text()
    for i in range(count):
        with restored(path):
            how, damaged = mutate_json(text, rng)
            path.write_text(damaged)
            yield i, how


def rehash_manifest(out: Path) -> None:
    m = read_manifest(out)
    write_manifest(out, m.config, m.data["settings"], list(m.data["files"]), m.data["source"])


def rehash_fusion(out: Path, target: Target = Target.TRT) -> None:
    path = fused_dir(out, target) / FUSION_JSON
    doc = json.loads(path.read_text())
    for name, entry in doc["files"].items():
        entry["sha256"] = sha256_file(path.parent / name)
    path.write_text(json.dumps(doc))


def damaged_fused_graphs(out: Path, target: Target, rng: random.Random, count: int, raw_every: int):
    """Yield (i, filename, how) `count` times with one fused graph (chosen at random) damaged in place — as bytes
    every `raw_every`-th case, else so that it still parses — and fusion.json rehashed to match, so only the
    graph's content is wrong; both files are put back before the next case."""
    folder = fused_dir(out, target)
    for i in range(count):
        kind = rng.choice(list(spec.GraphKind))
        path = folder / kind.filename
        with restored(path, folder / FUSION_JSON):
            how = damage_graph(path, rng, raw=i % raw_every == 0)
            rehash_fusion(out, target)
            yield i, kind.filename, how


@pytest.fixture
def quick_validation(monkeypatch):
    """Validation over one shape case: the files are fuzzed, not the sweep."""
    monkeypatch.setattr(spec, "sweep", lambda limits, batches=None: [spec.ShapeCase(2, 3, 1, 1, True)])
    return lambda out, graphs="plain": run_validation(out, ValidateSettings(graphs=graphs, samples=0))


@pytest.fixture
def stub_build(monkeypatch):
    """build_engines without TensorRT's compile (seconds a case): every check of the files it reads still runs."""
    from seq2trt.exporters import tensorrt_engines
    from seq2trt.exporters.tensorrt_build import BuildResult, NetworkInfo

    info = NetworkInfo({}, {}, {}, 0, 0)
    monkeypatch.setattr(tensorrt_engines, "build", lambda path, *a, **k: BuildResult(
        path.read_bytes()[:64], info, 0.0, "1.7.1.116", (86,)))
    monkeypatch.setattr(trt_compat, "load", lambda flavour: None)
    return lambda out: build_engines(out, EngineRequest("tensorrt-rtx", (86,), force=True))


def test_damaged_exported_graphs(work, quick_validation):
    out, rng, outcomes = work / "out", random.Random(SEED), Outcomes()
    graphs = {kind: (out / kind.filename).read_bytes() for kind in spec.GraphKind}
    for i in range(70):
        kind = rng.choice(list(spec.GraphKind))
        with restored(out / kind.filename, out / "manifest.json"):
            other = graphs[spec.GraphKind.DECODER if kind is spec.GraphKind.ENCODER else spec.GraphKind.ENCODER]
            how, data = ("other-graph", other) if i % 10 == 0 else mutate_bytes(graphs[kind], rng)
            (out / kind.filename).write_bytes(data)
            if i % 7:  # one in seven keeps the old hashes: the sha256 check must catch it
                rehash_manifest(out)
            case = f"{i} {kind.filename} {how}"
            outcomes.run(case + " fuse", lambda: fuse_artifacts(out, Target.ORT, force=True))
            if i % 4 == 0:
                outcomes.run(case + " validate", lambda: quick_validation(out))
    outcomes.check(minimum_errors=30)


@pytest.mark.skipif(not HAS_RTX, reason="tensorrt_rtx is not installed (pip install 'seq2trt[rtx]')")
def test_damaged_fused_graphs_reach_tensorrt(work):
    """Damage that still parses is what reaches TensorRT's parser, which can crash the process instead of failing:
    the build must refuse such graphs first."""
    out, rng, outcomes = work / "out", random.Random(SEED + 1), Outcomes()
    for i, name, how in damaged_fused_graphs(out, Target.TRT, rng, 24, raw_every=4):
        outcomes.run(f"{i} fused {name} {how} build", lambda: build_engines(
            out, EngineRequest("tensorrt-rtx", (86,), force=True)))
    outcomes.check(minimum_errors=12)


def test_damaged_manifest(work, stub_build, quick_validation):
    out, rng, outcomes = work / "out", random.Random(SEED + 2), Outcomes()
    for i, how in damaged_json(out / "manifest.json", rng, 60):
        case = f"{i} manifest {how}"
        outcomes.run(case + " verify", lambda: verify(out))
        outcomes.run(case + " fuse", lambda: fuse_artifacts(out, Target.ORT, force=True))
        outcomes.run(case + " build", lambda: stub_build(out))
        outcomes.run(case + " report", lambda: write_report(out))
        if i % 6 == 0:
            outcomes.run(case + " validate", lambda: quick_validation(out))
    outcomes.check(minimum_errors=60)


def test_damaged_fusion_json(work, stub_build):
    out, rng, outcomes = work / "out", random.Random(SEED + 3), Outcomes()
    for i, how in damaged_json(fused_dir(out, Target.TRT) / FUSION_JSON, rng, 40):
        outcomes.run(f"{i} fusion.json {how} build", lambda: stub_build(out))
        outcomes.run(f"{i} fusion.json {how} report", lambda: write_report(out))
    outcomes.check(minimum_errors=15)


def test_damaged_fused_ort_graphs_and_quantization_json(work, quick_validation):
    """int8: damaged fused ORT graphs reach ONNX Runtime's quantizer, a damaged quantization.json the checks of
    validate --graphs int8-ort and report; all end in a Seq2TrtError or still work."""
    from seq2trt.exporters.quantize import QUANTIZATION_JSON, quantize_artifacts, quantized_dir, verify_quantized

    out, rng, outcomes = work / "out", random.Random(SEED + 6), Outcomes()
    fuse_artifacts(out, Target.ORT)
    for i, name, how in damaged_fused_graphs(out, Target.ORT, rng, 24, raw_every=3):
        outcomes.run(f"{i} fused-ort {name} {how} quantize", lambda: quantize_artifacts(out, force=True))
    quantize_artifacts(out, force=True)
    for i, how in damaged_json(quantized_dir(out) / QUANTIZATION_JSON, rng, 30):
        outcomes.run(f"{i} quantization.json {how} verify", lambda: verify_quantized(out))
        outcomes.run(f"{i} quantization.json {how} report", lambda: write_report(out))
        if i % 5 == 0:
            outcomes.run(f"{i} quantization.json {how} validate", lambda: quick_validation(out, "int8-ort"))
    outcomes.check(minimum_errors=25)


@pytest.mark.skipif(not HAS_RTX, reason="needs the engines conftest.artifact builds with tensorrt_rtx")
def test_damaged_build_json(work):
    out, rng, outcomes = work / "out", random.Random(SEED + 4), Outcomes()
    engine_dir = out / ENGINES
    for i, how in damaged_json(engine_dir / BUILD_JSON, rng, 40):
        case = f"{i} build.json {how}"
        outcomes.run(case + " engine check", lambda: trt_compat.check_engine(
            read_build(engine_dir), "tensorrt-rtx", "1.7.1.116", 86))
        outcomes.run(case + " report", lambda: write_report(out))
    outcomes.check(minimum_errors=15)


def test_damaged_checkpoint(work):
    ckpt, rng, outcomes = work / "ckpt", random.Random(SEED + 5), Outcomes()
    files = ["model.safetensors", "config.json", "vocab.json"]
    originals = {name: (ckpt / name).read_bytes() for name in files}
    for i in range(90):
        name = files[i % 3]
        with restored(ckpt / name):
            if name.endswith(".json") and i % 2:
                how, damaged = mutate_json(originals[name].decode(), rng)
                (ckpt / name).write_text(damaged)
            else:
                how, data = mutate_bytes(originals[name], rng)
                (ckpt / name).write_bytes(data)
            outcomes.run(f"{i} {name} {how} load", lambda: load_checkpoint(ckpt))
    outcomes.check(minimum_errors=50)
