"""`seq2trt report`: one Markdown report and one self-contained HTML page for an artifact directory.

It reads what the stages wrote — manifest.json, fused/*/fusion.json, quantized/*/quantization.json,
engines/*/build.json, reports/parity*.json, reports/latency.json and the PNG plots — and says what was built, for which GPU,
how exact and how fast. Nothing is recomputed; a stage that has not run is reported as not run.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

from seq2trt.core import layout
from seq2trt.exporters import spec
from seq2trt.exporters.manifest import Manifest, generation, verify, writing_into
from seq2trt.reference_model.config import Seq2SeqConfig
from seq2trt.core.errors import ArtifactError, first_line
from seq2trt.core.atomic_files import atomic_write_text

from seq2trt.validation.reports import bench_table
from seq2trt.validation.reports import parity_table


# The command that writes each stage record the report reads (what to re-run when one is damaged).
WRITERS = {"latency.json": "seq2trt bench OUT", "parity": "seq2trt validate OUT", "build.json": "seq2trt build OUT",
           "fusion.json": "seq2trt fuse OUT", "quantization.json": "seq2trt quantize OUT"}


def _load(path: Path, strict: bool = False) -> dict | None:
    """A stage's JSON record; None when the stage never wrote it, or (not `strict`: a row among others, which the
    table marks unreadable) when it cannot be read. A `strict` one that is there but cannot be read (cut short, not
    JSON, not an object) is refused: showing a section as "not run" would hide that the stage ran."""
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        doc = exc
    if not isinstance(doc, dict) and not strict:
        return None
    if not isinstance(doc, dict):
        detail = f"{type(doc).__name__}: {first_line(doc)}" if isinstance(doc, Exception) else \
            f"a JSON {type(doc).__name__}, not an object"
        writer = next((w for k, w in WRITERS.items() if path.name.startswith(k)), "the stage that wrote it")
        raise ArtifactError(f"{path} is damaged ({detail}); re-run `{writer}` to write it again, or delete it")
    return doc


def _records(out: Path, pattern: str) -> dict[str, dict | None]:
    """A stage's JSON records, keyed by the folder each sits in (a fusion target, an engine directory, ...)."""
    return {p.parent.name: _load(p) for p in sorted(Path(out).glob(pattern))}


def _overview(manifest: dict) -> list[str]:
    cfg = manifest["config"]
    files = manifest["files"]
    lines = ["## Model and export", "",
             f"- model: {cfg['num_encoder_layers']}+{cfg['num_decoder_layers']} layers, d_model {cfg['d_model']}, "
             f"{cfg['num_heads']} heads, d_ff {cfg['d_ff']}, vocab {cfg['src_vocab_size']}/{cfg['tgt_vocab_size']}, "
             f"{'pre' if cfg['pre_norm'] else 'post'}-LN, {cfg['activation']}",
             f"- export: dtype {manifest['dtype']}, opset {manifest['opset']}, created {manifest.get('created')}",
             "- tools: " + ", ".join(f"{k} {v}" for k, v in manifest.get("tools", {}).items() if v)]
    limits = manifest["settings"].get("limits") or {}
    if limits:
        lines += ["", "Serving limits (they size the TensorRT profiles and bound what the runners accept):", "",
                  "| " + " | ".join(k.replace("_", " ") for k in limits) + " |", "|---:" * len(limits) + "|",
                  "| " + " | ".join(str(v) for v in limits.values()) + " |"]
    lines += ["", "| file | bytes | sha256 |", "|---|---|---|"]
    lines += [f"| {name} | {meta['bytes']:,} | `{meta['sha256'][:16]}…` |" for name, meta in files.items()]
    return lines + [""]


def _fusion(out: Path) -> list[str]:
    lines = ["## Fusion", ""]
    reports = _records(out, "fused/*/fusion.json")
    if not reports:
        return lines + ["Not run (`seq2trt fuse OUT --target trt|ort`).", ""]
    lines += ["| target | graph | attention blocks fused / expected | nodes before → after | complete |",
              "|---|---|---|---|---|"]
    for target, doc in reports.items():
        for graph, g in (doc or {}).get("graphs", {}).items():
            blocks = ", ".join(f"{k} {g['fused'].get(k, 0)}/{n}" for k, n in g["expected"].items())
            lines.append(f"| {target} | {graph} | {blocks} | {g['nodes_before']} → {g['nodes_after']} | "
                         f"{'yes' if g['complete'] else 'NO: ' + ', '.join(g['unfused_blocks'])} |")
    return lines + [""]


