"""The audio reader: files in three formats, any rate and channel count, float arrays; its refusals. The judges are
the signals' own formulas, soundfile's read and soxr's resampler called directly."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import soundfile as sf
import soxr

from helpers.audio import speak, synthetic
from seq2trt.reference_model.audio import SAMPLING_RATE, load_audio, prepare_audio
from seq2trt.core.errors import DependencyError, InputError

FORMATS = {"wav": "FLOAT", "flac": "PCM_16", "ogg": "VORBIS"}


def reference(path) -> np.ndarray:
    """soundfile's samples, mixed to mono and resampled by soxr directly."""
    data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    mono = data.astype(np.float64).mean(axis=1).astype(np.float32)
    return mono if rate == SAMPLING_RATE else soxr.resample(mono, rate, SAMPLING_RATE, quality="HQ")


@pytest.mark.parametrize("ext", FORMATS)
@pytest.mark.parametrize("rate", [8000, 16000, 44100])
@pytest.mark.parametrize("kind", ["silence", "tone", "noise", "clipping"])
def test_files_read_as_soundfile_and_soxr_read_them(tmp_path, ext, rate, kind):
    path = tmp_path / f"x.{ext}"
    sf.write(str(path), synthetic(kind, rate), rate, subtype=FORMATS[ext])
    got = load_audio(path)
    assert got.dtype == np.float32 and got.ndim == 1
    assert got.shape[0] == pytest.approx(2.0 * SAMPLING_RATE, abs=1)
    np.testing.assert_array_equal(got, reference(path))


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_resampled_tone_is_the_tone_at_16k(rate):
    """Independent of soxr: a 440 Hz tone at any rate comes back as the same tone sampled at 16 kHz (edges aside)."""
    got = prepare_audio(synthetic("tone", rate, seconds=1.0), rate)
    assert got.shape == (SAMPLING_RATE,)
    want = 0.5 * np.sin(2 * np.pi * 440 * np.arange(SAMPLING_RATE) / SAMPLING_RATE)
    np.testing.assert_allclose(got[200:-200], want[200:-200], atol=2e-3)


def test_stereo_is_the_mean_of_its_channels(tmp_path):
    left = synthetic("tone", 16000)
    right = synthetic("noise", 16000)
    path = tmp_path / "stereo.wav"
    sf.write(str(path), np.stack([left, right], axis=1), 16000, subtype="FLOAT")
    np.testing.assert_allclose(load_audio(path), (left + right) / 2, atol=1e-7)


def test_stereo_44k_goes_through_mixing_then_soxr(tmp_path):
    stereo = np.stack([synthetic("tone", 44100), synthetic("clipping", 44100)], axis=1)
    path = tmp_path / "stereo.flac"
    sf.write(str(path), stereo, 44100)
    np.testing.assert_array_equal(load_audio(path), reference(path))


def test_float_arrays_any_float_dtype():
    x = synthetic("noise", 16000)
    np.testing.assert_array_equal(prepare_audio(x, 16000), x)
    np.testing.assert_array_equal(prepare_audio(x.astype(np.float64), 16000), x)
    np.testing.assert_array_equal(prepare_audio(list(x[:100]), 16000), x[:100])
    y = synthetic("tone", 8000)
    np.testing.assert_array_equal(prepare_audio(y, 8000), soxr.resample(y, 8000, 16000, quality="HQ"))


def test_espeak_speech_reads_as_soxr_resamples_it(tmp_path):
    path = speak(tmp_path, "Speech in, features out.")
    assert sf.info(str(path)).samplerate != SAMPLING_RATE  # espeak-ng speaks at 22050 Hz: the resampler is used
    got = load_audio(path)
    np.testing.assert_array_equal(got, reference(path))
    assert np.abs(got).max() > 0.05  # it holds speech, not silence


def test_max_seconds_is_the_callers_limit(tmp_path):
    path = tmp_path / "long.wav"
    sf.write(str(path), synthetic("tone", 8000, seconds=3.0), 8000)
    assert load_audio(path, max_seconds=3.0).shape == (48000,)
    with pytest.raises(InputError, match=r"is 3.00 s long, over the limit of 2.5 s; trim it"):
        load_audio(path, max_seconds=2.5)
    with pytest.raises(InputError, match="over the limit of 1 s"):
        prepare_audio(synthetic("tone", 44100, seconds=1.01), 44100, max_seconds=1)


def one_line(exc) -> str:
    text = str(exc.value)
    assert "\n" not in text and "; " in text, text
    return text


def test_missing_directory_and_empty_files(tmp_path):
    with pytest.raises(InputError, match="does not exist; check the path") as exc:
        load_audio(tmp_path / "nope.wav")
    one_line(exc)
    with pytest.raises(InputError, match="is not a file"):
        load_audio(tmp_path)
    (tmp_path / "empty.wav").write_bytes(b"")
    with pytest.raises(InputError, match=r"is empty \(0 bytes\); give a WAV, FLAC or OGG") as exc:
        load_audio(tmp_path / "empty.wav")
    one_line(exc)
    sf.write(str(tmp_path / "zero.wav"), np.zeros((0, 1), np.float32), 16000)  # a header, no frames
    with pytest.raises(InputError, match="holds no samples") as exc:
        load_audio(tmp_path / "zero.wav")
    one_line(exc)


@pytest.mark.parametrize("name,data", [
    ("garbage.wav", b"RIFF\x10\x00\x00\x00WAVEfmt not really a header" * 4),
    ("text.ogg", b"hello, I am a text file\n" * 20),
    ("random.flac", np.random.RandomState(0).bytes(4096)),
])
def test_corrupt_or_unsupported_files_name_the_formats(tmp_path, name, data):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(InputError, match="is corrupt or in a format libsndfile cannot read .*WAV, FLAC or OGG") as exc:
        load_audio(tmp_path / name)
    one_line(exc)


