"""`seq2trt import hf`: bring a Hugging Face checkpoint (Marian, BART, mBART, M2M100/NLLB, T5/mT5/UMT5) into seq2trt."""

from __future__ import annotations

from pathlib import Path

import click


@click.group("import")
def import_group() -> None:
    """Import a checkpoint trained elsewhere as a seq2trt checkpoint."""


@import_group.command("hf")
@click.argument("src", type=click.Path(path_type=Path))
@click.option("-o", "--out", "out", type=click.Path(path_type=Path), required=True,
              help="seq2trt checkpoint directory to write.")
@click.option("--force", is_flag=True, help="Replace an existing checkpoint directory.")
def hf(src: Path, out: Path, force: bool) -> None:
    """Import the Hugging Face model directory SRC (as save_pretrained or a hub download writes it; never
    downloads) after proving it equal to transformers' own model and generate; the proof goes to OUT/import.json."""
    import seq2trt

    from seq2trt.cli.progress import progress_lines

    record = seq2trt.import_hf(src, out, force=force, progress=progress_lines("import")).record
    v = record["verification"]
    sets = [name for name in ("seeded", "texts") if name in v]
    n = sum(v[s]["sources"] for s in sets)
    logits = max(v[s]["logits_max_abs_err"] for s in sets)
    speech = "language" in v["seeded"]  # a speech model's proof runs on random log-mel features
    what = "random log-mel inputs" if speech else "sources"
    detected = " and detected languages" if "languages_equal" in v["seeded"] else ""
    missing = "transcribe prints ids" if speech else "translate takes --ids-file"
    own = [v[s]["judge_fp32_error"] for s in sets if "judge_fp32_error" in v[s]]
    if own:  # ill-conditioned: judged within twice transformers' own float32 error (proof._judge_own_error)
        logits = f"{logits:.1e}" + (f", inside twice transformers' own float32 error of "
                                    f"{max(e['logits'] for e in own):.1e} (scaled) on this model")
    else:
        logits = f"{logits:.1e}"
    click.echo(f"imported {record['family']} from {src}: equal to transformers on {n} {what} ({' + '.join(sets)}; "
               f"greedy and beam-{v['beam_size']} tokens{detected} identical, step logits within {logits}); "
               f"checkpoint in {out}" + ("" if record["tokenizer_files"] else f" (no tokenizer in the source: "
                                          f"{missing})"))


COMMANDS = [import_group]
