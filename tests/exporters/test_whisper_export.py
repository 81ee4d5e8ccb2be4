"""Whisper through export, fusion for both targets, int8 and graph-level validate, judged by transformers' own
`WhisperForConditionalGeneration`: the encoder graph reads `input_features` (the conv front end inside, no mask),
its states and the decoder's step logits on ONNX Runtime (plain and fused) equal transformers' on random features,
and `transcribe_features` on the ORT runners gives the tokens of its `generate(input_features, language, task)`.
The export's features.onnx computes what `WhisperFeatureExtractor` does.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")

from seq2trt.exporters import spec  # noqa: E402
from seq2trt.exporters.fuse import Target, fuse_artifacts  # noqa: E402
from seq2trt.exporters.manifest import verify  # noqa: E402
from seq2trt.exporters.onnx_export import export  # noqa: E402
from seq2trt.exporters.quantize import quantize_artifacts  # noqa: E402
from seq2trt.exporters.whisper_features import run_features, write_model_features  # noqa: E402
from seq2trt.core import layout  # noqa: E402
from seq2trt.reference_model.checkpoint import load_checkpoint, source_record  # noqa: E402
from seq2trt.exporters.ort_search import generate_artifacts  # noqa: E402
from seq2trt.core.errors import ConfigError, InputError  # noqa: E402
from seq2trt.hf_import.proof import load_transformers_model
from seq2trt.hf_import.speech_proof import whisper_generated  # noqa: E402
from seq2trt.reference_model.sources import source_kind  # noqa: E402
from seq2trt.reference_model.speech import SpeechTokens, transcribe_features  # noqa: E402
from seq2trt.runtime.registry import open_step_model  # noqa: E402
from seq2trt.validation.validate import ValidateSettings, run_validation  # noqa: E402

from helpers.audio import synthetic, whisper_checkpoint, whisper_source  # noqa: E402
from helpers.hf_models import WHISPER_IDS  # noqa: E402

MAX_BATCH, MAX_TGT = 2, 32  # the export's limits: the sweep's batches 1 and 2, pasts to 31; 4 prompt + 16 new tokens
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    """A random transformers Whisper (with its feature extractor), its checkpoint, and an fp32 export fused for both
    targets and quantized."""
    root = tmp_path_factory.mktemp("whisper")
    src = whisper_source(root / "hf", suppress_timestamps=True)  # generate cuts and re-seeks at a timestamp
    ckpt = whisper_checkpoint(src, root / "ckpt")
    model, _ = load_checkpoint(ckpt)
    limits = spec.Limits.for_model(model.cfg, max_batch=MAX_BATCH, max_tgt_len=MAX_TGT)
    out = export(model, root / "out", limits=limits, source=source_record(ckpt))
    for target in Target:
        fuse_artifacts(out, target)
    quantize_artifacts(out)
    gen = json.loads((ckpt / layout.GENERATION).read_text())
    return dict(src=src, ckpt=ckpt, model=model, out=out, gen=gen, hf=load_transformers_model(src, speech=True))


def features(cfg, count: int, seed: int) -> np.ndarray:
    return np.stack(source_kind(cfg).random(np.random.default_rng(seed), count))


def scaled_err(ours: np.ndarray, theirs: np.ndarray) -> float:
    """max |d| over max(1, max |theirs|): the import's own measure (hf_import/proof.py)."""
    return float(np.abs(ours - theirs).max()) / max(1.0, float(np.abs(theirs).max()))


