"""`seq2trt translate` on a checkpoint and on an export, through every CPU backend: its words and ids are compared
with an independent decode — the eager model for models trained here, transformers' `generate` (and the source's
own tokenizer) for imported ones."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from seq2trt.reference_model.decoding import DecodeSettings, beam_search, greedy_decode
from seq2trt.reference_model.eager import EagerStepModel
from seq2trt.core.errors import InputError
from seq2trt.reference_model.vocab import pad_batch

from helpers.artifacts import import_and_export
from helpers.cli import invoke, invoke_ok
from helpers.hf_models import hf_rows

HAS_HF = importlib.util.find_spec("transformers") is not None


@pytest.mark.parametrize("beam", [1, 3])
def test_translate_words_are_the_eager_decode(numbers_export, beam):
    root, model, task = numbers_export
    path = root / "ckpt"
    texts = ["40213", "7", "999999", "120"]
    result = invoke("translate", path, *texts, "--beam-size", beam, "--batch-size", 3)  # two batches
    assert result.exit_code == 0, result.output
    ids, mask = pad_batch([task.source_vocab.encode(t) + [model.cfg.eos_id] for t in texts], model.cfg.pad_id)
    settings = DecodeSettings.for_model(model.cfg)
    step = EagerStepModel(model)
    want = greedy_decode(step, ids, mask, settings) if beam == 1 else beam_search(step, ids, mask, settings, beam)
    assert result.output.splitlines() == [task.target_vocab.decode(w) for w in want]
    assert len({line for line in result.output.splitlines()}) > 1


def test_translate_threads_hold_torch_too(numbers_export, monkeypatch):
    """--threads also holds torch (the eager model, the loops' search arithmetic) while decoding, then restores it."""
    from seq2trt.runtime import decode_jobs

    path = numbers_export[0] / "ckpt"
    seen = []

    def spy(*args):
        seen.append(torch.get_num_threads())
        return greedy_decode(*args)

    monkeypatch.setattr(decode_jobs, "greedy_decode", spy)
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        result = invoke("translate", path, "40213", "7", "--threads", 1)
        assert result.exit_code == 0, result.output
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(saved)


def test_translate_refuses_bad_input(numbers_export, tmp_path):
    path = numbers_export[0] / "ckpt"
    result = invoke("translate", path, "12", "--backend", "ort")
    assert result.exit_code == 2 and "export it first" in result.output
    result = invoke("translate", path)
    assert result.exit_code == 2 and "either TEXTS or --ids-file" in result.output
    (tmp_path / "ids.jsonl").write_text("[3, 4, 2]\n[3, \"x\"]\n")
    result = invoke("translate", path, "--ids-file", tmp_path / "ids.jsonl")
    assert result.exit_code == 2 and "ids.jsonl:2" in result.output
    (tmp_path / "ids.jsonl").write_text("[3, 4, 99999]\n")
    result = invoke("translate", path, "--ids-file", tmp_path / "ids.jsonl")
    assert result.exit_code == 2 and "outside the source vocabulary" in result.output
    result = invoke("translate", path, "12", "--tgt-lang", "de")
    assert result.exit_code == 2 and "no language codes" in result.output


@pytest.fixture(scope="module")
def imported_marian(make_hf_model, make_marian_tokenizer, tmp_path_factory):
    """A Marian with its own sentencepiece tokenizer, imported and exported (fp32, ORT graphs fused)."""
    root = tmp_path_factory.mktemp("marian")
    src, n = make_marian_tokenizer(root / "src")
    make_hf_model(src, "marian", dict(vocab_size=n, pad_token_id=n - 1, decoder_start_token_id=n - 1,
                                      activation_function="swish", scale_embedding=True),
                  dict(bad_words_ids=[[n - 1]], num_beams=4, length_penalty=0.8))
    return import_and_export(src, root, "--max-batch", 8)


def _hf_generate(root, sources, **kwargs) -> list[list[int]]:
    from seq2trt.hf_import.proof import load_transformers_model

    hf_model = load_transformers_model(root / "src")
    ids, mask = pad_batch(sources, hf_model.config.pad_token_id)
    return hf_rows(hf_model, ids, mask, 63, hf_model.config.eos_token_id, **kwargs)


@pytest.mark.skipif(not HAS_HF, reason="the hf extra is not installed")
@pytest.mark.parametrize("beam", [1, 4])
def test_translate_text_of_an_imported_model_is_transformers_generate(imported_marian, beam):
    from transformers import AutoTokenizer

    root = imported_marian
    texts = ["kalo mine suta", "ri po de an", "taelor"]
    result = invoke("translate", root / "ckpt", *texts, "--beam-size", beam)
    assert result.exit_code == 0, result.output
    tokenizer = AutoTokenizer.from_pretrained(str(root / "src"))
    want = _hf_generate(root, tokenizer(texts)["input_ids"], num_beams=beam)
    assert result.output.splitlines() == [tokenizer.decode(w, skip_special_tokens=True) for w in want]


def _fp32_beam_tie(root, source: list[int], ours: list[int], theirs: list[int], max_new_tokens: int = 63) -> str:
    """Why two beam results of the same length are a tie at float32's precision, or "" when they are not: both
    rescored by transformers' model in float64 (the sum of the chosen tokens' log-probabilities, eos included where
    a row ended on it), their difference within what float32 arithmetic may move a sum of that many steps. The bound
    is core.numerics': each logit within FP32_LOGIT_TOLERANCE of the logits' magnitude, so each
    log-probability within twice that (the logit and the log-sum-exp), summed over both hypotheses' steps. Unequal
    lengths are never a tie here: the length penalty would weigh them differently."""
    from seq2trt.hf_import.proof import load_transformers_model
    from seq2trt.core.numerics import FP32_LOGIT_TOLERANCE

    if len(ours) != len(theirs):
        return ""
    hf_model = load_transformers_model(root / "src").double()
    start, eos = hf_model.config.decoder_start_token_id, hf_model.config.eos_token_id
    totals, bound = [], 0.0
    for hyp in (ours, theirs):
        tokens = hyp + ([eos] if len(hyp) < max_new_tokens else [])  # a row shorter than the limit ended on eos
        with torch.inference_mode():
            logits = hf_model(input_ids=torch.tensor([source]),
                              decoder_input_ids=torch.tensor([[start] + tokens[:-1]])).logits[0]
        logprobs = torch.log_softmax(logits, -1)
        totals.append(float(logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].sum()))
        bound += float(2 * FP32_LOGIT_TOLERANCE * logits.abs().amax(-1).clamp(min=1).sum())
    gap = abs(totals[0] - totals[1])
    return f"float64 sums {totals[0]:.6f} and {totals[1]:.6f}, within float32's {bound:.2e}" if gap <= bound else ""


