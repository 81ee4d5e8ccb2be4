"""`seq2trt ort-search`, `translate --backend ort-generate` and `validate --graphs generate` through the CLI, judged by
the eager searches (a model trained here) and by transformers' generate (an imported Marian)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from seq2trt.reference_model.decoding import DecodeSettings, greedy_decode, hf_beam_search
from seq2trt.reference_model.eager import EagerStepModel
from seq2trt.reference_model.vocab import pad_batch

from helpers.artifacts import import_and_export
from helpers.cli import invoke, invoke_ok

HAS_HF = importlib.util.find_spec("transformers") is not None


@pytest.fixture(scope="module")
def numbers_generate(numbers_export, tmp_path_factory):
    """A copy of the session's numbers export (these tests add graphs and reports to it) with its BeamSearch graph."""
    import shutil

    root, model, task = numbers_export
    copy = tmp_path_factory.mktemp("numbers") / "out"
    shutil.copytree(root / "out", copy)
    invoke_ok("ort-search", copy)
    return copy.parent, model, task


@pytest.mark.parametrize("beam", [1, 3])
def test_translate_ort_generate_is_the_eager_search(numbers_generate, beam):
    root, model, task = numbers_generate
    texts = ["40213", "7", "999999", "120"]
    result = invoke("translate", root / "out", *texts, "--backend", "ort-generate", "--beam-size", beam, "--length-penalty", 0.0)
    assert result.exit_code == 0, result.output
    ids, mask = pad_batch([task.source_vocab.encode(t) + [model.cfg.eos_id] for t in texts], model.cfg.pad_id)
    settings, step = DecodeSettings.for_model(model.cfg), EagerStepModel(model.double())
    want = greedy_decode(step, ids, mask, settings) if beam == 1 else hf_beam_search(step, ids, mask, settings, beam,
                                                                                     0.0, True)
    assert result.output.splitlines() == [task.target_vocab.decode(w) for w in want]


def test_generate_cli_errors_are_clear(numbers_generate):
    root, _, _ = numbers_generate
    result = invoke("ort-search", root / "out")
    assert result.exit_code != 0 and "pass --force" in result.output
    result = invoke("translate", root / "out", "7", "--backend", "ort-generate", "--beam-size", 9)
    assert result.exit_code != 0 and "max_batch" in result.output


def test_the_old_generate_verb_and_function_warn_and_write_the_same_graph(numbers_generate):
    """`seq2trt generate` and seq2trt.generate, the old names of ort-search, still build the graph, saying the new
    name; the graph they write is the one ort-search wrote (same record, same bytes)."""
    import warnings

    import seq2trt

    root, _, _ = numbers_generate
    graph = root / "out" / "generate" / "ort" / "generate.onnx"
    before = graph.read_bytes()
    result = invoke("generate", root / "out", "--force")
    assert result.exit_code == 0, result.output
    assert result.stderr == "warning: `seq2trt generate` is deprecated; use `seq2trt ort-search`\n"
    assert graph.read_bytes() == before
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = seq2trt.generate(root / "out", force=True)
    assert [str(w.message) for w in caught if w.category is FutureWarning] == \
        ["seq2trt.generate is deprecated; use seq2trt.ort_search"]
    assert old.graph == graph and graph.read_bytes() == before
    listed = [line.split()[0] for line in invoke("--help").output.split("Commands:")[1].splitlines() if line.strip()]
    assert "ort-search" in listed and "generate" not in listed  # the old verb is hidden


def test_validate_graphs_generate(numbers_generate):
    root, _, _ = numbers_generate
    result = invoke("validate", root / "out", "--graphs", "generate", "--samples", 24, "--beam-size", 2)
    assert result.exit_code == 0, result.output
    doc = json.loads((root / "out" / "reports" / "generate_parity.json").read_text())
    assert doc["passed"] and doc["end_to_end"]["samples"] == 24 and doc["settings"]["beam_size"] == 2


