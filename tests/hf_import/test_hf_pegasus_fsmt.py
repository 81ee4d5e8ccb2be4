"""`seq2trt import hf` of Pegasus and FSMT: small random models made with transformers' own config classes, imported
through their registered adapters, then judged by transformers itself (its model and its `generate` on the same
directory) on other sources than the import's proof: greedy and beam-4 tokens of padded batches. Also an FSMT's own
tokenizer (Moses + BPE, a vocabulary per side) through `seq2trt translate`, and the Pegasus variants whose attention
differs, refused by name."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")

from seq2trt.cli.main import cli  # noqa: E402
from seq2trt.reference_model.checkpoint import load_checkpoint  # noqa: E402
from seq2trt.reference_model.decoding import DecodeSettings, greedy_decode, hf_beam_search  # noqa: E402
from seq2trt.reference_model.eager import EagerStepModel  # noqa: E402
from seq2trt.hf_import.families import transformers_major  # noqa: E402
from seq2trt.hf_import.proof import load_transformers_model, seeded_sources  # noqa: E402
from seq2trt.reference_model.vocab import pad_batch  # noqa: E402

from helpers.hf_models import hf_rows, bart_like_model_dir  # noqa: E402

# fairseq's search never emits pad, and transformers' FSMT places a generated pad differently in its cached generate
# than in a forward (fsmt.py): the FSMT sources suppress it, as fairseq does.
NO_PAD = dict(suppress_tokens=[1])
# transformers 4.x's FSMT generate reads every step at the first position: FSMT imports with 5.x as the judge.
FSMT_REFUSED = "transformers 4.x's FSMT generate gives every decoder step the first position"


def _refused_under_4(family: str, result, out) -> bool:
    """Under transformers 4.x an FSMT import is refused by name (nothing written): True when it was."""
    if family != "fsmt" or transformers_major() >= 5:
        return False
    assert result.exit_code == 2 and FSMT_REFUSED in result.output, result.output
    assert not out.exists()
    return True
CASES = {  # (family, config options, generation settings)
    "pegasus-scaled-gelu": ("pegasus", dict(scale_embedding=True), {}),
    "pegasus-relu-unscaled-beams": ("pegasus", dict(activation_function="relu"),
                                    dict(num_beams=4, length_penalty=0.8, max_length=30)),
    "fsmt-own-vocabularies": ("fsmt", {}, NO_PAD),  # src 71, tgt 83, three tables (the head tied to the target in 4.x)
    "fsmt-tied-one-vocabulary": ("fsmt", dict(tie_word_embeddings=True, src_vocab_size=83), NO_PAD),
    "fsmt-gelu-unscaled": ("fsmt", dict(activation_function="gelu", scale_embedding=False), dict(NO_PAD, num_beams=2)),
}
# Without the sqrt(d_model) factor, embeddings at std 0.35 drown in the sinusoid and decode 2 tokens over and over;
# a Pegasus at 0.35 decodes 2 to 5 distinct tokens on 8 sources (transformers 4.57 initialises it otherwise than 5.x).
STD = {"fsmt-gelu-unscaled": 1.0, "pegasus-scaled-gelu": 0.7, "pegasus-relu-unscaled-beams": 0.7}


@pytest.mark.parametrize("case", sorted(CASES))
def test_import_equals_transformers_generate(case, tmp_path):
    family, config, generation = CASES[case]
    src = bart_like_model_dir(tmp_path / "src", family, config, generation, std=STD.get(case, 0.35))
    result = CliRunner().invoke(cli, ["import", "hf", str(src), "-o", str(tmp_path / "ckpt")])
    if _refused_under_4(family, result, tmp_path / "ckpt"):
        return
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "ckpt" / "import.json").read_text())
    assert record["family"] == family and record["verification"]["passed"]
    assert record["verification"]["transformers"] == transformers.__version__
    model, _ = load_checkpoint(tmp_path / "ckpt")
    cfg, hf = model.cfg, transformers.AutoConfig.from_pretrained(src)
    if family == "fsmt":
        assert (cfg.src_vocab_size, cfg.tgt_vocab_size, cfg.share_vocab) == (
            hf.src_vocab_size, hf.tgt_vocab_size, hf.tie_word_embeddings)
        assert cfg.tie_embeddings == hf.tie_word_embeddings
    assert (cfg.scale_embeddings, cfg.pre_norm) == (hf.scale_embedding, family == "pegasus")

    # The judge on other sources than the import's proof: a padded batch, greedy and beam 4.
    hf_model = load_transformers_model(src)
    gen = json.loads((tmp_path / "ckpt" / "generation.json").read_text())
    ids, mask = pad_batch(seeded_sources(cfg, 8, seed=42), cfg.pad_id)
    settings = DecodeSettings.for_model(cfg, 20, gen)
    step = EagerStepModel(model)
    greedy = greedy_decode(step, ids, mask, settings)
    assert greedy == hf_rows(hf_model, ids, mask, 20, cfg.eos_id, num_beams=1)
    beam = hf_beam_search(step, ids, mask, settings, 4, gen["length_penalty"], gen["early_stopping"])
    assert beam == hf_rows(hf_model, ids, mask, 20, cfg.eos_id, num_beams=4, length_penalty=gen["length_penalty"],
                             early_stopping=gen["early_stopping"])
    assert len({t for row in greedy for t in row}) > 3, "degenerate outputs cannot tell a wrong model apart"
    assert beam != greedy, "beam search never differed from greedy"


def test_a_wrong_position_table_fails_the_proof(tmp_path, monkeypatch):
    """Negative control: Pegasus read with fairseq's sinusoid layout instead of its own (sines | cosines) loads every
    tensor, and the proof refuses it (nothing written)."""
    from seq2trt.hf_import.families import FAMILIES

    src = bart_like_model_dir(tmp_path / "src", "pegasus", dict(scale_embedding=True))
    monkeypatch.setattr(FAMILIES["pegasus"], "architecture", dict(FAMILIES["pegasus"].architecture,
                                                                  positions="sinusoid_fairseq"))
    result = CliRunner().invoke(cli, ["import", "hf", str(src), "-o", str(tmp_path / "ckpt")])
    assert result.exit_code == 1 and "failed its verification against transformers" in result.output, result.output
    assert not (tmp_path / "ckpt").exists()


def _fsmt_tokenizer(path) -> tuple[int, int]:
    """An FSMT tokenizer written as its save_vocabulary writes one: a source and a target vocabulary (fairseq's
    <s> <pad> </s> <unk> first, BPE pieces with </w> ending a word) and their BPE merges; returns the two sizes."""
    pieces = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "de", "an", "el", "or"]
    merges = [("k", "a"), ("l", "o"), ("m", "i"), ("n", "e"), ("s", "u"), ("t", "a</w>"), ("r", "i</w>")]
    special = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    letters = sorted({c for p in pieces for c in p})
    src_tokens = (letters + [c + "</w>" for c in letters] + pieces + [p + "</w>" for p in pieces]
                  + ["".join(m) for m in merges])
    tgt_tokens = src_tokens + ["extra1", "extra2"]  # a target vocabulary of another size
    path.mkdir(parents=True, exist_ok=True)
    for name, tokens in (("vocab-src.json", src_tokens), ("vocab-tgt.json", tgt_tokens)):
        vocab = dict(special, **{t: i + len(special) for i, t in enumerate(dict.fromkeys(tokens))})
        (path / name).write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("".join(f"{a} {b} 1\n" for a, b in merges))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "FSMTTokenizer", "langs": ["en", "de"],
                                                            "do_lower_case": False}))
    return tuple(len(json.loads((path / name).read_text())) for name in ("vocab-src.json", "vocab-tgt.json"))


def test_translate_text_with_the_fsmt_tokenizer_is_transformers(tmp_path):
    """Text in through the source vocabulary, text out through the target one: `seq2trt translate` prints what
    transformers' tokenizer and generate give on the source directory."""
    pytest.importorskip("sacremoses", reason="FSMT's tokenizer needs sacremoses (the hf extra installs it)")
    src = tmp_path / "src"
    n_src, n_tgt = _fsmt_tokenizer(src)
    bart_like_model_dir(src, "fsmt", dict(src_vocab_size=n_src, tgt_vocab_size=n_tgt),
                        dict(suppress_tokens=[0, 1], min_new_tokens=4, no_repeat_ngram_size=2), std=0.6)
    result = CliRunner().invoke(cli, ["import", "hf", str(src), "-o", str(tmp_path / "ckpt")])
    if _refused_under_4("fsmt", result, tmp_path / "ckpt"):
        return
    assert result.exit_code == 0, result.output
    assert {"vocab-src.json", "vocab-tgt.json", "merges.txt"} <= set(
        json.loads((tmp_path / "ckpt" / "import.json").read_text())["tokenizer_files"])
    texts = ["kalo mine suta", "ri po de an", "taelor kasu minelo ta"]
    out = CliRunner().invoke(cli, ["translate", str(tmp_path / "ckpt"), *texts, "--beam-size", "4",
                                   "--max-new-tokens", "16"])
    assert out.exit_code == 0, out.output
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(src))
    assert type(tokenizer).__name__ == "FSMTTokenizer"
    encoded = tokenizer(texts)["input_ids"]
    assert all(row[-1] == 2 and max(row) < n_src for row in encoded)
    ids, mask = pad_batch(encoded, 1)
    want = hf_rows(load_transformers_model(src), ids, mask, 16, 2, num_beams=4)
    assert out.output.splitlines() == [tokenizer.decode(w, skip_special_tokens=True) for w in want]
    assert len(set(out.output.splitlines())) == len(texts), "distinct sources should translate differently"