def _quantization(out: Path) -> list[str]:
    lines = ["## int8 quantization", ""]
    reports = _records(out, "quantized/*/quantization.json")
    if not reports:
        return lines + ["Not run (opt-in: `seq2trt quantize OUT` after `seq2trt fuse OUT --target ort`).", ""]
    lines += ["| graphs | graph | MatMuls int8 / all | size (MiB) before → after | scales |", "|---|---|---|---|---|"]
    for name, doc in reports.items():
        for graph, g in (doc or {}).get("graphs", {}).items():
            lines.append(f"| {name} | {graph} | {g['quantized']}/{g['matmuls']} | {g['bytes_before'] / 2**20:.1f} → "
                         f"{g['bytes_after'] / 2**20:.1f} | {'per channel' if doc['per_channel'] else 'per tensor'} |")
    return lines + ["", "Accuracy cost: the int8-ort run under Parity; speed: ort-int8 under Latency.", ""]


def _builds(out: Path, cfg: Seq2SeqConfig) -> list[str]:
    lines = ["## Engines", ""]
    records = _records(out, "engines/*/build.json")
    builds = {name: doc for name, doc in records.items() if doc is not None}
    lines += [f"engines/{name}/build.json is unreadable; rebuild with --force.\n" for name in records if name not in builds]
    if not builds:
        return lines + ([] if records else ["No engine built (`seq2trt build OUT --backend tensorrt-rtx`).", ""])
    lines += ["| engines | TensorRT | targets | dtype | plugin | optimization level | workspace | created |",
              "|---|:---|:---|:---|:---|---|---|:---|"]
    for name, doc in builds.items():
        plugin = doc.get("plugin") or {}
        used = (f"{plugin.get('name')} v{plugin.get('version')}, " + " + ".join(
            f"{n} {graph}" for graph, n in (plugin.get("layers") or {}).items()) + " layers") if plugin.get("used") \
            else "not used"
        workspace = doc.get("workspace_bytes")
        lines.append(f"| {name} | {doc.get('flavour')} {doc.get('tensorrt_version')} | "
                     f"{', '.join(f'sm_{cc}' for cc in doc.get('compute_capabilities') or [])} | {doc.get('dtype')} | "
                     f"{used} | {doc.get('builder_optimization_level')} | "
                     f"{'default' if workspace is None else f'{workspace / 2**20:.0f} MiB'} | "
                     f"{str(doc.get('created'))[:16].replace('T', ' ')} |")
    lines += ["", "| engines | graph | plan (MiB) | build (s) | layers | plugin layers | built from |",
              "|---|:---|---|---|---|---|:---|"]
    for name, doc in builds.items():
        for graph, g in doc["graphs"].items():
            lines.append(f"| {name} | {graph} | {g['plan_bytes'] / 2**20:.1f} | {g['build_seconds']:.2f} | "
                         f"{sum((g.get('layer_types') or {}).values())} | {g.get('plugin_layers', '–')} | "
                         f"`{g.get('source')}` (`{str(g.get('source_sha256'))[:16]}…`) |")
    lines += ["", "Optimization profiles, min / opt / max of each dynamic axis:", "",
              "| engines | axis | " + " | ".join(kind.value for kind in spec.GraphKind) + " |",
              "|---|:---|" + "---|" * len(spec.GraphKind)]
    for name, doc in builds.items():
        ranges = {kind: _axis_ranges(cfg, kind, doc["graphs"].get(kind.value, {}).get("profiles", {}))
                  for kind in spec.GraphKind}
        for axis in dict.fromkeys(a for r in ranges.values() for a in r):
            lines.append(f"| {name} | {axis} | " + " | ".join(ranges[kind].get(axis, "–") for kind in spec.GraphKind)
                         + " |")
    return lines + [""]


def _axis_ranges(cfg: Seq2SeqConfig, kind: spec.GraphKind, profiles: dict) -> dict[str, str]:
    """Dynamic axis -> "min / opt / max", read off a graph's profiles (input -> [min, opt, max] shapes) through the
    spec's axes; an axis the inputs disagree on lists each range."""
    seen: dict[str, dict[str, None]] = {}
    for tensor in spec.inputs(cfg, kind):
        shapes = profiles.get(tensor.name)
        for i, axis in enumerate(tensor.axes):
            if shapes and isinstance(axis, str):
                seen.setdefault(axis, {})[" / ".join(str(shape[i]) for shape in shapes)] = None
    return {axis: "; ".join(values) for axis, values in seen.items()}