@pytest.mark.skipif(not HAS_HF, reason="the hf extra is not installed")
@pytest.mark.parametrize("backend", ["eager", "ort", "ort-fused"])
def test_translate_ids_through_each_backend_are_transformers_generate(imported_marian, backend, tmp_path):
    """Tokens equal transformers' generate; a beam row that differs passes only as a proven float32 tie (the random
    model's long rows repeat two tokens of near-equal probability: which of two such 62-token beams wins depends on
    the last bits of a float32 sum, in which each backend adds in its own order)."""
    root = imported_marian
    sources = [[5, 9, 13, 0], [22, 0], [7, 7, 30, 41, 12, 0], [60, 3, 0], [11, 0]]
    (tmp_path / "ids.jsonl").write_text("".join(json.dumps(s) + "\n" for s in sources))
    for beam in (1, 4):
        result = invoke("translate", root / "out", "--backend", backend, "--ids-file", tmp_path / "ids.jsonl",
                        "--beam-size", beam, "--output-ids", tmp_path / "out.jsonl")
        assert result.exit_code == 0, result.output
        got = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
        want = _hf_generate(root, sources, num_beams=beam)
        differ = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
        assert len(got) == len(want) and not (beam == 1 and differ), (backend, beam, differ)
        for i in differ:
            assert _fp32_beam_tie(root, sources[i], got[i], want[i]), (backend, beam, i, got[i], want[i])


@pytest.mark.skipif(not HAS_HF, reason="the hf extra is not installed")
def test_translate_with_language_codes_is_transformers_generate(make_hf_model, make_m2m100_tokenizer, tmp_path):
    """M2M100/NLLB: --src-lang sets the tokenizer's source code, --tgt-lang forces the target code first."""
    from transformers import AutoTokenizer

    src, n = make_m2m100_tokenizer(tmp_path / "src")
    make_hf_model(src, "m2m_100", dict(vocab_size=n))
    invoke_ok("import", "hf", src, "-o", tmp_path / "ckpt")
    texts = ["kalo mine suta", "ri po"]
    for tgt in ("de", "fr"):
        result = invoke("translate", tmp_path / "ckpt", *texts, "--src-lang", "en", "--tgt-lang", tgt)
        assert result.exit_code == 0, result.output
        tokenizer = AutoTokenizer.from_pretrained(str(src), src_lang="en")
        want = _hf_generate(tmp_path, tokenizer(texts)["input_ids"], num_beams=1,
                            forced_bos_token_id=tokenizer.get_lang_id(tgt))
        assert all(w[0] == tokenizer.get_lang_id(tgt) for w in want)
        assert result.output.splitlines() == [tokenizer.decode(w, skip_special_tokens=True) for w in want]
    result = invoke("translate", tmp_path / "ckpt", *texts, "--tgt-lang", "xx")
    assert result.exit_code == 2 and "language 'xx' is not in the tokenizer" in result.output


