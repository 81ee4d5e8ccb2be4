"""Whisper's log-mel front end as an ONNX graph (features.onnx), so a deployment needs no Python preprocessing.

The graph computes what transformers' `WhisperFeatureExtractor` computes (its torch path, which `__call__` takes when
torch is installed): pad with zeros / trim to `n_samples` (30 s), a centred STFT (reflect padding of n_fft / 2, a
periodic Hann window, n_fft 400, hop 160) without its last frame, the power spectrum, the extractor's own mel filter
matrix (slaney) as a constant, log10(max(x, 1e-10)), the per-example clamp max(x, x.max() - 8), then (x + 4) / 4.

Input `audio` float32 (batch, samples), any number of samples: the graph pads with zeros or trims to `n_samples`, so a
batch of clips zero-padded to their longest gives each clip's own features, as the extractor's padding does. Output
`input_features` float32 (batch, n_mels, n_frames). The STFT is a matrix product with the windowed DFT basis over
frames cut by reshapes and slices (no DFT or Conv op), which exports cleanly and runs as one GEMM. That product runs
in float64 (Cast, MatMul, Split, Mul, Add in doubles; ONNX Runtime runs them, TensorRT would not): in float32 it
misses the extractor by up to ~1.4e-4 on loud frames; in float64 it is within ~2e-7 of float64 arithmetic.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Union

import numpy as np
import onnx
import torch

from seq2trt.exporters import spec
from seq2trt.exporters.torch_cache import check_torch_cache, reused_torchlib_registry
from seq2trt.core import layout
from seq2trt.exporters.graph_files import save_graph
from seq2trt.core.errors import ConfigError, DependencyError, InputError
from seq2trt.reference_model.logmel import FeatureParams, LogMel

logger = logging.getLogger(__name__)

INPUT = "audio"
OUTPUT = "input_features"
PREPROCESSOR_CONFIG = "preprocessor_config.json"  # the feature extractor's settings, in an imported tokenizer/


def _params(source) -> FeatureParams:
    return source if isinstance(source, FeatureParams) else FeatureParams.from_extractor(source)


def features_graph(source, opset: int = spec.DEFAULT_OPSET) -> onnx.ModelProto:
    """The front end of `source` (a WhisperFeatureExtractor or FeatureParams) as a checked ONNX model."""
    if opset not in spec.OPSETS:
        raise ConfigError(f"opset {opset} is not supported; choose {spec.OPSETS.start}..{spec.OPSETS.stop - 1}")
    params = _params(source)
    check_torch_cache()
    module = LogMel(params).eval()
    example = (torch.zeros(2, params.n_samples // 3 + 7),)
    dynamic = ({0: torch.export.Dim("batch"), 1: torch.export.Dim("samples")},)
    with torch.no_grad(), warnings.catch_warnings(), reused_torchlib_registry():
        warnings.filterwarnings("ignore", category=FutureWarning)
        program = torch.onnx.export(module, example, dynamo=True, dynamic_shapes=dynamic, input_names=[INPUT],
                                    output_names=[OUTPUT], opset_version=opset, external_data=False, verbose=False)
    proto = program.model_proto
    proto.producer_name = "seq2trt"
    onnx.checker.check_model(proto, full_check=True)
    return proto


def write_features_graph(out_path: Union[str, Path], source, opset: int = spec.DEFAULT_OPSET) -> Path:
    """Write the front end of `source` (a WhisperFeatureExtractor or FeatureParams) to `out_path` atomically."""
    proto = features_graph(source, opset)
    save_graph(proto, Path(out_path))
    logger.info("wrote the %d-mel front end to %s", _params(source).n_mels, out_path)
    return Path(out_path)


def model_extractor(cfg, checkpoint: Union[str, Path, None] = None):
    """The WhisperFeatureExtractor of a model: the checkpoint's tokenizer/preprocessor_config.json when it has one,
    else Whisper's defaults (400-point FFT, hop 160, 30 s at 16 kHz) at the model's n_mels."""
    try:
        from transformers import WhisperFeatureExtractor
    except ImportError as exc:
        raise DependencyError(f"writing a speech model's features.onnx needs `transformers` ({exc}); "
                              "pip install 'seq2trt[hf]'") from None
    folder = Path(checkpoint) / layout.TOKENIZER_DIR if checkpoint else None
    if folder is not None and (folder / PREPROCESSOR_CONFIG).is_file():
        extractor = WhisperFeatureExtractor.from_pretrained(folder)
        if extractor.feature_size != cfg.n_mels:
            raise ConfigError(f"{folder / PREPROCESSOR_CONFIG} makes {extractor.feature_size} mel bins but the model "
                              f"reads {cfg.n_mels}; re-import the checkpoint with its own preprocessor_config.json")
        return extractor
    return WhisperFeatureExtractor(feature_size=cfg.n_mels)


def write_model_features(folder: Path, cfg, source: dict | None = None, opset: int = spec.DEFAULT_OPSET) -> Path:
    """Write `folder`/features.onnx for a speech model (`source`: the export's record, naming its checkpoint)."""
    checkpoint = (source or {}).get("checkpoint")
    return write_features_graph(Path(folder) / layout.FEATURES, model_extractor(cfg, checkpoint), opset)


def pad_clips(clips) -> np.ndarray:
    """float32 (B, longest) from 1-D clips, zero-padded at the end: the graph's input for a batch."""
    clips = [np.asarray(c, np.float32) for c in clips]
    if not clips or any(c.ndim != 1 or c.size == 0 for c in clips):
        raise InputError("the audio batch holds no clips, or a clip that is empty or not 1-D; "
                         "give 16 kHz mono clips (reference_model.audio.load_audio makes them)")
    out = np.zeros((len(clips), max(c.size for c in clips)), np.float32)
    for row, clip in zip(out, clips):
        row[:clip.size] = clip
    return out


def run_features(graph: Union[str, Path, onnx.ModelProto], audio: np.ndarray) -> np.ndarray:
    """input_features from features.onnx on ONNX Runtime's CPU provider; `audio` is (B, samples) or a list of clips."""
    from seq2trt.exporters.ort_session import open_session

    batch = pad_clips(audio) if isinstance(audio, (list, tuple)) else np.asarray(audio, np.float32)
    if batch.ndim != 2:
        raise InputError(f"audio shaped {batch.shape} is not (batch, samples); stack 16 kHz mono clips")
    session, _ = open_session(graph, threads=None, optimization=None)
    return session.run([OUTPUT], {INPUT: batch})[0]
