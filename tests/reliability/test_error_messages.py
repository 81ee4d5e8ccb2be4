"""Error lines name what is wrong and what to do, shortly: a huge input is not echoed whole, a damaged vocab.json,
SEQ2TRT_CACHE on a file, a checkpoint deleted after export, a NaN length penalty, a flag's value. Each is one short
error line (exit 2), no traceback.
"""

from __future__ import annotations

import json

import pytest


@pytest.mark.parametrize("text", ["12a" * 33_334, "12 a " * 20_000], ids=["one-word", "many-words"])
def test_a_huge_input_gives_a_short_error_line(work, text, invoke, one_error_line):
    """The vocabulary error echoes the text: it is shown by its ends and its length."""
    result = invoke("translate", work / "ckpt", text)
    assert len(result.output) < 1500, len(result.output)
    one_error_line(result, 2, "outside the vocabulary", "characters]")


@pytest.mark.parametrize("damage, fragment", [
    (lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "target": {
        "kind": "word", "tokens": ["<pad>", "<s>", "</s>", "one", 12, "three"]}})), "target.tokens must be non-empty "
                                                                                     "strings; entries [4]"),
    (lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "source": ["x"]})), "source must be an object"),
    (lambda p: p.write_text("[1, 2]"), "a JSON object with 'source' and 'target'"),
    (lambda p: (p.unlink(), p.mkdir()), "is a directory"),
], ids=["non-string-token", "entry-not-object", "not-an-object", "directory"])
def test_a_damaged_vocab_json_is_named(work, damage, fragment, invoke, one_error_line):
    damage(work / "ckpt" / "vocab.json")
    one_error_line(invoke("translate", work / "ckpt", "123"), 2, "vocab.json", fragment)


def test_seq2trt_cache_on_a_file_is_refused_before_training(work, monkeypatch, invoke, one_error_line):
    from seq2trt.reference_model import train

    (work / "cache").write_text("not a folder")
    monkeypatch.setenv("SEQ2TRT_CACHE", str(work / "cache"))
    monkeypatch.setattr(train, "train", lambda *a, **k: pytest.fail("trained before checking the cache"))
    one_error_line(invoke("demo", "-o", work / "demo"), 2, "SEQ2TRT_CACHE", f"{work / 'cache'} is a file")


def test_a_deleted_checkpoint_points_at_checkpoint_not_train(work, artifact, invoke, one_error_line):
    out = work / "out"
    manifest = json.loads((out / "manifest.json").read_text())
    gone = work / "moved-away"
    manifest["source"]["checkpoint"] = str(gone)  # as if the checkpoint had been deleted after export
    from seq2trt.exporters.manifest import read_manifest, write_manifest

    m = read_manifest(out)
    write_manifest(out, m.config, m.data["settings"], list(m.data["files"]), manifest["source"])
    line = one_error_line(invoke("validate", out, "--samples", "0"), 2, f"{gone}", "is gone", "--checkpoint")
    assert "seq2trt train" not in line
    assert invoke("validate", out, "--samples", "0", "--checkpoint", artifact / "ckpt").exit_code == 0


@pytest.mark.parametrize("alpha", ["nan", "-nan"])
def test_a_nan_length_penalty_is_refused(work, alpha, invoke, one_error_line):
    one_error_line(invoke("translate", work / "ckpt", "123", "--beam-size", "2", "--length-penalty", alpha), 2, "--length-penalty")


def _max_threads() -> int:
    from seq2trt.runtime.decode_jobs import MAX_THREADS

    return MAX_THREADS


@pytest.mark.parametrize("flag, value, fragment", [
    ("--threads", "0", "--threads must be in [1, {limit}], got 0"),
    ("--threads", "-1", "--threads must be in [1, {limit}], got -1"),
    ("--threads", "{over}", "--threads must be in [1, {limit}], got {over}"),
    ("--threads", "100000", "--threads must be in [1, {limit}], got 100000"),  # libgomp crashed creating them
    ("--batch-size", "0", "--batch-size must be >= 1, got 0"),
    ("--length-penalty", "nan", "--length-penalty must be a number, got nan"),
], ids=["threads-0", "threads-negative", "threads-just-over", "threads-huge", "batch-size-0", "alpha-nan"])
def test_translate_names_the_flag_and_the_value(work, flag, value, fragment, invoke, one_error_line, monkeypatch):
    from seq2trt.runtime import decode_jobs

    limit = _max_threads()
    value, fragment = (s.format(limit=limit, over=limit + 1) for s in (value, fragment))
    monkeypatch.setattr(decode_jobs, "torch_threads", lambda n: pytest.fail(f"torch was set to {n} threads"))
    one_error_line(invoke("translate", work / "ckpt", "123", flag, value), 2, fragment)


