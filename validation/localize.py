"""Where did it diverge: per-layer localisation of parity failures and near-ties (Polygraphy's "mark all", by name).

A debug copy of a graph marks every layer's sub-block outputs as extra graph outputs `debug.<module path>`; the
eager model's same tensors come from forward hooks on a float64 copy. A case is replayed on both with the parity
sweep's feed, and the first sub-block over the graph set's tolerance is the divergent block (docs/design.md,
"Localisation", says how tensors are found and how reduced precision is localised).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import onnx

from seq2trt.exporters import spec
from seq2trt.exporters.graph_files import external_ranges, load_structure
from seq2trt.core.errors import ArtifactError

from seq2trt.validation.parity import GraphParity, OutputStats, case_feeds, compare_output, tolerance_for
from seq2trt.runtime.runners import EagerRunner, OrtRunner

logger = logging.getLogger(__name__)

_SCOPES = "pkg.torch.onnx.name_scopes"


def _scopes(node: onnx.NodeProto) -> list[str]:
    value = next((p.value for p in node.metadata_props if p.key == _SCOPES), "")
    return [s.strip(" '") for s in value.strip("[]").split(",") if s.strip(" '")]


def _module(node: onnx.NodeProto) -> str:
    """The innermost module a node was traced in (`model.` prefix kept), or '' without metadata."""
    return next((s for s in reversed(_scopes(node)) if s.startswith("model.")), "")


def block_tensors(plain: onnx.ModelProto, cfg, kind: spec.GraphKind) -> dict[str, str]:
    """Module path of each sub-block -> the name of its output tensor in the plain export (module docstring)."""
    nodes = list(plain.graph.node)
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in nodes:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    graph_outputs = {o.name for o in plain.graph.output}
    tensors = {}
    for path in spec.sub_block_paths(cfg, kind):
        key = f"model.{path}"
        residual = [n for n in nodes if _module(n).startswith(key)]
        leaving = {t for n in residual for t in n.output if t in graph_outputs or any(
            _scopes(c) and key not in _scopes(c) for c in consumers.get(t, []))}
        if len(leaving) != 1:
            raise ArtifactError(f"cannot tell the output of {path} in the plain {kind.value} graph (tensors leaving "
                                f"its residual: {sorted(leaving)}); was it exported by this seq2trt version?")
        tensors[path] = leaving.pop()
    return tensors


def _ancestors(name: str, producers: Mapping[str, int], nodes: list[onnx.NodeProto]) -> set[int]:
    seen, todo = set(), [name]
    while todo:
        index = producers.get(todo.pop())
        if index is not None and index not in seen:
            seen.add(index)
            todo.extend(nodes[index].input)
    return seen


def block_nodes(graph: onnx.ModelProto, tensors: Mapping[str, str]) -> dict[str, list[onnx.NodeProto]]:
    """Module path -> the nodes of `graph` in that sub-block (module docstring)."""
    nodes = list(graph.graph.node)
    producers = {t: i for i, n in enumerate(nodes) for t in n.output}
    blocks, previous = {}, set()
    for path, tensor in tensors.items():
        ancestors = _ancestors(tensor, producers, nodes)
        key = f"model.{path}"
        blocks[path] = [n for i, n in enumerate(nodes) if key in _scopes(n) or (
            not _scopes(n) and i in ancestors and i not in previous)]
        previous = ancestors
    return blocks


def debug_copy(graph: onnx.ModelProto, tensors: Mapping[str, str], elem_type: int) -> onnx.ModelProto:
    """A copy of `graph` whose extra outputs `debug.<path>` are the sub-blocks' outputs (Identity of each)."""
    made = {t for n in graph.graph.node for t in n.output}
    missing = {p: t for p, t in tensors.items() if t not in made}
    if missing:
        raise ArtifactError(f"the graph has no tensor for sub-blocks {missing} (names from the plain export): it "
                            "was not derived from this export; re-run fuse / quantize")
    marked = copy.deepcopy(graph)
    for path, tensor in tensors.items():
        name = spec.debug_output_name(path)
        marked.graph.node.append(onnx.helper.make_node("Identity", [tensor], [name], name=f"{name}.identity"))
        marked.graph.output.append(onnx.helper.make_tensor_value_info(name, elem_type, None))
    return marked


