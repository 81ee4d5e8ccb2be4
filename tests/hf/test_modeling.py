"""`seq2trt.hf.Seq2TrtModelForSeq2SeqLM` driven by transformers itself: `pipeline(...)` over it gives the text that
`pipeline(...)` over the original transformers model gives, greedy and beam, and `generate()` the same ids. The
original model is the independent reference (the import proved our model equal to it; here the graphs are judged).
transformers 5 removed the translation, summarization and text2text-generation pipelines: under 5.x the text is what
their steps give (tokenizer, generate, batch_decode)."""

from __future__ import annotations

import pytest
import torch

from seq2trt.core.errors import InputError
from seq2trt.hf_import.families import transformers_major

from helpers.artifacts import import_and_export

pytest.importorskip("transformers", reason="the hf extra is not installed")

TEXTS = ["kalo mine suta", "ri po de an elor", "taelor", "su ta ri po de mi ne kalo"]
MAX_NEW = 24  # within the export's decoder (max_tgt_len 64); transformers' pipeline default would pass it


@pytest.fixture(scope="module")
def marian_export(make_hf_model, make_marian_tokenizer, tmp_path_factory):
    """A random Marian with its own tokenizer and generation options of its own (they must reach generate through
    the model's generation config): imported, exported (fp32), its ORT graphs fused."""
    root = tmp_path_factory.mktemp("marian")
    src, n = make_marian_tokenizer(root / "src")
    make_hf_model(src, "marian", dict(vocab_size=n, pad_token_id=n - 1, decoder_start_token_id=n - 1,
                                      activation_function="swish", scale_embedding=True),
                  dict(no_repeat_ngram_size=3, repetition_penalty=1.3), std=0.2)
    return import_and_export(src, root, "--max-batch", 16)


@pytest.fixture(scope="module")
def original(marian_export):
    from transformers import AutoTokenizer, MarianMTModel

    return MarianMTModel.from_pretrained(marian_export / "src").eval(), AutoTokenizer.from_pretrained(
        str(marian_export / "src"))


@pytest.fixture(scope="module")
def fused(marian_export):
    from seq2trt.hf import Seq2TrtModelForSeq2SeqLM

    with Seq2TrtModelForSeq2SeqLM.from_pretrained(marian_export / "out", backend="ort-fused", threads=1) as model:
        yield model


def test_the_model_is_a_transformers_generation_model(fused, marian_export):
    from transformers import GenerationMixin, MarianConfig, PreTrainedModel

    assert isinstance(fused, PreTrainedModel) and isinstance(fused, GenerationMixin) and fused.can_generate()
    assert isinstance(fused.config, MarianConfig) and fused.config.is_encoder_decoder  # the imported model's own
    assert fused.generation_config.decoder_start_token_id == fused.config.decoder_start_token_id
    assert fused.generation_config.forced_eos_token_id == fused.config.eos_token_id


@pytest.mark.parametrize("task", ["translation", "text2text-generation", "summarization"])
@pytest.mark.parametrize("beams", [1, 4])
def test_pipeline_text_is_the_original_models(fused, original, task, beams):
    model, tokenizer = original
    got = _texts(task, fused, tokenizer, TEXTS, num_beams=beams, max_new_tokens=MAX_NEW)
    want = _texts(task, model, tokenizer, TEXTS, num_beams=beams, max_new_tokens=MAX_NEW)
    assert got == want
    assert len(set(want)) > 1  # the texts differ: the check can fail


def _texts(task: str, model, tokenizer, texts: list[str], **options) -> list[str]:
    """The text `pipeline(task)` gives under transformers 4.x; under 5.x, which removed it, its steps by hand."""
    if transformers_major() < 5:
        from transformers import pipeline

        return [next(iter(row.values())) for row in pipeline(task, model=model, tokenizer=tokenizer)(texts, **options)]
    with torch.inference_mode():
        ids = model.generate(**tokenizer(texts, return_tensors="pt", padding=True), **options)
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def test_greedy_and_beam_differ_somewhere(original):
    """The beam tests would prove nothing if this random model's beam search returned its greedy output."""
    model, tokenizer = original
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    with torch.inference_mode():
        greedy = model.generate(**batch, num_beams=1, max_new_tokens=MAX_NEW).tolist()
        beam = model.generate(**batch, num_beams=4, max_new_tokens=MAX_NEW).tolist()
    assert greedy != beam


@pytest.mark.parametrize("backend", ["ort-fused", "ort"])
@pytest.mark.parametrize("beams", [1, 4])
def test_generate_ids_are_the_original_models(backend, beams, marian_export, original, fused):
    from seq2trt.hf import Seq2TrtModelForSeq2SeqLM

    model, tokenizer = original
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)  # padded rows: the encoder mask reaches the graphs
    with torch.inference_mode():
        want = model.generate(**batch, num_beams=beams, max_new_tokens=MAX_NEW)
    if backend == "ort-fused":
        got = fused.generate(**batch, num_beams=beams, max_new_tokens=MAX_NEW)
    else:
        with Seq2TrtModelForSeq2SeqLM.from_pretrained(marian_export / "out", backend=backend) as plain:
            got = plain.generate(**batch, num_beams=beams, max_new_tokens=MAX_NEW)
    assert got.tolist() == want.tolist()


