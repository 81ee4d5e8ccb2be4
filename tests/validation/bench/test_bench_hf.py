"""`seq2trt bench` against what users of a Hugging Face model run today: `hf` (transformers' generate) and `optimum`
(Optimum's ONNX Runtime export) on the directory an imported checkpoint came from, and `ct2` converted from that
directory by CTranslate2's own converter. Small random models made with the family's config class, no downloads.

The converters are judged against transformers' own `generate` on the source directory, never against the bench.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed")
pytest.importorskip("ctranslate2")

from seq2trt.core.errors import CheckpointError, DependencyError  # noqa: E402
from seq2trt.hf_import.importer import config_from_hf  # noqa: E402
from seq2trt.hf_import.proof import load_transformers_model, seeded_sources  # noqa: E402
from seq2trt.reference_model.vocab import pad_batch  # noqa: E402
from seq2trt.runtime import registry  # noqa: E402
from seq2trt.validation.bench import ct2_baseline as ct2_backend  # noqa: E402
from seq2trt.validation.bench import hf_baselines as hf_backends  # noqa: E402

from helpers.artifacts import checkpoint_and_export, import_and_export  # noqa: E402
from helpers.cli import invoke  # noqa: E402
from helpers.hf_models import hf_rows  # noqa: E402

NEW_TOKENS = 5
# optimum-onnx pins transformers<4.58: under transformers 5 the bench measures the rest and says why (CI's second
# pass, under 4.57, installs it and measures it).
OPTIMUM_WHY = registry.unavailable(("optimum",)).get("optimum")
PEERS = ("hf", "ct2") if OPTIMUM_WHY else ("hf", "optimum", "ct2")


def zero_pad_row(src, pad_id: int) -> None:
    """A trained Marian's pad embedding is zero (padding_idx); CTranslate2 starts its decoder from a zero embedding
    instead of the pad's, so a random model must have it too."""
    from transformers import AutoModelForSeq2SeqLM

    model = AutoModelForSeq2SeqLM.from_pretrained(str(src))
    with torch.no_grad():
        model.get_input_embeddings().weight[pad_id].zero_()
    model.save_pretrained(src)


def marian_src(make_hf_model, path, n: int = 97):
    """An opus-mt-like Marian (swish, scaled embeddings, pad suppressed, as the hub's generation configs say)."""
    make_hf_model(path, "marian", dict(vocab_size=n, pad_token_id=n - 1, decoder_start_token_id=n - 1,
                                       activation_function="swish", scale_embedding=True),
                  dict(bad_words_ids=[[n - 1]], num_beams=4))
    zero_pad_row(path, n - 1)
    return path


@pytest.fixture(scope="module")
def imported(make_hf_model, make_marian_tokenizer, tmp_path_factory):
    """A Marian with its own tokenizer, imported, exported (max batch 4) and fused for ORT."""
    root = tmp_path_factory.mktemp("bench_hf")
    src, n = make_marian_tokenizer(root / "src")
    marian_src(make_hf_model, src, n)
    return import_and_export(src, root, "--max-batch", 4)


@pytest.fixture(scope="module")
def report(imported):
    out = imported / "out"
    result = invoke("bench", out, "--backends", "ort-fused,hf,optimum,ct2", "--batch-sizes", "1,3", "--repeats", 2,
                    "--warmup", 1, "--src-len", 8, "--new-tokens", NEW_TOKENS)
    assert result.exit_code == 0, result.output
    if OPTIMUM_WHY:
        assert f"not measured: optimum: {OPTIMUM_WHY}" in result.output
    return json.loads((out / "reports" / "latency.json").read_text()), out


@pytest.mark.slow
def test_bench_times_hf_optimum_and_ct2_with_ratios(report):
    doc, out = report
    backends = ("ort-fused", *PEERS)
    assert set(doc["results"]["1"]) == set(backends)
    assert doc["not_measured"] == ({"optimum": OPTIMUM_WHY} if OPTIMUM_WHY else {})
    for name in backends:
        for batch in ("1", "3"):
            r = doc["results"]["1"][name][batch]
            assert r["tokens_per_s"] > 0 and r["repeats"] == 2
            assert r["tokens_per_s"] == pytest.approx(int(batch) * NEW_TOKENS / (r["decode_ms_p50"] / 1e3), rel=1e-2)
            ratio = doc["ratios"]["1"][name][batch]
            assert set(ratio) == {f"vs_{peer}" for peer in PEERS}
            assert all(np.isfinite(v) and v > 0 for v in ratio.values())
    for name in PEERS:
        assert doc["ratios"]["1"][name]["1"][f"vs_{name}"] == 1.0
    md = (out / "reports" / "latency.md").read_text()
    assert "transformers" in doc["threading"]["1"]["hf"]
    if OPTIMUM_WHY:
        assert "| vs eager | vs hf | vs ct2 |" in md and "optimum" not in md
    else:
        assert "| vs eager | vs hf | vs optimum | vs ct2 |" in md and "| optimum conversion | *.onnx" in md
        assert doc["threading"]["1"]["optimum"].startswith("1 thread")


