"""`seq2trt bench` on a tiny export: the reports and their keys, ratios, forced-length decoding, CLI errors.

Benchmarks are not tests: nothing here asserts a speed, only that what is reported is complete and consistent.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from seq2trt.reference_model.eager import EagerStepModel
from seq2trt.core.errors import InputError
from seq2trt.validation.bench import measure as bench
from seq2trt.validation.bench import backends as bench_backends
from seq2trt.validation.bench.settings import BenchSettings, parse_backends, parse_ints

from helpers.artifacts import checkpoint_and_export
from helpers.cli import invoke, one_error_line

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def exported(make_model, tmp_path_factory):
    """A tiny model's checkpoint and its export (max batch 4), the manifest naming the checkpoint."""
    for name in ("onnxscript", "onnx_ir", "torch.onnx", "torch.export", "torch._export"):
        logging.getLogger(name).setLevel(logging.ERROR)
    model = make_model(0, torch.float32)
    return checkpoint_and_export(tmp_path_factory.mktemp("bench"), model, max_batch=4)[1], model


@pytest.fixture(scope="module")
def report(exported):
    pytest.importorskip("ctranslate2")
    from seq2trt.exporters.fuse import Target, fuse_artifacts
    from seq2trt.exporters.quantize import quantize_artifacts

    out, _ = exported
    fuse_artifacts(out, Target.ORT)
    quantize_artifacts(out)
    settings = BenchSettings(backends=("eager", "ort", "ort-int8", "ct2", "ct2-int8"), batch_sizes=(1, 3),
                                   repeats=2, warmup=1, src_len=8, new_tokens=5, check_samples=8)
    bench.run_bench(out, settings)
    return out / "reports"


def test_latency_json_has_every_backend_and_batch(report, exported):
    doc = json.loads((report / "latency.json").read_text())
    _, model = exported
    backends = ("eager", "ort", "ort-int8", "ct2", "ct2-int8")
    results = doc["results"]["1"]
    assert set(results) == set(backends)
    for name in backends:
        for batch in ("1", "3"):
            r = results[name][batch]
            assert r["tokens_per_s"] > 0 and r["repeats"] == 2
            assert 0 < r["step_ms_p50"] <= r["step_ms_p90"] <= r["step_ms_p99"]
            assert r["decode_ms_p50"] <= r["decode_ms_p99"]
            # tokens/s counts exactly new_tokens per source
            assert r["tokens_per_s"] == pytest.approx(int(batch) * 5 / (r["decode_ms_p50"] / 1e3), rel=1e-2)
    assert doc["settings"]["new_tokens"] == 5 and doc["settings"]["forced_length"]
    assert doc["checks"]["ct2"]["passed"] and doc["checks"]["ct2"]["identical"] == 8
    int8 = doc["checks"]["ct2-int8"]  # int8 may differ from eager; its record must count what it says
    assert int8["sequences"] == 8 and int8["rate"] == pytest.approx(int8["identical"] / 8)
    assert int8["passed"] == (int8["identical"] + int8["ties"] == 8)
    assert doc["memory"]["ct2"]["peak_rss_mb"] > 0 and doc["memory"]["ort"]["peak_rss_mb"] > 0
    assert doc["builds"]["ct2"]["model_bytes"] > doc["builds"]["ct2-int8"]["model_bytes"]


def test_ratios_are_paired_and_anchored(report):
    doc = json.loads((report / "latency.json").read_text())
    ratios = doc["ratios"]["1"]
    for batch in ("1", "3"):
        assert ratios["eager"][batch]["vs_eager"] == 1.0 and ratios["ct2"][batch]["vs_ct2"] == 1.0
        assert ratios["ct2-int8"][batch]["vs_ct2_int8"] == 1.0
        for name in ("ort", "ort-int8", "ct2-int8"):
            for value in ratios[name][batch].values():
                assert np.isfinite(value) and value > 0