@pytest.mark.parametrize("model_type, named", [("pegasus_x", "block-local attention"),
                                               ("bigbird_pegasus", "block-sparse attention")])
def test_pegasus_variants_with_other_attention_are_refused_by_name(model_type, named, tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(json.dumps({"model_type": model_type, "d_model": 32}))
    result = CliRunner().invoke(cli, ["import", "hf", str(tmp_path / "src"), "-o", str(tmp_path / "ckpt")])
    assert result.exit_code == 2 and named in result.output and "pegasus, fsmt" in result.output, result.output
    assert not (tmp_path / "ckpt").exists()


def test_an_fsmt_tokenizer_without_sacremoses_is_one_line_naming_it(tmp_path, monkeypatch):
    import sys

    src = tmp_path / "src"
    n_src, n_tgt = _fsmt_tokenizer(src)
    bart_like_model_dir(src, "fsmt", dict(src_vocab_size=n_src, tgt_vocab_size=n_tgt), NO_PAD)
    monkeypatch.setitem(sys.modules, "sacremoses", None)  # its import fails as if it were not installed
    result = CliRunner().invoke(cli, ["import", "hf", str(src), "-o", str(tmp_path / "ckpt")])
    if _refused_under_4("fsmt", result, tmp_path / "ckpt"):
        return
    assert result.exit_code == 2 and "needs a library that is not installed" in result.output, result.output
    assert "sacremoses" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "ckpt").exists()
