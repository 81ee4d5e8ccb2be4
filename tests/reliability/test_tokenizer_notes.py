"""Issue 49 case 10: `seq2trt translate` of a T5 printed transformers' "You set `add_prefix_space`. The tokenizer
needs to be converted from the slow tokenizers" on every run. A T5 tokenizer saved by transformers 4.x records
add_prefix_space in tokenizer_config.json, and 4.x's fast T5 class logs that note whenever the key is set (5.x says
nothing). The one tokenizer loader (`hf_verify.load_tokenizer`, which translate, serve and the import use) now keeps
transformers' notes to itself; the tokens are sentencepiece's own, as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers", reason="the hf extra is not installed")

TEXTS = ["kalo mine suta", "ri po de an", "taelor"]


@pytest.fixture(scope="module")
def t5_saved_by_4x(make_t5_tokenizer, tmp_path_factory):
    """A T5 tokenizer folder as 4.57's T5Tokenizer.save_pretrained writes it: spiece.model and a tokenizer_config
    with add_prefix_space and legacy set (written here, since 5.x has no slow T5 tokenizer to save one)."""
    folder, _ = make_t5_tokenizer(tmp_path_factory.mktemp("t5-4x") / "tok")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_prefix_space": True, "legacy": True}))
    return folder


def test_loading_a_t5_tokenizer_prints_nothing_and_tokens_are_sentencepieces(t5_saved_by_4x):
    import sentencepiece as spm

    # a process of its own: transformers logs the note once per process (warning_once)
    code = ("import json, sys\nfrom seq2trt.reference_model.hf_verify import load_tokenizer\n"
            "t = load_tokenizer(__import__('pathlib').Path(sys.argv[1]))\n"
            "print(json.dumps([t(x)['input_ids'] for x in json.loads(sys.argv[2])]))\n")
    result = subprocess.run([sys.executable, "-c", code, str(t5_saved_by_4x), json.dumps(TEXTS)], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert "add_prefix_space" not in result.stderr and result.stderr.strip() == "", result.stderr
    pieces = spm.SentencePieceProcessor(model_file=str(t5_saved_by_4x / "spiece.model"))
    assert json.loads(result.stdout) == [pieces.encode(text) + [1] for text in TEXTS]  # T5 appends eos (id 1)
