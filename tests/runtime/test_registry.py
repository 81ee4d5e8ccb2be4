"""The backend registry is the one list every command offers, and `validate` checks TensorRT engines through it."""

from __future__ import annotations

import click
import pytest
import torch

from seq2trt.reference_model.errors import DependencyError, InputError
from seq2trt.runtime import registry


def _choices(command: click.Command, option: str) -> tuple[str, ...]:
    param = next(p for p in command.params if option in p.opts)
    return tuple(param.type.choices)


def test_every_command_offers_the_registry_backends():
    import seq2trt
    from seq2trt.cli.model_commands import translate
    from seq2trt.cli.serve_commands import serve
    from seq2trt.cli.validate_commands import validate
    from seq2trt.hf.modeling import HF_BACKENDS
    from seq2trt.validation.bench.settings import KNOWN_BACKENDS

    assert _choices(translate, "--backend") == registry.DECODE_BACKENDS == registry.names(translate=True)
    assert _choices(serve, "--backend") == registry.SERVE_BACKENDS
    assert _choices(validate, "--backend") == registry.VALIDATE_BACKENDS == ("ort", "tensorrt", "tensorrt-rtx")
    assert KNOWN_BACKENDS == tuple(registry.BACKENDS)
    assert HF_BACKENDS == registry.HF_MODEL_BACKENDS
    assert set(registry.BASELINES) == {"ct2", "ct2-int8", "hf", "optimum"}
    assert seq2trt.DECODE_BACKENDS == registry.DECODE_BACKENDS


def test_declarations_are_consistent():
    from seq2trt.validation.validate import GRAPH_SETS

    for name, b in registry.BACKENDS.items():
        assert b.name == name
        assert b.runs in {"eager", "onnxruntime", "tensorrt", "ort-search", "ctranslate2", "transformers", "optimum"}
        assert b.graphs is None or b.graphs in GRAPH_SETS, name
        assert b.whole_search == (b.runs == "ort-search"), name
        assert (b.runs == "onnxruntime") == (b.graphs in ("plain", "fused-ort", "int8-ort")), name
        assert not (b.modules and b.extra is None), f"{name}: a needed library must name the extra installing it"
        assert b.ours or not (b.translate or b.serve or b.validates), f"{name}: baselines are only timed"


def test_unknown_backend_names_the_choices():
    with pytest.raises(InputError, match="unknown backend 'onnx'; choose one of eager, ort, ort-fused"):
        registry.declared("onnx", registry.DECODE_BACKENDS)
    with pytest.raises(InputError, match="unknown backend 'ct2'; choose one of eager, ort"):
        registry.declared("ct2", registry.DECODE_BACKENDS)


def test_unavailable_says_why_and_the_extra(monkeypatch):
    from seq2trt.plugins import trt_compat

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
    from seq2trt.exporters.tensorrt_engines import EngineRequest, build_engines
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
    from seq2trt.plugins import trt_compat
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
    from seq2trt.reference_model.errors import ArtifactError

    with pytest.raises(ArtifactError):  # the registry's opener verifies build.json against the export
        run_validation(out, ValidateSettings(backend="tensorrt-rtx", samples=0))


def test_validate_tensorrt_needs_the_library_too(engines_export, monkeypatch):
    from seq2trt.plugins import trt_compat
    from seq2trt.validation.validate import ValidateSettings, run_validation

    out, _ = engines_export
    monkeypatch.setattr(trt_compat, "has_gpu", lambda: True)
    monkeypatch.setattr(registry, "_missing_module", lambda module: True)
    with pytest.raises(DependencyError, match=r"TensorRT is not installed \(pip install 'seq2trt\[trt\]'\)"):
        run_validation(out, ValidateSettings(backend="tensorrt", samples=0))
