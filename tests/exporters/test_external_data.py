"""Graphs with their weights as ONNX external data (exporters/graph_files.py), through every writer and reader.

At a small size the threshold is lowered to 0 (`SEQ2TRT_EXTERNAL_DATA_THRESHOLD`), so every graph an imported
Marian's pipeline writes (export, fuse for both targets, int8, generate.onnx, serve's repository) holds its weights
in `<graph>.onnx.data`, and every reader (the checker, ONNX Runtime sessions, validate with its localisation,
TensorRT-RTX's parser, translate) is judged on them against transformers' own generate and the eager model.
`test_past_2_gib_end_to_end` crosses protobuf's 2 GiB for real, at the default threshold.
"""

from __future__ import annotations

import importlib.util
import json
import resource

import numpy as np
import onnx
import pytest
import torch

from seq2trt.exporters import graph_files
from seq2trt.core.errors import ConfigError

from helpers.cli import invoke_ok

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
HAS_RTX = importlib.util.find_spec("tensorrt_rtx") is not None
SHAPE = dict(d_model=64, encoder_attention_heads=2, decoder_attention_heads=2)  # head dim 32: the plugin's kernels
LIMITS = ("--max-batch", 8, "--max-src-len", 24, "--max-tgt-len", 24)


def hf_tokens(src, sources: list[list[int]], beam: int, new_tokens: int) -> list[list[int]]:
    """transformers' own generate on `sources` (one at a time: no padding), eos and pad dropped."""
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(src), dtype=torch.float32).eval()
    cfg, rows = model.config, []
    for source in sources:
        with torch.inference_mode():
            row = model.generate(input_ids=torch.tensor([source]), max_new_tokens=new_tokens, num_beams=beam,
                                 do_sample=False)[0, 1:].tolist()
        row = row[: row.index(cfg.eos_token_id)] if cfg.eos_token_id in row else row
        rows.append([t for t in row if t != cfg.pad_token_id])
    return rows


def translated(out, tmp_path, sources, backend: str, beam: int, new_tokens: int) -> list[list[int]]:
    ids, written = tmp_path / "ids.jsonl", tmp_path / f"{backend}-{beam}.jsonl"
    ids.write_text("".join(json.dumps(s) + "\n" for s in sources))
    invoke_ok("translate", out, "--backend", backend, "--ids-file", ids, "--output-ids", written, "--beam-size", beam,
              "--max-new-tokens", new_tokens)
    return [json.loads(line) for line in written.read_text().splitlines()]


def assert_external(folder, *names):
    """Each graph holds no weight of its own: every tensor over 1 KiB is in its data file, named by the rule."""
    for name in names:
        graph = folder / name
        model = onnx.load(str(graph), load_external_data=False)
        assert set(graph_files.external_ranges(model)) == {graph_files.data_name(graph)}, graph
        inline = [t.name for t in graph_files._all_tensors(model)
                  if t.data_location != onnx.TensorProto.EXTERNAL and len(t.raw_data) > graph_files.INLINE_TENSOR_BYTES]
        assert not inline, (graph, inline)


