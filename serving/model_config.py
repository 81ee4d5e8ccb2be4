"""The model repository `seq2trt serve` runs: Triton's config.pbtxt (its text format, parsed by Triton's
`ModelConfig` protobuf), the served models' request inputs and outputs, and the Python-backend models' folders.
`serving.repository` writes the same configs for a Triton of the user's own; `serving.http_guard` checks requests
against them."""

from __future__ import annotations

import json
from pathlib import Path

from seq2trt.serving.settings import ServeSettings


def _pbtxt_value(value) -> str:
    return json.dumps(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)


def tensor_block(name: str, dtype: str, dims: list[int], **extra) -> str:
    fields = [f"name: {json.dumps(name)}", f"data_type: {dtype}", f"dims: [ {', '.join(map(str, dims))} ]"]
    fields += [f"{key}: {_pbtxt_value(value)}" for key, value in extra.items()]
    return "  {\n    " + "\n    ".join(fields) + "\n  }"


def model_config(name: str, inputs: list[str], outputs: list[str], max_batch: int, *, backend: str | None = None,
                 platform: str | None = None, delay_us: int | None = None, instances: int = 1, kind: str = "KIND_CPU",
                 parameters: dict[str, str] | None = None) -> str:
    """A config.pbtxt in Triton's text format (parsed by its model-config protobuf, `ModelConfig`)."""
    lines = [f"name: {json.dumps(name)}"]
    lines += [f"backend: {json.dumps(backend)}"] if backend else []
    lines += [f"platform: {json.dumps(platform)}"] if platform else []
    lines.append(f"max_batch_size: {max_batch}")
    lines.append("input [\n" + ",\n".join(inputs) + "\n]")
    lines.append("output [\n" + ",\n".join(outputs) + "\n]")
    if delay_us is not None:
        lines.append(f"dynamic_batching {{\n  max_queue_delay_microseconds: {delay_us}\n}}")
    lines.append(f"instance_group [\n  {{\n    count: {instances}\n    kind: {kind}\n  }}\n]")
    for key, value in (parameters or {}).items():
        lines.append(f"parameters {{\n  key: {json.dumps(key)}\n  value: {{ string_value: {json.dumps(value)} }}\n}}")
    return "\n".join(lines) + "\n"


def input_declarations(kind: str) -> list[tuple[str, str, list[int], dict]]:
    """The served models' inputs as (name, config data type, dims, config extras), declared once: `request_inputs`
    writes them into config.pbtxt and serve's HTTP front checks requests against them (`input_specs`). generate
    takes ids, translate text; both take the optional search limits and search options (`decode_service.
    REQUEST_OPTIONS`: sampling, length floor, repetition rules, n_best, scores), all from the one options table
    (reference_model/decoding/options.py), each with its deprecated spellings (num_beams, do_sample,
    output_token_logprobs) declared too: Triton passes a model only the inputs its config declares."""
    from seq2trt.reference_model.decoding.options import OPTIONS
    from seq2trt.serving.decode_service import REQUEST_OPTIONS

    optional, ragged = dict(optional=True), dict(optional=True, allow_ragged_batch=True)
    limits = [(name, OPTIONS[field].triton_type, [1], optional) for field in ("max_new_tokens", "beam_size")
              for name in (OPTIONS[field].served, *OPTIONS[field].old_served)]
    if kind == "transcribe":  # serving.transcribe_service: file bytes, or samples and their rate
        return [("audio", "TYPE_STRING", [1], optional), ("samples", "TYPE_FP32", [-1], ragged),
                ("sampling_rate", "TYPE_INT32", [1], optional), ("language", "TYPE_STRING", [1], optional),
                ("task", "TYPE_STRING", [1], optional), ("timestamps", "TYPE_BOOL", [1], optional),
                # transformers' long-form options (transcribe_service.SpeechJob); temperature: one, or the fallback list
                ("condition_on_prev_tokens", "TYPE_BOOL", [1], optional), ("temperature", "TYPE_FP32", [-1], ragged),
                ("compression_ratio_threshold", "TYPE_FP32", [1], optional),
                ("logprob_threshold", "TYPE_FP32", [1], optional), ("seed", "TYPE_INT64", [1], optional)] + limits
    limits += [(name, dtype, [1], optional) for field, dtype in REQUEST_OPTIONS.values()
               for name in (OPTIONS[field].served, *OPTIONS[field].old_served)]
    if kind == "generate":
        return [("input_ids", "TYPE_INT64", [-1], dict(allow_ragged_batch=True))] + limits
    return [("text", "TYPE_STRING", [1], {}), ("src_lang", "TYPE_STRING", [1], optional),
            ("tgt_lang", "TYPE_STRING", [1], optional)] + limits


