"""Seeded fuzz of the graph files: the exported ONNX graphs (fuse, validate), the fused TensorRT graphs (build) and
the fused ORT graphs with their quantization.json (quantize, validate, report). fuzzing.py damages them and judges
what came back; conftest.py owns the seeds (a failure prints its run seed and the command that replays it).

TensorRT builds only the fused-graph cases (a real build takes seconds), and validation sweeps one shape case (the
sweep is not what is fuzzed).
"""

from __future__ import annotations

import json

import pytest

from seq2trt.exporters import spec
from seq2trt.exporters.fuse import Target, fuse_artifacts
from seq2trt.exporters.tensorrt.engines import EngineRequest, build_engines
from seq2trt.validation.reports.report import write_report


def test_damaged_exported_graphs(work, quick_validation, fuzz, outcomes, rewrite_manifest):
    out = work / "out"
    graphs = {kind: (out / kind.filename).read_bytes() for kind in spec.GraphKind}
    for i, (seed, rng) in enumerate(outcomes.cases(0, 70)):
        kind = rng.choice(list(spec.GraphKind))
        with fuzz.restored(out / kind.filename, out / "manifest.json"):
            other = graphs[spec.GraphKind.DECODER if kind is spec.GraphKind.ENCODER else spec.GraphKind.ENCODER]
            how, data = ("other-graph", other) if i % 10 == 0 else fuzz.mutate_bytes(graphs[kind], rng)
            (out / kind.filename).write_bytes(data)
            if i % 7:  # one in seven keeps the old hashes: the sha256 check must catch it
                rewrite_manifest(out)
            case = f"{i} {kind.filename} {how} [seed {seed}]"
            outcomes.run(case + " fuse", lambda: fuse_artifacts(out, Target.ORT, force=True),
                         fuzz.validated(lambda: quick_validation(out, "fused-ort")))
            if i % 4 == 0:
                outcomes.run(case + " validate", lambda: quick_validation(out), fuzz.nothing_to_check)
    outcomes.check(minimum_errors=30)


@pytest.mark.rtx
def test_damaged_fused_graphs_reach_tensorrt(work, quick_validation, fuzz, outcomes):
    """Damage that still parses is what reaches TensorRT's parser, which can abort its process natively: the build
    runs TensorRT in a child, so such a crash must come back as a BuildError (a Seq2TrtError), never end this one;
    otherwise the build refuses the graphs, or validation of the same graphs passes or stops them."""
    from seq2trt.exporters.tensorrt.child import BuildChild

    out = work / "out"
    with BuildChild() as child:  # one child for the run; a crash ends it and the next job starts another
        for i, name, how in fuzz.damaged_fused_graphs(out, Target.TRT, outcomes.cases(1, 24), raw_every=4):
            outcomes.run(f"{i} fused {name} {how} build",
                         lambda: build_engines(out, EngineRequest("tensorrt-rtx", (86,), force=True), child=child),
                         fuzz.validated(lambda: quick_validation(out, "fused-trt")))
    outcomes.check(minimum_errors=12)


def test_damaged_fused_ort_graphs_and_quantization_json(work, quick_validation, fuzz, outcomes):
    """int8: damaged fused ORT graphs reach ONNX Runtime's quantizer, a damaged quantization.json the checks of
    validate --graphs int8-ort and report; all end in a Seq2TrtError or a result that is checked."""
    from seq2trt.exporters.quantize import QUANTIZATION_JSON, quantize_artifacts, quantized_dir, verify_quantized

    out = work / "out"
    fuse_artifacts(out, Target.ORT)
    for i, name, how in fuzz.damaged_fused_graphs(out, Target.ORT, outcomes.cases(6, 24), raw_every=3):
        outcomes.run(f"{i} fused-ort {name} {how} quantize", lambda: quantize_artifacts(out, force=True),
                     fuzz.validated(lambda: quick_validation(out, "int8-ort")))
    quantize_artifacts(out, force=True)
    quantization = (quantized_dir(out) / QUANTIZATION_JSON).read_text()
    report = write_report(out)[0].read_text()
    for i, how in fuzz.damaged_json(quantized_dir(out) / QUANTIZATION_JSON, outcomes.cases(7, 30)):
        outcomes.run(f"{i} quantization.json {how} verify", lambda: verify_quantized(out),
                     lambda doc: None if doc.get("files") == json.loads(quantization)["files"]
                     else "verify_quantized passed graph records that differ from the undamaged ones")
        outcomes.run(f"{i} quantization.json {how} report", lambda: write_report(out),
                     fuzz.same_report(out, report, {"int8 quantization"}))
        if i % 5 == 0:
            with fuzz.folder_kept(out / "reports"):
                outcomes.run(f"{i} quantization.json {how} validate", lambda: quick_validation(out, "int8-ort"),
                             fuzz.nothing_to_check)
    outcomes.check(minimum_errors=25)
