"""One module per backend kind (Polygraphy's `backend/<name>/`): `eager`, `onnxruntime`, `tensorrt`, `ort_search`
and `ort_cuda`. The registry (`runtime/registry.py`) declares each backend name once and points at its module here.

Every module exposes the same five things:
- `CONCURRENT`: whether one opened model takes calls from several threads at once (the Translator locks otherwise);
- `unavailable(backend)`: why it cannot run on this machine (a GPU, a provider), or None;
- `open(out, backend, manifest, checkpoint, threads)`: a context manager yielding what decodes: a `StepModel` for the
  searches of `reference_model.decoding`, or the whole search (`backend.whole_search`);
- `check(out, backend, manifest)`: what serving loads, checked before a server starts;
- `bench(ctx, backend)`: the opened model as `seq2trt bench` times it (`BenchModel`).
`backend` is the registry's declaration (`registry.Backend`); a module never imports the registry.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


@dataclass
class BenchContext:
    """What a bench run gives a backend to open itself on."""

    out: Path
    manifest: object
    checkpoint: Path | None
    reference: Callable[[], object]  # the eager model of the export's checkpoint, loaded once per bench
    threads: int


@dataclass
class BenchModel:
    """An opened backend as the bench times it: the model, the threads it really uses, how to close it, torch's
    thread setter when its arithmetic runs in torch, and a device sync (a GPU queues work and returns early)."""

    model: object
    threads: int
    close: Callable[[], None] = field(default=lambda: None)
    set_threads: Callable[[int], None] | None = None
    sync: Callable[[], None] | None = None


def bench_opened(opener, ctx: BenchContext, backend) -> BenchModel:
    """The default bench adapter: the module's `open` (`opener`), held until the bench closes it; torch's threads follow the
    bench's (the search loops' log-softmax and top-k run in torch, inside the same budget)."""
    import torch

    stack = contextlib.ExitStack()
    model = stack.enter_context(opener(ctx.out, backend, ctx.manifest, ctx.checkpoint, ctx.threads))
    return BenchModel(model, ctx.threads, close=stack.close, set_threads=torch.set_num_threads)
