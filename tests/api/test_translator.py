"""`seq2trt.Translator`: its hypotheses are the eager model's decode (models trained here) and transformers' generate
(imported ones), equal to `seq2trt translate`'s output on the same inputs; its errors are the CLI's typed errors with
the CLI's messages; one Translator called from 4 threads at once returns what each call returns alone."""

from __future__ import annotations

import importlib.util
import json
import re
import threading

import numpy as np
import pytest
import torch

import seq2trt
from seq2trt.reference_model.decoding import DecodeSettings, beam_search, greedy_decode
from seq2trt.reference_model.eager import EagerStepModel
from seq2trt.core.errors import InputError
from seq2trt.reference_model.vocab import pad_batch

from helpers.artifacts import import_and_export
from helpers.cli import invoke

HAS_HF = importlib.util.find_spec("transformers") is not None
TEXTS = ["40213", "7", "999999", "120", "5550", "31"]


def eager_decode(model, task, texts, beam):
    ids, mask = pad_batch([task.source_vocab.encode(t) + [model.cfg.eos_id] for t in texts], model.cfg.pad_id)
    settings, step = DecodeSettings.for_model(model.cfg), EagerStepModel(model)
    return greedy_decode(step, ids, mask, settings) if beam == 1 else beam_search(step, ids, mask, settings, beam)


def test_public_names():
    assert {"Translator", "Hypothesis", "InputError", "DECODE_BACKENDS"} <= set(seq2trt.__all__)
    assert seq2trt.InputError is InputError and "ort-fused" in seq2trt.DECODE_BACKENDS


@pytest.mark.parametrize("source, backend", [("ckpt", "eager"), ("out", "ort"), ("out", "ort-fused")])
@pytest.mark.parametrize("beam", [1, 3])
def test_translate_is_the_eager_decode_and_the_cli(numbers_export, source, backend, beam):
    root, model, task = numbers_export
    want = eager_decode(model, task, TEXTS, beam)
    with seq2trt.Translator(root / source, backend=backend, threads=1) as translator:
        got = translator.translate(TEXTS, beam_size=beam, batch_size=4)  # two batches
        by_ids = translator.generate([np.array(task.source_vocab.encode(t) + [model.cfg.eos_id]) for t in TEXTS],
                                     beam_size=beam)
    assert [h.ids for h in got] == want == [h.ids for h in by_ids]
    assert [h.text for h in got] == [task.target_vocab.decode(w) for w in want]
    assert len({h.text for h in got}) > 1
    result = invoke("translate", root / source, *TEXTS, "--backend", backend, "--beam-size", beam)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [h.text for h in got]


@pytest.mark.parametrize("beam", [1, 3])
def test_batches_are_formed_by_length_and_outputs_come_in_input_order(numbers_export, monkeypatch, beam):
    """Six sources of mixed lengths in batches of 2: each batch holds sources of similar length (longest first),
    and the outputs are the eager model's, in input order."""
    from seq2trt.runtime import decode_jobs

    root, model, task = numbers_export
    texts = ["7", "40213", "31", "999999", "120", "5550"]
    batches = []
    real = decode_jobs.pad_batch
    monkeypatch.setattr(decode_jobs, "pad_batch", lambda batch, pad: batches.append([len(s) for s in batch]) or
                        real(batch, pad))
    with seq2trt.Translator(root / "out", backend="ort-fused", threads=1) as translator:
        got = translator.translate(texts, beam_size=beam, batch_size=2)
        sampled = translator.translate(texts, batch_size=2, sample=True, seed=3)
    assert [h.ids for h in got] == eager_decode(model, task, texts, beam)
    lengths = [len(task.source_vocab.encode(t)) + 1 for t in texts]
    assert batches[:3] == [sorted(lengths, reverse=True)[i: i + 2] for i in (0, 2, 4)]
    assert batches[3:] == [lengths[i: i + 2] for i in (0, 2, 4)]  # sampling keeps the input order (its stream)
    assert len(sampled) == 6


