"""The decoding options are declared once (reference_model/decoding/options.DECODE_OPTIONS) and every surface is made
from that table: each row is a CLI flag of every verb it names, a Translator keyword, a served request input and a
refusal of the whole-search graph where it says so, and nothing on those surfaces is missing from it (a planted
row, or a row taken out, is caught). The deprecated spellings (`--beam`, `beam=`; the served `num_beams`,
`do_sample`, `output_token_logprobs`) warn with the new name and give what the new spelling gives."""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import re

import click
import numpy as np
import pytest

import seq2trt
from seq2trt.cli.main import cli
from seq2trt.reference_model.decoding import DecodeSettings
from seq2trt.reference_model.decoding.options import DECODE_OPTIONS, OPTIONS, DecodeOption
from seq2trt.core.errors import InputError

from helpers.cli import invoke

# The flags of the decoding verbs that are not decoding options (inputs, outputs, the backend, threads, ...).
NOT_OPTIONS = {
    "translate": {"--backend", "--ids-file", "--output-ids", "--src-lang", "--tgt-lang", "--batch-size",
                  "--checkpoint", "--threads", "--help"},
    "transcribe": {"--language", "--task", "--timestamps", "--backend", "--format", "--output-ids", "--batch-size",
                   "--max-seconds", "--checkpoint", "--threads", "--condition-on-prev-tokens", "--temperature",
                   "--compression-ratio-threshold", "--logprob-threshold", "--help"},
}
# The served inputs that are not decoding options (the source, its languages).
NOT_SERVED_OPTIONS = {"input_ids", "text", "src_lang", "tgt_lang"}
# Translator.translate's parameters that are not decoding options.
NOT_KWARGS = {"self", "texts", "batch_size", "search"}


def _flags(verb: str) -> tuple[set[str], set[str]]:
    """(the visible flags, the hidden ones) of `seq2trt VERB`."""
    shown, hidden = set(), set()
    for param in cli.get_command(click.Context(cli), verb).params:
        for name in param.opts + param.secondary_opts:
            if name.startswith("--"):
                (hidden if getattr(param, "hidden", False) else shown).add(name)
    return shown, hidden


def mismatches(rows) -> list[str]:
    """Where the surfaces and the table `rows` disagree, in words (empty: they agree)."""
    from seq2trt.serving.model_config import input_specs
    from seq2trt.translator import SEARCH_OPTIONS

    found = []
    for verb, others in NOT_OPTIONS.items():
        shown, hidden = _flags(verb)
        want = {o.flag for o in rows if verb in o.verbs}
        want |= {f"--no-{o.flag[2:]}" for o in rows if verb in o.verbs and o.negatable}
        found += [f"{verb} lacks {f}" for f in want - shown] + [f"{verb} has {f}, not in the table"
                                                                  for f in shown - want - others]
        old = {f for o in rows if verb in o.verbs for f in o.old_flags}
        found += [f"{verb} lacks the hidden alias {f}" for f in old - hidden]
    kwargs = set(inspect.signature(seq2trt.Translator.translate).parameters) - NOT_KWARGS | set(SEARCH_OPTIONS)
    table = {o.kwarg for o in rows}
    found += [f"Translator.translate lacks {k}=" for k in table - kwargs]
    found += [f"Translator.translate takes {k}=, not in the table" for k in kwargs - table]
    for kind in ("generate", "translate"):
        served = set(input_specs(kind)) - NOT_SERVED_OPTIONS
        table = {name for o in rows if o.served for name in (o.served, *o.old_served)}
        found += [f"served {kind} lacks {n}" for n in table - served]
        found += [f"served {kind} takes {n}, not in the table" for n in served - table]
    return found


def test_every_row_is_on_every_surface_it_names_and_nothing_else_is():
    assert mismatches(DECODE_OPTIONS) == []