def test_validate_graphs_generate_int8(numbers_generate):
    """The int8 graphs' generate.onnx (`generate --int8`) is validated end to end by int8's targets, in its own
    report; before it exists the command names the step that makes it."""
    root, _, _ = numbers_generate
    result = invoke("validate", root / "out", "--graphs", "generate-int8", "--samples", 8)
    assert result.exit_code != 0 and "seq2trt ort-search" in result.output and "--int8" in result.output
    assert "Traceback" not in result.output
    for args in (("quantize", root / "out"), ("ort-search", root / "out", "--int8")):
        result = invoke(*args)
        assert result.exit_code == 0, result.output
    result = invoke("validate", root / "out", "--graphs", "generate-int8", "--samples", 24, "--beam-size", 2)
    assert result.exit_code == 0, result.output
    doc = json.loads((root / "out" / "reports" / "generate_int8_parity.json").read_text())
    assert doc["passed"] and doc["precision"] == "int8" and doc["backend"] == "ort-generate-int8"
    assert doc["targets"]["token_agreement"] < 1.0 and doc["end_to_end"]["samples"] == 24
    assert doc["end_to_end"]["greedy"]["token_agreement"] >= doc["targets"]["token_agreement"]
    assert "int8" in (root / "out" / "reports" / "generate_int8_parity.md").read_text()


@pytest.mark.slow
@pytest.mark.skipif(not HAS_HF, reason="the hf extra is not installed")
def test_ort_generate_of_an_imported_marian_is_transformers_generate(make_hf_model, make_marian_tokenizer, tmp_path):
    from seq2trt.hf_import.proof import load_transformers_model

    src, n = make_marian_tokenizer(tmp_path / "src")
    make_hf_model(src, "marian", dict(vocab_size=n, pad_token_id=n - 1, decoder_start_token_id=n - 1,
                                      activation_function="swish", scale_embedding=True),
                  dict(bad_words_ids=[[n - 1]], num_beams=4, length_penalty=0.8, early_stopping=True))
    import_and_export(src, tmp_path, "--max-batch", 8)
    invoke_ok("ort-search", tmp_path / "out")
    sources = [[5, 9, 13, 0], [22, 0], [7, 7, 30, 41, 12, 0], [60, 3, 0], [11, 0]]
    (tmp_path / "ids.jsonl").write_text("".join(json.dumps(s) + "\n" for s in sources))
    hf_model = load_transformers_model(src)
    ids, mask = pad_batch(sources, hf_model.config.pad_token_id)
    eos = hf_model.config.eos_token_id
    for beam in (1, 4):
        result = invoke("translate", tmp_path / "out", "--backend", "ort-generate", "--ids-file", tmp_path / "ids.jsonl",
                        "--beam-size", beam, "--output-ids", tmp_path / "out.jsonl")
        assert result.exit_code == 0, result.output
        got = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
        with torch.inference_mode():
            rows = hf_model.generate(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                                     do_sample=False, max_new_tokens=63, num_beams=beam)[:, 1:].tolist()
        assert got == [r[: r.index(eos)] if eos in r else r for r in rows], beam


def test_bench_search_beam_times_ort_generate(numbers_generate):
    root, _, _ = numbers_generate
    result = invoke("bench", root / "out", "--backends", "ort-fused,ort-generate", "--batch-sizes", "1,2", "--repeats", 1,
                    "--warmup", 0, "--search", "beam", "--beam-size", 3, "--new-tokens", 10)
    assert result.exit_code == 0, result.output
    doc = json.loads((root / "out" / "reports" / "latency.json").read_text())
    assert doc["settings"]["search"] == "beam" and doc["settings"]["beam"] == 3
    row = doc["results"]["1"]["ort-generate"]["2"]
    assert row["search"] == "beam" and row["beam"] == 3 and row["tokens_per_s"] > 0
    assert "nan" not in result.output and "step p50" not in result.output  # a whole search has no step times
    result = invoke("bench", root / "out", "--backends", "ort-generate", "--batch-sizes", 4, "--search", "beam")
    assert result.exit_code != 0 and "exports for beam need max_batch >= B x K" in result.output