def test_latency_curves_cover_the_bounds(report, exported):
    doc = json.loads((report / "latency.json").read_text())
    cfg = exported[1].cfg
    by_past = doc["step_ms_by_past"]["1"]
    for name in ("eager", "ort"):
        assert {"0", "1", str(cfg.max_tgt_len - 1)} <= set(by_past[name]["3"])
        assert set(doc["encoder_ms"]["1"][name]["1"]) >= {"1", str(cfg.max_src_len)}
    assert str(cfg.max_tgt_len - 1) in by_past["ct2"]["1"] and "0" not in by_past["ct2"]["1"]
    assert "ct2" not in doc["encoder_ms"]["1"]


def test_markdown_and_plots(report):
    md = (report / "latency.md").read_text()
    assert "| ort | 3 |" in md and "vs ct2" in md and "![tokens/s by batch size](tokens_per_s.png)" in md
    for name in ("step_latency.png", "tokens_per_s.png", "error_by_step.png"):
        assert (report / name).read_bytes()[:8] == PNG


def test_error_series_from_parity_and_checks(report, tmp_path):
    from seq2trt.validation.reports import plots

    doc = json.loads((report / "latency.json").read_text())
    by_step = doc["checks"]["ct2"]["logit_abs_err_by_step"]
    assert len(by_step) > 1 and max(by_step) == doc["checks"]["ct2"]["max_abs_logit_diff"]
    series = plots.error_series(doc, {"backend": "ort", "dtype": "fp32",
                                      "end_to_end": {"logit_abs_err_by_step": [1e-6, 2e-6, 0.0]}})
    assert set(series) == {"ort fp32 (parity.json)", "ct2 (bench check)", "ct2-int8 (bench check)"}
    assert plots.error_by_step(series, tmp_path / "e.png").read_bytes()[:8] == PNG
    assert plots.error_by_step({}, tmp_path / "none.png") is None


def test_forced_length_decoding_runs_every_step(exported):
    _, model = exported
    backend = bench_backends.StepModelBackend("eager", EagerStepModel(model), model.cfg, threads=1)
    ids = np.array([[3, 4, 5, model.cfg.eos_id]] * 2)
    seconds, steps = backend.decode(ids, np.ones_like(ids), 7)
    assert len(steps) == 7 and seconds >= sum(steps)
    assert len(backend.step_seconds(ids, np.ones_like(ids), past_len=5, calls=3)) == 3


def test_paired_ratio_is_the_median_of_pairs():
    assert bench.paired_ratio([2.0, 9.0, 4.0], [1.0, 3.0, 4.0]) == 2.0  # pairs 2, 3, 1 -> 2
    assert bench.paired_ratio(None, [1.0]) is None


def test_parse_errors_list_what_is_known():
    with pytest.raises(InputError, match="known backends: eager, eager-cuda, ort, ort-fused, ort-int8, tensorrt"):
        parse_backends("eager,onnx")
    with pytest.raises(InputError, match="integers >= 1"):
        parse_ints("1,0", "--batch-sizes")


def test_one_multi_thread_count_per_run_with_onnx_runtime():
    """ONNX Runtime's shared pool is fixed once per process: 1 and one other count, never two others."""
    BenchSettings(backends=("ort", "ct2"), threads=(1, 2))
    BenchSettings(backends=("eager", "ct2"), threads=(2, 4))
    with pytest.raises(InputError, match="one shared thread pool per process"):
        BenchSettings(backends=("ort-fused",), threads=(1, 2, 4))


def test_latency_json_says_how_each_backend_threads(report):
    doc = json.loads((report / "latency.json").read_text())
    threading = doc["threading"]["1"]
    assert threading["ort"] == threading["ort-int8"] == "1 thread" and threading["eager"] == "1 thread(s)"
    assert threading["ct2"].startswith("1 intra-op thread(s), OpenMP")
    assert "Threading: eager: 1 thread(s); ort: 1 thread" in (report / "latency.md").read_text()


