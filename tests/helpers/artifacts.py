"""A checkpoint and its export, the artifact most tests start from: from a random model built here
(`checkpoint_and_export`, in process), or from a Hugging Face directory imported through the CLI (`import_and_export`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from helpers.cli import invoke_ok


def numbers_model(make_model, seed: int, **overrides):
    """A random fp32 model on the numbers task's vocabularies, so `translate` has text: (model, task)."""
    from seq2trt.reference_model.tasks import get_task

    task = get_task("numbers")
    model = make_model(seed=seed, dtype=torch.float32, src_vocab_size=len(task.source_vocab),
                       tgt_vocab_size=len(task.target_vocab), **overrides)
    return model, task


def checkpoint_and_export(root: Path, model, task=None, *, max_batch: int | None = None, fuse: tuple[str, ...] = (),
                          record_task: bool = False) -> tuple[Path, Path]:
    """`model` saved as root/ckpt (with `task`'s vocabularies; metrics.json naming the task when
    `record_task`), exported to root/out with the checkpoint as its source (profiles up to `max_batch`, the
    exporter's default when None), fused for each target in `fuse` ("ort", "trt"). Returns (checkpoint, out)."""
    from seq2trt.exporters import spec
    from seq2trt.exporters.fuse import Target, fuse_artifacts
    from seq2trt.exporters.onnx_export import export
    from seq2trt.reference_model.checkpoint import save_checkpoint, source_record

    vocabs = (task.source_vocab, task.target_vocab) if task is not None else None
    extra = {"metrics.json": json.dumps({"task": task.name})} if record_task else None
    ckpt = save_checkpoint(root / "ckpt", model, vocabs, extra_files=extra)
    limits = spec.Limits.for_model(model.cfg, max_batch) if max_batch is not None else None
    out = export(model, root / "out", limits=limits, source=source_record(ckpt))
    for target in fuse:
        fuse_artifacts(out, Target(target))
    return ckpt, out


def import_and_export(src: Path, root: Path, *export_flags, fuse: str | None = "ort") -> Path:
    """`seq2trt import hf SRC -o root/ckpt`, `export root/ckpt -o root/out EXPORT_FLAGS...` and, unless `fuse` is
    None, `fuse root/out --target FUSE`, each of which must succeed; returns root."""
    invoke_ok("import", "hf", src, "-o", root / "ckpt")
    invoke_ok("export", root / "ckpt", "-o", root / "out", *export_flags)
    if fuse is not None:
        invoke_ok("fuse", root / "out", "--target", fuse)
    return root
