"""The import's proof of a speech model (Whisper): transformers' side runs first (`judge_speech`: its model loaded,
run on seeded random log-mel features and freed), then ours is judged against its outputs (`verify_speech`), so that
one model is in memory at a time. The judge and its bounds are the text proof's (proof.py)."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from seq2trt.hf_import import proof
from seq2trt.hf_import.text import load_tokenizer, quiet_transformers
from seq2trt.reference_model.decoding import DecodeSettings, greedy_decode
from seq2trt.reference_model.eager import EagerStepModel
from seq2trt.reference_model.model import Seq2SeqTransformer


def whisper_generated(sequences: torch.Tensor, prompt_len: int, eos_id: int) -> list[list[int]]:
    """Whisper generate's sequences with return_dict_in_generate (start token and prompt kept; without it they are
    dropped) -> the tokens after the prompt, up to (without) eos."""
    rows = sequences[:, 1 + prompt_len:].tolist()
    return [r[: r.index(eos_id)] if eos_id in r else r for r in rows]


def compare_speech(hf_model, model: Seq2SeqTransformer, features: np.ndarray, gen: dict[str, Any],
                   max_new_tokens: int | None, progress: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """`compare` for a speech model on a (B, n_mels, frames) feature batch: encoder states, the step logits of
    greedy search, greedy and beam tokens against transformers' `generate(input_features, language, task)` with a
    given language (the first the model knows), and the languages transformers detects against ours.

    The tokens are judged on what each side transcribes: transformers' plain output (its long-form loop runs for
    short inputs too, so a model that emits a timestamp pair is decoded again from it inside the window) against
    our `transcribe`, which follows it. The step logits are those of one decode of each window's first pass
    (generate with `force_unique_generate_call`, whose returned logits are that call's). transformers' side runs
    first (`_their_speech`), so that a caller may free its model before ours is built (`judge_speech`)."""
    return _our_speech(model, _their_speech(hf_model, model.cfg, features, gen, max_new_tokens, progress), gen,
                       progress)


def _their_speech(hf_model, cfg, features: np.ndarray, gen: dict[str, Any], max_new_tokens: int | None,
                  progress: Callable[[str], None]) -> dict[str, Any]:
    """What transformers' model computes for `compare_speech` on `features`: its outputs, no reference to it."""
    from seq2trt.reference_model.speech import SpeechTokens, generation_limit

    speech = SpeechTokens.from_record(gen.get("speech"))
    language = next(iter(speech.languages), None) if speech.multilingual else None
    prompt = speech.prompt(language, "transcribe")
    limit = generation_limit(cfg, prompt, max_new_tokens)
    x = torch.as_tensor(features)
    progress("transformers' encoder states")
    with torch.inference_mode(), proof._transformers_runs():
        enc = hf_model.get_encoder()(input_features=x).last_hidden_state.numpy()
    common = dict(input_features=x, max_new_tokens=limit, do_sample=False,
                  **({"language": language, "task": "transcribe"} if speech.multilingual else {}))
    with torch.inference_mode(), proof._transformers_runs(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        progress("transformers' generate: greedy (logits), greedy, beam")
        first = hf_model.generate(**common, num_beams=1, output_logits=True, return_dict_in_generate=True,
                                  force_unique_generate_call=True)
        greedy = hf_model.generate(**common, num_beams=1)
        beam = hf_model.generate(**common, num_beams=proof.BEAM_SIZE, length_penalty=gen["length_penalty"],
                                 early_stopping=gen["early_stopping"])
    greedy, beam = ([r[: r.index(cfg.eos_id)] if cfg.eos_id in r else r for r in out.tolist()]
                    for out in (greedy, beam))  # no prompt, padded with pad (eos) on the right
    theirs = {"features": features, "language": language, "prompt": prompt, "limit": limit, "encoder": enc,
              "first": whisper_generated(first.sequences, len(prompt), cfg.eos_id), "first_logits": first.logits,
              "greedy": greedy, "beam": beam, "limit_failure": proof._limit_failure(hf_model, cfg)}
    if speech.multilingual:
        progress("transformers' language detection")
        with torch.inference_mode(), proof._transformers_runs():
            theirs["languages"] = hf_model.detect_language(input_features=x).tolist()
    return theirs


def _our_speech(model: Seq2SeqTransformer, theirs: dict[str, Any], gen: dict[str, Any],
                progress: Callable[[str], None]) -> dict[str, Any]:
    """Our side of `compare_speech`, judged against transformers' outputs `theirs` (`_their_speech`)."""
    from seq2trt.reference_model.speech import SpeechTokens, detect_languages
    from seq2trt.reference_model.longform import transcribe

    cfg, speech = model.cfg, SpeechTokens.from_record(gen.get("speech"))
    features, language, limit = theirs["features"], theirs["language"], theirs["limit"]
    step_model = EagerStepModel(model)
    mask = np.ones((len(features), cfg.max_src_len), dtype=np.int64)
    progress("our encoder states")
    with torch.inference_mode():
        ours_enc = model.encode(torch.as_tensor(features), torch.as_tensor(mask)).numpy()
    enc_err, enc_rel = proof._scaled_err(ours_enc, theirs["encoder"])
    settings = dataclasses.replace(DecodeSettings.for_model(cfg, 1, gen), prompt=theirs["prompt"],
                                   max_new_tokens=limit, do_sample=False, num_return_sequences=1)
    recorded: list[tuple[int, np.ndarray, np.ndarray]] = []
    progress("our greedy search, then our transcription (greedy and beam)")
    ours_first = greedy_decode(step_model, features, mask, settings,
                               on_step=lambda step, rows, logits: recorded.append((step, rows.copy(), logits.copy())))
    ours_greedy, ours_beam = ([t.tokens for t in transcribe(
        step_model, cfg, speech, list(features), language=language, task="transcribe", beam_size=beams,
        length_penalty=gen["length_penalty"], early_stopping=gen["early_stopping"], max_new_tokens=limit,
        generation=gen)] for beams in (1, proof.BEAM_SIZE))
    compared, logit_err, logit_rel = proof._step_logits(recorded, ours_first, theirs["first"], theirs["first_logits"],
                                                  cfg.eos_id)
    greedy, beam = theirs["greedy"], theirs["beam"]
    result = {"sources": len(features), "language": language, "prompt": list(theirs["prompt"]),
              "encoder_max_abs_err": enc_err, "encoder_scaled_err": enc_rel,
              "step_logits_compared": compared, "logits_max_abs_err": logit_err,
              "logits_scaled_err": logit_rel,
              "greedy_equal": sum(a == b for a, b in zip(ours_greedy, greedy)),
              "beam_equal": sum(a == b for a, b in zip(ours_beam, beam)),
              "greedy_mismatches": [i for i, (a, b) in enumerate(zip(ours_greedy, greedy)) if a != b],
              "beam_mismatches": [i for i, (a, b) in enumerate(zip(ours_beam, beam)) if a != b]}
    if "languages" in theirs:
        progress("our language detection")
        by_id = {i: c for c, i in speech.languages.items()}
        ours_lang = detect_languages(step_model, step_model.encode(features, mask), mask, cfg.bos_id, speech)
        result["languages_equal"] = sum(by_id.get(t) == o for t, o in zip(theirs["languages"], ours_lang))
    return result


def judge_speech(src: Path, cfg, gen: dict[str, Any], progress: Callable[[str], None] = lambda m: None,
                 count: int = 8, max_new_tokens: int = 24) -> dict[str, Any]:
    """transformers' side of a speech model's proof, on seeded random features (`proof_scope`'s count; the
    tokenizer and feature extractor checked first). Its model is loaded here and freed on return, so that the
    import can build ours after it: one 1.5 B model in memory at a time, not two."""
    from seq2trt.reference_model.sources import source_kind

    scope = proof._announce_scope(cfg, count, progress)
    tokenizer = load_tokenizer(src)
    if tokenizer is not None:
        proof.check_tokenizer_ids(src, tokenizer, cfg)
    from seq2trt.reference_model.logmel import FeatureParams
    from seq2trt.hf_import.families.whisper import FEATURE_EXTRACTOR

    # The extractor the checkpoint will transcribe with, against the model: a damaged one would be copied as it is.
    FeatureParams.from_file(src / FEATURE_EXTRACTOR, cfg.n_mels, cfg.source_frames,
                            f"fix it (WhisperFeatureExtractor(feature_size={cfg.n_mels}).save_pretrained), or remove "
                            f"it to transcribe with the default extractor for {cfg.n_mels} mel bins")
    features = np.stack(source_kind(cfg).random(np.random.default_rng(0), scope["sources_per_set"]))
    progress(f"comparing {len(features)} seeded feature batches with transformers; loading transformers' model")
    with quiet_transformers():
        hf_model = proof.load_transformers_model(src, speech=True)
        return _their_speech(hf_model, cfg, features, gen, max_new_tokens, progress) | {"scope": scope}


def verify_speech(judged: dict[str, Any], model: Seq2SeqTransformer, gen: dict[str, Any],
                   progress: Callable[[str], None], max_new_tokens: int = 24) -> dict[str, Any]:
    """The import's proof of a speech model: our side of `compare_speech` against transformers' (`judge_speech`)."""
    import transformers

    result = _our_speech(model, judged, gen, progress)
    features = judged["features"]
    report: dict[str, Any] = {"transformers": transformers.__version__, "beam_size": proof.BEAM_SIZE,
                              "max_new_tokens": max_new_tokens, "tolerance_scaled": proof.LOGIT_TOLERANCE,
                              "length_penalty": gen["length_penalty"], "early_stopping": gen["early_stopping"],
                              "seeded": result, "scope": judged["scope"]}
    failures = [] if judged["limit_failure"] is None else [judged["limit_failure"]]
    for what in ("encoder", "logits"):
        if not result[f"{what}_scaled_err"] <= proof.LOGIT_TOLERANCE:
            failures.append(f"seeded: {what} differ by {result[f'{what}_max_abs_err']:.3g} "
                            f"(scaled {result[f'{what}_scaled_err']:.3g} > {proof.LOGIT_TOLERANCE})")
    for what in ("greedy", "beam", "languages"):
        if what + "_equal" in result and result[f"{what}_equal"] != len(features):
            failures.append(f"seeded: {what} differ from transformers' on features "
                            f"{result.get(f'{what}_mismatches', '')} ({result[f'{what}_equal']}/{len(features)} equal)")
    report["failures"], report["passed"] = failures, not failures
    return report