def test_cli_reports_unknown_and_unavailable_backends(exported, monkeypatch):
    out, _ = exported
    result = invoke("bench", out, "--backends", "eager,trt")
    assert result.exit_code == 2 and "known backends: eager, eager-cuda, ort" in result.output
    monkeypatch.setattr("seq2trt.exporters.tensorrt.trt_compat.has_gpu", lambda: False)
    result = invoke("bench", out, "--backends", "ort,tensorrt")
    assert result.exit_code == 2 and "tensorrt: TensorRT engines run only on an NVIDIA GPU" in result.output
    result = invoke("bench", out, "--backends", "ort", "--batch-sizes", "8")
    assert result.exit_code == 2 and "exceed the export's max_batch 4" in result.output
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    result = invoke("bench", out, "--backends", "eager,eager-cuda")
    assert result.exit_code == 2 and "eager-cuda: the eager model on CUDA needs a GPU" in result.output
    assert "available here: eager, ort" in result.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_eager_cuda_is_timed_beside_the_cpu_backends(exported, tmp_path):
    """The GPU baseline: the same reference model on CUDA, timed in the same rounds, with its own ratio column."""
    import shutil

    out, _ = exported
    copy = shutil.copytree(out, tmp_path / "out")
    settings = BenchSettings(backends=("eager", "eager-cuda", "ort"), batch_sizes=(1, 3), repeats=2, warmup=1,
                                   src_len=8, new_tokens=5)
    doc = bench.run_bench(copy, settings)
    assert set(doc["results"]["1"]) == {"eager", "eager-cuda", "ort"}
    assert all(r["tokens_per_s"] > 0 for by_batch in doc["results"]["1"].values() for r in by_batch.values())
    ratios = doc["ratios"]["1"]
    assert ratios["eager-cuda"]["1"]["vs_eager_cuda"] == 1.0 and ratios["ort"]["3"]["vs_eager_cuda"] > 0
    assert doc["threading"]["1"]["eager-cuda"].startswith("cuda")
    assert "| vs eager-cuda |" in (copy / "reports" / "latency.md").read_text()


def test_no_curves_times_decoding_only(exported, tmp_path):
    """--no-curves: tokens/s and step times, no encoder-by-length or step-by-past tables (nor their plot)."""
    import shutil

    out, _ = exported
    copy = shutil.copytree(out, tmp_path / "out", ignore=shutil.ignore_patterns("reports"))
    settings = BenchSettings(backends=("eager", "ort"), batch_sizes=(2,), repeats=1, warmup=0, src_len=6,
                                   new_tokens=4, curves=False)
    doc = bench.run_bench(copy, settings)
    assert doc["results"]["1"]["ort"]["2"]["tokens_per_s"] > 0 and doc["results"]["1"]["ort"]["2"]["step_ms_p50"] > 0
    assert doc["encoder_ms"] == {} and doc["step_ms_by_past"] == {}
    md = (copy / "reports" / "latency.md").read_text()
    assert "Encoder p50" not in md and not (copy / "reports" / "step_latency.png").exists()


@pytest.fixture(scope="module")
def sample_report(exported, tmp_path_factory):
    """`bench --search sample --n-best 2` (temperature 0.8, top-k 5) of eager, ort and ct2 through the CLI."""
    pytest.importorskip("ctranslate2")
    import shutil

    out, _ = exported
    copy = shutil.copytree(out, tmp_path_factory.mktemp("sample") / "out", ignore=shutil.ignore_patterns("reports"))
    result = invoke("bench", copy, "--backends", "eager,ort,ct2", "--search", "sample", "--n-best", 2,
                    "--temperature", 0.8, "--top-k", 5, "--batch-sizes", "1,2", "--repeats", 2, "--warmup", 0,
                    "--src-len", 8, "--new-tokens", 5)
    assert result.exit_code == 0, result.output
    return json.loads((copy / "reports" / "latency.json").read_text()), result.output