def test_a_planted_row_and_a_missing_row_are_caught():
    planted = DecodeOption("typical_p", "typical_p", "--typical-p", "typical_p", float, None, "planted", False,
                           ("translate", "transcribe"))
    found = mismatches(DECODE_OPTIONS + (planted,))
    assert {"translate lacks --typical-p", "transcribe lacks --typical-p", "Translator.translate lacks typical_p=",
            "served generate lacks typical_p", "served translate lacks typical_p"} <= set(found)
    without = tuple(o for o in DECODE_OPTIONS if o.field != "top_k")
    assert set(mismatches(without)) == {"translate has --top-k, not in the table",
                                        "Translator.translate takes top_k=, not in the table",
                                        "served generate takes top_k, not in the table",
                                        "served translate takes top_k, not in the table"}


def test_the_rules_are_the_tables_and_decode_settings_names_the_callers_spelling():
    settings = DecodeSettings(1, 2, 0, 8)
    for o in DECODE_OPTIONS:
        if o.rule is None:
            continue
        bad = "x" if o.kind is not str else 1
        with pytest.raises(InputError, match="^" + re.escape(f"{o.flag} must be {o.rule[1]}")):
            settings.with_options({o.field: bad}, {p.field: p.flag for p in DECODE_OPTIONS})
        with pytest.raises(InputError, match=f"^{o.kwarg} must be "):
            settings.with_options({o.field: bad}, {p.field: p.kwarg for p in DECODE_OPTIONS})


def test_the_whole_search_graph_refuses_exactly_the_rows_it_does_not_apply():
    from seq2trt.runtime.decode_jobs import unsupported_in_graph

    base = DecodeSettings(1, 2, 0, 8)
    changed = {"do_sample": True, "temperature": 0.5, "top_k": 3, "top_p": 0.5, "seed": 1, "fast_sampling": True,
               "num_return_sequences": 2, "output_scores": True, "output_token_logprobs": True, "min_length": 2,
               "min_new_tokens": 1, "no_repeat_ngram_size": 2, "repetition_penalty": 1.5}
    settings = dataclasses.replace(base, **changed)
    refused = {item.split("=")[0] for item in unsupported_in_graph(settings)}
    assert refused == {f for f in changed if not OPTIONS[f].in_graph}
    assert {"do_sample", "output_token_logprobs", "min_new_tokens"} & refused == {"do_sample", "output_token_logprobs"}


def test_the_old_beam_flag_warns_and_gives_the_new_flags_output(numbers_export):
    root, _, _ = numbers_export
    texts = ["123", "40213"]
    new = invoke("translate", root / "out", *texts, "--backend", "ort-fused", "--beam-size", 3)
    old = invoke("translate", root / "out", *texts, "--backend", "ort-fused", "--beam", 3)
    assert new.exit_code == old.exit_code == 0, old.output
    assert old.stderr == "warning: --beam is deprecated; use --beam-size\n" and new.stderr == ""
    assert old.stdout == new.stdout and len(new.stdout.splitlines()) == len(texts)
    both = invoke("translate", root / "out", *texts, "--beam", 3, "--beam-size", 3)
    assert both.exit_code == 2 and "--beam is the deprecated spelling of --beam-size; give --beam-size alone" in \
        both.output


def test_the_old_beam_keyword_warns_and_gives_the_new_keywords_result(numbers_export):
    root, _, _ = numbers_export
    with seq2trt.Translator(root / "out", backend="ort-fused") as translator:
        want = translator.translate(["123", "40213"], beam_size=3)
        with pytest.warns(FutureWarning, match=r"^beam= is deprecated; use beam_size=$"):
            got = translator.translate(["123", "40213"], beam=3)
        with pytest.warns(FutureWarning, match="beam= is deprecated"):
            by_ids = translator.generate([[3, 4, 2]], beam=3)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert by_ids == translator.generate([[3, 4, 2]], beam_size=3)
        with pytest.warns(FutureWarning), pytest.raises(InputError, match="give beam_size= alone"):
            translator.translate(["123"], beam=3, beam_size=2)
    assert got == want


