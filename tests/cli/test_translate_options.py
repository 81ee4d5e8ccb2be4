"""`seq2trt translate` with the search options (sampling, n-best lists with scores, length floors, no-repeat
n-grams, repetition penalty) and an imported model's own generation settings, judged by transformers' `generate`
on the same source model; an ORT export decodes the same ids as the checkpoint (one step loop for every backend)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import seq2trt

pytest.importorskip("transformers", reason="the hf extra is not installed")

from seq2trt.hf_import.proof import load_transformers_model  # noqa: E402
from seq2trt.reference_model.vocab import pad_batch  # noqa: E402

from helpers.artifacts import import_and_export  # noqa: E402
from helpers.cli import invoke  # noqa: E402
from helpers.hf_models import hf_generate  # noqa: E402

SOURCES = [[5, 9, 13, 2], [22, 2], [7, 7, 30, 41, 12, 2], [60, 3, 2], [11, 2], [40, 41, 42, 43, 2]]
NEW = 20
# A summarization checkpoint's settings (BART CNN-style): they must apply without a flag.
STORED = dict(min_length=6, no_repeat_ngram_size=3, length_penalty=2.0, num_beams=4, early_stopping=True)


@pytest.fixture(scope="module")
def bart(make_hf_model, tmp_path_factory):
    """A BART with STORED settings, imported and exported (fp32 ORT graphs)."""
    root = tmp_path_factory.mktemp("bart")
    make_hf_model(root / "src", "bart", {}, STORED)
    import_and_export(root / "src", root, "--max-batch", 24, fuse=None)
    (root / "ids.jsonl").write_text("".join(json.dumps(s) + "\n" for s in SOURCES))
    return root


def _generate(root, seed=None, **kwargs):
    hf_model = load_transformers_model(root / "src")
    ids, mask = pad_batch(SOURCES, hf_model.config.pad_token_id)
    if seed is not None:
        torch.manual_seed(seed)
    return hf_generate(hf_model, ids, mask, NEW, hf_model.config.eos_token_id, **kwargs)


def _translate(root, *flags, source="ckpt"):
    out = root / "got.jsonl"
    result = invoke("translate", root / source, "--ids-file", root / "ids.jsonl", "--max-new-tokens", NEW,
                    "--output-ids", out, *flags)
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in out.read_text().splitlines()], result.output.splitlines()


def test_the_models_stored_settings_apply_without_flags(bart):
    got, lines = _translate(bart)
    want, _ = _generate(bart)  # transformers reads the same generation_config.json
    assert got == want and lines == [json.dumps(w) for w in want]
    neutral, _ = _generate(bart, min_length=0, no_repeat_ngram_size=0)
    assert got != neutral, "the stored options changed nothing: the test could not fail"


def test_flags_override_and_n_best_lists_carry_transformers_scores(bart):
    flags = ["--beam-size", 5, "--n-best", 3, "--scores", "--min-length", 4, "--no-repeat-ngram-size", 2,
             "--repetition-penalty", 1.3]
    got, lines = _translate(bart, *flags)
    want, out = _generate(bart, num_beams=5, num_return_sequences=3, output_scores=True, min_length=4,
                          no_repeat_ngram_size=2, repetition_penalty=1.3)
    assert [ids for row in got for ids in row["ids"]] == want
    scores = out.sequences_scores.numpy()
    np.testing.assert_allclose([s for row in got for s in row["scores"]], scores, rtol=1e-5)
    assert len(lines) == 3 * len(SOURCES)
    assert [line.split("\t")[1] for line in lines] == [json.dumps(w) for w in want]
    np.testing.assert_allclose([float(line.split("\t")[0]) for line in lines], scores, rtol=1e-5)


@pytest.mark.parametrize("source", ["ckpt", "out"])
def test_sampling_is_transformers_with_the_same_seed_eager_and_ort(bart, source):
    flags = ["--sample", "--top-k", 12, "--top-p", 0.95, "--temperature", 0.8, "--seed", 7, "--n-best", 2]
    got, _ = _translate(bart, *flags, *(["--backend", "ort"] if source == "out" else []), source=source)
    want, _ = _generate(bart, seed=7, do_sample=True, num_beams=1, top_k=12, top_p=0.95, temperature=0.8,
                        num_return_sequences=2)
    assert [ids for row in got for ids in row["ids"]] == want
    assert len({json.dumps(w) for w in want}) > len(SOURCES), "the two samples of a source never differed"
    again, _ = _translate(bart, *flags[:-4], "--seed", 8, "--n-best", 2)
    assert again != got


def test_an_ort_export_decodes_the_options_as_the_checkpoint(bart):
    flags = ["--beam-size", 3, "--n-best", 2, "--scores", "--repetition-penalty", 1.5, "--min-new-tokens", 5]
    eager, _ = _translate(bart, *flags)
    ort, _ = _translate(bart, *flags, "--backend", "ort", source="out")
    assert [row["ids"] for row in ort] == [row["ids"] for row in eager]
    np.testing.assert_allclose([row["scores"] for row in ort], [row["scores"] for row in eager], rtol=1e-4)


def test_fast_sampling_is_seeded_and_its_own_stream(bart):
    flags = ["--sample", "--top-k", 12, "--seed", 7, "--n-best", 2]
    ids = lambda rows: [row["ids"] for row in rows]
    fast, _ = _translate(bart, *flags, "--fast-sampling")
    assert ids(fast) == ids(_translate(bart, *flags, "--fast-sampling", "--backend", "ort", source="out")[0])
    assert ids(fast) != ids(_translate(bart, *flags)[0])  # not transformers' stream


@pytest.mark.parametrize("source", ["ckpt", "out"])
def test_token_logprobs_are_transformers_transition_scores(bart, source):
    """--token-logprobs on the stored beam settings (beam 4, length_penalty 2.0): compute_transition_scores with
    beam_indices, the closing eos included; eager and ORT alike."""
    got, lines = _translate(bart, "--token-logprobs", "--n-best", 2,
                            *(["--backend", "ort"] if source == "out" else []), source=source)
    want, out = _generate(bart, num_return_sequences=2, output_scores=True)
    assert [ids for row in got for ids in row["ids"]] == want
    steps = load_transformers_model(bart / "src").compute_transition_scores(out.sequences, out.scores,
                                                                            out.beam_indices).numpy()
    lps = [lp for row in got for lp in row["token_logprobs"]]
    assert [len(lp) for lp in lps] == [len(w) + (len(w) < NEW) for w in want]
    for lp, w, row in zip(lps, want, steps):
        np.testing.assert_allclose(lp, row[: len(w) + (len(w) < NEW)], rtol=1e-4, atol=1e-4)
    assert len(lines) == 2 * len(SOURCES) and "\t" not in lines[0]  # no --scores: plain lines
    plain, _ = _translate(bart)
    assert "token_logprobs" not in json.dumps(plain)


@pytest.mark.parametrize("flags, message", [
    (["--temperature", 0.5], "--temperature sets how sampling draws, and this decode does not sample; add --sample"),
    (["--sample", "--top-p", 0], "--top-p must be a number in (0, 1] such as 0.9, got 0.0"),
    (["--sample", "--temperature", 0], "--temperature must be a number > 0 such as 0.7, got 0.0"),
    (["--n-best", 5], "--n-best 5 is more than the 4 beams searched"),
    (["--sample", "--beam-size", 4], "--beam-size 4 with sampling"),
    (["--repetition-penalty", -1], "--repetition-penalty must be a number > 0"),
    (["--no-repeat-ngram-size", -2], "--no-repeat-ngram-size must be an integer >= 0"),
    (["--fast-sampling"], "--fast-sampling sets how sampling draws, and this decode does not sample; add --sample"),
], ids=["temperature-no-sample", "top-p", "temperature", "n-best-over-beams", "sample-beam", "penalty", "ngram",
        "fast-no-sample"])
def test_bad_search_options_are_one_error_line(bart, flags, message):
    result = invoke("translate", bart / "ckpt", "--ids-file", bart / "ids.jsonl", "--output-ids", bart / "bad.jsonl",
                    *flags)
    assert result.exit_code == 2 and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not (bart / "bad.jsonl").exists()


def _with_generate(bart):
    if not (bart / "out" / "generate").exists():
        assert invoke("fuse", bart / "out", "--target", "ort").exit_code == 0
        assert invoke("ort-search", bart / "out").exit_code == 0


def test_ort_generate_refuses_the_options_its_graph_does_not_apply(bart):
    _with_generate(bart)
    result = invoke("translate", bart / "out", "--backend", "ort-generate", "--ids-file", bart / "ids.jsonl",
                    "--sample", "--seed", 3)
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert line.startswith("error: --backend ort-generate runs ONNX Runtime's BeamSearch graph, which does not apply")
    assert "do_sample=True" in line
    for applied in ("min_length", "no_repeat_ngram_size", "num_return_sequences"):
        assert applied not in line  # applied in the graph (below)
    assert "--backend ort" in line and len(line.splitlines()) == 1
    # the Python API is told its keywords, not the CLI's flags (this graph applies no sampling; greedy scores differ)
    with seq2trt.Translator(bart / "out", backend="ort-generate") as translator:
        with pytest.raises(seq2trt.InputError, match=r"^backend=ort-generate runs .* use backend=ort \(") as raised:
            translator.generate(SOURCES, sample=True, seed=3)
        assert "--" not in str(raised.value)
        with pytest.raises(seq2trt.InputError, match=r"use beam_size >= 2 .* or backend=ort for greedy scores"):
            translator.generate(SOURCES, beam_size=1, scores=True)


def test_ort_generate_applies_the_stored_settings_n_best_and_scores_as_transformers(bart):
    """generate.onnx built with the model's own no_repeat_ngram_size (3), its min_length (the stored 6), the
    repetition_penalty input, n-best lists and sequences_scores, with the stored length penalty and early stopping:
    token for token transformers' generate with the same options, and its scores."""
    _with_generate(bart)
    got, lines = _translate(bart, "--backend", "ort-generate", "--repetition-penalty", 1.3, "--n-best", 3,
                            "--scores", source="out")
    want, out = _generate(bart, repetition_penalty=1.3, num_return_sequences=3, output_scores=True)
    assert [ids for row in got for ids in row["ids"]] == want
    np.testing.assert_allclose([s for row in got for s in row["scores"]], out.sequences_scores.numpy(), rtol=1e-5)
    assert len(lines) == 3 * len(SOURCES)
    plain, _ = _generate(bart, no_repeat_ngram_size=0, min_length=0, num_return_sequences=3)
    assert want != plain, "min_length and no_repeat_ngram_size changed nothing: the test could not fail"


