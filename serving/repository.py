"""`seq2trt serve OUT --write-repository DIR`: a Triton model repository for the standard server image on a GPU host.

  DIR/encoder, DIR/decoder   the graphs: `onnxruntime` (the ONNX graphs of --backend), `tensorrt_plan` (the engines of
                             `seq2trt build`), or `python` (ONNX Runtime inside the Python backend, `triton_bls.OnnxModel`)
  DIR/generate, DIR/translate  Python-backend BLS models running seq2trt's search over the two (`serving.triton_bls`), with
                             dynamic batching, the export's manifest and the checkpoint's tokenizer beside their code
  DIR/transcribe             instead of those for a Whisper export: the same over audio, features.onnx beside its code
  DIR/README.md              how to start it
  DIR/seq2trt.json           what it was written from: the mark `--force` looks for before replacing a folder
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from seq2trt.exporters import spec
from seq2trt.exporters.manifest import verify
from seq2trt.core.errors import InputError
from seq2trt.core.atomic_files import refuse_existing
from seq2trt.core.layout import FEATURES
from seq2trt.exporters.graph_files import copy_graph
from seq2trt.core.swap import staged_directory

from seq2trt.runtime.decode_jobs import checkpoint_folder, has_tokenizer
from seq2trt.serving.model_config import model_config, model_kinds, tensor_block, write_python_model
from seq2trt.serving.server import ServeSettings

REPOSITORY_BACKENDS = ("onnxruntime", "tensorrt_plan", "python")
MARKER = "seq2trt.json"
_WHAT = "Triton model repository"
_TRITON_DTYPES = {"int64": "TYPE_INT64", "fp32": "TYPE_FP32", "fp16": "TYPE_FP16", "bf16": "TYPE_BF16"}


def graph_config(kind: spec.GraphKind, cfg, dtype: str, repository_backend: str, threads: int) -> str:
    """config.pbtxt of the encoder or decoder: no Triton batching (the BLS model sends whole batches), every axis of
    the spec dynamic except the fixed ones."""
    def block(s: spec.TensorSpec) -> str:
        dims = [-1 if isinstance(axis, str) else int(axis) for axis in s.axes]
        return tensor_block(s.name, _TRITON_DTYPES["int64" if s.dtype == "int64" else dtype], dims)

    inputs, outputs = [block(s) for s in spec.inputs(cfg, kind)], [block(s) for s in spec.outputs(cfg, kind)]
    if repository_backend == "python":
        return model_config(kind.value, inputs, outputs, 0, backend="python", parameters={"threads": str(threads)})
    if repository_backend == "onnxruntime":
        return model_config(kind.value, inputs, outputs, 0, platform="onnxruntime_onnx", kind="KIND_GPU")
    return model_config(kind.value, inputs, outputs, 0, platform="tensorrt_plan", kind="KIND_GPU")


def _graph_files(out: Path, settings: ServeSettings, repository_backend: str, manifest) -> dict[spec.GraphKind, Path]:
    if repository_backend == "tensorrt_plan":
        from seq2trt.core.layout import engine_dir
        from seq2trt.runtime.registry import ENGINE_BACKENDS

        flavour = settings.backend if settings.backend in ENGINE_BACKENDS else "tensorrt"
        engines = engine_dir(out, flavour)
        return {kind: engines / f"{kind.value}.plan" for kind in spec.GraphKind}
    from seq2trt.runtime.registry import BACKENDS, graph_folder

    if BACKENDS[settings.backend].runs != "onnxruntime":
        raise InputError(f"--repository-backend {repository_backend} serves ONNX graphs: choose --backend ort, "
                         f"ort-fused or ort-int8, not {settings.backend}")
    folder = graph_folder(out, settings.backend, manifest)
    return {kind: folder / kind.filename for kind in spec.GraphKind}


README = """# Triton model repository for {out}

Written by `seq2trt serve --write-repository` (graphs: {what}). Models:

{models}
## Start it

The Python-backend models import seq2trt (the search, the request checks), so the server's Python needs it: put
the seq2trt wheel this repository was written with (`pip wheel --no-deps .` in its source tree) beside this file, then

```
docker run --gpus all --rm -p 8000:8000 -p 8001:8001 -p 8002:8002 -v $PWD:/models \\
  nvcr.io/nvidia/tritonserver:24.10-py3 \\
  bash -c "pip install /models/seq2trt-*.whl && tritonserver --model-repository=/models"
```

(or bake that install into an image FROM the Triton image). The BLS models pass the KV cache to the decoder model
and back as host arrays every step. Then
`curl localhost:8000/v2/health/ready` and, for example,
{example}

