"""The reference an export is judged against: the eager model it came from (hash-checked) and the sources to decode.

`validate` and `bench` both start from these: the checkpoint the manifest names (or one passed in) and, for a model
trained on a built-in task, that task's held-out sources; seeded random ids otherwise.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from seq2trt.exporters.manifest import Manifest
from seq2trt.core.errors import CheckpointError, InputError
from seq2trt.core.atomic_files import sha256_file


def load_reference(manifest: Manifest, checkpoint: Path | None):
    """The eager model the export came from: `checkpoint`, or the one the manifest names (hash-checked)."""
    from seq2trt.reference_model.checkpoint import load_checkpoint, weights_path

    source = manifest.data.get("source") or {}
    path = Path(checkpoint) if checkpoint else (Path(source["checkpoint"]) if source.get("checkpoint") else None)
    if path is None:
        raise InputError(f"{manifest.root} records no source checkpoint; pass --checkpoint")
    if checkpoint is None and not path.exists():  # not a typo of the user's: the recorded checkpoint went away
        raise CheckpointError(f"the checkpoint {manifest.root} was exported from, {path}, is gone (moved or "
                              "deleted); pass its new place with --checkpoint PATH")
    model, vocabs = load_checkpoint(path)
    weights = weights_path(path)
    if source.get("weights_sha256") and sha256_file(weights) != source["weights_sha256"]:
        raise CheckpointError(f"{weights} is not the checkpoint {manifest.root} was exported from (sha256 differs); "
                              "pass the right --checkpoint or re-export")
    if model.cfg != manifest.config:
        raise CheckpointError(f"{path}'s config differs from the one recorded in {manifest.root}/manifest.json")
    return model, source.get("task")


def e2e_sources(cfg, task_name: str | None, samples: int, seed: int) -> tuple[list[list[int]], str]:
    """Held-out sources of the checkpoint's task (eos included), or seeded random sources of the model's source kind
    (ids, or audio features) for a model without one."""
    if task_name:
        from seq2trt.reference_model.tasks import get_task

        task = get_task(task_name)
        pairs = task.heldout(samples)
        return [task.source_vocab.encode(s) + [cfg.eos_id] for s, _ in pairs], f"held-out {task_name}"
    from seq2trt.reference_model.sources import source_kind

    rng, kind = np.random.default_rng(seed), source_kind(cfg)
    return kind.random(rng, samples, min(16, cfg.max_src_len - 1)), f"random {kind.name}"
