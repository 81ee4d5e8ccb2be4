"""The float element types seq2trt exports and runs, by name ("fp32", "fp16", "bf16"), and their torch types."""

from __future__ import annotations

DTYPES = ("fp32", "fp16", "bf16")


def torch_dtype(name: str):
    """The torch dtype of `name`; KeyError for a name outside DTYPES."""
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def dtype_name(dtype) -> str | None:
    """The name of a torch dtype among DTYPES, else None (float64 included)."""
    return next((name for name in DTYPES if torch_dtype(name) == dtype), None)