def test_max_new_tokens_bounds_the_output(numbers_export):
    root, model, task = numbers_export
    with seq2trt.Translator(root / "out", backend="ort-fused") as translator:
        short = translator.translate(TEXTS, max_new_tokens=2)
    assert all(len(h.ids) <= 2 for h in short)
    assert [h.ids for h in short] == [w[:2] for w in eager_decode(model, task, TEXTS, 1)]


def test_search_options_are_the_clis(numbers_export):
    """n-best lists with scores, and seeded sampling: what `seq2trt translate` prints for the same flags."""
    from seq2trt.translator import SEARCH_OPTIONS
    from seq2trt.reference_model.decoding.options import SETTING_FIELDS

    assert set(SEARCH_OPTIONS.values()) | {"num_return_sequences", "output_scores"} == set(SETTING_FIELDS)
    root, _, _ = numbers_export
    with seq2trt.Translator(root / "out", backend="ort-fused") as translator:
        nbest = translator.translate(TEXTS, beam_size=3, n_best=2, scores=True)
        sampled = translator.translate(TEXTS, sample=True, seed=3, temperature=0.8, top_k=5)
        again = translator.translate(TEXTS, sample=True, seed=3, temperature=0.8, top_k=5)
    assert [len(hyps) for hyps in nbest] == [2] * len(TEXTS) and all(h.score is not None for r in nbest for h in r)
    result = invoke("translate", root / "out", *TEXTS, "--backend", "ort-fused", "--beam-size", 3, "--n-best", 2, "--scores")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [f"{h.score:.6g}\t{h.text}" for hyps in nbest for h in hyps]
    result = invoke("translate", root / "out", *TEXTS, "--backend", "ort-fused", "--sample", "--seed", 3,
                    "--temperature", 0.8, "--top-k", 5)
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [h.text for h in sampled] and sampled == again


@pytest.mark.parametrize("backend, beam", [("ort-fused", 1), ("ort-fused", 3), ("eager", 3)])
def test_four_threads_at_once_return_what_each_call_returns_alone(numbers_export, backend, beam):
    root, _, _ = numbers_export
    jobs = [TEXTS, TEXTS[::-1], TEXTS[1:4] * 3, ["12", "340", "7"]]
    with seq2trt.Translator(root / ("ckpt" if backend == "eager" else "out"), backend=backend) as translator:
        alone = [translator.translate(texts, beam_size=beam, batch_size=2) for texts in jobs]
        together: list = [None] * len(jobs)
        start = threading.Barrier(len(jobs))
        errors = []

        def work(i):
            try:
                start.wait()
                for _ in range(3):  # overlap the calls for a while, not just their first steps
                    together[i] = translator.translate(jobs[i], beam_size=beam, batch_size=2)
            except BaseException as exc:  # noqa: BLE001  re-raised below, in the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    assert together == alone


def test_closing_releases_sessions_and_torch_threads(numbers_export):
    root, _, _ = numbers_export
    saved = torch.get_num_threads()
    translator = seq2trt.Translator(root / "out", backend="ort-fused", threads=1)
    assert torch.get_num_threads() == 1
    runners = [translator._opened.model.encoder, translator._opened.model.decoder]
    translator.close()
    assert torch.get_num_threads() == saved
    assert not any(r.is_active for r in runners)
    with pytest.raises(InputError, match="this Translator is closed; open a new one"):
        translator.translate(TEXTS)


def _cli_error(*args) -> str:
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    return result.output.strip().removeprefix("error: ")