def test_ort_generate_refuses_another_ngram_size_until_rebuilt(bart):
    """no_repeat_ngram_size is fixed in the graph: a decode asking another is refused with the command that
    rebuilds it, and the rebuilt graph applies the new size as transformers does."""
    _with_generate(bart)
    result = invoke("translate", bart / "out", "--backend", "ort-generate", "--ids-file", bart / "ids.jsonl",
                    "--no-repeat-ngram-size", 2)
    assert result.exit_code == 2, result.output
    assert "bans repeated n-grams of size 3" in result.output and "asks 2" in result.output
    assert f"seq2trt ort-search {bart / 'out'} --no-repeat-ngram-size 2 --force" in result.output
    result = invoke("ort-search", bart / "out", "--no-repeat-ngram-size", 2, "--force")
    assert result.exit_code == 0 and "no_repeat_ngram_size 2," in result.output, result.output
    try:
        got, _ = _translate(bart, "--backend", "ort-generate", "--no-repeat-ngram-size", 2, source="out")
        want, _ = _generate(bart, no_repeat_ngram_size=2)
        assert got == want
        assert want != _generate(bart)[0], "sizes 2 and 3 decoded alike: the test could not fail"
    finally:  # the module's graph again holds the model's own size
        assert invoke("ort-search", bart / "out", "--force").exit_code == 0
    bad = invoke("ort-search", bart / "out", "--no-repeat-ngram-size", -1, "--force")
    assert bad.exit_code == 2 and "--no-repeat-ngram-size must be an integer >= 0" in bad.output, bad.output