@pytest.mark.slow
def test_every_writer_and_reader_on_external_data(make_hf_model, tmp_path, monkeypatch):
    monkeypatch.setenv(graph_files.THRESHOLD_ENV, "0")
    # early stopping: the one beam-search rule generate.onnx (ONNX Runtime's BeamSearch) runs as transformers does
    src = make_hf_model(tmp_path / "src", "marian", SHAPE, generation={"early_stopping": True, "num_beams": 4},
                        std=0.1)
    invoke_ok("import", "hf", src, "-o", tmp_path / "ckpt")
    out = tmp_path / "fp32"
    invoke_ok("export", tmp_path / "ckpt", "-o", out, *LIMITS)
    for target in ("ort", "trt"):
        invoke_ok("fuse", out, "--target", target)
    invoke_ok("quantize", out)
    invoke_ok("ort-search", out)
    graphs = ("encoder.onnx", "decoder.onnx")
    for folder in (out, out / "fused" / "ort", out / "fused" / "trt", out / "quantized" / "ort-int8"):
        assert_external(folder, *graphs)
    assert_external(out / "generate" / "ort", "generate.onnx")  # BeamSearch's subgraphs' weights included
    manifest = json.loads((out / "manifest.json").read_text())
    assert {"encoder.onnx.data", "decoder.onnx.data"} <= set(manifest["files"])

    # every graph set against the eager model (the import proved it equal to transformers), localisation included
    for graph_set in ("plain", "fused-ort", "fused-trt", "int8-ort", "generate"):
        output = invoke_ok("validate", out, "--graphs", graph_set, "--samples", 8, "--localize")
        assert "parity passed" in output, (graph_set, output)
    sources = [[int(t) for t in np.random.default_rng(i).integers(1, 96, 5 + i)] + [0] for i in range(4)]
    for beam in (1, 3):
        want = hf_tokens(src, sources, beam, 12)
        for backend in ("ort", "ort-fused", "ort-generate"):
            assert translated(out, tmp_path, sources, backend, beam, 12) == want, (backend, beam)
    if HAS_RTX:  # TensorRT-RTX's parser reads the fused graphs' data files from their folder (parse_from_file)
        assert "engines in" in invoke_ok("build", out, "--backend", "tensorrt-rtx", "--target", "sm_86")

    # serve's repository: the data file beside model.onnx, renamed by the rule, and the graph reads it
    import onnxruntime as ort

    invoke_ok("serve", out, "--write-repository", tmp_path / "repo")
    copied = tmp_path / "repo" / "encoder" / "1" / "model.onnx"
    assert_external(copied.parent, "model.onnx")
    feed = {"input_ids": np.array([sources[0]]), "attention_mask": np.ones((1, len(sources[0])), np.int64)}
    repo = ort.InferenceSession(str(copied), providers=["CPUExecutionProvider"]).run(None, feed)
    fused = ort.InferenceSession(str(out / "fused" / "ort" / "encoder.onnx"),
                                 providers=["CPUExecutionProvider"]).run(None, feed)
    assert all(np.array_equal(a, b) for a, b in zip(repo, fused))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_reduced_precision_exports_with_external_data_validate(make_hf_model, tmp_path, monkeypatch, dtype):
    """fp16/bf16 graphs' fp32 twins (validate's structure check, bf16's emulation on CPU) widen external weights by
    Casts in the session instead of rewriting them: the checks still pass, graph level and end to end."""
    monkeypatch.setenv(graph_files.THRESHOLD_ENV, "0")
    src = make_hf_model(tmp_path / "src", "marian", SHAPE, std=0.1)
    invoke_ok("import", "hf", src, "-o", tmp_path / "ckpt")
    out = tmp_path / dtype
    invoke_ok("export", tmp_path / "ckpt", "-o", out, "--dtype", dtype, *LIMITS)
    invoke_ok("fuse", out, "--target", "ort")
    assert_external(out, "encoder.onnx", "decoder.onnx")
    for graph_set in ("plain", "fused-ort"):
        output = invoke_ok("validate", out, "--graphs", graph_set, "--samples", 8)
        assert "parity passed" in output, (graph_set, output)


def test_whisper_features_graph_with_external_data(tmp_path, monkeypatch):
    """features.onnx (the log-mel front end) written with external data computes what it computes in one file."""
    from seq2trt.exporters.whisper_features import FeatureParams, run_features, write_features_graph

    params = FeatureParams.from_extractor(transformers.WhisperFeatureExtractor(feature_size=80))
    audio = np.random.default_rng(0).normal(0, 0.1, (2, 16000)).astype(np.float32)
    (tmp_path / "one").mkdir()
    whole = write_features_graph(tmp_path / "one" / "features.onnx", params)
    monkeypatch.setenv(graph_files.THRESHOLD_ENV, "0")
    (tmp_path / "ext").mkdir()
    split = write_features_graph(tmp_path / "ext" / "features.onnx", params)
    assert_external(split.parent, "features.onnx")
    np.testing.assert_array_equal(run_features(split, audio), run_features(whole, audio))