@pytest.mark.parametrize("samples,rate,match", [
    (synthetic("noise", 16000, seconds=1.0), 16000, "holds no samples libsndfile can read"),
    (np.zeros((16000, 2), np.float32), 44100, "is corrupt"),
])
def test_truncated_ogg_is_refused(tmp_path, samples, rate, match):
    """Cut in half, a short OGG stream fails to open or reports no frames (libsndfile finds its length at the end)."""
    sf.write(str(tmp_path / "full.ogg"), samples, rate)
    data = (tmp_path / "full.ogg").read_bytes()
    (tmp_path / "cut.ogg").write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match=match) as exc:
        load_audio(tmp_path / "cut.ogg")
    one_line(exc)


@pytest.mark.parametrize("bad,match", [
    (np.array([0.1, np.nan, 0.2], np.float32), "holds 1 NaN or infinite sample"),
    (np.array([[0.1, np.inf], [-np.inf, 0.0]], np.float32), "holds 2 NaN or infinite sample"),
    (np.zeros((2, 2, 100), np.float32), r"has shape \(2, 2, 100\); give \(samples,\) or \(samples, channels\)"),
    (np.zeros((2, 16000), np.float32), r"has shape \(2, 16000\).*needs \.T"),
    (np.float32(0.5), r"has shape \(\)"),
    (np.zeros(0, np.float32), "holds no samples"),
    (np.zeros((0, 2), np.float32), "holds no samples"),
    (np.zeros(100, np.int16), "has dtype int16, not float"),
])
def test_bad_arrays(bad, match):
    with pytest.raises(InputError, match=match) as exc:
        prepare_audio(bad, 16000)
    one_line(exc)


@pytest.mark.parametrize("rate", [0, -16000, 16000.0, True, None])
def test_bad_sampling_rates(rate):
    with pytest.raises(InputError, match="is not a positive whole number of Hz"):
        prepare_audio(np.zeros(10, np.float32), rate)


@pytest.mark.parametrize("module,call", [
    ("soundfile", lambda tmp: load_audio(tmp / "x.wav")),
    ("soxr", lambda tmp: prepare_audio(np.zeros(10, np.float32), 8000)),
])
def test_missing_dependency_names_the_extra(tmp_path, monkeypatch, module, call):
    sf.write(str(tmp_path / "x.wav"), np.zeros(10, np.float32), 16000)
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    with pytest.raises(DependencyError, match=rf"needs {module}.*pip install 'seq2trt\[audio\]'"):
        call(tmp_path)


def test_speech_tests_fail_without_espeak(tmp_path, monkeypatch):
    """A machine without espeak-ng fails the speech tests with the fix, rather than skipping them."""
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(pytest.fail.Exception, match="espeak-ng is not installed; apt-get install espeak-ng"):
        speak(tmp_path, "hello")


def test_a_cut_wav_is_read_with_a_warning(tmp_path, caplog):
    """A WAV cut to a third was decoded as if whole, without a word: what is there is read, and a warning says how
    much the header announced."""
    x = synthetic("tone", SAMPLING_RATE, seconds=3.0)
    path = tmp_path / "cut.wav"
    sf.write(str(path), x, SAMPLING_RATE, subtype="FLOAT")
    data = path.read_bytes()
    path.write_bytes(data[: 44 + (len(data) - 44) // 3])
    with caplog.at_level("WARNING", logger="seq2trt"):
        got = load_audio(path)
    assert abs(len(got) - SAMPLING_RATE) < 100  # about the first second (the header's size aside), as soundfile reads it
    np.testing.assert_array_equal(got, reference(path))
    assert any("cut short" in r.getMessage() and "3.00 s" in r.getMessage() and "1.00 s" in r.getMessage()
               for r in caplog.records), caplog.text
    caplog.clear()
    sf.write(str(path), x, SAMPLING_RATE, subtype="FLOAT")
    with caplog.at_level("WARNING", logger="seq2trt"):
        load_audio(path)
    assert not caplog.records


def test_a_wav_header_claiming_4_gb_over_2_kb_is_read_with_a_warning(tmp_path, caplog):
    """Issue 49 case 10: a header announcing ~4 GB before 2 kB of samples was decoded without a word."""
    import struct

    path = tmp_path / "claims-4gb.wav"
    sf.write(str(path), synthetic("tone", SAMPLING_RATE, seconds=1.0), SAMPLING_RATE, subtype="PCM_16")
    data = bytearray(path.read_bytes()[: 44 + 2048])
    data[4:8] = struct.pack("<I", 0xFFFFFFF0)  # the RIFF chunk's size
    data[40:44] = struct.pack("<I", 0xFFFFFFD0)  # the data chunk's size (the header soundfile writes is 44 bytes)
    assert bytes(data[36:40]) == b"data"
    path.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="seq2trt"):
        got = load_audio(path)
    np.testing.assert_array_equal(got, reference(path))
    assert len(got) == 1024  # the 2 kB of 16-bit samples there are
    assert any("cut short" in r.getMessage() and "holds 0.06 s" in r.getMessage() for r in caplog.records), \
        caplog.text


def test_a_damaged_mp3_is_not_called_missing(tmp_path):
    """libsndfile's reason for an MP3 it cannot decode is "File does not exist or is not a regular file", which the
    error repeated about a file that exists."""
    path = tmp_path / "song.mp3"
    path.write_bytes(b"ID3\x03\x00\x00\x00\x00\x00\x00" + bytes(range(256)) * 20)
    with pytest.raises(InputError) as exc:
        load_audio(path)
    assert "does not exist" not in str(exc.value) and "song.mp3" in str(exc.value)
    assert "corrupt" in str(exc.value)
