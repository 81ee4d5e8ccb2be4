"""The parity report: `reports/parity.json` / `.md` from the document `validate.run_validation` builds."""

from __future__ import annotations

import json
from pathlib import Path

from seq2trt.core import layout
from seq2trt.core.atomic_files import atomic_write_text


def _bound(tol: dict) -> str:
    """A tolerance as the table shows it: its basis when it was made for each case, else atol / rtol."""
    return tol.get("basis") or f"atol {tol['atol']:g} / rtol {tol['rtol']:g}"


def markdown(doc: dict) -> str:
    lines = [f"# Parity of the {doc['graphs_set']} graphs on {doc['backend']}, {doc['dtype']}: "
             f"{'PASSED' if doc['passed'] else 'FAILED'}", "",
             f"Reference {doc['reference']}; {doc['cases']} graph cases.", "", "## Graph level (worst case per output)", "",
             "| graph | output | max abs | max rel | mean abs | p99 abs | rms | min cosine | NaN/Inf | bound | failed |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for graph, outputs in doc["graphs"].items():
        for name, s in outputs.items():
            tol = s["tolerance"]
            lines.append(f"| {graph} | {name} | {s['max_abs']:.3g} | {s['max_rel']:.3g} | {s['mean_abs']:.3g} | "
                         f"{s['p99_abs']:.3g} | {s.get('rms', 0.0):.3g} | {s['min_cosine']:.7f} | {s['nan']}/{s['inf']} | "
                         f"{_bound(tol)} | {len(s['failed_cases'])}/{s['cases']} |")
    e2e = doc["end_to_end"]
    if e2e:
        lines += ["", f"## End to end ({e2e['samples']} {e2e['inputs']} sources)", "",
                  "| search | token agreement | sequence match | first divergent step |", "|---|---|---|---|"]
        for name in ("greedy", "beam"):
            a = e2e[name]
            lines.append(f"| {name}{'' if name == 'greedy' else ' ' + str(e2e['beam_size'])} | "
                         f"{a['token_agreement']:.6f} | {a['sequence_match']:.6f} | {a['first_divergent_step']} |")
        lines += _near_ties(e2e)
        metric = e2e.get("task_metric")
        if metric:
            lines += ["", f"{metric['name']} (greedy): {metric['candidate']:.4f} on these graphs, "
                          f"{metric['reference']:.4f} for the eager reference (reported, not judged)"]
        t = e2e["targets"]
        lines += ["", f"max_logit_abs_err along the eager greedy path: {e2e['max_logit_abs_err']:.3g} "
                      + (f"(target <= {t['max_logit_abs_err']:g})" if t['max_logit_abs_err'] is not None
                         else "(reported; judged per case at graph level)") + "; along the eager beam search: "
                      f"{e2e['beam_max_logit_abs_err']:.3g} (reported); targets: token agreement >= "
                      f"{t['token_agreement']}, sequence match >= {t['sequence_match']}"]
    lines += _sampling(doc.get("sampling"))
    lines += _localisation(doc)
    sampled = doc.get("sampling")
    failures = doc["graph_failures"] + ([] if not e2e or e2e["passed"] else ["end to end below target"]) + (
        [] if not sampled or sampled["passed"] else ["sampling disagrees with the eager model"])
    if failures:
        lines += ["", "## Failures", ""] + [f"- {f}" for f in failures]
    return "\n".join(lines) + "\n"


def _sampling(s: dict | None) -> list[str]:
    """Sampling agreement (parity.json files from before it have none): exact under one seed on float32 graphs, a
    chi-square test of first tokens otherwise."""
    if not s:
        return []
    warpers = f"temperature {s['temperature']:g}, top-k {s['top_k']}, top-p {s['top_p']:g}, seed {s['seed']}"
    lines = ["", f"## Sampling ({warpers}): {'passed' if s['passed'] else 'FAILED'}", ""]
    if s.get("exact"):
        e = s["exact"]
        lines.append(f"Exact under the same seed: {e['identical']} of {e['sequences']} sampled sequences identical "
                     f"to the eager model's, {e['near_ties']} near-tie(s); max_logit_abs_err along the eager sampled "
                     f"path {e['max_logit_abs_err']:.3g}")
    if s.get("distribution"):
        d = s["distribution"]
        lines.append(f"Chi-square of first tokens: {d['draws']} draws of each of {d['sources']} sources, statistic "
                     f"{d['statistic']:.1f} on {d['dof']} degrees of freedom, p-value {d['p_value']:.3g} (fails below "
                     f"{d['alpha']:g}) against the {d.get('null', 'eager')} model's probabilities; "
                     f"{d['impossible']} draws of tokens of probability 0"
                     + (f"; total variation distance from the eager probabilities {d['total_variation']:.3g} "
                        "(reported)" if d.get("total_variation") is not None else ""))
    return lines


def _near_ties(e2e: dict) -> list[str]:
    """Each search's near-ties (parity.json files from before near-ties, or before beam's, have none): how many,
    the first five with their eager margins, and the agreement judged without them."""
    lines = []
    for name, why in (("greedy", "the eager top-1 / top-2 margin is within twice the measured logit error"),
                      ("beam", "the eager scores the searches compared are within what the measured logit error "
                               "can move (validation.ties.beam_near_ties)")):
        a = e2e[name]
        if not a.get("near_ties"):
            continue
        shown = ", ".join(f"sample {t['sample']} step {t['step']}" + (f" {t['kind']}" if "kind" in t else "") +
                          f" margin {t['eager_margin']:.3g}" +
                          (f" (tolerance {t['tolerance']:.3g})" if "tolerance" in t else "")
                          for t in a["near_tie_examples"][:5])
        lines += ["", f"{name.capitalize()} near-ties: {a['near_ties']} divergence(s) where {why} ({shown}); "
                      f"judged without them: token agreement {a['judged_token_agreement']:.6f}, sequence match "
                      f"{a['judged_sequence_match']:.6f}"]
    return lines


def localisation_plot(doc: dict) -> str:
    """The file name of a run's error-by-layer plot, beside its reports."""
    return f"localisation-{doc['backend']}-{doc['graphs_set']}.png"


def _localisation(doc: dict, rows: int = 12) -> list[str]:
    """Per localised case (the first `rows`; parity.json has all): the first sub-block over tolerance, its op
    types, and the error after every sub-block."""
    items = doc.get("localisation") or []
    if not items:
        return []
    lines = ["", "## Where it diverged (per layer, vs eager float64)", "",
             "| graph | case | why | first sub-block over tolerance | its max abs (atol) | top-1 flips / near-ties | "
             "op types in that block | max abs after each sub-block |", "|---|---|---|---|---|---|---|---|"]
    for item in items[:rows]:
        first = item["first_divergent"]
        block = next((b for b in item["blocks"] if b["block"] == first), None)
        err = f"{block['max_abs']:.3g} ({item['tolerance']['atol']:g})" if block else "–"
        ops = ", ".join(f"{op} {n}" for op, n in item["op_types"].items()) or "–"
        growth = " → ".join(f"{b['max_abs']:.2g}" for b in item["blocks"])
        lines.append(f"| {item['graph']} | {item['case']} | {item['reason']} | {first or 'none (within tolerance)'} "
                     f"| {err} | {item['token_flips']} / {item.get('near_ties', 0)} | {ops} | {growth} |")
    if len(items) > rows:
        lines += ["", f"{len(items) - rows} more localised cases in parity.json."]
    if doc.get("localisation_unchecked"):
        lines += ["", f"{doc['localisation_unchecked']} cases were left unchecked by the time budget "
                      "(--localize-budget)."]
    return lines + ["", f"![error after each sub-block]({localisation_plot(doc)})"]


def write_reports(out: Path, doc: dict) -> None:
    """`parity.json`/`.md` hold the latest run; `parity-<backend>-<graphs>.*` keep each graph set's own."""
    reports = layout.reports_dir(out)
    if doc.get("localisation"):
        from seq2trt.validation.reports.plots import error_by_layer

        error_by_layer(doc["localisation"], reports / localisation_plot(doc))
    for stem in ("parity", f"parity-{doc['backend']}-{doc['graphs_set']}"):
        atomic_write_text(reports / f"{stem}.json", json.dumps(doc, indent=2) + "\n")
        atomic_write_text(reports / f"{stem}.md", markdown(doc))
