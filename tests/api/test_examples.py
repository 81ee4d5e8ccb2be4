"""The README's "Python API" examples run as written, and what they return is judged against transformers, not
merely printed. They run in a folder holding what they name: `ckpt` (an imported random Marian with its tokenizer),
`out` (its export, ORT graphs fused) and `whisper-ckpt` (a random Whisper's checkpoint) beside `talk.wav` (espeak-ng
speech). Each example's variables are read after it ran; `JUDGES` holds one judge per example, in README order, so an
example added to the README without a judge fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers.artifacts import import_and_export

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
torch = pytest.importorskip("torch")
README = Path(__file__).resolve().parents[2] / "README.md"
MARIAN_SOURCES = ["kalo mine suta", "ri po de an"]


def readme_examples() -> list[str]:
    """The ```python blocks of the README's "## Python API" section."""
    section = re.search(r"^## Python API\n(.*?)(?=^## |\Z)", README.read_text(), re.S | re.M)
    assert section is not None, "README.md has no '## Python API' section"
    return re.findall(r"```python\n(.*?)```", section.group(1), re.S)


@pytest.fixture(scope="module")
def workdir(make_hf_model, make_marian_tokenizer, tmp_path_factory):
    from helpers.audio import SENTENCES, speak, whisper_checkpoint, whisper_source

    root = tmp_path_factory.mktemp("examples")
    src, n = make_marian_tokenizer(root / "src")
    make_hf_model(src, "marian", dict(vocab_size=n, pad_token_id=n - 1, decoder_start_token_id=n - 1), std=0.2)
    import_and_export(src, root)
    whisper_checkpoint(whisper_source(root / "whisper-src", seed=3, std=1.0, suppress_timestamps=True),
                       root / "whisper-ckpt")
    speak(root, SENTENCES[0], "talk.wav")
    return root


@pytest.fixture(scope="module")
def marian(workdir):
    """transformers' own model and tokenizer of the Marian the examples' `ckpt` was imported from."""
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(workdir / "src")).eval()
    return model, transformers.AutoTokenizer.from_pretrained(str(workdir / "src"))


def _tokens(model, rows) -> list[list[int]]:
    """generate's rows without the start token, and cut at eos (padding after it dropped)."""
    eos, pad = model.generation_config.eos_token_id, model.generation_config.pad_token_id
    out = []
    for row in rows.tolist():
        row = row[1:]
        row = row[: row.index(eos)] if eos in row else row
        out.append([t for t in row if t != pad])
    return out


def judge_translator(found: dict, workdir: Path, marian) -> None:
    """Beam 4, 2-best with scores and seeded top-k sampling: transformers' `generate` on the same sources."""
    model, tokenizer = marian
    batch = tokenizer(MARIAN_SOURCES, return_tensors="pt", padding=True)
    with torch.inference_mode():
        want = _tokens(model, model.generate(**batch, num_beams=4, max_new_tokens=20))
        nbest = model.generate(**tokenizer(["taelor"], return_tensors="pt"), num_beams=4, num_return_sequences=2,
                               max_new_tokens=20, output_scores=True, return_dict_in_generate=True)
        torch.manual_seed(1)
        sampled = model.generate(input_ids=torch.tensor([[5, 9, 13, 0]]), do_sample=True, top_k=10,
                                 max_new_tokens=20)
    assert [h.ids for h in found["hyps"]] == want
    assert [h.text for h in found["hyps"]] == tokenizer.batch_decode(want, skip_special_tokens=True)
    assert [h.ids for h in found["best"]] == _tokens(model, nbest.sequences)
    assert [h.score for h in found["best"]] == pytest.approx(nbest.sequences_scores.tolist(), abs=1e-4)
    assert found["sampled"].ids == _tokens(model, sampled)[0]


def judge_transcriber(found: dict, workdir: Path, marian) -> None:
    """The tokens and text of transformers' Whisper `generate` on the same file, language given."""
    from helpers.audio import generate_tokens, judge_clip
    from seq2trt.hf_import.proof import load_transformers_model

    src = workdir / "whisper-src"
    want, _ = generate_tokens(load_transformers_model(src, speech=True), src, [judge_clip(workdir / "talk.wav")],
                              "en", 1, 12)
    result = found["result"]
    assert result.language == "en" and result.tokens == want[0] and want[0]
    assert result.text == transformers.WhisperTokenizer.from_pretrained(str(src)).decode(want[0],
                                                                                         skip_special_tokens=True)
    assert [(s.start, s.end) for s in result.segments] == [(0.0, pytest.approx(result.duration))]


def judge_hf_model(found: dict, workdir: Path, marian) -> None:
    """transformers' generate over seq2trt's graphs, and its ids decoded: what they give over transformers' own
    model."""
    model, tokenizer = marian
    with torch.inference_mode():
        want_ids = model.generate(**tokenizer(["kalo mine suta"], return_tensors="pt"), num_beams=4,
                                  max_new_tokens=20)
    want_text = tokenizer.batch_decode(want_ids, skip_special_tokens=True)
    assert any(want_text)  # a judge of empty strings would pass anything
    assert found["translated"] == want_text
    assert found["generated"].tolist() == want_ids.tolist()


def judge_stages(found: dict, workdir: Path, marian) -> None:
    """Export, fuse and validate: every attention block fused (encoder self, decoder self and cross per layer of
    the model), and the fused graphs' parity with the eager model passed with its report written."""
    model, _ = marian
    cfg = model.config
    blocks = {"encoder": {"ENCODER_SELF": cfg.encoder_layers},
              "decoder": {"DECODER_SELF": cfg.decoder_layers, "CROSS": cfg.decoder_layers}}
    assert found["exported"].graphs["decoder"].is_file()
    assert {g: (a["expected"], a["fused"]) for g, a in found["fused"].audit.items()} == \
        {g: (n, n) for g, n in blocks.items()}
    checked = found["checked"]
    assert checked.passed and checked.cases > 0 and checked.end_to_end["token_agreement"] == 1.0
    assert checked.report.is_file()


JUDGES = [judge_translator, judge_transcriber, judge_hf_model, judge_stages]


def test_every_example_has_a_judge():
    assert len(readme_examples()) == len(JUDGES)


@pytest.mark.parametrize("number", range(len(JUDGES)), ids=[j.__name__ for j in JUDGES])
def test_the_python_api_examples_give_transformers_results(workdir, marian, number, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    found: dict = {}
    exec(compile(readme_examples()[number], f"README Python API example {number + 1}", "exec"), found)
    JUDGES[number](found, workdir, marian)
    assert capsys.readouterr().out.strip()  # and it shows what it got
