"""The models of a written Triton repository (`seq2trt serve --write-repository`): `generate`/`translate` (for a
Whisper export `transcribe`) as Python-backend BLS models whose step model calls the repository's `encoder` and
`decoder` models (served by the onnxruntime or tensorrt_plan backend, or by `OnnxModel` below in the Python
backend), and the same request handling as `seq2trt serve` (`serving.triton_model.TritonPythonModel` and
`TranscribeModel`, `decode_service.DecodeService`, `transcribe_service.TranscribeService`).

The search loop is `reference_model.decoding`'s, fed by `step_model.RunnerStepModel` over two `BlsRunner`s: the KV cache
goes to the decoder model and back each step as numpy arrays.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from seq2trt.reference_model.decoding import GNMT_ALPHA
from seq2trt.exporters import spec

from seq2trt.runtime.runners import Runner
from seq2trt.serving.triton_model import TranscribeModel as ServedTranscribeModel
from seq2trt.serving.triton_model import TritonPythonModel as ServedModel


class BlsRunner(Runner):
    """A graph served as another model of the same Triton server, called through BLS."""

    def _infer(self, feed):
        import triton_python_backend_utils as pb_utils

        names = [s.name for s in spec.outputs(self.cfg, self.kind) if s.name != "encoder_hidden_states"]
        request = pb_utils.InferenceRequest(model_name=self.name, requested_output_names=names,
                                            inputs=[pb_utils.Tensor(k, np.ascontiguousarray(v)) for k, v in feed.items()])
        response = request.exec()
        if response.has_error():
            raise RuntimeError(f"model {self.name!r}: {response.error().message()}")
        return {name: pb_utils.get_output_tensor_by_name(response, name).as_numpy() for name in names}


class TritonPythonModel(ServedModel):
    """generate / translate over the repository's encoder and decoder models."""

    def initialize(self, args: dict) -> None:
        from seq2trt.serving.decode_service import DecodeService

        params, here, opened = bls_decoder(args)
        self.kind = params["kind"]
        self.service = DecodeService(here, "bls", alpha=float(params.get("alpha", GNMT_ALPHA)), opened=opened)


def bls_decoder(args: dict):
    """(the model's parameters, its version folder, an OpenedDecoder whose step model calls the repository's
    encoder and decoder models): the manifest and the checkpoint files beside the model's code."""
    from seq2trt.exporters.manifest import Manifest

    from seq2trt.runtime.decode_jobs import OpenedDecoder
    from seq2trt.runtime.step_model import RunnerStepModel

    config = json.loads(args["model_config"])
    params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
    here = Path(args["model_repository"]) / args["model_version"]
    manifest = Manifest(here, json.loads((here / "manifest.json").read_text()))
    cfg, limits = manifest.config, manifest.limits
    runners = [BlsRunner(params[f"{kind.value}_model"] if f"{kind.value}_model" in params else kind.value, cfg, kind,
                         manifest.dtype, limits) for kind in spec.GraphKind]
    for runner in runners:
        runner.__enter__()
    opened = OpenedDecoder(RunnerStepModel(*runners), cfg, here / "checkpoint",
                           (limits.max_src_len, "the export's max_src_len"), limits.max_batch)
    return params, here, opened


class TranscribeModel(ServedTranscribeModel):
    """transcribe over the repository's encoder and decoder models, the features from the features.onnx beside it."""

    def initialize(self, args: dict) -> None:
        from seq2trt.runtime.transcription import Transcriber
        from seq2trt.serving.transcribe_service import TranscribeService

        params, here, opened = bls_decoder(args)
        transcriber = Transcriber(opened, here, int(params.get("threads", "1")))
        self.service = TranscribeService(here, "bls", transcriber=transcriber)


class OnnxModel:
    """An encoder or decoder graph run by ONNX Runtime inside the Python backend (for servers without the
    onnxruntime backend, such as the one nvidia-pytriton bundles). One session run per request."""

    def initialize(self, args: dict) -> None:
        from seq2trt.exporters.ort_session import open_session

        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        graph = Path(args["model_repository"]) / args["model_version"] / "model.onnx"
        self.session, _ = open_session(graph, threads=int(params.get("threads", "1")), optimization=None)
        self.inputs = [i.name for i in self.session.get_inputs()]

    def execute(self, requests: list) -> list:
        import triton_python_backend_utils as pb_utils

        responses = []
        for request in requests:
            feed = {name: pb_utils.get_input_tensor_by_name(request, name).as_numpy() for name in self.inputs}
            wanted = request.requested_output_names() or [o.name for o in self.session.get_outputs()]
            values = self.session.run(list(wanted), feed)
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor(n, v) for n, v in zip(wanted, values)]))
        return responses
