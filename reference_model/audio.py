"""Audio in: a file (WAV, FLAC, OGG, read by libsndfile through `soundfile`) or a float array from Python, made into
the one form Whisper's front end reads: float32 mono samples at 16 kHz.

Channels are mixed to mono by their mean (as librosa's `to_mono` does), then any other rate is resampled with soxr at
its "HQ" quality, the setting librosa's default `res_type="soxr_hq"` and Hugging Face `datasets`' Audio casting use.
A length limit is the caller's (`max_seconds`, checked at the source rate); none applies unless one is given.
soundfile and soxr are the `audio` extra, imported only when audio is read.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

from seq2trt.core.errors import DependencyError, InputError, first_line

logger = logging.getLogger(__name__)

SAMPLING_RATE = 16000  # what Whisper's feature extractor reads
RESAMPLE_QUALITY = "HQ"  # soxr's quality preset: librosa's and datasets' default
FORMATS = "WAV, FLAC or OGG (Vorbis/Opus)"


def _soundfile():
    try:
        import soundfile
    except ImportError:
        raise DependencyError("reading audio files needs soundfile, which is not installed; "
                              "pip install 'seq2trt[audio]'") from None
    return soundfile


def _soxr():
    try:
        import soxr
    except ImportError:
        raise DependencyError("resampling audio needs soxr, which is not installed; "
                              "pip install 'seq2trt[audio]'") from None
    return soxr


def _check_length(frames: int, rate: int, where: str, max_seconds: Optional[float]) -> None:
    if frames == 0:
        raise InputError(f"{where} holds no samples; give audio at least one sample long")
    if max_seconds is not None and frames > max_seconds * rate:
        raise InputError(f"{where} is {frames / rate:.2f} s long, over the limit of {max_seconds:g} s; "
                         f"trim it to {max_seconds:g} s or less (or raise max_seconds)")


def prepare_audio(samples: Union[np.ndarray, Sequence[float]], sampling_rate: int, max_seconds: Optional[float] = None,
                  where: str = "the audio array") -> np.ndarray:
    """float32 mono 16 kHz samples (n,) from `samples` shaped (n,) or (n, channels), as soundfile returns them, at
    `sampling_rate` Hz. Refuses non-float, NaN/inf, empty, wrongly shaped or (with `max_seconds`) over-long audio."""
    if isinstance(sampling_rate, bool) or not isinstance(sampling_rate, (int, np.integer)) or sampling_rate <= 0:
        raise InputError(f"sampling rate {sampling_rate!r} of {where} is not a positive whole number of Hz; "
                         "pass the rate the samples were recorded at, e.g. 16000")
    array = np.asarray(samples)
    if not np.issubdtype(array.dtype, np.floating):
        raise InputError(f"{where} has dtype {array.dtype}, not float; give float samples in [-1, 1] "
                         "(int16 PCM: divide by 32768)")
    if array.ndim not in (1, 2) or (array.ndim == 2 and (array.shape[1] == 0 or array.shape[1] > array.shape[0] > 0)):
        raise InputError(f"{where} has shape {array.shape}; give (samples,) or (samples, channels) "
                         "(an array shaped (channels, samples) needs .T)")
    _check_length(array.shape[0], int(sampling_rate), where, max_seconds)
    if not np.isfinite(array).all():
        bad = int(np.size(array) - np.isfinite(array).sum())
        raise InputError(f"{where} holds {bad} NaN or infinite sample(s); replace them (e.g. np.nan_to_num) "
                         "or fix the source")
    mono = array.mean(axis=1, dtype=np.float64) if array.ndim == 2 else array
    mono = np.ascontiguousarray(mono, dtype=np.float32)
    if sampling_rate != SAMPLING_RATE:
        mono = _soxr().resample(mono, int(sampling_rate), SAMPLING_RATE, quality=RESAMPLE_QUALITY)
    return np.ascontiguousarray(mono, dtype=np.float32)


def load_audio(path: Union[str, Path], max_seconds: Optional[float] = None) -> np.ndarray:
    """float32 mono 16 kHz samples (n,) read from an audio file. The file's length is checked against `max_seconds`
    from its header, before its samples are read."""
    path = Path(path)
    where = f"audio file {path}"
    if not path.exists():
        raise InputError(f"{where} does not exist; check the path")
    if not path.is_file():
        raise InputError(f"{where} is not a file; give a {FORMATS} file")
    if path.stat().st_size == 0:
        raise InputError(f"{where} is empty (0 bytes); give a {FORMATS} file that holds audio")
    sf = _soundfile()
    try:
        info = sf.info(str(path))
        if info.frames == 0:
            raise InputError(f"{where} holds no samples libsndfile can read (a header alone, or a cut-off stream); "
                             f"give a {FORMATS} file that holds audio")
        _check_length(info.frames, info.samplerate, where, max_seconds)
        samples, rate = sf.read(str(path), dtype="float32", always_2d=True)
    except (sf.SoundFileError, RuntimeError) as exc:
        why = getattr(exc, "error_string", None) or first_line(exc)  # libsndfile's reason, without the path
        if "does not exist" in why:  # libsndfile's reason when its MPEG decoder finds no stream; the file exists
            why = "no audio stream it can decode"
        raise InputError(f"{where} is corrupt or in a format libsndfile cannot read ({why}); "
                         f"give a {FORMATS} file") from None
    announced = _announced_frames(info)
    if announced > len(samples):  # a file cut short: libsndfile reads what is there
        logger.warning("%s is cut short: its header announces %.2f s of audio and it holds %.2f s; transcribing "
                       "what is there", where, announced / rate, len(samples) / rate)
    return prepare_audio(samples, rate, max_seconds, where)


def _announced_frames(info) -> float:
    """The frames a file's header announces. libsndfile counts the frames the file holds, and notes in its log a
    WAV data chunk larger than the file ("data : 192000 (should be 63946)"): the announced count is its frames
    scaled by the chunk's claimed bytes over those present."""
    import re

    found = re.search(r"^data\s*:\s*(\d+)\s*\(should be (\d+)\)", info.extra_info or "", re.MULTILINE)
    if found is None or int(found[2]) <= 0:
        return info.frames
    return info.frames * int(found[1]) / int(found[2])