{notes}
Scale out by running more copies of this server behind a load balancer (Kubernetes Service, KServe
InferenceService with the Triton runtime); each replica is independent, no shared state.
"""

TEXT_MODELS = """- `generate`: input `input_ids` INT64 [-1] (one source per request), optional `max_new_tokens` INT32 [1] and
  `beam_size` INT32 [1] (`num_beams`: deprecated) -> `output_ids` INT64 [-1]. Dynamic batching (up to {max_batch} requests,
  {delay} us queue delay); each request gets what `seq2trt translate --ids-file` gives for its ids.
- Both models take the optional search options of `translate` as [1] inputs: `sample` BOOL, `temperature` FP32,
  `top_k` INT32, `top_p` FP32, `seed` INT64, `min_new_tokens` INT32, `no_repeat_ngram_size` INT32,
  `repetition_penalty` FP32, `n_best` INT32, `output_scores` BOOL, `token_logprobs` BOOL, `fast_sampling` BOOL
  (`do_sample`, `output_token_logprobs`: deprecated); with n_best > 1, output_scores or token_logprobs the response
  also holds `hypotheses` BYTES [1]
  (JSON: "ids", "scores", "token_logprobs" when asked, and "text" from translate) and `scores` FP32 [-1].
{translate}- `encoder`, `decoder`: the export's graphs; `generate` calls them through BLS every decoding step.
"""

SPEECH_MODELS = """- `transcribe` (a Whisper export): input `audio` BYTES [1] (a WAV, FLAC or OGG file's bytes) or
  `samples` FP32 [-1] (mono) with `sampling_rate` INT32 [1]; optional `language` BYTES [1], `task` BYTES [1]
  (transcribe or translate), `beam_size` INT32 [1], `max_new_tokens` INT32 [1], `timestamps` BOOL [1] -> `text`
  BYTES [1], `segments` BYTES [1] (JSON: [{{"start", "end", "text", "tokens"}}]), `language` BYTES [1], `tokens`
  INT64 [-1]. Dynamic batching (up to {max_batch} requests, {delay} us queue delay); each request gets what
  `seq2trt transcribe` gives for its audio. The log-mel features run in the model itself (its features.onnx).
- `encoder`, `decoder`: the export's graphs; `transcribe` calls them through BLS every decoding step.
"""

TEXT_EXAMPLE = ("`curl -X POST localhost:8000/v2/models/generate/infer -d "
                """'{"inputs":[{"name":"input_ids","shape":[1,3],"datatype":"INT64","data":[4,5,2]}]}'`.""")
SPEECH_EXAMPLE = ("`curl -X POST localhost:8000/v2/models/transcribe/infer -d "
                  """'{"inputs":[{"name":"samples","shape":[1,4],"datatype":"FP32","data":[0,0.1,0.2,0]},"""
                  """{"name":"sampling_rate","shape":[1,1],"datatype":"INT32","data":[16000]}]}'`"""
                  "\n(a file's bytes go as `audio` in the binary tensor extension, as tritonclient sends them).")

_BLS_CODE = {
    "generate": '"""The served generate / translate model over the encoder and decoder models (BLS)."""\n'
                "from seq2trt.serving.triton_bls import TritonPythonModel  # noqa: F401\n",
    "transcribe": '"""The served transcribe model over the encoder and decoder models (BLS)."""\n'
                  "from seq2trt.serving.triton_bls import TranscribeModel as TritonPythonModel  # noqa: F401\n"}
_BLS_CODE["translate"] = _BLS_CODE["generate"]

_NOTES = {
    "onnxruntime": "The onnxruntime backend of the image must run the graphs' opset ({opset}) and their ops (fused "
                   "graphs use com.microsoft attention ops); `instance_group` puts them on the GPU.",
    "tensorrt_plan": "The engines were built by `seq2trt build` for a given GPU and TensorRT version: the image's "
                     "TensorRT must match build.json, and the seq2trt attention plugin library must be loaded "
                     "(tritonserver --backend-config=tensorrt,plugins=/path/to/plugin.so) when the graphs were fused "
                     "for TensorRT.",
    "python": "Encoder and decoder run in ONNX Runtime inside the Python backend (CPU): this repository loads in "
              "the server that nvidia-pytriton bundles, as `seq2trt serve` does.",
}


def is_repository(folder: Path) -> bool:
    """Whether `folder` is a repository `write_repository` wrote (its MARKER names the repository backend)."""
    try:
        return "repository_backend" in json.loads((Path(folder) / MARKER).read_text())
    except (OSError, ValueError, TypeError):
        return False


