"""`seq2trt train` and `seq2trt translate`: the reference model on its own."""

from __future__ import annotations

import json
from pathlib import Path

import click

from seq2trt.reference_model.checkpoint import load_checkpoint, save_checkpoint
from seq2trt.reference_model.config import PRESETS
from seq2trt.reference_model.decoding import DecodeSettings, beam_search, greedy_decode
from seq2trt.reference_model.eager import EagerStepModel
from seq2trt.reference_model.errors import CheckpointError, InputError
from seq2trt.reference_model.tasks import TASKS
from seq2trt.reference_model.train import TrainSettings, train as train_model
from seq2trt.reference_model.vocab import pad_batch


@click.command()
@click.option("-o", "--out", "out", type=click.Path(path_type=Path), required=True, help="Checkpoint directory to write.")
@click.option("--task", default="numbers", show_default=True, help=f"Built-in task: {', '.join(TASKS)}.")
@click.option("--preset", default="demo", show_default=True, help=f"Model size: {', '.join(PRESETS)}.")
@click.option("--steps", type=int, default=TrainSettings.steps, show_default=True)
@click.option("--batch-size", type=int, default=TrainSettings.batch_size, show_default=True)
@click.option("--lr", type=float, default=TrainSettings.lr, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--eval-examples", type=int, default=TrainSettings.eval_examples, show_default=True,
              help="Held-out examples decoded for heldout_exact_match.")
@click.option("--force", is_flag=True, help="Replace an existing checkpoint directory.")
def train(out: Path, task: str, preset: str, steps: int, batch_size: int, lr: float, seed: int,
          eval_examples: int, force: bool) -> None:
    """Train a model on a built-in task (CPU) and write its checkpoint and metrics.json."""
    from seq2trt.reference_model.config import preset as make_preset
    from seq2trt.reference_model.io import refuse_existing
    from seq2trt.reference_model.tasks import get_task

    from .progress import progress_bar

    get_task(task), make_preset(preset)  # fail on a bad name before any work
    settings = TrainSettings(task=task, preset=preset, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                             eval_examples=eval_examples)
    refuse_existing(out, force, "checkpoint")  # before any work; the write below is atomic
    with progress_bar(f"training {preset} on {task}", steps) as update:
        model, metrics = train_model(settings, lambda step, loss: update(step, f"loss {loss:.3f}"))
    t = get_task(task)
    save_checkpoint(out, model, (t.source_vocab, t.target_vocab), force=True,
                    extra_files={"metrics.json": json.dumps(metrics, indent=2) + "\n"})
    click.echo(f"held-out exact match {metrics['heldout_exact_match']:.4f} on {eval_examples} examples "
               f"({metrics['train_seconds']:.0f} s of training); checkpoint in {out}")


@click.command()
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.argument("texts", nargs=-1, required=True)
@click.option("--beam", type=int, default=1, show_default=True, help="Beam size; 1 is greedy search.")
@click.option("--alpha", type=float, default=0.6, show_default=True, help="Beam length penalty (GNMT).")
def translate(checkpoint: Path, texts: tuple[str, ...], beam: int, alpha: float) -> None:
    """Decode TEXTS with the eager model of CHECKPOINT (greedy, or beam search with --beam N)."""
    if beam < 1:
        raise InputError(f"--beam must be >= 1, got {beam}")
    model, vocabs = load_checkpoint(checkpoint)
    if vocabs is None:
        raise CheckpointError(f"{checkpoint} has no vocab.json, so text cannot be encoded; "
                              "save the checkpoint with its vocabularies")
    cfg = model.cfg
    sources = []
    for text in texts:
        ids = vocabs[0].encode(text.strip()) + [cfg.eos_id]
        if len(ids) == 1:
            raise InputError("empty source text; give at least one symbol")
        if len(ids) > cfg.max_src_len:
            raise InputError(f"source {text!r} is {len(ids)} tokens with eos, over the model's max_src_len "
                             f"{cfg.max_src_len}; shorten it")
        sources.append(ids)
    ids, mask = pad_batch(sources, cfg.pad_id)
    settings = DecodeSettings(cfg.bos_id, cfg.eos_id, cfg.pad_id, cfg.max_tgt_len - 1)
    step_model = EagerStepModel(model)
    outputs = greedy_decode(step_model, ids, mask, settings) if beam == 1 else \
        beam_search(step_model, ids, mask, settings, beam_size=beam, alpha=alpha)
    for out in outputs:
        click.echo(vocabs[1].decode(out))


COMMANDS = [train, translate]
