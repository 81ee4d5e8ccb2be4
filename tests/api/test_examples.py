"""The README's "Python API" examples run as written, in a folder holding what they name: `ckpt` (an imported Marian
with its tokenizer) and `out` (its export, ORT graphs fused). Until the README holds the section, the examples below
(the text proposed for it) run instead."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers.artifacts import import_and_export

pytest.importorskip("transformers", reason="the hf extra is not installed")
README = Path(__file__).resolve().parents[2] / "README.md"

EXAMPLES = [
    '''
import seq2trt

with seq2trt.Translator("out", backend="ort-fused", threads=1) as translator:
    for hyp in translator.translate(["kalo mine suta", "ri po de an"], beam=4, max_new_tokens=20):
        print(hyp.text, hyp.ids)
    for hyps in translator.translate(["taelor"], beam=4, n_best=2, scores=True):
        print([(h.score, h.text) for h in hyps])
    print(translator.generate([[5, 9, 13, 0]], sample=True, seed=1, top_k=10)[0].ids)
''',
    '''
from transformers import AutoTokenizer, pipeline
from seq2trt.hf import Seq2TrtModelForSeq2SeqLM

tokenizer = AutoTokenizer.from_pretrained("ckpt/tokenizer")
model = Seq2TrtModelForSeq2SeqLM.from_pretrained("out", backend="ort-fused")
translate = pipeline("translation", model=model, tokenizer=tokenizer)
print(translate(["kalo mine suta"], num_beams=4, max_new_tokens=20))
batch = tokenizer(["kalo mine suta"], return_tensors="pt")
print(model.generate(**batch, num_beams=4, max_new_tokens=20))
model.close()
''',
]


def readme_examples() -> list[str]:
    """The ```python blocks of the README's "## Python API" section, or [] when it has none."""
    text = README.read_text() if README.is_file() else ""
    section = re.search(r"^## Python API\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    return re.findall(r"```python\n(.*?)```", section.group(1), re.S) if section else []


@pytest.fixture(scope="module")
def workdir(make_hf_model, make_marian_tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("examples")
    src, n = make_marian_tokenizer(root / "src")
    make_hf_model(src, "marian", dict(vocab_size=n, pad_token_id=n - 1, decoder_start_token_id=n - 1), std=0.2)
    return import_and_export(src, root)


@pytest.mark.parametrize("number", range(len(readme_examples() or EXAMPLES)))
def test_the_python_api_examples_run(workdir, number, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    exec(compile((readme_examples() or EXAMPLES)[number], f"README Python API example {number + 1}", "exec"), {})
    assert capsys.readouterr().out.strip()  # each example prints what it got