def test_sample_bench_rows_beside_greedy(sample_report):
    """Sampling rows: forced length (B x n x new_tokens tokens), the warpers as asked, and each backend's greedy
    decode of the same rows timed in the same turns, with sampling's extra cost per step."""
    doc, output = sample_report
    assert doc["settings"]["search"] == "sample" and doc["settings"]["forced_length"]
    for name in ("eager", "ort", "ct2"):
        for batch in ("1", "2"):
            r = doc["results"]["1"][name][batch]
            assert (r["search"], r["n_best"], r["temperature"], r["top_k"], r["top_p"]) == ("sample", 2, 0.8, 5, 1.0)
            assert r["tokens_per_s"] == pytest.approx(int(batch) * 2 * 5 / (r["decode_ms_p50"] / 1e3), rel=1e-2)
            assert r["greedy_decode_ms_p50"] > 0 and np.isfinite(r["sampling_extra_fraction"])
            assert np.isfinite(r["sampling_extra_ms_per_step"])
    assert doc["ratios"]["1"]["ort"]["2"]["vs_ct2"] > 0 and doc["ratios"]["1"]["ort"]["2"]["vs_eager"] > 0
    assert "ort B=  2 sample n-best 2:" in output and "of a greedy step" in output


def test_fast_sampling_bench_rows_and_its_refusal(exported, tmp_path):
    """--fast-sampling: our loops' rows say so beside their greedy decodes; without --search sample it is refused."""
    import shutil

    out, _ = exported
    copy = shutil.copytree(out, tmp_path / "out", ignore=shutil.ignore_patterns("reports"))
    result = invoke("bench", copy, "--backends", "eager,ort", "--search", "sample", "--fast-sampling", "--top-k", 5,
                    "--batch-sizes", "2", "--repeats", 2, "--warmup", 0, "--src-len", 8, "--new-tokens", 5)
    assert result.exit_code == 0, result.output
    doc = json.loads((copy / "reports" / "latency.json").read_text())
    for name in ("eager", "ort"):
        r = doc["results"]["1"][name]["2"]
        assert r["fast_sampling"] is True and np.isfinite(r["sampling_extra_fraction"])
    one_error_line(invoke("bench", copy, "--fast-sampling"), 2,
                   "--fast-sampling sets how --search sample draws")


def test_sample_bench_checks_ct2_sampling_as_a_distribution(sample_report):
    """CTranslate2 samples from its own random stream: its first tokens pass the chi-square test against the eager
    model's probabilities (temperature 0.8, top-k 5) before it is timed."""
    doc, _ = sample_report
    check = doc["checks"]["ct2"]["sampling"]
    assert check["passed"] and check["draws"] == 2000 and check["sources"] == 4 and check["impossible"] == 0
    from seq2trt.validation.sampling_distribution import ALPHA

    assert check["p_value"] >= check["alpha"] == ALPHA


