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
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np
import onnx
import torch
from torch import nn

from seq2trt.exporters import spec
from seq2trt.exporters.torch_cache import check_torch_cache, reused_torchlib_registry
from seq2trt.reference_model import layout
from seq2trt.exporters.graph_files import save_graph
from seq2trt.reference_model.errors import ConfigError, DependencyError, InputError, first_line

logger = logging.getLogger(__name__)

INPUT = "audio"
OUTPUT = "input_features"
PREPROCESSOR_CONFIG = "preprocessor_config.json"  # the feature extractor's settings, in an imported tokenizer/


@dataclass(frozen=True, eq=False)
class FeatureParams:
    """The feature extractor's settings. `mel_filters` is (n_fft // 2 + 1, n_mels), as the extractor stores it."""

    mel_filters: np.ndarray
    n_fft: int = 400
    hop_length: int = 160
    n_samples: int = 480000  # 30 s at 16 kHz: the model's window
    sampling_rate: int = 16000

    def __post_init__(self):
        shape = np.shape(self.mel_filters)
        if len(shape) != 2 or shape[0] != self.n_fft // 2 + 1:
            raise ConfigError(f"mel filters shaped {shape} do not fit n_fft {self.n_fft}; "
                              f"give ({self.n_fft // 2 + 1}, n_mels) as WhisperFeatureExtractor.mel_filters is")
        if self.n_fft <= 0 or self.hop_length <= 0 or self.n_samples < self.n_fft // 2 + 1:
            raise ConfigError(f"n_fft {self.n_fft}, hop {self.hop_length}, n_samples {self.n_samples} cannot frame "
                              "audio; use the extractor's settings (400, 160, 480000)")

    @property
    def n_mels(self) -> int:
        return int(np.shape(self.mel_filters)[1])

    @property
    def n_frames(self) -> int:
        """STFT frames without the last one: 3000 for 30 s."""
        return self.n_samples // self.hop_length

    @classmethod
    def from_file(cls, path: Path, n_mels: int, frames: int, advice: str) -> "FeatureParams":
        """The settings of the preprocessor_config.json at `path` (transformers' defaults for `n_mels` bins when
        there is none), checked against a model reading (n_mels, frames) features of 16 kHz audio; a file that
        cannot be read or does not fit is refused with one line ending in `advice`."""
        from seq2trt.reference_model.audio import SAMPLING_RATE

        try:
            from transformers import WhisperFeatureExtractor
        except ImportError:
            raise DependencyError("computing log-mel features needs transformers' mel filters, which is not "
                                  "installed; pip install 'seq2trt[hf]'") from None
        path = Path(path)
        if not path.is_file():
            return cls.from_extractor(WhisperFeatureExtractor(feature_size=n_mels))
        import json

        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path} cannot be read: it is not JSON ({first_line(exc)}); {advice}") from None
        try:
            extractor = WhisperFeatureExtractor.from_pretrained(str(path.parent), local_files_only=True)
            params = cls.from_extractor(extractor)
        except Exception as exc:  # a foreign or inconsistent file: transformers raises anything from OSError to KeyError
            shown = ", ".join(f"{k} {raw.get(k)!r}" for k in ("feature_size", "n_fft", "hop_length", "chunk_length")
                              if isinstance(raw, dict) and k in raw)
            raise ConfigError(f"{path} cannot be read as a Whisper feature extractor ({shown}; "
                              f"{type(exc).__name__}: {first_line(exc)}); {advice}") from None
        if params.sampling_rate != SAMPLING_RATE:
            raise ConfigError(f"{path} sets sampling_rate {params.sampling_rate}; Whisper's front end reads "
                              f"{SAMPLING_RATE} Hz audio (seq2trt resamples every clip to it); {advice}")
        if (params.n_mels, params.n_frames) != (n_mels, frames):
            raise ConfigError(f"{path} makes ({params.n_mels}, {params.n_frames}) features and the model reads "
                              f"({n_mels}, {frames}); {advice}")
        return params

    @classmethod
    def from_extractor(cls, fe) -> "FeatureParams":
        """From a transformers `WhisperFeatureExtractor`. Dither (random noise) and a non-zero padding value cannot
        be reproduced by a fixed graph, so they are refused."""
        if getattr(fe, "dither", 0.0) != 0.0:
            raise ConfigError(f"the feature extractor dithers (dither={fe.dither}), which a graph cannot reproduce; "
                              "set dither=0.0")
        if getattr(fe, "padding_value", 0.0) != 0.0:
            raise ConfigError(f"the feature extractor pads with {fe.padding_value}, not zeros; set padding_value=0.0")
        return cls(np.asarray(fe.mel_filters), int(fe.n_fft), int(fe.hop_length), int(fe.n_samples),
                   int(fe.sampling_rate))


