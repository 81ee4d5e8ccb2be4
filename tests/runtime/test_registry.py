"""The backend registry is the one list every command offers, and `validate` checks TensorRT engines through it."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import click
import pytest
import torch

from seq2trt.core.errors import DependencyError, InputError
from seq2trt.runtime import registry

ROOT = Path(__file__).resolve().parents[2]


def _choices(command: click.Command, option: str) -> tuple[str, ...]:
    param = next(p for p in command.params if option in p.opts)
    return tuple(param.type.choices)


def _offered() -> dict[str, set[str]]:
    """Verb -> the backend names its user-facing surface accepts (the CLI's --backend choices; bench's parser)."""
    import seq2trt
    from seq2trt.cli.model_commands import translate
    from seq2trt.cli.serve_commands import serve
    from seq2trt.cli.transcribe_commands import transcribe
    from seq2trt.cli.validate_commands import validate
    from seq2trt.hf import HF_BACKENDS
    from seq2trt.validation.bench.settings import parse_backends

    def bench_accepts(name: str) -> bool:
        try:
            return parse_backends(name) == (name,)
        except InputError:
            return False

    return {"translate": set(_choices(translate, "--backend")), "serve": set(_choices(serve, "--backend")),
            "transcribe": set(_choices(transcribe, "--backend")), "validate": set(_choices(validate, "--backend")),
            "bench": {n for n in registry.BACKENDS if bench_accepts(n)} | {n for n in ("onnx", "cuda") if bench_accepts(n)},
            "Translator": set(seq2trt.DECODE_BACKENDS), "hf": set(HF_BACKENDS)}


def _declared_for(verb: str, b: registry.Backend) -> bool:
    return {"translate": b.translate, "serve": b.serve, "transcribe": b.translate and not b.whole_search,
            "validate": b.validates, "bench": True, "Translator": b.translate, "hf": b.hf_model}[verb]


def test_every_registry_name_is_reachable_from_the_verbs_that_offer_it():
    """Each declaration's flags are what the verbs accept: a verb offering a name its declaration does not (a stale
    list), or missing one it does, fails; and every name is reachable from at least one verb."""
    offered = _offered()
    for verb, names in offered.items():
        want = {n for n, b in registry.BACKENDS.items() if _declared_for(verb, b)}
        assert names == want, f"{verb}: offers {sorted(names - want)} undeclared, misses {sorted(want - names)}"
    reachable = set().union(*offered.values())
    assert reachable == set(registry.BACKENDS)
    assert {"ort-cuda", "ort-generate-cuda"} <= offered["translate"]  # the GPU backends, one declaration each
    assert "ort-cuda" in offered["serve"] & offered["validate"] & offered["transcribe"] & offered["hf"]


def test_declared_flag_missing_from_a_verb_is_caught(monkeypatch):
    """The check above can fail: a declaration saying `serve` while serve's choices were made before it."""
    monkeypatch.setitem(registry.BACKENDS, "ort-generate", replace(registry.BACKENDS["ort-generate"], serve=True))
    with pytest.raises(AssertionError, match=r"serve: offers \[\] undeclared, misses \['ort-generate'\]"):
        test_every_registry_name_is_reachable_from_the_verbs_that_offer_it()


# Literal collections of two or more backend names outside the registry, with why each may stay.
ALLOWED_NAME_LISTS = {
    "validation/reports/bench_table.py": "the latency table's column order (a layout, not a property of backends)",
}


def stray_name_lists(root: Path) -> list[str]:
    """`file:line [names]` for each tuple / list / set literal in library code holding two or more registry backend
    names outside runtime/registry.py: a second list of what a declaration should say."""
    from test_packaging import LAYERS

    found = []
    for folder in LAYERS:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel == "runtime/registry.py" or rel in ALLOWED_NAME_LISTS:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                    names = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in registry.BACKENDS]
                    if len(names) >= 2:
                        found.append(f"{rel}:{node.lineno} {names}")
    return found


def test_no_backend_name_list_beside_the_registry():
    assert stray_name_lists(ROOT) == []


def test_a_planted_stray_name_list_is_caught(tmp_path):
    for folder in ("runtime", "api"):
        (tmp_path / folder).mkdir()
    (tmp_path / "runtime" / "registry.py").write_text('BACKENDS = ("eager", "ort")\n')  # the registry itself: fine
    (tmp_path / "api" / "translator.py").write_text('X = 1\nCONCURRENT = ["eager", "ort", "ort-fused"]\n')
    assert stray_name_lists(tmp_path) == ["api/translator.py:2 ['eager', 'ort', 'ort-fused']"]


