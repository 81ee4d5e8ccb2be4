"""The reference encoder-decoder Transformer: config, eager model, checkpoints, decoding, demo tasks."""

from seq2trt.reference_model.config import PRESETS, Seq2SeqConfig, preset
from seq2trt.core.errors import (ArtifactError, CheckFailed, CheckpointError, ConfigError, DependencyError, InputError,
                                 Seq2TrtError)


def __getattr__(name: str):
    """The model imports torch (about a second): load it on first use, so that light users of the package (the
    TensorRT build child, `errors`, `config`) start fast."""
    if name == "Seq2SeqTransformer":
        from seq2trt.reference_model.model import Seq2SeqTransformer

        return Seq2SeqTransformer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["PRESETS", "Seq2SeqConfig", "preset", "Seq2SeqTransformer", "Seq2TrtError", "ConfigError",
           "CheckpointError", "InputError", "ArtifactError", "DependencyError", "CheckFailed"]