def test_errors_are_the_clis(numbers_export, tmp_path):
    root, _, task = numbers_export
    with pytest.raises(InputError) as exc:
        seq2trt.Translator(root / "ckpt", backend="ort")
    assert str(exc.value) == _cli_error("translate", root / "ckpt", "12", "--backend", "ort")
    with seq2trt.Translator(root / "out", backend="ort-fused") as translator:
        for options, flags in (({"beam_size": 0}, ["--beam-size", 0]), ({"max_new_tokens": 0}, ["--max-new-tokens", 0]),
                               ({"batch_size": 0}, ["--batch-size", 0]), ({"length_penalty": float("nan")}, ["--length-penalty", "nan"])):
            with pytest.raises(InputError) as exc:
                translator.translate(["12"], **options)
            # the same message, naming the keyword where the CLI names the flag
            assert str(exc.value) == re.sub(r"--([a-z-]+)", lambda m: m[1].replace("-", "_"),
                                            _cli_error("translate", root / "out", "12", "--backend", "ort-fused",
                                                       *flags))
            assert str(exc.value).startswith(next(iter(options)) + " ")
        (tmp_path / "ids.jsonl").write_text(json.dumps([3, 4, 9999]) + "\n")
        with pytest.raises(InputError, match=r"source 1 holds ids outside the source vocabulary \[0, \d+\): \[9999\]"):
            translator.generate([[3, 4, 9999]])
        with pytest.raises(InputError) as exc:
            translator.translate(["12"], temperature=0.5)
        assert str(exc.value) == _cli_error("translate", root / "out", "12", "--backend", "ort-fused",
                                            "--temperature", 0.5).replace("--", "")
        with pytest.raises(InputError, match="unknown search option.s. beams; Translator takes beam"):
            translator.translate(["12"], beams=2)
        with pytest.raises(InputError, match="texts must be a list of strings, got one string"):
            translator.translate("12")
        with pytest.raises(InputError, match="source 2 must be a list of integer token ids"):
            translator.generate([[3, 4], [3, "x"]])
        with pytest.raises(InputError, match="text 2 is empty"):
            translator.translate(["12", " "])
        assert translator.translate([]) == []
    with pytest.raises(InputError, match="unknown backend 'onnx'; choose one of eager, ort, ort-fused"):
        seq2trt.Translator(root / "out", backend="onnx")


@pytest.mark.skipif(not HAS_HF, reason="the hf extra is not installed")
@pytest.mark.parametrize("beam", [1, 4])
def test_an_imported_model_translates_as_transformers_generate(make_hf_model, make_marian_tokenizer, tmp_path, beam):
    from transformers import AutoTokenizer, MarianMTModel

    src, n = make_marian_tokenizer(tmp_path / "src")
    make_hf_model(src, "marian", dict(vocab_size=n, pad_token_id=n - 1, decoder_start_token_id=n - 1), std=0.2)
    import_and_export(src, tmp_path, "--max-batch", 16, fuse=None)
    texts = ["kalo mine suta", "ri po de an", "taelor"]
    tokenizer, original = AutoTokenizer.from_pretrained(str(src)), MarianMTModel.from_pretrained(src).eval()
    with torch.inference_mode():
        out = original.generate(**tokenizer(texts, return_tensors="pt", padding=True), num_beams=beam,
                                max_new_tokens=20, output_scores=True, return_dict_in_generate=True)
        if beam > 1:
            want_scores = out.sequences_scores.tolist()
        else:  # the log-probs of the generated tokens, up to and with eos (finished rows are padded after it)
            steps = original.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
            ended = out.sequences[:, 1:] == original.config.eos_token_id
            after_eos = (ended.cumsum(-1) - ended.long()) > 0
            want_scores = steps.masked_fill(after_eos, 0).sum(-1).tolist()
    want = tokenizer.batch_decode(out.sequences, skip_special_tokens=True)
    with seq2trt.Translator(tmp_path / "out", backend="ort") as translator:
        got = translator.translate(texts, beam_size=beam, max_new_tokens=20)
        scored = translator.translate(texts, beam_size=beam, max_new_tokens=20, scores=True)
    assert [h.text for h in got] == want == [h.text for h in scored]
    assert all(h.score is None for h in got)
    assert [h.score for h in scored] == pytest.approx(want_scores, abs=1e-4)
    with seq2trt.Translator(tmp_path / "out", backend="ort") as translator:
        logged = translator.translate(texts, beam_size=beam, max_new_tokens=20, token_logprobs=True)
    steps = (original.compute_transition_scores(out.sequences, out.scores, out.beam_indices) if beam > 1 else
             original.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)).numpy()
    for h, row in zip(logged, steps):
        assert h.text in want and len(h.token_logprobs) == len(h.ids) + (len(h.ids) < 20)
        np.testing.assert_allclose(h.token_logprobs, row[: len(h.token_logprobs)], rtol=1e-4, atol=1e-4)
    assert all(h.token_logprobs is None for h in scored)
