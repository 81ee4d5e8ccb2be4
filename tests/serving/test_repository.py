"""`seq2trt serve --write-repository`: the Python-backend repository (BLS generate/translate over encoder/decoder
models) loads and answers in the bundled server exactly as translate; the GPU repositories' configs parse with
Triton's own model-config protobuf and name the spec's tensors."""

from __future__ import annotations

import pytest

from seq2trt.exporters import spec
from seq2trt.serving.repository import is_repository

from helpers.cli import invoke, one_error_line

from .conftest import Server, generate_inputs, text_inputs, translate_ids
from .test_serve import SOURCES


def test_python_repository_answers_as_translate(served, tmp_path):
    import tritonclient.http as http

    out, _ = served
    result = invoke("serve", out, "--write-repository", tmp_path / "repo", "--repository-backend", "python")
    assert result.exit_code == 0, result.output
    assert "docker run" in (tmp_path / "repo" / "README.md").read_text()
    server = Server(out, tmp_path / "server.log", "--repository", str(tmp_path / "repo"))
    try:
        c = http.InferenceServerClient(server.url, network_timeout=60)
        for beam in (1, 4):
            want = translate_ids(out, SOURCES, "--beam-size", str(beam))
            got = [c.infer("generate", generate_inputs(s, beam_size=beam)).as_numpy("output_ids")[0].tolist()
                   for s in SOURCES]
            assert got == want
        assert c.infer("translate", text_inputs("120")).as_numpy("text")[0, 0].decode() == \
            invoke("translate", out, "120", "--backend", "ort-fused").output.strip()
        c.close()  # Triton's drain waits for open HTTP connections, idle keep-alive ones included
    finally:
        assert server.stop(timeout_s=150) == 0


def test_gpu_repository_configs_parse_with_tritons_protobuf(served, tmp_path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from seq2trt.exporters.manifest import read_manifest
    from seq2trt.serving.repository import graph_config

    out, _ = served
    result = invoke("serve", out, "--write-repository", tmp_path / "repo")
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
    result = invoke("serve", out, "--write-repository", tmp_path / "plans", "--repository-backend", "tensorrt_plan")
    assert result.exit_code == 2 and "seq2trt build" in result.output  # no engines in this export: named
    result = invoke("serve", out, "--write-repository", tmp_path / "repo")
    assert result.exit_code == 2 and not (tmp_path / "plans").exists()  # nothing overwritten without --force


def _write(out, folder, *extra):
    return invoke("serve", out, "--write-repository", folder, *extra)


@pytest.mark.parametrize("force", [False, True])
def test_a_folder_seq2trt_did_not_write_is_never_replaced(exported, tmp_path, force):
    folder = tmp_path / "mine"
    (folder / "photos").mkdir(parents=True)
    (folder / "notes.txt").write_text("keep me")
    line = one_error_line(_write(exported, folder, *(["--force"] if force else [])), 2, str(folder),
                          "not a seq2trt Triton model repository", "notes.txt, photos")
    assert "pass --force" not in line
    assert (folder / "notes.txt").read_text() == "keep me" and (folder / "photos").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no staging folder left either


@pytest.mark.parametrize("where", ["export", "its parent", "the checkpoint"])
def test_force_never_replaces_what_the_repository_is_written_from(exported, where):
    folder = {"export": exported, "its parent": exported.parent, "the checkpoint": exported.parent / "ckpt"}[where]
    before = sorted(str(p.relative_to(exported.parent)) for p in exported.parent.rglob("*"))
    one_error_line(_write(exported, folder, "--force"), 2, f"path {folder} holds", "which this command reads")
    assert sorted(str(p.relative_to(exported.parent)) for p in exported.parent.rglob("*")) == before


def test_force_replaces_a_repository_seq2trt_wrote(exported, tmp_path):
    folder = tmp_path / "repo"
    assert _write(exported, folder).exit_code == 0
    assert is_repository(folder)
    (folder / "stale.txt").write_text("from the last run")
    one_error_line(_write(exported, folder), 2, f"{folder} already exists", "pass --force")
    result = _write(exported, folder, "--force", "--repository-backend", "python")
    assert result.exit_code == 0, result.output
    assert not (folder / "stale.txt").exists() and (folder / "encoder" / "1" / "model.py").exists()