@pytest.mark.slow
def test_every_reference_passed_its_check_before_timing(report):
    doc, out = report
    for name in PEERS:
        check = doc["checks"][name]
        assert check["passed"] and check["sequences"] == 40 and check["identical"] + check["ties"] == 40
    ct2 = doc["checks"]["ct2"]
    assert ct2["identical"] > ct2["ties"]  # the check compares tokens: a tie within CTranslate2's error is the exception
    assert doc["builds"]["ct2"]["converter"] == "CTranslate2's TransformersConverter"
    assert ("optimum" in doc["builds"]) == (OPTIMUM_WHY is None)
    if OPTIMUM_WHY is None:
        assert doc["builds"]["optimum"]["model_bytes"] > 0
        assert (out / "optimum" / "decoder_model_merged.onnx").exists()


@pytest.mark.slow
def test_beam_bench_checks_and_times_generate_beam_search(imported, tmp_path):
    """--search beam: hf and optimum run generate's own beam search, checked first against hf_beam_search (which the
    import proved equal to transformers' generate), then timed beside ours."""
    import shutil

    out = shutil.copytree(imported / "out", tmp_path / "out", ignore=shutil.ignore_patterns("reports"))
    result = invoke("bench", out, "--backends", "ort-fused,hf,optimum", "--search", "beam", "--beam-size", 2,
                    "--length-penalty", 0.8, "--batch-sizes", "1,2", "--repeats", 1, "--warmup", 0, "--new-tokens", 12)
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "reports" / "latency.json").read_text())
    for name in (p for p in PEERS if p != "ct2"):
        beam = doc["checks"][name]["beam"]
        assert beam["beam"] == 2 and beam["identical"] == beam["sequences"] == 40
        for batch in ("1", "2"):
            row = doc["results"]["1"][name][batch]
            assert row["search"] == "beam" and row["beam"] == 2 and row["tokens_per_s"] > 0
    assert doc["ratios"]["1"]["ort-fused"]["2"]["vs_hf"] > 0
    assert doc["ratios"]["1"]["ort-fused"]["2"].get("vs_optimum", 1) > 0


@pytest.mark.slow
def test_ct2_from_the_source_equals_transformers_generate(imported, tmp_path):
    """Judged by transformers: CTranslate2's own conversion of the source (its tokenizer's names) decodes as
    generate does, without the forced eos CTranslate2 lacks."""
    src = imported / "src"
    _, cfg, _ = config_from_hf(src)
    translator = ct2_backend.Ct2Translator(ct2_backend.convert_hf(src, cfg, tmp_path / "ct2"), threads=1)
    assert translator.target_tokens[0] == "</s>" and len(translator.target_tokens) == cfg.tgt_vocab_size - 1
    ids, mask = pad_batch(seeded_sources(cfg, 12, seed=3), cfg.pad_id)
    assert translator.greedy(ids, mask, 20).tokens == hf_rows(load_transformers_model(src), ids, mask, 20, cfg.eos_id, num_beams=1, forced_eos_token_id=None)


@pytest.mark.parametrize("family", ["marian", "bart"])
def test_ct2_conversion_without_a_tokenizer(family, make_hf_model, tmp_path):
    """A source without tokenizer files: ids get synthetic names (Marian's pad dropped as CTranslate2 drops it)."""
    src = marian_src(make_hf_model, tmp_path / "src") if family == "marian" else \
        make_hf_model(tmp_path / "src", family)
    _, cfg, _ = config_from_hf(src)
    translator = ct2_backend.Ct2Translator(ct2_backend.convert_hf(src, cfg, tmp_path / "ct2"), threads=1)
    assert len(translator.target_tokens) == cfg.tgt_vocab_size - (family == "marian")
    ids, mask = pad_batch(seeded_sources(cfg, 8, seed=4), cfg.pad_id)
    want = hf_rows(load_transformers_model(src), ids, mask, 12, cfg.eos_id, num_beams=1, forced_eos_token_id=None)
    assert len({tuple(w) for w in want}) > 1, "want varied outputs"
    assert translator.greedy(ids, mask, 12).tokens == want


@pytest.mark.slow
def test_generate_backends_decode_exactly_the_forced_length(imported):
    """hf and optimum time the bench's work: exactly N tokens per row, one step time per token."""
    source = hf_backends.imported_source(imported / "ckpt")
    _, cfg, _ = config_from_hf(source.path)
    ids, mask = pad_batch(seeded_sources(cfg, 3, seed=5), cfg.pad_id)
    if OPTIMUM_WHY:  # not installed beside this transformers: opening it says how to get it
        with pytest.raises(DependencyError, match=r"pip install 'seq2trt\[optimum\]'"):
            hf_backends.open_backend("optimum", source, imported / "out", threads=1)
    for name in (p for p in PEERS if p != "ct2"):
        backend = hf_backends.open_backend(name, source, imported / "out", threads=1)
        try:
            backend.activate()
            seconds, steps = backend.decode(ids, mask, 7)
            assert len(steps) == 7 and seconds > sum(steps) > 0
            assert backend.encode_seconds(ids, mask) > 0
        finally:
            backend.close()