def test_every_declaration_points_at_a_module_with_the_backend_interface():
    from seq2trt.validation.validate import GRAPH_SETS

    assert GRAPH_SETS is registry.GRAPH_SETS  # one graph-set table
    for name, b in registry.BACKENDS.items():
        assert b.name == name
        assert b.graphs is None or b.graphs in registry.GRAPH_SETS, name
        assert b.whole_search == registry.GRAPH_SETS[b.graphs].whole_search if b.graphs else not b.whole_search, name
        assert not (b.modules and b.extra is None), f"{name}: a needed library must name the extra installing it"
        assert not (b.needs_gpu and b.extra is None and b.runs != "eager"), f"{name}: name the extra for its GPU"
        assert b.ours == (b.module is not None), f"{name}: ours run through a kind module, baselines are only timed"
        if b.module is None:
            assert not (b.translate or b.serve or b.validates or b.hf_model), name
            continue
        module = registry.kind(name)
        assert isinstance(module.CONCURRENT, bool)
        for attribute in ("unavailable", "open", "check", "bench"):
            assert callable(getattr(module, attribute)), f"{name}: {b.module} lacks {attribute}"
        if not b.whole_search and b.runs != "eager":
            assert callable(module.step_model), name


def test_unknown_backend_names_the_choices():
    with pytest.raises(InputError, match="unknown backend 'onnx'; choose one of eager, ort, ort-fused"):
        registry.declared("onnx", registry.DECODE_BACKENDS)
    with pytest.raises(InputError, match="unknown backend 'ct2'; choose one of eager, ort"):
        registry.declared("ct2", registry.DECODE_BACKENDS)


def test_unavailable_says_why_and_the_extra(monkeypatch):
    from seq2trt.exporters.tensorrt import trt_compat

    monkeypatch.setattr(trt_compat, "has_gpu", lambda: False)
    monkeypatch.setattr(registry, "_missing_module", lambda module: module in ("ctranslate2", "optimum.onnxruntime"))
    why = registry.unavailable(("ort", "tensorrt-rtx", "ct2", "optimum", "hf"))
    assert set(why) == {"tensorrt-rtx", "ct2", "optimum"}
    assert "only on an NVIDIA GPU" in why["tensorrt-rtx"]
    assert why["ct2"] == "CTranslate2 is not installed (pip install 'seq2trt[ct2]')"
    assert why["optimum"] == "optimum.onnxruntime is not installed (pip install 'seq2trt[optimum]')"
    monkeypatch.setattr(trt_compat, "has_gpu", lambda: True)
    monkeypatch.setattr(registry, "_missing_module", lambda module: module == "tensorrt_rtx")
    assert registry.unavailable(("tensorrt-rtx",)) == {
        "tensorrt-rtx": "TensorRT-RTX is not installed (pip install 'seq2trt[rtx]')"}


def test_the_cuda_provider_is_asked_of_onnxruntime(monkeypatch):
    """ort-cuda and ort-generate-cuda need ONNX Runtime's CUDA provider (onnxruntime-gpu) and a GPU; each missing
    piece is named, with the extra that installs the provider."""
    import onnxruntime as ort

    from seq2trt.exporters.tensorrt import trt_compat

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    why = registry.unavailable(("ort-cuda", "ort-generate-cuda", "ort-fused"))
    assert set(why) == {"ort-cuda", "ort-generate-cuda"}
    assert why["ort-cuda"] == ("ONNX Runtime has no CUDA provider here (onnxruntime-gpu is not installed); "
                               "pip install 'seq2trt[gpu]'")
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(trt_compat, "has_gpu", lambda: False)
    assert "needs an NVIDIA GPU" in registry.unavailable(("ort-cuda",))["ort-cuda"]
    monkeypatch.setattr(trt_compat, "has_gpu", lambda: True)
    assert registry.unavailable(("ort-cuda", "ort-generate-cuda")) == {}


def test_a_peer_installed_beside_a_transformers_it_excludes_is_unavailable(monkeypatch):
    """optimum-onnx 0.1 pins transformers<4.58: installed beside transformers 5 (pip does not stop a later upgrade)
    it cannot run, and the reason names both versions; its extras' requirements and packages absent do not count."""
    import importlib.metadata as metadata

    installed = {"optimum-onnx": "0.1.0", "transformers": "5.25.0", "onnx": "1.23.2"}
    requires = {"optimum-onnx": ["transformers<4.58.0,>=4.36", "onnx", "absent-package>=1",
                                 "pytest; extra == 'tests'"]}

    def version(name):
        if name not in installed:
            raise metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(metadata, "version", version)
    monkeypatch.setattr(metadata, "requires", lambda name: requires.get(name))
    monkeypatch.setattr(registry, "_missing_module", lambda module: False)
    assert registry.unavailable(("optimum", "hf")) == {"optimum": (
        "optimum-onnx 0.1.0 needs transformers<4.58.0,>=4.36 and transformers 5.25.0 is installed, so it cannot run "
        "beside it (install 'seq2trt[optimum]' in an environment of its own)")}
    installed["transformers"] = "4.57.6"
    assert registry.unavailable(("optimum",)) == {}


