"""generate.onnx (ONNX Runtime's BeamSearch around the fused ORT graphs) against the eager searches of
reference_model.decoding: one beam = greedy_decode, K beams = hf_beam_search(early_stopping=True); the record's hash
checks; the errors. The eager model runs in float64 (independent of ONNX Runtime and of the graph's adaptation)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from seq2trt.exporters import spec
from seq2trt.exporters.fuse import Target, fuse_artifacts
from seq2trt.exporters.ort_search import FILENAME, GENERATE_JSON, generate_artifacts, generate_dir, verify_generate
from seq2trt.exporters.manifest import verify
from seq2trt.exporters.onnx_export import export
from seq2trt.reference_model.decoding import DecodeSettings, greedy_decode, hf_beam_search
from seq2trt.reference_model.eager import EagerStepModel
from seq2trt.core.errors import ArtifactError, InputError
from seq2trt.reference_model.vocab import pad_batch
from seq2trt.runtime.ort_search import GenerateModel

from helpers.sources import random_sources

pytest.importorskip("onnxruntime")


def _build(model, out, max_batch=16):
    export(model, out, limits=spec.Limits.for_model(model.cfg, max_batch=max_batch))
    fuse_artifacts(out, Target.ORT)
    generate_artifacts(out)
    return out


VARIANTS = {"plain": {}, "forced-bos-eos-suppressed": {"forced_bos_id": 5, "forced_eos": True, "suppress_ids": (3, 4)}}


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, make_model, tmp_path_factory):
    model = make_model(seed=7, dtype=torch.float32, **VARIANTS[request.param])
    return model, _build(model, tmp_path_factory.mktemp("generate") / "out")


def _compare(model, out, sources, settings, beams, length_penalty, rows):
    eager = EagerStepModel(model.double())
    want, got = [], []
    with GenerateModel(out, verify(out)) as generate:
        for i in range(0, len(sources), rows):
            ids, mask = pad_batch(sources[i: i + rows], model.cfg.pad_id)
            want += (greedy_decode(eager, ids, mask, settings) if beams == 1 else
                     hf_beam_search(eager, ids, mask, settings, beams, length_penalty, True))
            got += generate.decode(ids, mask, settings, beams, length_penalty)
    return want, got


# Length penalty 0: the random model's hypotheses mostly run into the length limit, where ONNX Runtime counts the
# start token in the length (exporters/ort_search.py); with no penalty the length does not enter the score.
@pytest.mark.parametrize("beams, length_penalty", [(1, 1.0), (4, 0.0), (3, 0.0)])
def test_generate_equals_the_eager_search_on_a_tiny_model(tiny, beams, length_penalty):
    model, out = tiny
    settings = DecodeSettings.for_model(model.cfg, 20)
    want, got = _compare(model, out, random_sources(model.cfg, 24), settings, beams, length_penalty, rows=16 // beams)
    assert got == want
    assert len({tuple(w) for w in want}) > 8  # varied outputs: the comparison can fail
    if model.cfg.forced_bos_id is not None:
        assert all(w[0] == model.cfg.forced_bos_id and not {3, 4} & set(w) for w in want)
        assert any(len(w) < settings.max_new_tokens for w in want)  # the forced eos ends every beam at the limit


def test_the_graph_is_beam_search_around_the_fused_graphs(tiny):
    model, out = tiny
    graph = onnx.load(str(generate_dir(out) / FILENAME)).graph
    (node,) = graph.node
    assert (node.op_type, node.domain) == ("BeamSearch", "com.microsoft")
    attrs = {a.name: a for a in node.attribute}
    assert attrs["early_stopping"].i == 1 and attrs["model_type"].i == 1
    assert attrs["pad_token_id"].i == attrs["eos_token_id"].i == model.cfg.eos_id
    decoder = attrs["decoder"].g
    assert [i.name for i in decoder.input][:4] == ["input_ids", "encoder_attention_mask", "past_key_self_0",
                                                   "past_value_self_0"]
    assert decoder.input[0].type.tensor_type.shape.dim[1].dim_value == 1
    assert [o.name for o in attrs["encoder"].g.output] == ["present_key_cross_0", "present_value_cross_0",
                                                          "present_key_cross_1", "present_value_cross_1"]
    assert sum(n.op_type == "MultiHeadAttention" for n in decoder.node) == 2 * model.cfg.num_decoder_layers


def test_stale_or_modified_generation_graphs_are_refused(make_model, tmp_path):
    out = _build(make_model(seed=1, dtype=torch.float32), tmp_path / "out")
    record_path = generate_dir(out) / GENERATE_JSON
    record = json.loads(record_path.read_text())
    record["sources"]["decoder.onnx"] = "0" * 64
    record_path.write_text(json.dumps(record))
    with pytest.raises(ArtifactError, match="built from older fused graphs .decoder.onnx"):
        verify_generate(out)
    generate_artifacts(out, force=True)
    with open(generate_dir(out) / FILENAME, "ab") as f:
        f.write(b"\0")
    with pytest.raises(ArtifactError, match="does not match its sha256.*seq2trt ort-search"):
        GenerateModel(out, verify(out))
    fuse_artifacts(out, Target.ORT, force=True)  # same fused graphs: the generation graph is still current
    generate_artifacts(out, force=True)
    verify_generate(out)
    (generate_dir(out) / GENERATE_JSON).unlink()
    with pytest.raises(ArtifactError, match="run `seq2trt ort-search"):
        verify_generate(out)


def test_beam_needs_max_batch_of_batch_times_beam(make_model, tmp_path):
    model = make_model(seed=2, dtype=torch.float32)
    out = _build(model, tmp_path / "out", max_batch=4)
    ids, mask = pad_batch(random_sources(model.cfg, 2), model.cfg.pad_id)
    settings = DecodeSettings.for_model(model.cfg, 10)
    with GenerateModel(out, verify(out)) as generate:
        generate.decode(ids, mask, settings, 2)  # 4 rows: fits
        with pytest.raises(InputError, match="exports for beam need max_batch >= B x K"):
            generate.decode(ids, mask, settings, 3)
        with pytest.raises(InputError, match="decoding rules it was built with"):
            generate.decode(ids, mask, DecodeSettings(model.cfg.bos_id, model.cfg.eos_id, model.cfg.pad_id, 10, 6), 1)
        with pytest.raises(InputError, match="exceed the export's max_tgt_len"):
            generate.decode(ids, mask, DecodeSettings.for_model(model.cfg, model.cfg.max_tgt_len), 1)


def test_models_the_graph_cannot_serve_are_refused(make_model, tmp_path):
    with pytest.raises(ArtifactError, match="seq2trt fuse"):
        generate_artifacts(export(make_model(seed=1, dtype=torch.float32), tmp_path / "unfused"))


@pytest.mark.slow
@pytest.mark.parametrize("beams", [1, 4])
def test_generate_equals_the_eager_search_on_the_demo_model(demo_checkpoint, tmp_path_factory, beams):
    from seq2trt.reference_model.checkpoint import load_checkpoint
    from seq2trt.reference_model.tasks import get_task

    model, _ = load_checkpoint(demo_checkpoint)
    out = tmp_path_factory.getbasetemp() / "demo-generate"
    if not (generate_dir(out) / GENERATE_JSON).exists():
        _build(model, out, max_batch=32)
    task = get_task("numbers")
    sources = [task.source_vocab.encode(s) + [model.cfg.eos_id] for s, _ in task.heldout(48)]
    settings = DecodeSettings.for_model(model.cfg, 63)
    want, got = _compare(model, out, sources, settings, beams, 0.6, rows=32 // beams)
    assert got == want


def test_int8_generation_graph_is_the_search_over_the_int8_graphs(make_model, tmp_path):
    """generate --int8 wraps quantized/ort-int8: judged by the Python loops over those same int8 graphs."""
    from seq2trt.exporters.quantize import quantize_artifacts, quantized_dir
    from seq2trt.runtime.registry import open_step_model

    model = make_model(seed=4, dtype=torch.float32)
    out = _build(model, tmp_path / "out")
    quantize_artifacts(out)
    generate_artifacts(out, int8=True)
    settings = DecodeSettings.for_model(model.cfg, 16)
    ids, mask = pad_batch(random_sources(model.cfg, 4, seed=3), model.cfg.pad_id)
    with open_step_model(out, "ort-int8") as (loop, manifest), GenerateModel(out, manifest, int8=True) as generate:
        assert generate.decode(ids, mask, settings, 1) == greedy_decode(loop, ids, mask, settings)
        assert generate.decode(ids, mask, settings, 4, 0.0) == hf_beam_search(loop, ids, mask, settings, 4, 0.0, True)
    quantize_artifacts(out, force=True)  # new int8 files (a new sha256 only if they differ): still checked
    (quantized_dir(out) / "decoder.onnx").write_bytes((quantized_dir(out) / "decoder.onnx").read_bytes() + b"\0")
    with pytest.raises(ArtifactError, match="seq2trt quantize"):
        verify_generate(out, int8=True)


# min_length / min_new_tokens (ORT's min_length input: the start token counts) and repetition_penalty (a runtime
# input: ORT penalises every id of the sequence, start token included, as Hugging Face's processor over input_ids).
@pytest.mark.parametrize("options, beams", [({"min_new_tokens": 12, "repetition_penalty": 1.8}, 3),
                                            ({"min_length": 15, "repetition_penalty": 0.7}, 3),
                                            ({"min_length": 15}, 1)])
def test_generate_applies_min_length_and_repetition_penalty(tiny, options, beams):
    import dataclasses

    model, out = tiny
    settings = dataclasses.replace(DecodeSettings.for_model(model.cfg, 20), **options)
    want, got = _compare(model, out, random_sources(model.cfg, 16), settings, beams, 0.0, rows=16 // beams)
    assert got == want
    plain, _ = _compare(model, out, random_sources(model.cfg, 16), DecodeSettings.for_model(model.cfg, 20), beams,
                        0.0, rows=16 // beams)
    assert plain != want  # the options change the outputs: the comparison can fail
    floor = options.get("min_length", 1 + options.get("min_new_tokens", 0)) - 1
    assert all(len(w) >= floor - (model.cfg.forced_bos_id is not None) for w in want)


def test_greedy_with_repetition_penalty_is_refused(tiny):
    # ORT's greedy search does not penalise as Hugging Face's greedy search (raw logits) does: refused by name.
    import dataclasses

    model, out = tiny
    settings = dataclasses.replace(DecodeSettings.for_model(model.cfg, 20), repetition_penalty=1.8)
    ids, mask = pad_batch(random_sources(model.cfg, 2), model.cfg.pad_id)
    with GenerateModel(out, verify(out)) as generate, pytest.raises(InputError, match="repetition_penalty 1.8 with one beam"):
        generate.decode(ids, mask, settings, 1)


def test_no_repeat_ngrams_n_best_and_scores_equal_the_eager_beam_search(make_model, tmp_path):
    """no_repeat_ngram_size (an attribute: fixed when the graph is built), num_return_sequences (an input) and
    sequences_scores (an output) against hf_beam_search in float64 with the same options: the same n-best token
    lists, best first, and their scores to float32 rounding; a decode asking another n-gram size is refused."""
    import dataclasses

    from seq2trt.reference_model.decoding import Hypothesis

    model = make_model(seed=7, dtype=torch.float32)
    out = tmp_path / "out"
    export(model, out, limits=spec.Limits.for_model(model.cfg, max_batch=16))
    fuse_artifacts(out, Target.ORT)
    record = generate_artifacts(out, no_repeat_ngram_size=2)
    assert record["semantics"]["no_repeat_ngram_size"] == 2
    attrs = {a.name: a.i for a in onnx.load(str(generate_dir(out) / FILENAME)).graph.node[0].attribute
             if a.type == onnx.AttributeProto.INT}
    assert attrs["no_repeat_ngram_size"] == 2
    settings = dataclasses.replace(DecodeSettings.for_model(model.cfg, 20), no_repeat_ngram_size=2,
                                   num_return_sequences=3, output_scores=True)
    want, got = _compare(model, out, random_sources(model.cfg, 16), settings, 4, 1.0, rows=4)
    assert [[h.tokens for h in hyps] for hyps in got] == [[h.tokens for h in hyps] for hyps in want]
    np.testing.assert_allclose([[h.score for h in hyps] for hyps in got], [[h.score for h in hyps] for hyps in want],
                               rtol=1e-5, atol=1e-5)
    assert all(isinstance(h, Hypothesis) and len(hyps) == 3 for hyps in got for h in hyps)
    for hyps in want:  # the rule held: no bigram of a hypothesis (start token included) occurs twice
        for h in hyps:
            row = [settings.bos_id, *h.tokens]
            bigrams = list(zip(row, row[1:]))
            assert len(bigrams) == len(set(bigrams))
    ids, mask = pad_batch(random_sources(model.cfg, 16), model.cfg.pad_id)
    free = hf_beam_search(EagerStepModel(model.double()), ids, mask, DecodeSettings.for_model(model.cfg, 20), 4, 1.0,
                          True)
    assert free != [hyps[0].tokens for hyps in want]  # the model repeats bigrams when free: the test could fail
    assert any(len(h.tokens) == 20 for hyps in want for h in hyps)  # scores of hypotheses the limit closed too
    with GenerateModel(out, verify(out)) as generate:
        with pytest.raises(InputError, match=r"bans repeated n-grams of size 2 .* asks 3; re-run `seq2trt ort-search"):
            generate.check(2, ids.shape[1], dataclasses.replace(settings, no_repeat_ngram_size=3), 4)
        with pytest.raises(InputError, match="num_return_sequences 5 is more than the 4 beams"):
            generate.check(2, ids.shape[1], dataclasses.replace(settings, num_return_sequences=5), 4)
        with pytest.raises(InputError, match="scores with one beam"):
            generate.check(2, ids.shape[1], dataclasses.replace(settings, num_return_sequences=1), 1)