def test_samples_of_a_source_count_against_the_exports_max_batch(bart):
    """Each of --n-best N samples is a decoder row: batches hold max_batch // N sources, and N over it is refused."""
    got, _ = _translate(bart, "--backend", "ort", "--sample", "--seed", 3, "--n-best", 12, "--batch-size", 6,
                        source="out")  # 6 sources x 12 samples: batches of 2 under max_batch 24
    assert [len(row["ids"]) for row in got] == [12] * len(SOURCES)
    result = invoke("translate", bart / "out", "--backend", "ort", "--ids-file", bart / "ids.jsonl", "--sample",
                    "--n-best", 25)
    assert result.exit_code == 2 and "--n-best 25 needs batches of 25 rows, over the export's max_batch 24" in \
        result.output, result.output
    with seq2trt.Translator(bart / "out", backend="ort") as translator:  # the API names its keywords
        for options, name in ((dict(sample=True, n_best=25), "n_best"), (dict(beam_size=25), "beam_size")):
            with pytest.raises(seq2trt.InputError, match=rf"^{name} 25 needs batches of 25 rows, over the export's "
                               rf"max_batch 24; re-export with --max-batch >= batch x {name}, or use a smaller "
                               rf"{name}$"):
                translator.generate([[4, 5, 2]], **options)


def test_serves_decode_applies_the_stored_settings_as_translate(bart):
    """serve's DecodeService (requests carry no search options yet) decodes with the model's own settings too."""
    from seq2trt.serving.decode_service import DecodeService, Job

    service = DecodeService(bart / "out", "ort")
    try:
        got = service.run([Job(tuple(s), max_new_tokens=NEW) for s in SOURCES])
    finally:
        service.close()
    assert got == _generate(bart)[0]
