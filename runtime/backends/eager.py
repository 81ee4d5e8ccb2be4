"""Backend kind `eager`: the PyTorch model of the export's checkpoint (the reference every backend is judged
against), on the CPU or on a CUDA device (`eager-cuda`, bench only)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from seq2trt.runtime.backends import BenchContext, BenchModel

CONCURRENT = True  # torch modules in inference mode take calls from several threads


def unavailable(backend) -> str | None:
    if backend.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "the eager model on CUDA needs a GPU visible to PyTorch, and this machine has none"
    return None


@contextlib.contextmanager
def open(out: Path, backend, manifest, checkpoint: Path | None, threads: int):
    from seq2trt.reference_model.eager import EagerStepModel
    from seq2trt.runtime.reference_loader import load_reference

    model, _ = load_reference(manifest, checkpoint)
    yield EagerStepModel(model.to(backend.device), device=backend.device)


def check(out: Path, backend, manifest) -> None:
    """Nothing before a start: the served eager model loads (and checks) the checkpoint itself."""


def bench(ctx: BenchContext, backend) -> BenchModel:
    """The bench's already loaded reference model (on CUDA: a copy there, the CPU reference stays where it is)."""
    import copy

    import torch

    from seq2trt.reference_model.eager import EagerStepModel

    cuda = backend.device == "cuda"
    model = copy.deepcopy(ctx.reference()).cuda() if cuda else ctx.reference()
    return BenchModel(EagerStepModel(model, device=backend.device), ctx.threads, set_threads=torch.set_num_threads,
                      sync=torch.cuda.synchronize if cuda else None)