class EagerLayers:
    """The eager model in float64 with forward hooks, on a copy, capturing every sub-block's output."""

    def __init__(self, model, kind: spec.GraphKind, limits: spec.Limits):
        import torch

        self.model = copy.deepcopy(model).eval()
        if next(self.model.parameters()).dtype != torch.float64:  # .double() would rebuild rounded position tables
            self.model = self.model.double()
        self.captured: dict[str, np.ndarray] = {}
        for path in spec.sub_block_paths(self.model.cfg, kind):
            self.model.get_submodule(path).register_forward_hook(self._hook(path))
        self.runner = EagerRunner(self.model, kind, limits, name="eager-fp64-layers")

    def _hook(self, path: str):
        def store(module, args, output):
            self.captured[path] = output.detach().cpu().numpy()
        return store

    def infer(self, feed: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        self.captured = {}
        with self.runner:
            outputs = self.runner.infer(feed)
        return outputs, dict(self.captured)


@dataclass
class Localisation:
    """One case: every sub-block's error against the eager model, the first over tolerance and its op types."""

    graph: str
    case: str
    reason: str  # "failure", "near-tie" or "requested"
    blocks: list[OutputStats]
    token_flips: int  # positions where the graph's top-1 token differs from the eager model's (decoder)
    near_ties: int  # positions whose eager top-2 logit margin a graph within the logits tolerance may close
    op_types: dict[str, int] = field(default_factory=dict)  # of the first divergent block

    @property
    def first_divergent(self) -> str | None:
        return next((b.name for b in self.blocks if not b), None)

    def to_dict(self) -> dict:
        return {"graph": self.graph, "case": self.case, "reason": self.reason,
                "first_divergent": self.first_divergent, "token_flips": self.token_flips,
                "near_ties": self.near_ties, "op_types": self.op_types,
                "tolerance": asdict(self.blocks[0].tolerance) if self.blocks else None,
                "blocks": [{"block": b.name, "max_abs": b.max_abs, "mean_abs": b.mean_abs, "cosine": b.cosine,
                            "violations": b.violations, "passed": b.passed} for b in self.blocks]}


class GraphLocaliser:
    """One graph of a graph set, marked, beside the hooked eager model; `run(feed)` compares every sub-block."""

    def __init__(self, candidate: onnx.ModelProto, plain: onnx.ModelProto, model, kind: spec.GraphKind, dtype: str,
                 limits: spec.Limits, precision: str, runner_options: Mapping | None = None,
                 fp32_options: Mapping | None = None, data_dir: Path | None = None):
        """`precision` "fp16"/"bf16": the graph runs as its fp32 twin beside the eager model holding the same rounded
        values (`fp32_options`: an fp32 graph's runner options); "int8": beside the reference that quantizes as it
        does and follows its decisions. Every comparison is then at the fp32 tolerances (validation/precision.py).
        `data_dir`: the folder of `candidate`'s external data, when it was loaded as structure (exporters/graph_files.py:
        the debug copy then stays structure too, its session reading the weights from there)."""
        from seq2trt.validation.precision import UNIT_ROUNDOFF, peer_model, rounded_model, twin_options

        cfg = model.cfg
        self.kind, self.precision = kind, precision
        self.tensors = block_tensors(plain, cfg, kind)
        self.nodes = block_nodes(candidate, self.tensors)
        marked = debug_copy(candidate, self.tensors, spec.DTYPES[dtype][1]).SerializeToString()
        options, run_dtype, reference = dict(runner_options or {}), dtype, model
        if precision in ("fp16", "bf16"):
            options = twin_options(fp32_options or {})
            run_dtype, reference = "fp32", rounded_model(model, precision)
        elif precision == "int8":
            from seq2trt.validation.int8_reference import expose_decisions, quantized_reference

            marked = expose_decisions(marked)
            weighed = candidate
            if data_dir is not None and external_ranges(candidate):  # the reference reads the int8 weights
                weighed = copy.deepcopy(candidate)
                onnx.load_external_data_for_model(weighed, str(data_dir))
            reference = quantized_reference(model, weighed)[0]
        self.run_dtype = run_dtype
        self.runner = OrtRunner(marked, cfg, kind, run_dtype, limits, name="onnxruntime-debug", data_dir=data_dir,
                                **options)
        self.eager = EagerLayers(reference, kind, limits)
        # near-ties of a reduced-precision graph: against what its rounding can move the logits (precision.py)
        self.peer = EagerRunner(peer_model(model, precision), kind, limits, name=f"eager-{precision}") \
            if precision in UNIT_ROUNDOFF and kind is spec.GraphKind.DECODER else None

    def __enter__(self) -> "GraphLocaliser":
        self.runner.__enter__()
        if self.peer is not None:
            self.peer.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.peer is not None:
            self.peer.__exit__(*exc)
        self.runner.__exit__(*exc)

    def run(self, feed: Mapping[str, np.ndarray], case: str, reason: str | None = None) -> tuple[Localisation, bool]:
        """The case's localisation and whether its ordinary outputs pass; `reason` None: "failure" when an output
        fails, "near-tie" when only tokens flip, else "requested"."""
        from seq2trt.validation.int8_reference import decisions_of
        from seq2trt.validation.precision import UNIT_ROUNDOFF, as_fp32, noise_tolerance, twin_tolerance

        got = self.runner.infer(as_fp32(feed) if self.run_dtype == "fp32" else feed)
        decisions = decisions_of(self.eager.model)
        if decisions is not None:
            decisions.outputs = got
        want, captured = self.eager.infer(feed)
        tol = lambda name: (twin_tolerance(self.precision) if self.precision in UNIT_ROUNDOFF
                            else tolerance_for("fp32", name))
        passed = all(compare_output(n, got[n], want[n], tol(n)) for n in want)
        if decisions is not None:  # int8: a quantized input off the graph's integers is a failure too
            passed = passed and all(decisions.checks)
            decisions.outputs, decisions.checks = None, []
        blocks = [compare_output(path, got[spec.debug_output_name(path)], captured[path],
                                 tol(spec.debug_output_name(path))) for path in self.tensors]
        flips = ties = 0
        if "logits" in want:
            flips = int((np.argmax(got["logits"].astype(np.float64), -1) != np.argmax(want["logits"], -1)).sum())
            ties_tolerance = tol("logits") if self.peer is None else noise_tolerance(
                want["logits"], self.peer.infer(feed)["logits"], self.precision)
            ties = near_ties(want["logits"], ties_tolerance)
        reason = reason or ("failure" if not passed else "near-tie" if flips or ties else "requested")
        result = Localisation(self.kind.value, case, reason, blocks, flips, ties)
        if result.first_divergent:
            result.op_types = _count_ops(self.nodes[result.first_divergent])
        return result, passed


def near_ties(logits: np.ndarray, tolerance) -> int:
    """Positions where the top-2 eager logits are closer than the tolerance lets each move: a graph within
    tolerance may pick either token there, so a flip is a near-tie, not a fault."""
    top = np.sort(np.asarray(logits, dtype=np.float64), axis=-1)[..., -2:]  # (..., 2): second, first
    slack = 2 * tolerance.atol + tolerance.rtol * np.abs(top).sum(-1)
    return int((top[..., 1] - top[..., 0] < slack).sum())


def _count_ops(nodes: list[onnx.NodeProto]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in nodes:
        op = n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}.{n.op_type}"
        counts[op] = counts.get(op, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def replay_feeds(model, limits: spec.Limits, cases: list[spec.ShapeCase], dtype: str, seed: int
                 ) -> list[tuple[spec.GraphKind, str, dict]]:
    """The feeds `parity.graph_parity` made for `cases` with `seed`, in its order: (graph, case label, feed)."""
    reference = model.double()
    runners = [EagerRunner(reference, kind, limits, name="eager-fp64") for kind in spec.GraphKind]
    rng, seen, feeds = np.random.default_rng(seed), set(), []
    with runners[0], runners[1]:
        for case in cases:
            encoder_feed, decoder_feed = case_feeds(runners[0], runners[1], case, dtype, rng)
            if (case.batch, case.src_len, case.padded) not in seen:
                seen.add((case.batch, case.src_len, case.padded))
                label = f"B{case.batch}-S{case.src_len}{'-pad' if case.padded else ''}"
                feeds.append((spec.GraphKind.ENCODER, label, encoder_feed))
            feeds.append((spec.GraphKind.DECODER, case.label, decoder_feed))
    return feeds


def localise(localisers: Mapping[spec.GraphKind, GraphLocaliser], feeds: list[tuple[spec.GraphKind, str, dict]],
             parity: GraphParity | None = None, budget_s: float = 120.0, requested: bool = False,
             clock: Callable[[], float] = time.perf_counter) -> tuple[list[Localisation], int]:
    """Failing cases first (from `parity`, else every case is checked), then every other case for near-ties, within
    `budget_s` seconds; `requested`: with nothing to report, each graph's clean case with the largest error at
    its last sub-block.
    Returns the localisations and how many cases the budget left unchecked."""
    failing = {(c.graph, c.case) for c in (parity.cases if parity else []) if not c}
    order = sorted(feeds, key=lambda f: (f[0].value, f[1]) not in failing)
    start, found, worst, checked = clock(), [], {}, 0
    with contextlib.ExitStack() as stack:
        for localiser in localisers.values():
            stack.enter_context(localiser)
        for kind, label, feed in order:
            if clock() - start > budget_s:
                break
            result, passed = localisers[kind].run(feed, label)
            checked += 1
            if not passed or result.token_flips or result.near_ties:
                found.append(result)
            elif requested and (kind not in worst or result.blocks[-1].max_abs > worst[kind].blocks[-1].max_abs):
                worst[kind] = result
    if requested and not found:
        found = list(worst.values())
    found.sort(key=lambda r: (r.reason != "failure", r.token_flips == 0))  # stable: sweep order within each
    return found, len(order) - checked


def localise_export(graph_dir: Path, plain_dir: Path, model, dtype: str, limits: spec.Limits, precision: str,
                    runner_options: Mapping, parity: GraphParity | None, seed: int, budget_s: float,
                    requested: bool, fp32_options: Mapping | None = None) -> dict:
    """`validate`'s localisation of one graph set (graphs in `graph_dir`, tensor names from the plain export in
    `plain_dir`) over the parity sweep replayed with `seed`: parity.json's `localisation` list and what the time
    budget left unchecked."""
    start = time.perf_counter()
    try:
        fix = "re-export (and re-fuse) it"  # the graphs were checked by validate before: this is a late change
        localisers = {kind: GraphLocaliser(load_structure(graph_dir / kind.filename, fix),
                                           load_structure(plain_dir / kind.filename, fix), model, kind, dtype, limits,
                                           precision, runner_options, fp32_options, data_dir=graph_dir)
                      for kind in spec.GraphKind}
    except ArtifactError as exc:
        if requested:
            raise
        # The automatic pass is a diagnosis: a graph it cannot mark must not fail a validation that passed.
        logger.warning("per-layer localisation skipped: %s", exc)
        return {"localisation": [], "localisation_error": str(exc)}
    # the cases validate swept (spec.sweep by the model: an audio model has one source length)
    feeds = replay_feeds(model, limits, spec.sweep(limits, cfg=model.cfg), dtype, seed)
    found, unchecked = localise(localisers, feeds, parity, max(0.0, budget_s - (time.perf_counter() - start)),
                                requested)
    if unchecked:
        logger.warning("localisation stopped at its %.0f s budget with %d of %d cases unchecked", budget_s, unchecked,
                       len(feeds))
    return {"localisation": [r.to_dict() for r in found], "localisation_unchecked": unchecked,
            "localisation_cases": len(feeds) - unchecked}
