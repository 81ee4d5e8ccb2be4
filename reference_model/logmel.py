"""Whisper's log-mel front end in torch: the feature extractor's settings (`FeatureParams`, read from and checked
against a model's preprocessor_config.json) and the computation transformers' `WhisperFeatureExtractor` does on its
torch path (`LogMel`). `exporters.whisper_features` exports `LogMel` as features.onnx; the import checks a source's
extractor with `FeatureParams.from_file` before copying it.

The STFT is a matrix product with the windowed DFT basis (`dft_basis`) over frames cut by reshapes and slices, in
float64 (in float32 it misses the extractor by up to ~1.4e-4 on loud frames).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from seq2trt.core.errors import ConfigError, DependencyError, first_line


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