def test_a_text_starting_with_a_dash_hints_at_double_dash(work, invoke, one_error_line):
    one_error_line(invoke("translate", work / "ckpt", "-5"), 2, "No such option", "-5",
                   "put `--` before the texts", "seq2trt translate SOURCE -- -5")
    line = one_error_line(invoke("translate", work / "ckpt", "12", "--beams", "2"), 2, "--beams", "--beam-size")
    assert "`--`" not in line  # a misspelt option keeps click's own suggestion alone
    one_error_line(invoke("translate", work / "ckpt", "--", "-5"), 2, "outside the vocabulary: ['-']")


@pytest.mark.parametrize("flag", ["--tgt-lang", "--src-lang"])
def test_a_language_without_a_tokenizer_says_it_needs_one(work, flag, invoke, one_error_line):
    (work / "ckpt" / "vocab.json").unlink()  # a checkpoint that holds no tokenizer at all
    (work / "ids.jsonl").write_text("[4, 5, 2]\n")
    line = one_error_line(invoke("translate", work / "ckpt", "--ids-file", work / "ids.jsonl", flag, "de"), 2,
                          f"{flag} de needs the model's tokenizer", "has none", f"drop {flag}")
    assert "give token ids with --ids-file" not in line


def test_ort_generate_on_an_fp16_export_says_what_runs_it(work, invoke, one_error_line):
    """`seq2trt ort-search` (and `quantize`) refuse an fp16 export: pointing at them led to a second error."""
    assert invoke("export", work / "ckpt", "-o", work / "half", "--dtype", "fp16").exit_code == 0
    for backend in ("ort-generate", "ort-generate-int8"):
        line = one_error_line(invoke("translate", work / "half", "123", "--backend", backend), 2,
                              f"--backend {backend}", "float32 graphs", "are fp16", "--backend ort,", "tensorrt",
                              "--dtype fp32")
        assert "run `seq2trt ort-search" not in line
    result = invoke("translate", work / "half", "123", "--backend", "ort")  # what the line offers does run it
    assert result.exit_code == 0 and result.output.strip(), result.output


@pytest.mark.parametrize("verb", ["validate", "bench"])
def test_validate_and_bench_bound_their_thread_counts(work, verb, invoke, one_error_line):
    """As translate: a count libgomp cannot create is refused by name before anything runs (validate's 0 means one
    thread per core and stays allowed)."""
    limit = _max_threads()
    one_error_line(invoke(verb, work / "out", "--threads", str(limit + 1)), 2,
                   f"--threads must be in [1, {limit}], got {limit + 1}")
    one_error_line(invoke(verb, work / "out", "--threads", "100000"), 2, "got 100000")


@pytest.mark.parametrize("generation, beam, fragment", [
    ({"num_beams": -3}, None, "the checkpoint's generation settings: num_beams must be an integer >= 1, got -3"),
    ({"num_beams": 4}, 0, "--beam-size must be an integer >= 1, got 0"),
])
def test_a_bad_beam_count_names_where_it_came_from(generation, beam, fragment):
    """A hand-edited generation.json is named as the source of its num_beams, not as a --beam-size never given."""
    from seq2trt.core.errors import InputError
    from seq2trt.runtime.decode_jobs import choose_search

    with pytest.raises(InputError) as raised:
        choose_search(generation, beam, 0.6)
    assert fragment in str(raised.value)


@pytest.mark.parametrize("name, rerun", [("latency.json", "seq2trt bench"), ("parity.json", "seq2trt validate")])
def test_report_of_a_damaged_stage_record_names_it(work, invoke, one_error_line, name, rerun):
    """A latency.json cut short was shown as "Not run (`seq2trt bench OUT`)" with exit 0: the report hid that the
    bench ran and its record is damaged. A missing record still reads "Not run"."""
    reports = work / "out" / "reports"
    reports.mkdir(exist_ok=True)
    (reports / name).write_text('{"runs": [')
    one_error_line(invoke("report", work / "out"), 2, name, "damaged", rerun)
    (reports / name).unlink()
    assert invoke("report", work / "out").exit_code == 0
