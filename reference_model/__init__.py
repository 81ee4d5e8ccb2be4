"""The reference encoder-decoder Transformer: config, eager model, checkpoints, decoding, demo tasks."""

from .config import PRESETS, Seq2SeqConfig, preset
from .errors import (ArtifactError, CheckFailed, CheckpointError, ConfigError, DependencyError, InputError,
                     Seq2TrtError)
from .model import Seq2SeqTransformer

__all__ = ["PRESETS", "Seq2SeqConfig", "preset", "Seq2SeqTransformer", "Seq2TrtError", "ConfigError",
           "CheckpointError", "InputError", "ArtifactError", "DependencyError", "CheckFailed"]