def test_sampling_options_reach_each_backend(exported):
    """The warpers and the seed reach the shared loop and CTranslate2: eager samples are the loop's own under the seed
    (and differ from greedy); CTranslate2 with top-k 1 is its greedy search, with n samples a source it returns n; a
    planted wrong temperature fails the chi-square test of its first tokens."""
    pytest.importorskip("ctranslate2")
    from dataclasses import replace

    from seq2trt.reference_model.decoding import DecodeSettings, greedy_decode
    from seq2trt.reference_model.vocab import pad_batch
    from seq2trt.validation import sampling_distribution as judge
    from seq2trt.validation.bench import ct2_baseline
    from seq2trt.validation.bench.settings import Sampling

    out, model = exported
    cfg = model.cfg
    ids, mask = bench._sources(cfg, 3, 6, np.random.default_rng(1))
    eager = bench_backends.StepModelBackend("eager", EagerStepModel(model), cfg, threads=1)
    options = Sampling(temperature=1.5, top_k=0, top_p=0.9, n=2, seed=7)
    _, steps, got = eager.sample(ids, mask, 6, options)
    want = DecodeSettings(cfg.bos_id, bench_backends.NEVER, cfg.pad_id, 6, do_sample=True, temperature=1.5, top_k=0,
                          top_p=0.9, seed=7, num_return_sequences=2, output_scores=True)
    assert got == bench_backends.sequences(greedy_decode(EagerStepModel(model), ids, mask, want)) and len(steps) == 6
    _, greedy = eager.search(ids, mask, DecodeSettings(cfg.bos_id, bench_backends.NEVER, cfg.pad_id, 6), 1, 1.0)
    assert len(got) == 6 and got[::2] != greedy
    folder = ct2_baseline.convert(model, out / "ct2-options", force=True)
    translator = ct2_baseline.Ct2Translator(folder)
    worker = bench_backends.Ct2Backend("ct2", folder, translator.source_tokens, 1, "float32")
    try:
        _, _, top1 = worker.sample(ids, mask, 6, replace(options, top_k=1, n=1))
        forced_greedy = worker._ask({"op": "decode", "sources": worker._sources(ids, mask), "new_tokens": 6,
                                     "forced": True, "step_times": False})["tokens"]
        assert top1 == forced_greedy and len(top1) == 3
        _, _, two = worker.sample(ids, mask, 6, options)
        assert len(two) == 6 and all(len(row) == 6 for row in two)
    finally:
        worker.close()
    settings = replace(DecodeSettings.for_model(cfg, 1), do_sample=True, temperature=0.8, top_k=5)
    sources = [row.tolist() for row in ids]
    probs = judge.first_token_probs(EagerStepModel(model), sources, settings)
    wrong = Sampling(temperature=1.2, top_k=5, top_p=1.0, n=1, seed=3)
    failed = judge.chi_square(ct2_baseline.first_token_counts(translator, ids, mask, wrong, 2000, probs.shape[1]), probs)
    assert not failed, failed
    right = replace(wrong, temperature=0.8)
    assert judge.chi_square(ct2_baseline.first_token_counts(translator, ids, mask, right, 2000, probs.shape[1]), probs)


def test_beam_n_best_rows(exported, tmp_path):
    """--search beam --n-best 2: every backend returns two hypotheses a source (CTranslate2 num_hypotheses with
    return_scores); tokens/s counts every returned sequence."""
    pytest.importorskip("ctranslate2")
    import shutil

    out, _ = exported
    copy = shutil.copytree(out, tmp_path / "out", ignore=shutil.ignore_patterns("reports"))
    settings = BenchSettings(backends=("eager", "ort", "ct2"), batch_sizes=(1, 2), repeats=1, warmup=0, src_len=8,
                             new_tokens=6, check_samples=8, search="beam", beam=2, n_best=2, curves=False)
    doc = bench.run_bench(copy, settings)
    for name in ("eager", "ort", "ct2"):
        for batch in ("1", "2"):
            r = doc["results"]["1"][name][batch]
            assert r["search"] == "beam" and r["beam"] == 2 and r["n_best"] == 2 and r["tokens_per_s"] > 0
            assert "sampling_extra_fraction" not in r


def test_ct2_top_k_over_the_vocabulary_is_the_whole_vocabulary():
    """Hugging Face keeps min(k, V) tokens; CTranslate2 refuses a sampling_topk above its vocabulary: k >= V is its 0."""
    from seq2trt.validation.bench.settings import Sampling

    assert Sampling(1.0, 50, 1.0, 1, 0, vocab_size=34).ct2()["sampling_topk"] == 0
    assert Sampling(1.0, 33, 1.0, 1, 0, vocab_size=34).ct2()["sampling_topk"] == 33


def test_sampling_and_n_best_settings_are_checked():
    with pytest.raises(InputError, match="greedy search returns one sequence"):
        BenchSettings(n_best=2)
    with pytest.raises(InputError, match="more than the 2 beams"):
        BenchSettings(search="beam", beam=2, n_best=3)
    with pytest.raises(InputError, match="--temperature must be > 0"):
        BenchSettings(search="sample", temperature=0.0)
    with pytest.raises(InputError, match="ort-generate: generate.onnx runs beam search and does not sample"):
        BenchSettings(backends=("ort", "ort-generate"), search="sample")