def _parity(out: Path) -> list[str]:
    runs = sorted(layout.reports_dir(out).glob("parity-*.json")) or sorted(layout.reports_dir(out).glob("parity.json"))
    docs = {p.stem: _load(p, strict=True) for p in runs}
    docs = {k: v for k, v in docs.items() if v}
    if not docs:
        return ["## Parity", "", "Not run (`seq2trt validate OUT`).", ""]
    lines = ["## Parity", "", "| run | backend | graphs | dtype | passed | greedy agreement | beam agreement | "
             "max logit err | task metric (eager) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, doc in docs.items():
        e2e = doc.get("end_to_end") or {}
        agree = lambda s: (f"{e2e[s]['token_agreement']:.6f}" if s in e2e else "–") + \
            (f" ({n} near-tie(s))" if s in e2e and (n := e2e[s].get("near_ties")) else "")
        err = f"{e2e['max_logit_abs_err']:.3g}" if "max_logit_abs_err" in e2e else "–"
        m = e2e.get("task_metric")
        metric = f"{m['candidate']:.4f} ({m['reference']:.4f})" if m else "–"
        lines.append(f"| {name} | {doc.get('backend')} | {doc.get('graphs_set')} | {doc.get('dtype')} | "
                     f"{'yes' if doc.get('passed') else 'NO'} | {agree('greedy')} | {agree('beam')} | {err} | "
                     f"{metric} |")
    for name, doc in docs.items():
        lines += ["", _demote(parity_table.markdown(doc), 2)]  # each run nested under "## Parity"
    return lines + [""]


def _latency(out: Path) -> list[str]:
    doc = _load(layout.reports_dir(out) / "latency.json", strict=True)
    if not doc:
        return ["## Latency", "", "Not run (`seq2trt bench OUT`).", ""]
    if doc.get("kind") == "speech":  # a Whisper export's bench: its own table (validation/bench/speech_bench.py)
        from seq2trt.validation.bench.speech_bench import markdown as speech_markdown

        return [_demote(speech_markdown(doc)), ""]
    images = {p.stem.replace("_", " "): p.name for p in sorted(layout.reports_dir(out).glob("*.png"))}
    return [_demote(bench_table.markdown(doc, images)), ""]


def _demote(markdown: str, levels: int = 1) -> str:
    """Nest a stage's own report `levels` heading levels down."""
    return re.sub(r"^(#+) ", "#" * levels + r"\1 ", markdown, flags=re.MULTILINE)


def verify_everything(out: Path) -> Manifest:
    """Check every artifact the report describes the way its own consumers do: the export's files against the
    manifest, fused and int8 graphs against fusion.json / quantization.json (and made from this export), engines
    against build.json and built from the graphs here (`verify_engines`). One ArtifactError names the first
    that fails: a report must not present edited or foreign artifacts as this export's."""
    from seq2trt.exporters.fuse import FUSION_JSON, Target, fused_dir, verify_fused
    from seq2trt.exporters.quantize import quantized_dir, verify_quantized
    from seq2trt.exporters.tensorrt.engines import verify_engines

    out = Path(out)
    manifest = verify(out)
    for target in Target:
        if (fused_dir(out, target) / FUSION_JSON).exists():
            verify_fused(out, target, manifest)
    if quantized_dir(out).is_dir():
        verify_quantized(out, manifest)
    for record in sorted(out.glob("engines/*/build.json")):
        verify_engines(record.parent)
    return manifest


def render_markdown(out: Path) -> str:
    manifest = verify_everything(out)
    lines = [f"# seq2trt report: {Path(out).resolve().name}", ""]
    sections = (("Model and export", lambda: _overview(manifest.data)), ("Fusion", lambda: _fusion(out)),
                ("int8 quantization", lambda: _quantization(out)), ("Engines", lambda: _builds(out, manifest.config)),
                ("Parity", lambda: _parity(out)), ("Latency", lambda: _latency(out)))
    for title, section in sections:
        try:
            lines += section()
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:  # a stage's JSON is damaged
            lines += [f"## {title}", "", f"A file of this stage is malformed ({type(exc).__name__}: {exc}); "
                      "re-run the stage with --force.", ""]
    return "\n".join(lines)


def render_html(markdown: str, reports: Path) -> str:
    """The same report as one HTML page with the plots inlined as data URIs."""
    from markdown_it import MarkdownIt

    body = MarkdownIt("commonmark").enable("table").render(markdown)

    def inline(match: re.Match) -> str:
        path = reports / match.group(1)
        if not path.exists():
            return match.group(0)
        return f'src="data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}"'

    body = re.sub(r'src="([^"/]+\.png)"', inline, body)
    style = ("body{font-family:system-ui,sans-serif;max-width:72rem;margin:2rem auto;padding:0 1rem}"
             "table{border-collapse:collapse;margin:.5rem 0 1rem}"
             "td,th{border:1px solid #ccc;padding:.2rem .5rem;text-align:right}"
             "td:first-child,th:first-child{text-align:left}img{max-width:100%}pre{background:#f5f5f5;padding:.5rem}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>seq2trt report</title>"
            f"<style>{style}</style></head><body>{body}</body></html>\n")


def write_report(out: Path) -> tuple[Path, Path]:
    """Write OUT/reports/report.md and report.html; returns their paths."""
    out = Path(out)
    started = generation(out)
    reports = layout.reports_dir(out)
    markdown = render_markdown(out)
    md, html = reports / "report.md", reports / "report.html"
    page = render_html(markdown, reports)
    with writing_into(out, started, "report"):
        atomic_write_text(md, markdown)
        atomic_write_text(html, page)
    return md, html