def test_forward_logits_and_cache_are_the_original_models(fused, original):
    """One forward over a whole target prefix, then one cached step: logits equal, the cache in transformers' types."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    model, tokenizer = original
    batch = tokenizer(TEXTS[:2], return_tensors="pt", padding=True)
    start = model.config.decoder_start_token_id
    prefix = torch.tensor([[start, 5, 9], [start, 12, 3]])
    with torch.inference_mode():
        want = model(**batch, decoder_input_ids=prefix).logits
        got = fused(**batch, decoder_input_ids=prefix[:, :2], use_cache=True)
        cache = got.past_key_values
        assert isinstance(cache, EncoderDecoderCache) and isinstance(cache.self_attention_cache, DynamicCache)
        assert cache.get_seq_length() == 2
        encoder_outputs = fused.get_encoder()(**batch)
        step = fused(attention_mask=batch["attention_mask"], decoder_input_ids=prefix[:, 2:],
                     encoder_outputs=encoder_outputs, past_key_values=cache, use_cache=True)
    torch.testing.assert_close(got.logits, want[:, :2].float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(step.logits, want[:, 2:].float(), atol=1e-4, rtol=1e-4)
    assert step.past_key_values.get_seq_length() == 3


def test_bad_backends_and_paths_are_named(marian_export):
    from seq2trt.hf import Seq2TrtModelForSeq2SeqLM

    with pytest.raises(InputError, match="backend 'eager' cannot drive transformers' generate.*ort-fused"):
        Seq2TrtModelForSeq2SeqLM.from_pretrained(marian_export / "out", backend="eager")
    with pytest.raises(InputError, match=r"ckpt is not an export directory \(no manifest.json\)"):
        Seq2TrtModelForSeq2SeqLM.from_pretrained(marian_export / "ckpt")
    with pytest.raises(InputError, match="threads must be in"):
        Seq2TrtModelForSeq2SeqLM.from_pretrained(marian_export / "out", threads=0)


def test_a_closed_model_says_so(marian_export, original):
    from seq2trt.hf import Seq2TrtModelForSeq2SeqLM

    with Seq2TrtModelForSeq2SeqLM.from_pretrained(marian_export / "out", backend="ort") as model:
        runners = [model.get_encoder().runner, model._decoder]
    assert not any(r.is_active for r in runners)
    with pytest.raises(InputError, match="is closed"):
        model.generate(**original[1](TEXTS[:1], return_tensors="pt"), max_new_tokens=4)


def test_a_length_over_the_export_is_one_clear_error(fused, original):
    _, tokenizer = original
    with pytest.raises(InputError, match="over the export's max_tgt_len 64; generate at most 63 tokens"):
        fused.generate(**tokenizer(TEXTS[:1], return_tensors="pt"), max_new_tokens=100, min_new_tokens=100)


def test_pipeline_defaults_stay_within_the_export(fused, original):
    """transformers' pipeline asks 256 new tokens by default (generate, 20); the model's generation config bounds it
    to what the export's decoder holds, so a plain call runs."""
    rows = _texts("translation", fused, original[1], TEXTS[:2])
    assert len(rows) == 2 and all(isinstance(row, str) for row in rows)
    assert fused.generation_config.max_length == 64


def test_a_model_trained_here_generates_its_eager_greedy_decode(numbers_export):
    """No Hugging Face config to copy: a minimal encoder-decoder config is built from the model's own."""
    from seq2trt.hf import Seq2TrtModelForSeq2SeqLM
    from seq2trt.reference_model.decoding import DecodeSettings, greedy_decode
    from seq2trt.reference_model.eager import EagerStepModel
    from seq2trt.reference_model.vocab import pad_batch

    root, model, task = numbers_export
    ids, mask = pad_batch([task.source_vocab.encode(t) + [model.cfg.eos_id] for t in ("40213", "7", "999999")],
                          model.cfg.pad_id)
    want = greedy_decode(EagerStepModel(model), ids, mask, DecodeSettings.for_model(model.cfg))
    with Seq2TrtModelForSeq2SeqLM.from_pretrained(root / "out", backend="ort") as hf_model:
        assert hf_model.config.is_encoder_decoder and hf_model.config.vocab_size == len(task.target_vocab)
        rows = hf_model.generate(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask))[:, 1:].tolist()
    eos = model.cfg.eos_id
    assert [r[: r.index(eos)] if eos in r else r for r in rows] == want


def test_what_the_model_cannot_do_is_a_typed_error(fused, original):
    """save_pretrained ended in an IndexError deep in transformers, generate(inputs_embeds=...) in an untyped error,
    and .to("cuda") on a machine without CUDA did nothing, silently."""
    _, tokenizer = original
    with pytest.raises(InputError, match="cannot be saved.*copy the export directory"):
        fused.save_pretrained("/nonexistent/never-written")
    batch = tokenizer(TEXTS[:1], return_tensors="pt")
    with pytest.raises(InputError, match="inputs_embeds.*input_ids"):
        fused.generate(inputs_embeds=torch.zeros(1, 3, 8), attention_mask=batch["attention_mask"][:, :3],
                       max_new_tokens=4)
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="CUDA is not available"):
            fused.to("cuda")
    assert fused.to("cpu") is fused


def test_a_speech_export_is_refused_when_opened(tmp_path):
    """A Whisper export opened as a text model failed only at generate."""
    from seq2trt.hf import Seq2TrtModelForSeq2SeqLM

    from helpers.hf_models import whisper_model_dir

    out = import_and_export(whisper_model_dir(tmp_path / "src", config=dict(max_target_positions=32)), tmp_path,
                            fuse=None)
    with pytest.raises(InputError, match="speech model.*transcribe"):
        Seq2TrtModelForSeq2SeqLM.from_pretrained(out / "out", backend="ort")
