"""Test audio made here, never downloaded: synthetic signals and speech spoken by espeak-ng."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

SENTENCES = ["The quick brown fox jumps over the lazy dog.",
             "Speech goes in and log mel features come out of the graph.",
             "One two three four five six seven eight nine ten."]


def synthetic(kind: str, rate: int = 16000, seconds: float = 2.0, seed: int = 0) -> np.ndarray:
    """float32 mono samples of one kind of signal: silence, a 440 Hz tone, white noise, a clipped 1 kHz tone."""
    t = np.arange(int(rate * seconds)) / rate
    if kind == "silence":
        x = np.zeros_like(t)
    elif kind == "tone":
        x = 0.5 * np.sin(2 * np.pi * 440 * t)
    elif kind == "noise":
        x = 0.1 * np.random.RandomState(seed).randn(t.size)
    elif kind == "clipping":
        x = np.clip(3.0 * np.sin(2 * np.pi * 1000 * t), -1.0, 1.0)
    else:
        raise ValueError(kind)
    return x.astype(np.float32)


def speak(folder: Path, text: str, name: str = "speech.wav") -> Path:
    """A WAV file of `text` spoken by espeak-ng (22050 Hz mono). Fails, never skips, when espeak-ng is missing."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        pytest.fail("espeak-ng is not installed; apt-get install espeak-ng (the speech tests need it)")
    out = Path(folder) / name
    subprocess.run([exe, "-w", str(out), text], check=True, capture_output=True)
    return out
