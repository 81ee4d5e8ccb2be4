"""PNG plots of a bench (latency.json) and a validation (parity.json), with matplotlib's non-interactive backend.

Each function takes the JSON document, writes one PNG atomically and returns its path, or None when the
document holds nothing to draw.
"""

from __future__ import annotations

import io
from pathlib import Path

from seq2trt.core.errors import DependencyError
from seq2trt.core.atomic_files import atomic_write_bytes


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DependencyError("plots need matplotlib; pip install 'seq2trt[dev]' (or pip install matplotlib)") from None
    return plt


def _save(fig, path: Path) -> Path:
    """Write the figure as a PNG and release it (pyplot keeps every open figure alive until closed)."""
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    finally:
        _pyplot().close(fig)
    atomic_write_bytes(path, buffer.getvalue())
    return path


def step_latency_by_past(doc: dict, path: Path) -> Path | None:
    """Decoder step p50 vs past length, one panel per thread count and batch size, one line per backend."""
    table = doc.get("step_ms_by_past") or {}
    panels = [(t, b) for t, backends in table.items() for b in sorted({b for v in backends.values() for b in v}, key=int)]
    if not panels:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (t, batch) in zip(axes[0], panels):
        for backend, by_batch in table[t].items():
            points = sorted((int(p), s["p50"]) for p, s in by_batch.get(batch, {}).items() if s)
            if points:
                ax.plot(*zip(*points), marker="o", markersize=3, label=backend)
        ax.set(title=f"batch {batch}, {t} thread(s)", xlabel="past length", ylabel="step latency p50 (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def tokens_per_second(doc: dict, path: Path) -> Path | None:
    """End-to-end greedy tokens/s vs batch size, one panel per thread count, one line per backend."""
    results = doc.get("results") or {}
    if not results:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(4.6 * len(results), 3.6), squeeze=False)
    for ax, (t, backends) in zip(axes[0], results.items()):
        for backend, by_batch in backends.items():
            points = sorted((int(b), r["tokens_per_s"]) for b, r in by_batch.items())
            ax.plot(*zip(*points), marker="o", label=backend)
        ax.set(title=f"greedy decoding, {t} thread(s)", xlabel="batch size", ylabel="tokens/s", xscale="log",
               yscale="log")
        batches = sorted({int(b) for by_batch in backends.values() for b in by_batch})
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    return _save(fig, path)


def error_by_step(series: dict[str, list[float]], path: Path) -> Path | None:
    """Largest |logit error| against the eager model vs decoding step, one line per labelled series."""
    series = {label: values for label, values in series.items() if values}
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.4, 3.4))
    for label, values in series.items():
        ax.plot(range(len(values)), [max(e, 1e-9) for e in values], marker="o", markersize=2, label=label)
    ax.set(title="logit error vs eager", xlabel="decoding step", ylabel="max |logit error|", yscale="log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, path)


def error_series(latency: dict, parity: dict) -> dict[str, list[float]]:
    """Per-step logit errors: parity.json's `logit_abs_err_by_step` (under end_to_end) when it has one, and the bench's
    CTranslate2 agreement checks."""
    series = {}
    by_step = ((parity or {}).get("end_to_end") or {}).get("logit_abs_err_by_step")
    if by_step:
        series[f"{parity.get('backend', 'validated')} {parity.get('dtype', '')} (parity.json)".strip()] = by_step
    for name, check in (latency.get("checks") or {}).items():
        if check.get("logit_abs_err_by_step"):
            series[f"{name} (bench check)"] = check["logit_abs_err_by_step"]
    return series


def error_by_layer(localisation: list[dict], path: Path, limit: int = 6) -> Path | None:
    """Largest |error| against the eager model after each sub-block, one panel per graph, one line per localised
    case (the first `limit`), the tolerance's atol dashed: where the error is born and how it grows."""
    by_graph: dict[str, list[dict]] = {}
    for item in localisation:
        if item.get("blocks"):
            by_graph.setdefault(item["graph"], []).append(item)
    if not by_graph:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(by_graph), figsize=(5.2 * len(by_graph), 3.6), squeeze=False)
    for ax, (graph, items) in zip(axes[0], by_graph.items()):
        names = [b["block"] for b in items[0]["blocks"]]
        for item in items[:limit]:
            ax.plot(range(len(names)), [max(b["max_abs"], 1e-12) for b in item["blocks"]], marker="o", markersize=3,
                    label=f"{item['case']} ({item['reason']})")
        if items[0].get("tolerance"):
            ax.axhline(items[0]["tolerance"]["atol"], color="grey", linestyle="--", linewidth=1, label="atol")
        ax.set_xticks(range(len(names)), [n.replace("_layers.", " ").replace("_block", "") for n in names],
                      rotation=45, ha="right", fontsize=7)
        ax.set(title=f"{graph}: error after each sub-block", ylabel="max |error| vs eager fp64", yscale="log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, path)
