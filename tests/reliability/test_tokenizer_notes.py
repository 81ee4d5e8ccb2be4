"""Issue 49 case 10: `seq2trt translate` of a T5 printed transformers' "You set `add_prefix_space`. The tokenizer needs
to be converted from the slow tokenizers" on every run. A T5 tokenizer saved by transformers 4.x records
add_prefix_space in tokenizer_config.json, and 4.x's fast T5 class logs that note whenever the key is set (5.x says
nothing). The one tokenizer loader (`hf_import.text.load_tokenizer`, which translate, serve and the import use) now
keeps transformers' notes to itself; the tokens are sentencepiece's own, as before. With a tokenizer.json beside it,
4.x's fast class ignores that file when add_prefix_space is set and converts the sentencepiece model through protobuf,
which failed where the serve extra pins protobuf below sentencepiece's (the tokenizer "cannot be loaded"): the loader
now falls back to the slow tokenizer, the one the conversion starts from, as it does without tokenizer.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers", reason="the hf extra is not installed")

TEXTS = ["kalo mine suta", "ri po de an", "taelor"]


@pytest.fixture(scope="module", params=["spiece.model", "tokenizer.json"])
def t5_saved_by_4x(request, make_t5_tokenizer, tmp_path_factory):
    """A T5 tokenizer folder as 4.57's T5Tokenizer.save_pretrained writes it: spiece.model and a tokenizer_config
    with add_prefix_space and legacy set (written here, since 5.x has no slow T5 tokenizer to save one); with
    "tokenizer.json", also a tokenizer.json of the same pieces and scores (made by the tokenizers library from
    sentencepiece's pieces, not by transformers' protobuf-based converter)."""
    folder, _ = make_t5_tokenizer(tmp_path_factory.mktemp("t5-4x") / "tok")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_prefix_space": True, "legacy": True}))
    if request.param == "tokenizer.json":
        import sentencepiece as spm
        from tokenizers.implementations import SentencePieceUnigramTokenizer

        sp = spm.SentencePieceProcessor(model_file=str(folder / "spiece.model"))
        pieces = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
        pieces += [(f"<extra_id_{i}>", 0.0) for i in reversed(range(config["extra_ids"]))]
        SentencePieceUnigramTokenizer(pieces, replacement="\u2581", add_prefix_space=True).save(
            str(folder / "tokenizer.json"))
    return folder


def test_loading_a_t5_tokenizer_prints_nothing_and_tokens_are_sentencepieces(t5_saved_by_4x):
    import sentencepiece as spm

    # a process of its own: transformers logs the note once per process (warning_once)
    code = ("import json, sys\nfrom seq2trt.hf_import.text import load_tokenizer\n"
            "t = load_tokenizer(__import__('pathlib').Path(sys.argv[1]))\n"
            "print(json.dumps([t(x)['input_ids'] for x in json.loads(sys.argv[2])]))\n")
    result = subprocess.run([sys.executable, "-c", code, str(t5_saved_by_4x), json.dumps(TEXTS)], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert "add_prefix_space" not in result.stderr and result.stderr.strip() == "", result.stderr
    pieces = spm.SentencePieceProcessor(model_file=str(t5_saved_by_4x / "spiece.model"))
    assert json.loads(result.stdout) == [pieces.encode(text) + [1] for text in TEXTS]  # T5 appends eos (id 1)