@pytest.mark.skipif(not HAS_HF, reason="the hf extra is not installed")
def test_translate_text_without_a_tokenizer_names_ids_file(make_hf_model, tmp_path):
    src = make_hf_model(tmp_path / "src", "bart")
    invoke_ok("import", "hf", src, "-o", tmp_path / "ckpt")
    result = invoke("translate", tmp_path / "ckpt", "hello")
    assert result.exit_code == 2 and "no tokenizer" in result.output and "--ids-file" in result.output


def test_many_sources_decode_in_bounded_batches_and_stream(numbers_export, tmp_path, monkeypatch):
    """20,000 sources with --beam-size 4 once went into one batch and died of memory: each batch holds at most
    --batch-size sources, and the lines stream: those of a window of SORT_WINDOW batches (sorted by length inside
    it) are printed before the next window is decoded."""
    import seq2trt.runtime.decode_jobs as jobs

    root, model, task = numbers_export
    path = root / "ckpt"
    sources = [task.source_vocab.encode(str(n)) + [model.cfg.eos_id] for n in range(2000)]
    ids_file = tmp_path / "ids.jsonl"
    ids_file.write_text("".join(json.dumps(s) + "\n" for s in sources))
    batches, printed_before = [], []
    echoed = []
    real_pad_batch = jobs.pad_batch

    def recording_pad_batch(rows, pad_id):
        batches.append(len(rows))
        printed_before.append(len(echoed))
        return real_pad_batch(rows, pad_id)

    monkeypatch.setattr(jobs, "pad_batch", recording_pad_batch)
    import seq2trt.cli.model_commands as commands

    real_echo = commands.click.echo
    monkeypatch.setattr(commands.click, "echo", lambda *a, **k: (echoed.append(a), real_echo(*a, **k)))
    result = invoke("translate", path, "--ids-file", ids_file, "--beam-size", 4, "--batch-size", 64,
                    "--max-new-tokens", 4)
    assert result.exit_code == 0, result.output
    assert len(result.output.splitlines()) == 2000
    assert max(batches) <= 64 and sum(batches) == 2000
    window = 64 * jobs.SORT_WINDOW  # streamed: batch i starts after the windows before its own
    assert printed_before == [window * (i // jobs.SORT_WINDOW) for i in range(len(batches))]
    assert len(batches) == 32 and batches[-1] == 2000 - 1024 - 15 * 64


@pytest.mark.skipif(not HAS_HF, reason="the hf extra is not installed")
def test_a_text_that_is_not_utf8_is_one_error_line(imported_marian):
    """b'\\xff' in argv reaches Python as the surrogate '\\udcff': sentencepiece raised a pybind11 RuntimeError."""
    result = invoke("translate", imported_marian / "ckpt", "kalo mine", "ka\udcfflo")
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: source 2 holds byte 0xff at character 3"), result.output
    assert "UTF-8" in lines[0]


@pytest.mark.skipif(not HAS_HF, reason="the hf extra is not installed")
def test_a_language_code_must_be_a_language_token_not_an_ordinary_piece(make_marian_tokenizer,
                                                                          make_m2m100_tokenizer, tmp_path):
    """A tokenizer without language codes (Marian, T5) refuses every code alike: an ordinary piece that happens to
    spell one ("de", "fr") was forced as the first token, exit 0, where a code that is no piece was refused."""
    from transformers import AutoTokenizer

    from seq2trt.hf_import.text import _language_id

    marian = AutoTokenizer.from_pretrained(str(make_marian_tokenizer(tmp_path / "marian")[0]))
    special = set(marian.all_special_tokens)
    pieces = [p for p in marian.get_vocab() if p not in special][:3] + ["zz_not_a_piece"]
    for piece in pieces:
        with pytest.raises(InputError, match="this tokenizer has no language codes"):
            _language_id(marian, piece, tmp_path)
    m2m = AutoTokenizer.from_pretrained(str(make_m2m100_tokenizer(tmp_path / "m2m")[0]))
    assert _language_id(m2m, "de", tmp_path) == m2m.get_lang_id("de")
    with pytest.raises(InputError, match="language 'xx' is not in the tokenizer"):
        _language_id(m2m, "xx", tmp_path)
