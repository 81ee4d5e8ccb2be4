"""The bench's reports: `latency.json` (the document `measure.Bench.run` returns), `latency.md` and the PNG plots.

Everything is written atomically into OUT/reports/; the Markdown embeds the plots by relative path.
"""

from __future__ import annotations

import json
from pathlib import Path

from seq2trt.core.atomic_files import atomic_write_text

from seq2trt.validation.reports import plots


def _fmt(value, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def markdown(doc: dict, images: dict[str, str]) -> str:
    s = doc["settings"]
    m = doc["machine"]
    lines = ["# Latency", "",
             f"{doc['model']['num_encoder_layers']}+{doc['model']['num_decoder_layers']} layers, d_model "
             f"{doc['model']['d_model']}, {doc['dtype']}; source length {s['src_len']}, exactly {s['new_tokens']} new "
             f"tokens per source (greedy, eos does not stop a row); {s['repeats']} repetitions after {s['warmup']} "
             f"warm-up, backends interleaved round-robin.", "",
             f"Machine: {m.get('cpus')} CPUs, {m.get('processor')}; load average before {m.get('loadavg_before')}, "
             f"after {m.get('loadavg_after')} (a shared machine: compare ratios, not absolute times).", ""]
    for section in (_latency_tables, _encoder_tables, _checks_table, _memory_table, _builds_table):
        lines += section(doc)
    for title, name in images.items():
        lines += [f"![{title}]({name})", ""]
    return "\n".join(lines)


def _latency_tables(doc: dict) -> list[str]:
    """One table a thread count: each backend's tokens/s, step and decode times, and its ratios."""
    lines = []
    for t, backends in doc["results"].items():
        threading = doc.get("threading", {}).get(t, {})
        how = "; ".join(f"{name}: {text}" for name, text in threading.items())
        extra = [r for r in ("eager-cuda", "hf", "optimum") if r in backends]  # columns only where they were measured
        lines += [f"## {t} thread(s)", ""] + ([f"Threading: {how}.", ""] if how else []) + [
                  "| backend | batch | tokens/s | step p50 (ms) | step p90 | step p99 | decode p50 (ms) | vs eager | " +
                  "".join(f"vs {r} | " for r in extra) + "vs ct2 | vs ct2 int8 |",
                  "|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(extra)]
        for backend, by_batch in backends.items():
            for batch, r in sorted(by_batch.items(), key=lambda kv: int(kv[0])):
                ratio = doc["ratios"].get(t, {}).get(backend, {}).get(batch, {})
                lines.append(f"| {backend} | {batch} | {r['tokens_per_s']:.1f} | {_fmt(r.get('step_ms_p50'), '.3f')} | "
                             f"{_fmt(r.get('step_ms_p90'), '.3f')} | {_fmt(r.get('step_ms_p99'), '.3f')} | "
                             f"{_fmt(r.get('decode_ms_p50'), '.1f')} | {_fmt(ratio.get('vs_eager'))}× | " +
                             "".join(f"{_fmt(ratio.get('vs_' + r.replace('-', '_')))}× | " for r in extra) +
                             f"{_fmt(ratio.get('vs_ct2'))}× | {_fmt(ratio.get('vs_ct2_int8'))}× |")
        lines.append("")
    lines += ["Ratios are tokens/s ratios (> 1: faster than the reference), medians of per-repetition pairs. "
              "CTranslate2's step times come from its per-token callback (steps 1 .. N-1).", ""]
    return lines


def _encoder_tables(doc: dict) -> list[str]:
    """The encoder's p50 by source length, one table a thread count."""
    lines = []
    for t, backends in (doc.get("encoder_ms") or {}).items():
        lines += [f"### Encoder p50 (ms) by source length, {t} thread(s)", "", "| backend | batch | " +
                  " | ".join(f"S={n}" for n in _keys(backends)) + " |", "|---|---|" + "---|" * len(_keys(backends))]
        for backend, by_batch in backends.items():
            for batch, by_len in sorted(by_batch.items(), key=lambda kv: int(kv[0])):
                lines.append(f"| {backend} | {batch} | " + " | ".join(
                    _fmt(by_len.get(n, {}).get("p50"), ".3f") for n in _keys(backends)) + " |")
        lines.append("")
    return lines


def _checks_table(doc: dict) -> list[str]:
    """Each backend's agreement with the eager model, checked before timing."""
    if not doc.get("checks"):
        return []
    lines = ["## Agreement with the eager model (greedy tokens, checked before timing)", "",
             "| backend | sources | identical | near-ties | max abs logit diff |", "|---|---|---|---|---|"]
    for name, c in doc["checks"].items():
        lines.append(f"| {name} | {c['sequences']} {c['sources']} | {c['identical']} ({c['rate']:.3f}) | "
                     f"{c['ties']} | {_fmt(c['max_abs_logit_diff'], '.3g')} |")
    lines.append("")
    return lines


def _memory_table(doc: dict) -> list[str]:
    """Each backend's peak RSS and what loading it added."""
    if not doc.get("memory"):
        return []
    lines = ["## Memory", "", "| backend | peak RSS (MB) | scope | RSS added by loading (MB) |", "|---|---|---|---|"]
    for name, mem in doc["memory"].items():
        lines.append(f"| {name} | {_fmt(mem.get('peak_rss_mb'), '.0f')} | {mem.get('scope', '')} | "
                     f"{_fmt(mem.get('load_rss_delta_mb'), '.1f')} |")
    lines.append("")
    return lines


def _builds_table(doc: dict) -> list[str]:
    """Each build's graphs, build seconds and sizes (TensorRT plans, CTranslate2 and Optimum conversions)."""
    if not doc.get("builds"):
        return []
    lines = ["## Builds", "", "| build | graph | seconds | size (MiB) |", "|:---|:---|---|---|"]
    for name, build in doc["builds"].items():
        if "convert_seconds" in build:  # a CTranslate2 conversion (one model.bin) or Optimum's export
            lines.append(f"| {name} conversion | {build.get('file', 'model.bin')} | {_fmt(build['convert_seconds'])} | "
                         f"{_fmt(build['model_bytes'] / 2**20, '.1f')} |")
            continue
        for graph, g in build.items():  # a TensorRT engine directory: one plan per graph
            size = None if g.get("plan_bytes") is None else g["plan_bytes"] / 2**20
            lines.append(f"| {name} | {graph}.plan | {_fmt(g.get('build_seconds'))} | {_fmt(size, '.1f')} |")
    lines.append("")
    return lines


def _keys(backends: dict) -> list[str]:
    return sorted({n for by_batch in backends.values() for by_len in by_batch.values() for n in by_len}, key=int)


def write_reports(reports: Path, doc: dict) -> dict[str, Path]:
    """Write latency.json, latency.md and the plots; returns what was written."""
    reports = Path(reports)
    written = {"json": reports / "latency.json"}
    atomic_write_text(written["json"], json.dumps(doc, indent=2) + "\n")
    images = {}
    for title, name, draw, source in (
            ("step latency by past length", "step_latency.png", plots.step_latency_by_past, doc),
            ("tokens/s by batch size", "tokens_per_s.png", plots.tokens_per_second, doc),
            ("logit error by decoding step", "error_by_step.png", plots.error_by_step,
             plots.error_series(doc, _parity(reports)))):
        if draw(source, reports / name) is not None:
            images[title] = name
            written[name] = reports / name
    written["md"] = reports / "latency.md"
    atomic_write_text(written["md"], markdown(doc, images))
    return written


def _parity(reports: Path) -> dict:
    path = reports / "parity.json"
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except json.JSONDecodeError:
        return {}