def _request(**inputs):
    """A request's `get(input name)` as the served model has it: each input a [1] array of its Triton type."""
    def array(value):
        return np.array([value], np.bool_ if isinstance(value, bool) else np.int32)

    return lambda name: None if name not in inputs else array(inputs[name])


@pytest.mark.parametrize("row", [o for o in DECODE_OPTIONS if o.old_served], ids=lambda o: o.field)
def test_an_old_served_input_is_read_and_named_as_sent(row, caplog):
    from seq2trt.serving.decode_service import served_input

    value = 3 if row.kind is int else True
    (old,) = row.old_served
    assert served_input(_request(**{row.served: value}), row.field) == (value, row.served)
    with caplog.at_level("WARNING"):
        assert served_input(_request(**{old: value}), row.field) == (value, old)
    assert f"{old} is deprecated; send {row.served}" in caplog.text
    assert served_input(_request(), row.field) == (None, row.served)
    with pytest.raises(InputError, match=f"{row.served} and {old} are one option; send {row.served} alone"):
        served_input(_request(**{row.served: value, old: value}), row.field)


def test_the_served_names_are_the_cli_and_python_names_but_where_an_output_holds_it():
    """One name per concept: a served input is the kwarg's name (the flag's, dashes as underscores), the served
    spelling before kept as its alias; output_scores alone differs, `scores` being the served output tensor."""
    from seq2trt.serving.model_config import request_outputs

    outputs = {re.search(r'name: "(\w+)"', block)[1] for kind in ("generate", "translate")
               for block in request_outputs(kind)}
    for o in DECODE_OPTIONS:
        if o.served is None:
            continue
        assert o.flag == "--" + o.kwarg.replace("_", "-") or o.old_flags, o
        if o.kwarg in outputs:
            assert o.served != o.kwarg and o.served not in outputs, o
        elif o.kwarg != "n_best":  # n_best: the served name is the kwarg's (num_return_sequences is the field)
            assert o.served == o.kwarg, f"served {o.served} is not the CLI / Python name {o.kwarg}"
    assert OPTIONS["output_scores"].served == "output_scores" and "scores" in outputs


def test_a_request_by_the_old_inputs_is_the_request_by_the_new_ones():
    from seq2trt.serving.decode_service import request_options

    new = request_options(_request(sample=True, token_logprobs=True, top_k=3))
    old = request_options(_request(do_sample=True, output_token_logprobs=True, top_k=3))
    assert new == ({"do_sample": True, "output_token_logprobs": True, "top_k": 3}, {})
    assert old == (new[0], {"do_sample": "do_sample", "output_token_logprobs": "output_token_logprobs"})


def test_the_old_length_penalty_spellings_warn_and_give_the_new_ones_result(numbers_export):
    root, _, _ = numbers_export
    texts = ["123", "40213", "7"]
    new = invoke("translate", root / "ckpt", *texts, "--beam-size", 3, "--length-penalty", 1.5, "--scores")
    old = invoke("translate", root / "ckpt", *texts, "--beam-size", 3, "--alpha", 1.5, "--scores")
    assert new.exit_code == old.exit_code == 0, old.output
    assert old.stderr == "warning: --alpha is deprecated; use --length-penalty\n" and new.stderr == ""
    assert old.stdout == new.stdout
    other = invoke("translate", root / "ckpt", *texts, "--beam-size", 3, "--scores")
    assert other.stdout != new.stdout  # the penalty moved the scores: the comparison above could fail
    with seq2trt.Translator(root / "ckpt", backend="eager") as translator:
        want = translator.translate(texts, beam_size=3, length_penalty=1.5, scores=True)
        with pytest.warns(FutureWarning, match=r"^alpha= is deprecated; use length_penalty=$"):
            got = translator.translate(texts, beam_size=3, alpha=1.5, scores=True)
    assert got == want and [f"{h.score:.6g}\t{h.text}" for h in want] == new.stdout.splitlines()
