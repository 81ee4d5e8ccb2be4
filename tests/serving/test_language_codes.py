"""Issue 49 case 6, served: a tokenizer without language codes (T5, Marian) refuses `tgt_lang` and `src_lang` in a
`translate` request as `seq2trt translate` refuses --tgt-lang / --src-lang: every code alike, an ordinary piece that
happens to spell one ("de" in these vocabularies) included, which had been forced as the first token with exit 0.
One served model per family through the real `seq2trt serve` (its own server each); the request without a code
is answered what translate gives, so the refusal is the code's and nothing else's."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the hf extra is not installed")

from helpers.artifacts import import_and_export  # noqa: E402
from helpers.cli import invoke, one_error_line  # noqa: E402
from helpers.hf_models import t5_model_dir  # noqa: E402

from .conftest import Server, text_inputs  # noqa: E402

TEXT = "kalo mine suta"


def _t5(root, fixture):
    src, vocab = fixture("make_t5_tokenizer")(root / "src")
    t5_model_dir(src, "t5", dict(vocab_size=vocab))


def _marian(root, fixture):
    src, n = fixture("make_marian_tokenizer")(root / "src")
    fixture("make_hf_model")(src, "marian", dict(vocab_size=n, pad_token_id=n - 1, decoder_start_token_id=n - 1))


@pytest.fixture(scope="module", params=[_t5, _marian], ids=["t5", "marian"])
def served_family(request, tmp_path_factory):
    """(root with ckpt/ and out/, a running Server of out/): the family imported with its sentencepiece tokenizer
    (made here), exported unfused, served with --backend ort."""
    root = tmp_path_factory.mktemp(request.param.__name__.strip("_"))
    request.param(root, request.getfixturevalue)
    import_and_export(root / "src", root, "--max-batch", 4, fuse=None)
    server = Server(root / "out", root / "server.log", "--backend", "ort")
    yield root, server
    assert server.stop() == 0, "".join(server.lines)


def _pieces(root) -> list[str]:
    """Codes that are ordinary pieces of the tokenizer ("de" among them), and one that is no piece."""
    from seq2trt.hf_import.text import load_tokenizer

    vocab = load_tokenizer(root / "ckpt" / "tokenizer").get_vocab()
    spelled = [code for code in ("de", "an", "el", "fr") if code in vocab]
    assert "de" in spelled, sorted(vocab)  # the case of the issue: the piece "de" exists
    return spelled + ["zz"]


def test_language_codes_are_refused_served_as_by_translate(served_family):
    import tritonclient.http as http
    from tritonclient.utils import InferenceServerException

    root, server = served_family
    c = http.InferenceServerClient(server.url, network_timeout=120)
    try:
        plain = c.infer("translate", text_inputs(TEXT)).as_numpy("text")[0, 0].decode()
        for code in _pieces(root):
            for side in ("tgt_lang", "src_lang"):
                with pytest.raises(InferenceServerException) as exc:
                    c.infer("translate", text_inputs(TEXT, **{side: code}))
                message = exc.value.message()
                assert exc.value.status() == "400", message
                assert f"language {code!r} is not in the tokenizer" in message, message
                assert "this tokenizer has no language codes: drop src_lang/tgt_lang" in message, message
                assert "--" not in message, message
        assert c.infer("translate", text_inputs(TEXT)).as_numpy("text")[0, 0].decode() == plain  # still up
    finally:
        c.close()
    want = invoke("translate", root / "out", TEXT, "--backend", "ort")
    assert want.exit_code == 0 and want.output.strip() == plain.strip(), want.output
    for flag in ("--tgt-lang", "--src-lang"):  # the CLI: the same refusal, its flags named
        one_error_line(invoke("translate", root / "out", TEXT, "--backend", "ort", flag, "de"), 2,
                       "language 'de' is not in the tokenizer",
                       "this tokenizer has no language codes: drop --src-lang/--tgt-lang")