def test_imported_source_refuses_a_changed_directory(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"weights")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "import.json").write_text(json.dumps({"family": "marian", "source": {
        "path": str(src), "weights_sha256": {"model.safetensors": "0" * 64}}}))
    with pytest.raises(CheckpointError, match="not the file imported.*restore it or re-import"):
        hf_backends.imported_source(ckpt)
    assert hf_backends.imported_source(src) is None  # no import.json: not imported


@pytest.fixture(scope="module")
def plain_export(make_model, tmp_path_factory):
    """A checkpoint trained here (not imported) and its export, not fused (a test names the missing fused graphs)."""
    return checkpoint_and_export(tmp_path_factory.mktemp("plain"), make_model(0, torch.float32), max_batch=4)[1]


@pytest.mark.parametrize("backends", ["ort,hf", "optimum", "hf,optimum"])
def test_hf_backends_need_an_imported_checkpoint(plain_export, backends):
    result = invoke("bench", plain_export, "--backends", backends, "--batch-sizes", 1, "--repeats", 1, "--warmup", 0)
    assert result.exit_code == 2
    if OPTIMUM_WHY and backends == "optimum":  # nothing left to measure: the one reason
        assert f"cannot bench optimum: {OPTIMUM_WHY}" in result.output
        return
    wanted = ", ".join(n for n in backends.split(",") if n != "ort" and not (n == "optimum" and OPTIMUM_WHY))
    assert f"{wanted}: these backends time transformers and Optimum" in result.output
    assert "was not imported (it holds no import.json)" in result.output and "seq2trt import hf" in result.output


def test_missing_fused_graphs_are_named_by_the_one_opener(plain_export):
    result = invoke("bench", plain_export, "--backends", "ort-fused", "--batch-sizes", 1, "--repeats", 1, "--warmup", 0)
    assert result.exit_code != 0 and f"seq2trt fuse {plain_export} --target ort" in result.output


@pytest.mark.slow
def test_generate_bench_on_an_imported_model_applies_its_rules(imported, tmp_path):
    """Greedy bench of ort-generate on an imported Marian: generate.onnx holds the model's rules (suppressed pad,
    forced eos), and the bench asks for exactly those (it once asked for none and was refused); timed rows equal
    the forced length."""
    import shutil

    out = shutil.copytree(imported / "out", tmp_path / "out", ignore=shutil.ignore_patterns("reports"))
    assert invoke("ort-search", out).exit_code == 0
    result = invoke("bench", out, "--backends", "ort-fused,ort-generate", "--batch-sizes", "1,3", "--repeats", 1,
                    "--warmup", 0, "--new-tokens", 8, "--no-curves")
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "reports" / "latency.json").read_text())
    for batch in ("1", "3"):
        for name in ("ort-fused", "ort-generate"):
            assert doc["results"]["1"][name][batch]["tokens_per_s"] > 0


@pytest.mark.slow
def test_sample_and_n_best_bench_against_transformers(imported, tmp_path):
    """--search sample --n-best 2: transformers' generate(do_sample=True, num_return_sequences=2) must sample the eager
    model's tokens under the same seed before it is timed (the same q stream), CTranslate2 its first-token
    distribution; --search beam --n-best 2: generate's two hypotheses equal hf_beam_search's."""
    import shutil

    out = shutil.copytree(imported / "out", tmp_path / "out", ignore=shutil.ignore_patterns("reports"))
    result = invoke("bench", out, "--backends", "ort-fused,hf,ct2", "--search", "sample", "--n-best", 2, "--top-k", 8,
                    "--top-p", 0.9, "--temperature", 0.9, "--batch-sizes", "1,2", "--repeats", 1, "--warmup", 0,
                    "--new-tokens", 6)
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "reports" / "latency.json").read_text())
    sample = doc["checks"]["hf"]["sample"]
    assert sample["identical"] == sample["sequences"] == 80 and (sample["top_k"], sample["n"]) == (8, 2)
    assert doc["checks"]["ct2"]["sampling"]["passed"]
    for name in ("ort-fused", "hf", "ct2"):
        row = doc["results"]["1"][name]["2"]
        assert row["search"] == "sample" and row["n_best"] == 2 and row["greedy_decode_ms_p50"] > 0
    result = invoke("bench", out, "--backends", "ort-fused,hf,ct2", "--search", "beam", "--beam-size", 3, "--n-best", 2,
                    "--batch-sizes", "1", "--repeats", 1, "--warmup", 0, "--new-tokens", 8)
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "reports" / "latency.json").read_text())
    beam = doc["checks"]["hf"]["beam"]
    assert beam["n_best"] == 2 and beam["identical"] == beam["sequences"] == 80
    assert doc["results"]["1"]["hf"]["1"]["n_best"] == 2
