"""The Python-backend model behind `seq2trt serve`'s `generate` and `translate` (Triton's `TritonPythonModel`
interface: initialize, execute on a dynamically batched list of requests, finalize). Each request is parsed into a
`decode_service.Job`; a bad one gets an error response naming the problem and the batch's others are answered.

Outputs: `output_ids` INT64 [-1] (generate) or `text` BYTES [1] (translate), the best hypothesis, as ever. A
request that asks n_best > 1, output_scores or token_logprobs also gets `hypotheses` BYTES [1], a JSON
object — generate: {"ids": [[...], ...], "scores": [...]} (and "token_logprobs": [[...], ...] when asked),
translate's `--output-ids` line; translate: the same with "text": [...] —
and `scores` FP32 [-1], each hypothesis's score (beam: Hugging Face's sequences_scores, GNMT's for models trained
here; greedy and sampling: the sum of its tokens' log-probabilities), best first.

`TranscribeModel` is the same for `transcribe` (a Whisper export): each request parsed into a
`transcribe_service.SpeechJob` (its audio decoded and resampled while it is read), answered by
`TranscribeService`; outputs `text`, `segments` (JSON), `language` and `tokens`.

`triton_python_backend_utils` exists only inside Triton's Python-backend stub, so it is imported there.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from seq2trt.reference_model.decoding import GNMT_ALPHA, Hypothesis
from seq2trt.core.errors import InputError, Seq2TrtError

from seq2trt.serving.decode_service import (DecodeService, Job, beam_size_input, option_value, request_message,
                                            request_options, scalar, source_ids, text_of)

logger = logging.getLogger(__name__)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.kind = params["kind"]  # "generate" or "translate"
        self.service = DecodeService(Path(params["export"]), params["backend"],
                                     Path(params["checkpoint"]) if params.get("checkpoint") else None,
                                     int(params.get("threads", "1")), float(params.get("alpha", GNMT_ALPHA)))

    def finalize(self) -> None:
        self.service.close()

    def _job(self, request, pb_utils) -> tuple[Job, object]:
        """(the request's job, its codec for translate)."""
        def get(name):
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy()

        beam_size, beam_input = beam_size_input(get)
        limits = dict(max_new_tokens=scalar(get("max_new_tokens"), "max_new_tokens"), beam_size=beam_size,
                      beam_input=beam_input)
        limits["options"], limits["spelled"] = request_options(get)
        if self.kind == "generate":
            return Job(source_ids(get("input_ids")), **limits), None
        text = text_of(get("text"), "text")
        codec = self.service.codec(text_of(get("src_lang"), "src_lang", False), text_of(get("tgt_lang"), "tgt_lang", False))
        if not text.strip():
            raise InputError("empty source text; give at least one symbol")
        return Job(tuple(codec.encode(text)), forced_bos_id=codec.forced_bos_id, **limits), codec

    def execute(self, requests: list) -> list:
        import triton_python_backend_utils as pb_utils

        jobs, codecs, errors = [], [], {}
        for n, request in enumerate(requests):
            try:
                job, codec = self._job(request, pb_utils)
            except Exception as exc:  # noqa: BLE001 - an escaping exception would reach the client with its frames
                if not isinstance(exc, Seq2TrtError):
                    logger.exception("reading request %d failed", n)
                errors[n], job, codec = exc, Job(()), None
            jobs.append(job)
            codecs.append(codec)
        valid = [n for n in range(len(requests)) if n not in errors]
        results = dict(zip(valid, self.service.run([jobs[n] for n in valid]))) if valid else {}
        results.update(errors)
        responses = []
        for n in range(len(requests)):
            try:
                responses.append(self._response(results[n], codecs[n], pb_utils))
            except Exception as exc:  # noqa: BLE001 - as above
                logger.exception("answering request %d failed", n)
                responses.append(self._response(exc, None, pb_utils))
        return responses

    def _response(self, result, codec, pb_utils):
        if isinstance(result, Exception):
            return error_response(result, pb_utils)
        n_best = bool(result) and isinstance(result[0], Hypothesis)  # a plain result is one token list
        best = result[0].tokens if n_best else result
        if self.kind == "generate":
            tensors = [pb_utils.Tensor("output_ids", np.array([best], dtype=np.int64).reshape(1, -1))]
        else:
            tensors = [pb_utils.Tensor("text", np.array([[codec.decode(best).encode("utf-8")]], dtype=np.object_))]
        if n_best:
            tensors += [pb_utils.Tensor(name, value) for name, value in hypotheses_outputs(result, codec).items()]
        return pb_utils.InferenceResponse(output_tensors=tensors)


def error_response(exc: Exception, pb_utils):
    """An error response: the request's fault (a Seq2TrtError) as HTTP 400 / gRPC INVALID_ARGUMENT with its message,
    anything else as an internal error."""
    if isinstance(exc, Seq2TrtError):
        error = pb_utils.TritonError(request_message(str(exc)), pb_utils.TritonError.INVALID_ARG)
    else:
        error = pb_utils.TritonError(f"internal error: {exc!r}")
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


def hypotheses_outputs(hypotheses: list[Hypothesis], codec=None) -> dict[str, np.ndarray]:
    """The `hypotheses` (JSON text, with each one's text when `codec` is given) and `scores` outputs of an n-best
    result, batched as [1, ...]."""
    record = {"ids": [h.tokens for h in hypotheses], "scores": [h.score for h in hypotheses]}
    if hypotheses and hypotheses[0].token_logprobs is not None:
        record["token_logprobs"] = [list(h.token_logprobs) for h in hypotheses]
    if codec is not None:
        record = {"text": [codec.decode(h.tokens) for h in hypotheses], **record}
    return {"hypotheses": np.array([[json.dumps(record).encode("utf-8")]], dtype=np.object_),
            "scores": np.array([[h.score for h in hypotheses]], dtype=np.float32)}


class TranscribeModel:
    """`transcribe` (a Whisper export): audio in (`audio` file bytes, or `samples` with `sampling_rate`), optional
    `language`, `task`, `beam_size` (`num_beams`: deprecated), `max_new_tokens`, `timestamps` and the long-form options
    (`condition_on_prev_tokens`, `temperature`, `compression_ratio_threshold`, `logprob_threshold`, `seed`) -> `text`
    BYTES [1] (empty without a tokenizer), `segments` BYTES [1] (JSON: [{start, end, text, tokens}]), `language` BYTES [1] and `tokens` INT64 [-1]
    (`serving.transcribe_service`)."""

    def initialize(self, args: dict) -> None:
        from seq2trt.serving.transcribe_service import TranscribeService

        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.service = TranscribeService(Path(params["export"]), params["backend"],
                                         Path(params["checkpoint"]) if params.get("checkpoint") else None,
                                         int(params.get("threads", "1")))

    def finalize(self) -> None:
        self.service.close()

    def _job(self, request, pb_utils):
        from seq2trt.serving.transcribe_service import SpeechJob, request_clip

        def get(name):
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy()

        clip = request_clip(get("audio"), get("samples"), scalar(get("sampling_rate"), "sampling_rate"))
        timestamps = option_value(get("timestamps"), "timestamps")
        temperature = get("temperature")
        if temperature is not None:
            if temperature.size == 0:
                raise InputError("temperature holds no value; send one temperature or the fallback list, or omit it")
            temperature = tuple(float(str(t)) for t in temperature.reshape(-1))  # FP32 as its shortest decimal
        return SpeechJob(clip, language=text_of(get("language"), "language", False) or None,
                         task=text_of(get("task"), "task", False) or None,
                         **dict(zip(("beam_size", "beam_input"), beam_size_input(get))),
                         max_new_tokens=scalar(get("max_new_tokens"), "max_new_tokens"), timestamps=bool(timestamps),
                         condition_on_prev_tokens=bool(option_value(get("condition_on_prev_tokens"),
                                                                    "condition_on_prev_tokens")),
                         temperature=temperature,
                         compression_ratio_threshold=option_value(get("compression_ratio_threshold"),
                                                                  "compression_ratio_threshold"),
                         logprob_threshold=option_value(get("logprob_threshold"), "logprob_threshold"),
                         seed=option_value(get("seed"), "seed"))

    def execute(self, requests: list) -> list:
        import triton_python_backend_utils as pb_utils

        jobs, errors = {}, {}
        for n, request in enumerate(requests):
            try:
                jobs[n] = self._job(request, pb_utils)
            except Exception as exc:  # noqa: BLE001 - an escaping exception would reach the client with its frames
                if not isinstance(exc, Seq2TrtError):
                    logger.exception("reading request %d failed", n)
                errors[n] = exc
        results = dict(zip(jobs, self.service.run(list(jobs.values())))) if jobs else {}
        results.update(errors)
        responses = []
        for n in range(len(requests)):
            try:
                responses.append(self._response(results[n], pb_utils))
            except Exception as exc:  # noqa: BLE001 - as above
                logger.exception("answering request %d failed", n)
                responses.append(self._response(exc, pb_utils))
        return responses

    def _response(self, result, pb_utils):
        if isinstance(result, Exception):
            return error_response(result, pb_utils)
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor(name, value) for name, value in transcription_outputs(result).items()])


def transcription_outputs(t) -> dict[str, np.ndarray]:
    """A Transcription as the `transcribe` model's outputs, batched as [1, ...]."""
    from seq2trt.serving.transcribe_service import transcription_record

    record = transcription_record(t)

    def string(value: str) -> np.ndarray:
        return np.array([[value.encode("utf-8")]], dtype=np.object_)

    return {"text": string(t.text or ""), "segments": string(json.dumps(record["segments"], ensure_ascii=False)),
            "language": string(t.language or ""), "tokens": np.array([t.tokens], dtype=np.int64).reshape(1, -1)}
