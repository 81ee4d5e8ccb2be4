"""`seq2trt serve --write-repository`: the Python-backend repository (BLS generate/translate over encoder/decoder
models) loads and answers in the bundled server exactly as translate; the GPU repositories' configs parse with
Triton's own model-config protobuf and name the spec's tensors."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from seq2trt.cli.main import cli
from seq2trt.exporters import spec

from .conftest import Server, generate_inputs, text_inputs, translate_ids
from .test_serve import SOURCES


def test_python_repository_answers_as_translate(served, tmp_path):
    import tritonclient.http as http

    out, _ = served
    result = CliRunner().invoke(cli, ["serve", str(out), "--write-repository", str(tmp_path / "repo"),
                                      "--repository-backend", "python"])
    assert result.exit_code == 0, result.output
    assert "docker run" in (tmp_path / "repo" / "README.md").read_text()
    server = Server(out, tmp_path / "server.log", "--repository", str(tmp_path / "repo"))
    try:
        c = http.InferenceServerClient(server.url, network_timeout=60)
        for beam in (1, 4):
            want = translate_ids(out, SOURCES, "--beam", str(beam))
            got = [c.infer("generate", generate_inputs(s, num_beams=beam)).as_numpy("output_ids")[0].tolist()
                   for s in SOURCES]
            assert got == want
        assert c.infer("translate", text_inputs("120")).as_numpy("text")[0, 0].decode() == \
            CliRunner().invoke(cli, ["translate", str(out), "120", "--backend", "ort-fused"]).output.strip()
        c.close()  # Triton's drain waits for open HTTP connections, idle keep-alive ones included
    finally:
        assert server.stop(timeout_s=150) == 0


def test_gpu_repository_configs_parse_with_tritons_protobuf(served, tmp_path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from seq2trt.exporters.manifest import read_manifest
    from seq2trt.validation.triton_repository import graph_config

    out, _ = served
    result = CliRunner().invoke(cli, ["serve", str(out), "--write-repository", str(tmp_path / "repo")])
    assert result.exit_code == 0, result.output
    cfg = read_manifest(out).config
    configs = {p.parent.name: p.read_text() for p in (tmp_path / "repo").glob("*/config.pbtxt")}
    configs["decoder-plan"] = graph_config(spec.GraphKind.DECODER, cfg, "fp32", "tensorrt_plan", 1)
    assert set(configs) == {"encoder", "decoder", "generate", "translate", "decoder-plan"}
    parsed = {name: text_format.Parse(text, model_config_pb2.ModelConfig()) for name, text in configs.items()}
    assert parsed["encoder"].platform == "onnxruntime_onnx" and parsed["decoder-plan"].platform == "tensorrt_plan"
    for name, kind in (("encoder", spec.GraphKind.ENCODER), ("decoder", spec.GraphKind.DECODER),
                       ("decoder-plan", spec.GraphKind.DECODER)):
        assert [i.name for i in parsed[name].input] == [s.name for s in spec.inputs(cfg, kind)]
        assert [o.name for o in parsed[name].output] == [s.name for s in spec.outputs(cfg, kind)]
    generate = parsed["generate"]
    assert generate.backend == "python" and generate.dynamic_batching.max_queue_delay_microseconds > 0
    assert generate.input[0].allow_ragged_batch and generate.input[1].optional
    assert (tmp_path / "repo" / "encoder" / "1" / "model.onnx").exists()
    result = CliRunner().invoke(cli, ["serve", str(out), "--write-repository", str(tmp_path / "plans"),
                                      "--repository-backend", "tensorrt_plan"])
    assert result.exit_code == 2 and "seq2trt build" in result.output  # no engines in this export: named
    result = CliRunner().invoke(cli, ["serve", str(out), "--write-repository", str(tmp_path / "repo")])
    assert result.exit_code == 2 and not (tmp_path / "plans").exists()  # nothing overwritten without --force