# --- validate on TensorRT engines ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engines_export(tmp_path_factory):
    """A tiny model exported, fused for TensorRT and built into TensorRT-RTX engines (no GPU needed to build)."""
    from seq2trt.exporters import spec
    from seq2trt.exporters.fuse import Target, fuse_artifacts
    from seq2trt.exporters.onnx_export import export
    from seq2trt.exporters.tensorrt.engines import EngineRequest, build_engines
    from seq2trt.reference_model.checkpoint import save_checkpoint, source_record
    from seq2trt.reference_model.config import preset
    from seq2trt.reference_model.model import Seq2SeqTransformer

    torch.manual_seed(0)
    model = Seq2SeqTransformer(preset("tiny", src_vocab_size=24, tgt_vocab_size=24, num_heads=1)).eval()
    root = tmp_path_factory.mktemp("engines")
    checkpoint = save_checkpoint(root / "ckpt", model)
    out = export(model, root / "art", limits=spec.Limits(2, 16, 16), source=source_record(checkpoint))
    fuse_artifacts(out, Target.TRT)
    engines = build_engines(out, EngineRequest("tensorrt-rtx", (86,)))
    return out, engines


def test_validate_tensorrt_without_a_gpu_is_refused_before_anything_is_written(engines_export):
    from click.testing import CliRunner

    from seq2trt.cli.main import cli

    out, _ = engines_export
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    result = CliRunner().invoke(cli, ["validate", str(out), "--backend", "tensorrt-rtx"])
    assert result.exit_code != 0
    assert "--backend tensorrt-rtx: TensorRT engines run only on an NVIDIA GPU" in result.output
    assert "--graphs fused-trt" in result.output  # the fix this machine can run
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def test_validate_tensorrt_runs_the_verified_engines_judged_by_their_source_graphs(engines_export, monkeypatch):
    """With a GPU, validate opens the engines through the registry (build.json verified against the export) and
    judges them against the fused-trt graphs they were built from. Here the GPU runner is replaced by ONNX Runtime
    on the plan's source graph (this machine cannot run a plan); every check before it is the real one."""
    from seq2trt.exporters import spec
    from seq2trt.exporters.tensorrt import trt_compat
    from seq2trt.plugins.plugin_cpu import for_cpu, register_reference_ops
    from seq2trt.runtime import tensorrt_runner
    from seq2trt.runtime.runners import OrtRunner
    from seq2trt.validation.validate import ValidateSettings, run_validation

    out, engines = engines_export
    opened = []

    def stand_in(engine_dir, kind: spec.GraphKind, cfg, limits):
        opened.append((engine_dir, kind))
        return OrtRunner(out / "fused" / "trt" / kind.filename, cfg, kind, "fp32", limits, name="stand-in",
                         prepare=lambda m: for_cpu(m, "fp32"), custom_op_libraries=(register_reference_ops(),))

    monkeypatch.setattr(trt_compat, "has_gpu", lambda: True)
    monkeypatch.setattr(tensorrt_runner, "runner_for", stand_in)
    doc = run_validation(out, ValidateSettings(backend="tensorrt-rtx", samples=4, localize_budget_s=0))
    assert opened == [(engines, kind) for kind in spec.GraphKind]
    assert doc["passed"] and doc["backend"] == "tensorrt-rtx" and doc["graphs_set"] == "fused-trt"
    with pytest.raises(InputError, match="built from the fused-trt graphs, not --graphs plain"):
        run_validation(out, ValidateSettings(backend="tensorrt-rtx", graphs="plain", samples=0))
    (engines / "build.json").write_text((engines / "build.json").read_text().replace('"dtype": "fp32"', '"dtype": "fp16"'))
    from seq2trt.core.errors import ArtifactError

    with pytest.raises(ArtifactError):  # the registry's opener verifies build.json against the export
        run_validation(out, ValidateSettings(backend="tensorrt-rtx", samples=0))


def test_validate_tensorrt_needs_the_library_too(engines_export, monkeypatch):
    from seq2trt.exporters.tensorrt import trt_compat
    from seq2trt.validation.validate import ValidateSettings, run_validation

    out, _ = engines_export
    monkeypatch.setattr(trt_compat, "has_gpu", lambda: True)
    monkeypatch.setattr(registry, "_missing_module", lambda module: True)
    with pytest.raises(DependencyError, match=r"TensorRT is not installed \(pip install 'seq2trt\[trt\]'\)"):
        run_validation(out, ValidateSettings(backend="tensorrt", samples=0))