def dft_basis(n_fft: int) -> torch.Tensor:
    """(n_fft, 2 * (n_fft // 2 + 1)): the periodic Hann window times [cos | -sin] of the real DFT, in float64."""
    n = torch.arange(n_fft, dtype=torch.float64)
    k = torch.arange(n_fft // 2 + 1, dtype=torch.float64)
    window = torch.hann_window(n_fft, periodic=True, dtype=torch.float64)
    angle = 2 * math.pi * n[:, None] * k[None, :] / n_fft  # (n_fft, n_freq)
    return torch.cat([window[:, None] * torch.cos(angle), -window[:, None] * torch.sin(angle)], dim=1)


class LogMel(nn.Module):
    """audio (B, samples) -> input_features (B, n_mels, n_frames), in float32."""

    def __init__(self, params: FeatureParams):
        super().__init__()
        self.p = params
        self.register_buffer("basis", dft_basis(params.n_fft))
        self.register_buffer("mel", torch.from_numpy(np.asarray(params.mel_filters, np.float64)).float())

    def frames(self, padded: torch.Tensor) -> torch.Tensor:
        """(B, L) -> (B, n_frames, n_fft), frame i starting at i * hop: the signal cut in hop-long chunks, frame i
        being chunks i, i + 1, ... joined (the last one cut short), so no gather is needed."""
        n_fft, hop, frames = self.p.n_fft, self.p.hop_length, self.p.n_frames
        chunks = -(-n_fft // hop)
        length = (frames + chunks - 1) * hop
        padded = torch.cat([padded, padded.new_zeros((padded.shape[0], max(0, length - padded.shape[1])))], 1)
        c = padded[:, :length].reshape(padded.shape[0], frames + chunks - 1, hop)  # (B, frames + chunks - 1, hop)
        parts = [c[:, j:j + frames, :min(hop, n_fft - j * hop)] for j in range(chunks)]
        return torch.cat(parts, dim=2)  # (B, frames, n_fft)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        n, half = self.p.n_samples, self.p.n_fft // 2
        x = torch.cat([audio, audio.new_zeros((audio.shape[0], n))], dim=1)[:, :n]  # zero-pad / trim: (B, n)
        x = torch.cat([x[:, 1:half + 1].flip(1), x, x[:, -half - 1:-1].flip(1)], dim=1)  # reflect: (B, n + n_fft)
        # The DFT in float64: a float32 product over 400 taps is ~4x less exact than torch's FFT, and bins 8 decades
        # below a loud frame's peak (still above the clamp) would miss the extractor by more than 1e-4.
        spec_ = self.frames(x).double() @ self.basis  # (B, F, 2 * n_freq): real parts, then imaginary parts
        re, im = spec_.chunk(2, dim=2)
        power = (re * re + im * im).float()  # (B, F, n_freq)
        mel = (power @ self.mel).transpose(1, 2)  # (B, n_mels, F)
        log = torch.log10(torch.clamp(mel, min=1e-10))
        log = torch.maximum(log, log.amax(dim=(1, 2), keepdim=True) - 8.0)
        return (log + 4.0) / 4.0


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