def test_the_encoder_graph_reads_features_alone(whisper):
    cfg, out = whisper["model"].cfg, whisper["out"]
    import onnx

    for folder in (out, layout.fused_dir(out, "ort"), layout.fused_dir(out, "trt"), layout.quantized_dir(out)):
        graph = onnx.load(folder / spec.GraphKind.ENCODER.filename).graph
        (only,) = graph.input
        dims = [d.dim_param or d.dim_value for d in only.type.tensor_type.shape.dim]
        assert only.name == "input_features" and dims == [spec.BATCH, cfg.n_mels, 2 * cfg.max_src_len]
        assert [d.dim_value for d in graph.output[0].type.tensor_type.shape.dim][1:] == [cfg.max_src_len, cfg.d_model]
    profiles = spec.profiles(cfg, spec.Limits.for_model(cfg, max_batch=MAX_BATCH, max_tgt_len=MAX_TGT))
    assert profiles[spec.GraphKind.ENCODER] == {"input_features": ((1, 80, 3000), (2, 80, 3000), (2, 80, 3000))}
    assert {s[1] for s in profiles[spec.GraphKind.DECODER]["encoder_attention_mask"]} == {cfg.max_src_len}
    with pytest.raises(ConfigError, match="drop --max-src-len"):
        spec.Limits.for_model(cfg, max_src_len=100)
    with pytest.raises(InputError, match="speech model .* --backend ort-fused"):
        generate_artifacts(out)


@pytest.mark.parametrize("backend", ["ort", "ort-fused"])
def test_encoder_states_and_step_logits_equal_transformers(whisper, backend):
    """Encoder states, then the logits of a prefill of the prompt and of two steps on its KV cache, against
    transformers' encoder and one forward over the same decoder tokens, scaled as the import's proof is."""
    cfg, hf = whisper["model"].cfg, whisper["hf"]
    x = features(cfg, MAX_BATCH, seed=1)
    tokens = np.array([[cfg.bos_id, WHISPER_IDS["languages"]["de"], WHISPER_IDS["transcribe"],
                        WHISPER_IDS["no_timestamps"], 5, 9]] * len(x), dtype=np.int64)
    with open_step_model(whisper["out"], backend) as (model, _):
        hidden = model.encoder.infer({"input_features": x})["encoder_hidden_states"]
        mask = np.ones((len(x), cfg.max_src_len), np.int64)  # (B, 1500): the encoder positions, none masked
        state, past, logits = model.encode(x, mask), model.empty_past(len(x)), []
        for start, stop in ((0, 4), (4, 5), (5, 6)):
            feed = {"input_ids": tokens[:, start:stop], "encoder_attention_mask": mask, **state, **past}
            step = model.decoder.infer(feed)
            logits.append(step["logits"])
            past = spec.kv_feed(cfg, "decoder", step)
    with torch.inference_mode():
        theirs_hidden = hf.get_encoder()(input_features=torch.as_tensor(x)).last_hidden_state.numpy()
        theirs = hf(input_features=torch.as_tensor(x), decoder_input_ids=torch.as_tensor(tokens)).logits.numpy()
    assert scaled_err(hidden, theirs_hidden) <= 1e-4
    assert scaled_err(np.concatenate(logits, axis=1), theirs) <= 1e-4


def generate(hf, x: np.ndarray, **kwargs) -> torch.Tensor:
    with torch.inference_mode():
        return hf.generate(input_features=torch.as_tensor(x), task="transcribe", max_new_tokens=NEW_TOKENS,
                           return_dict_in_generate=True, **kwargs).sequences


def transcribe(model, cfg, speech, x: np.ndarray, **kwargs) -> list:
    """transcribe_features over batches of the export's max_batch rows."""
    return [t for i in range(0, len(x), MAX_BATCH)
            for t in transcribe_features(model, cfg, speech, x[i:i + MAX_BATCH], max_new_tokens=NEW_TOKENS, **kwargs)]


@pytest.mark.parametrize("backend", ["ort", "ort-fused"])
def test_transcribe_features_on_ort_equals_generate(whisper, backend):
    """Greedy with a language; beam 4 with the model's length penalty; no language (ours detects it on the
    graphs, per row, as transformers does)."""
    cfg, hf, gen = whisper["model"].cfg, whisper["hf"], whisper["gen"]
    speech = SpeechTokens.from_record(gen["speech"])
    x = features(cfg, 4, seed=2)
    eot = WHISPER_IDS["eot"]
    with open_step_model(whisper["out"], backend) as (model, _):
        greedy = transcribe(model, cfg, speech, x, language="de", task="transcribe", generation=gen)
        assert greedy == whisper_generated(generate(hf, x, language="de"), 3, eot)
        if backend == "ort-fused":
            beam = transcribe(model, cfg, speech, x, language="fr", task="transcribe", beam_size=4,
                              length_penalty=gen["length_penalty"], early_stopping=gen["early_stopping"],
                              generation=gen)
            assert beam == whisper_generated(generate(hf, x, language="fr", num_beams=4,
                                                      length_penalty=gen["length_penalty"],
                                                      early_stopping=gen["early_stopping"]), 3, eot)
            languages: list = []
            detected = transcribe(model, cfg, speech, x, generation=gen, languages_out=languages)
            assert detected == whisper_generated(generate(hf, x), 3, eot)
            assert len(set(languages)) > 1  # rows of one batch decoded with different prompts
    assert any(len(set(t)) > 1 for t in greedy)  # the random model says something, not one token repeated