def write_repository(settings: ServeSettings, folder: Path, repository_backend: str = "onnxruntime",
                     force: bool = False) -> Path:
    """Write the repository (staged, renamed into place; an existing folder only with `force`); returns it."""
    if repository_backend not in REPOSITORY_BACKENDS:
        raise InputError(f"unknown repository backend {repository_backend!r}; choose {', '.join(REPOSITORY_BACKENDS)}")
    out = Path(settings.out)
    manifest = verify(out, [kind.filename for kind in spec.GraphKind])
    cfg, limits = manifest.config, manifest.limits
    audio = bool(getattr(cfg, "audio", False))
    graphs = _graph_files(out, settings, repository_backend, manifest)
    source = checkpoint_folder(out, manifest, settings.checkpoint)
    text = has_tokenizer(source)
    max_batch = settings.max_batch or limits.max_batch
    protect = [out, source, *graphs.values()] + ([settings.checkpoint] if settings.checkpoint else [])
    # A folder seq2trt did not write is refused with or without --force, and its message never suggests --force.
    refuse_existing(Path(folder), True, _WHAT, kind=is_repository, protect=protect)
    with staged_directory(Path(folder), force, _WHAT, kind=is_repository, protect=protect) as tmp:
        _write_graphs(tmp, graphs, manifest, repository_backend, settings.threads)
        for kind in model_kinds(text, audio):
            parameters = {"alpha": repr(settings.alpha), "threads": str(settings.threads)}
            model = write_python_model(tmp, kind, max_batch, settings.max_queue_delay_us, settings.instances,
                                       parameters, _BLS_CODE[kind])
            _copy_model_files(out, source, model / "1", audio)
        _write_readme(tmp, settings, manifest, repository_backend, max_batch, text)
        (tmp / MARKER).write_text(json.dumps({"export": str(out.resolve()), "backend": settings.backend,
                                              "repository_backend": repository_backend}, indent=2) + "\n")
    return Path(folder)


def _write_graphs(tmp: Path, graphs: dict, manifest, repository_backend: str, threads: int) -> None:
    """Each graph's Triton model: its config and its model.onnx / model.plan (and model.py for the Python backend)."""
    for kind, graph in graphs.items():
        (tmp / kind.value / "1").mkdir(parents=True)
        (tmp / kind.value / "config.pbtxt").write_text(
            graph_config(kind, manifest.config, manifest.dtype, repository_backend, threads))
        if repository_backend == "tensorrt_plan":
            shutil.copyfile(graph, tmp / kind.value / "1" / "model.plan")
        else:  # a big graph's data file comes along, hard-linked where it can be, named for model.onnx
            copy_graph(graph, tmp / kind.value / "1" / "model.onnx", link=True)
        if repository_backend == "python":
            (tmp / kind.value / "1" / "model.py").write_text(
                "from seq2trt.serving.triton_bls import OnnxModel as TritonPythonModel  # noqa: F401\n")


def _copy_model_files(out: Path, source: Path, version: Path, audio: bool) -> None:
    """What a Python (BLS) model reads beside its code: the manifest, the feature graph, the checkpoint's vocab,
    generation settings and tokenizer."""
    shutil.copyfile(out / "manifest.json", version / "manifest.json")
    if audio:  # the feature extractor graph, checked against the manifest where it loads
        copy_graph(out / FEATURES, version / FEATURES, link=True)
    (version / "checkpoint").mkdir()
    for name in ("vocab.json", "generation.json", "tokenizer"):
        if (source / name).is_dir():
            shutil.copytree(source / name, version / "checkpoint" / name)
        elif (source / name).exists():
            shutil.copyfile(source / name, version / "checkpoint" / name)


def _write_readme(tmp: Path, settings: ServeSettings, manifest, repository_backend: str, max_batch: int,
                  text: bool) -> None:
    """The repository's README: its models, an example request, the backend's notes."""
    audio = bool(getattr(manifest.config, "audio", False))
    translate = "- `translate`: input `text` BYTES [1] (optional `src_lang`, `tgt_lang`) -> `text` BYTES [1].\n" \
        if text else ""
    models = (SPEECH_MODELS if audio else TEXT_MODELS).format(
        max_batch=max_batch, delay=settings.max_queue_delay_us, translate=translate)
    what = {"onnxruntime": f"ONNX, {settings.backend}", "tensorrt_plan": "TensorRT engines",
            "python": f"ONNX in the Python backend, {settings.backend}"}[repository_backend]
    (tmp / "README.md").write_text(README.format(
        out=Path(settings.out).name, what=what, models=models, example=SPEECH_EXAMPLE if audio else TEXT_EXAMPLE,
        notes=_NOTES[repository_backend].format(opset=manifest.data.get("settings", {}).get("opset", "?"))))
