"""`seq2trt validate OUT --graphs generate` (or `generate-int8`): the in-runtime search (generate.onnx, or the one
`seq2trt ort-search --int8` built around the int8 graphs) against the eager model.

There are no graph-level cases: the graph is the whole search. The check is end to end on the held-out sources:
generate.onnx with one beam = `greedy_decode` on the eager model (float64), and with K beams =
`hf_beam_search(early_stopping=True)` with the same length_penalty (the graph's semantics: exporters/ort_search.py),
token for token: fp32 targets (agreement 1.0) for generate.onnx, int8's (end_to_end.TARGETS) for the int8 one.
Written to OUT/reports/generate_parity.json and .md (generate_int8_parity.* for the int8 one).
"""

from __future__ import annotations

import datetime
import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from seq2trt.core import layout
from seq2trt.reference_model.decoding import GNMT_ALPHA
from seq2trt.exporters import spec
from seq2trt.exporters.ort_search import verify_generate
from seq2trt.exporters.manifest import verify
from seq2trt.reference_model.decoding import DecodeSettings, greedy_decode, hf_beam_search
from seq2trt.reference_model.eager import EagerStepModel
from seq2trt.core.errors import CheckFailed, InputError
from seq2trt.core.atomic_files import atomic_write_text
from seq2trt.reference_model.vocab import pad_batch

from seq2trt.validation.end_to_end import TARGETS, agreement
from seq2trt.runtime.decode_jobs import generation_config
from seq2trt.runtime.ort_search import GenerateModel
from seq2trt.runtime.reference_loader import e2e_sources, load_reference

logger = logging.getLogger(__name__)

LENGTH_PENALTY = GNMT_ALPHA  # for models trained here; imported models use their own


def run_generate_validation(out: Path, settings, checkpoint: Path | None = None,
                            progress: Callable[[str], None] | None = None, int8: bool = False) -> dict:
    """`settings`: validate's ValidateSettings (samples, beam_size, max_new_tokens, threads, seed); `int8`: the
    generate.onnx of the int8 graphs."""
    out = Path(out)
    manifest = verify(out, [kind.filename for kind in spec.GraphKind])
    verify_generate(out, manifest, int8)
    name = "generate-int8" if int8 else "generate"
    label = "the int8 graphs' generate.onnx" if int8 else "generate.onnx"
    cfg, limits = manifest.config, manifest.limits
    if settings.device != "cpu":
        raise InputError(f"--graphs {name} runs ONNX Runtime's CPU BeamSearch; use --device cpu")
    model, task_name = load_reference(manifest, checkpoint)
    source = Path(checkpoint) if checkpoint else Path((manifest.data.get("source") or {}).get("checkpoint", out))
    generation = generation_config(source)
    length_penalty = generation["length_penalty"] if generation else LENGTH_PENALTY
    cap = limits.max_tgt_len - 1 if task_name else min(32, limits.max_tgt_len - 1)
    decode = DecodeSettings.for_model(cfg, settings.max_new_tokens or cap)
    sources, origin = e2e_sources(cfg, task_name, settings.samples, settings.seed)
    K = settings.beam_size
    results = _search_agreements(out, manifest, settings, int8, EagerStepModel(model.double()), sources, decode,
                                 length_penalty, label, progress)
    targets = TARGETS["int8" if int8 else "fp32"]
    failures = [f"{search}: token_agreement {a.token_agreement:.6f}, sequence_match {a.sequence_match:.6f} (targets "
                f"{targets.token_agreement}, {targets.sequence_match}), first divergent step {a.first_divergent_step}, "
                f"samples {a.divergent_samples}" for search, a in results.items()
                if a.token_agreement < targets.token_agreement or a.sequence_match < targets.sequence_match]
    report = "generate_int8_parity" if int8 else "generate_parity"
    document = {"passed": not failures, "graphs_set": name, "backend": f"ort-{name}",
                "dtype": manifest.dtype, "precision": "int8" if int8 else manifest.dtype, "targets": asdict(targets),
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "reference": "eager PyTorch, float64: greedy_decode and hf_beam_search(early_stopping=True)",
                "settings": {"samples": settings.samples, "beam_size": K, "length_penalty": length_penalty,
                             "max_new_tokens": decode.max_new_tokens, "threads": settings.threads, "seed": settings.seed},
                "cases": 0, "failures": failures, "report": f"{report}.md",
                "end_to_end": {"samples": len(sources), "inputs": origin, "max_logit_abs_err": float("nan"),
                               "token_agreement": min(a.token_agreement for a in results.values()),
                               "sequence_match": min(a.sequence_match for a in results.values()),
                               **{search: asdict(a) for search, a in results.items()}}}
    _write(out, document, report, label)
    if failures:
        raise CheckFailed(f"{label} of {out} differs from the eager search ({out}/reports/{report}.md):\n  "
                          + "\n  ".join(failures))
    return document


def _search_agreements(out: Path, manifest, settings, int8: bool, eager: EagerStepModel, sources: list[list[int]],
                       decode: DecodeSettings, length_penalty: float, label: str, progress) -> dict:
    """Greedy search and beam search (`settings.beam_size` beams) of the export's generate.onnx against the eager
    model's on `sources`, batched within the export's max_batch: each search's token agreement."""
    cfg, limits, K = manifest.config, manifest.limits, settings.beam_size
    searches = {"greedy": (1, lambda m, ids, mask: greedy_decode(m, ids, mask, decode)),
                "beam": (K, lambda m, ids, mask: hf_beam_search(m, ids, mask, decode, K, length_penalty, True))}
    results = {}
    with GenerateModel(out, manifest, settings.threads, int8) as generate:
        for search, (beams, reference) in searches.items():
            if progress:
                progress(f"{search} ({beams} beam{'s' * (beams > 1)}) of {len(sources)} sources: {label} vs eager")
            rows = max(1, limits.max_batch // beams)
            want, got = [], []
            for i in range(0, len(sources), rows):
                ids, mask = pad_batch(sources[i: i + rows], cfg.pad_id)
                want += reference(eager, ids, mask)
                got += generate.decode(ids, mask, decode, beams, length_penalty)
            results[search] = agreement(want, got, cfg.eos_id)
    return results


def _write(out: Path, document: dict, report: str, label: str) -> None:
    e2e, s, t = document["end_to_end"], document["settings"], document["targets"]
    lines = [f"# Parity of {label} (the whole search in ONNX Runtime)", "",
             f"{'PASSED' if document['passed'] else 'FAILED'}; {e2e['samples']} sources ({e2e['inputs']}), reference: "
             f"{document['reference']}; length_penalty {s['length_penalty']}, at most {s['max_new_tokens']} new "
             f"tokens; targets ({document['precision']}): token agreement >= {t['token_agreement']}, sequence match >= "
             f"{t['sequence_match']}.",
             "", "| search | token agreement | sequence match | first divergent step |", "| --- | --- | --- | --- |"]
    for name in ("greedy", "beam"):
        a = e2e[name]
        row = "greedy" if name == "greedy" else f"beam {s['beam_size']}"
        lines.append(f"| {row} | {a['token_agreement']:.6f} | {a['sequence_match']:.6f} | {a['first_divergent_step']} |")
    reports = layout.reports_dir(out)
    atomic_write_text(reports / f"{report}.json", json.dumps(document, indent=2) + "\n")
    atomic_write_text(reports / f"{report}.md", "\n".join(lines + document["failures"]) + "\n")