def request_inputs(kind: str) -> list[str]:
    """The served models' inputs as config.pbtxt blocks (`input_declarations`)."""
    return [tensor_block(name, dtype, dims, **extra) for name, dtype, dims, extra in input_declarations(kind)]


def input_specs(kind: str) -> dict[str, tuple[str, list[int]]]:
    """{input name: (Triton's request datatype, dims)} of a served model kind: what serve's HTTP front checks an
    infer request against (config data type TYPE_X is datatype X in a request; TYPE_STRING is BYTES)."""
    return {name: ("BYTES" if dtype == "TYPE_STRING" else dtype.removeprefix("TYPE_"), dims)
            for name, dtype, dims, _ in input_declarations(kind)}


def request_outputs(kind: str) -> list[str]:
    """The best hypothesis (ids or text); `hypotheses` (JSON) and `scores` when a request asks n_best or scores.
    transcribe: the text, its segments (JSON), the language and the token ids."""
    if kind == "transcribe":
        return [tensor_block("text", "TYPE_STRING", [1]), tensor_block("segments", "TYPE_STRING", [1]),
                tensor_block("language", "TYPE_STRING", [1]), tensor_block("tokens", "TYPE_INT64", [-1])]
    best = [tensor_block("output_ids", "TYPE_INT64", [-1])] if kind == "generate" else \
        [tensor_block("text", "TYPE_STRING", [1])]
    return best + [tensor_block("hypotheses", "TYPE_STRING", [1]), tensor_block("scores", "TYPE_FP32", [-1])]


def write_python_model(repository: Path, kind: str, max_batch: int, delay_us: int, instances: int,
                       parameters: dict[str, str], code: str) -> Path:
    folder = repository / kind
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(model_config(kind, request_inputs(kind), request_outputs(kind), max_batch,
                                                      backend="python", delay_us=delay_us, instances=instances,
                                                      parameters={"kind": kind, **parameters}))
    (folder / "1" / "model.py").write_text(code)
    return folder


def model_kinds(text: bool, audio: bool) -> list[str]:
    """The models served for an export: `transcribe` alone for a speech model (it reads audio, never ids), else
    `generate`, and `translate` when the checkpoint has a tokenizer."""
    if audio:
        return ["transcribe"]
    return ["generate", "translate"] if text else ["generate"]


_MODEL_CODE = {
    "transcribe": "from seq2trt.serving.triton_model import TranscribeModel as TritonPythonModel  # noqa: F401\n"}


def write_local_repository(repository: Path, settings: ServeSettings, max_batch: int, text: bool,
                           audio: bool = False) -> list[str]:
    """The Python-backend models `serve` runs; returns their names."""
    parameters = {"export": str(Path(settings.out).resolve()), "backend": settings.backend,
                  "checkpoint": str(settings.checkpoint.resolve()) if settings.checkpoint else "",
                  "threads": str(settings.threads), "alpha": repr(settings.alpha)}
    kinds = model_kinds(text, audio)
    for kind in kinds:
        code = '"""seq2trt serve: the decoding lives in the installed package."""\n' + _MODEL_CODE.get(
            kind, "from seq2trt.serving.triton_model import TritonPythonModel  # noqa: F401\n")
        write_python_model(repository, kind, max_batch, settings.max_queue_delay_us, settings.instances, parameters, code)
    return kinds