def test_threshold_setting_is_checked(monkeypatch):
    monkeypatch.setenv(graph_files.THRESHOLD_ENV, "2GB")
    with pytest.raises(ConfigError, match=graph_files.THRESHOLD_ENV):
        graph_files.threshold()
    monkeypatch.setenv(graph_files.THRESHOLD_ENV, str(graph_files.PROTOBUF_LIMIT))  # one file could not hold it
    with pytest.raises(ConfigError, match="unset it"):
        graph_files.threshold()
    monkeypatch.delenv(graph_files.THRESHOLD_ENV)
    assert graph_files.threshold() == graph_files.DEFAULT_THRESHOLD < graph_files.PROTOBUF_LIMIT


# -- past 2 GiB for real ------------------------------------------------------------------------------------------
# A Marian whose shared embedding alone passes protobuf's cap: vocabulary x d_model x 4 bytes > 2**31, so both graphs
# (each holds the embedding) and the checkpoint do. d_model 512 with 1,050,000 tokens is 2.0027 GiB of embedding; a
# wider, shorter table costs the same bytes and more per-layer time. The model's own limit of 4 new tokens keeps the
# import's proof small: it holds sources x steps x vocabulary logits, in float64, from both models.
BIG_VOCAB, BIG_D, BIG_NEW_TOKENS = 1_050_000, 512, 4
BIG_MARIAN = f"""
import sys, torch, transformers
cfg = transformers.MarianConfig(
    vocab_size={BIG_VOCAB}, d_model={BIG_D}, encoder_layers=1, decoder_layers=1, encoder_attention_heads=8,
    decoder_attention_heads=8, encoder_ffn_dim=1024, decoder_ffn_dim=1024, max_position_embeddings=64,
    pad_token_id={BIG_VOCAB - 1}, decoder_start_token_id={BIG_VOCAB - 1}, eos_token_id=0, scale_embedding=True)
torch.manual_seed(0)
model = transformers.MarianMTModel(cfg).eval()
with torch.no_grad():
    for p in model.parameters():
        if p.dim() > 1:
            p.normal_(0, 0.1)
    model.final_logits_bias.normal_(0, 1)
model.generation_config.num_beams = 1
model.generation_config.max_new_tokens = {BIG_NEW_TOKENS}
model.save_pretrained(sys.argv[1])
"""


@pytest.mark.slow
def test_past_2_gib_end_to_end(tmp_path):
    """import hf -> export -> fuse -> translate on a model whose every graph passes 2 GiB, at the default threshold:
    the tokens are transformers' own greedy ones. The source model is made in a child process (transformers' model
    is not this process's to hold); this process's peak RSS is printed (pytest -s) against the weights' bytes."""
    import subprocess
    import sys

    assert BIG_VOCAB * BIG_D * 4 > graph_files.PROTOBUF_LIMIT
    subprocess.run([sys.executable, "-c", BIG_MARIAN, str(tmp_path / "src")], check=True)
    invoke_ok("import", "hf", tmp_path / "src", "-o", tmp_path / "ckpt")
    out = tmp_path / "out"
    invoke_ok("export", tmp_path / "ckpt", "-o", out, "--max-batch", 2, "--max-src-len", 16, "--max-tgt-len", 16)
    for name in ("encoder.onnx", "decoder.onnx"):
        assert (out / graph_files.data_name(name)).stat().st_size > graph_files.PROTOBUF_LIMIT
        assert (out / name).stat().st_size < 2**20  # the structure alone
    invoke_ok("fuse", out, "--target", "ort")
    sources = [[int(t) for t in np.random.default_rng(i).integers(1, BIG_VOCAB - 1, 4 + i)] + [0] for i in range(3)]
    ours = translated(out, tmp_path, sources, "ort-fused", 1, BIG_NEW_TOKENS)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert ours == hf_tokens(tmp_path / "src", sources, 1, BIG_NEW_TOKENS)
    weights = BIG_VOCAB * BIG_D * 4
    print(f"\npast-2-GiB pipeline: peak RSS {peak / 2**30:.2f} GiB, {peak / weights:.2f}x the embedding's bytes")
