"""The Python-backend model behind `seq2trt serve`'s `generate` and `translate` (Triton's `TritonPythonModel`
interface: initialize, execute on a dynamically batched list of requests, finalize). Each request is parsed into a
`serving.Job`; a bad one gets an error response naming the problem and the batch's others are answered.

`triton_python_backend_utils` exists only inside Triton's Python-backend stub, so it is imported there.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from seq2trt.reference_model.decoding import GNMT_ALPHA
from seq2trt.reference_model.errors import InputError, Seq2TrtError

from seq2trt.serving.decode_service import DecodeService, Job, scalar, source_ids, text_of

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

        limits = dict(max_new_tokens=scalar(get("max_new_tokens"), "max_new_tokens"),
                      num_beams=scalar(get("num_beams"), "num_beams"))
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
            if isinstance(result, Seq2TrtError):  # the request's fault: HTTP 400, gRPC INVALID_ARGUMENT
                error = pb_utils.TritonError(str(result), pb_utils.TritonError.INVALID_ARG)
            else:
                error = pb_utils.TritonError(f"internal error: {result!r}")
            return pb_utils.InferenceResponse(output_tensors=[], error=error)
        if self.kind == "generate":
            return pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("output_ids", np.array([result], dtype=np.int64).reshape(1, -1))])
        text = codec.decode(result).encode("utf-8")
        return pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor("text", np.array([[text]], dtype=np.object_))])