@pytest.mark.parametrize("graphs", ["fused-trt", "int8-ort"])
def test_graph_level_validate(whisper, graphs):
    """validate's sweep (batch sizes; one source length; pasts 0 .. 31) against the float64 eager model: the plugin
    graphs (on CPU through the op's reference) at the fp32 tolerances, int8 against the reference that quantizes
    alike. (The plain and fused ORT graphs are judged against transformers above.)"""
    doc = run_validation(whisper["out"], ValidateSettings(graphs=graphs, samples=0, localize_budget_s=0))
    assert doc["passed"] and doc["cases"] == 2 * (1 + 6)  # per batch size: the encoder, 6 decoder cases


def test_end_to_end_validate(whisper):
    """validate's end-to-end check on audio: random features, the model's prompt (first language, transcribe), the
    fused graphs' greedy and beam tokens against the float64 eager model's."""
    doc = run_validation(whisper["out"], ValidateSettings(graphs="fused-ort", samples=2, beam_size=2,
                                                          localize_budget_s=0))
    e2e = doc["end_to_end"]
    assert doc["passed"] and e2e["inputs"] == "random audio features" and e2e["samples"] == 2
    assert e2e["greedy"]["sequence_match"] == e2e["beam"]["sequence_match"] == 1.0


def test_features_onnx_equals_the_extractor(whisper, tmp_path):
    """The export's features.onnx (from the checkpoint's preprocessor_config.json, listed in the manifest) and the
    default one made from n_mels both give WhisperFeatureExtractor's features on synthetic clips; an extractor of
    another mel count than the model's is refused."""
    from transformers import WhisperFeatureExtractor

    out, cfg = whisper["out"], whisper["model"].cfg
    verify(out, [layout.FEATURES])
    clips = [synthetic("tone", seconds=2.0), synthetic("noise", seconds=3.5, seed=1), synthetic("clipping")]
    want = WhisperFeatureExtractor.from_pretrained(whisper["src"])(clips, sampling_rate=16000,
                                                                   return_tensors="np").input_features
    assert np.abs(run_features(out / layout.FEATURES, clips) - want).max() <= 1e-4
    default = write_model_features(tmp_path, cfg)
    assert np.abs(run_features(default, clips[:1]) - want[:1]).max() <= 1e-4
    other = tmp_path / "ckpt"
    WhisperFeatureExtractor(feature_size=128).save_pretrained(other / layout.TOKENIZER_DIR)
    with pytest.raises(ConfigError, match="makes 128 mel bins but the model reads 80"):
        write_model_features(tmp_path / "refused", cfg, {"checkpoint": str(other)})


def test_bf16_export_validates(whisper, tmp_path):
    """bf16 (the front end convolving in fp32 on bf16 weights: ONNX's Conv takes no bf16 at opset 18), judged as
    validate judges reduced precision: the fp32 twin against the rounded model, the graph against eager-bf16."""
    model, ckpt = whisper["model"], whisper["ckpt"]
    limits = spec.Limits.for_model(model.cfg, max_batch=MAX_BATCH, max_tgt_len=MAX_TGT)
    out = export(model, tmp_path / "bf16", dtype="bf16", limits=limits, source=source_record(ckpt))
    assert run_validation(out, ValidateSettings(samples=0, localize_budget_s=0))["passed"]
