"""The build stage: an artifact directory's graphs -> `engines/<backend>-<target>-<dtype>/` (docs/design.md, "The
artifact directory").

`build_engines(out, backend, targets, ...)` verifies the sha256 of every graph it reads (manifest.json for the
exported graphs, `fused/trt/fusion.json` via `fuse.verify_fused` for the fused ones), builds the encoder and the decoder
with `build.build` (both in one child process) under profiles from `spec.profiles`, and writes
`encoder.plan`, `decoder.plan` and `build.json` into a staged directory renamed into place at the end (nothing
half-written; `force` to replace).
Two builds of the same engine directory take turns (a lock file beside it), so the second one sees the first's
result: refused without `force`, replaced whole with it.
`--no-plugin` engines (unfused graphs, TensorRT's own fusion) go to the same name with `-noplugin` appended, so
both can sit side by side for comparison.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Callable

from seq2trt.exporters.tensorrt import trt_compat
from seq2trt.core import layout
from seq2trt.core.layout import BUILD_JSON
from seq2trt.plugins.op import PLUGIN_NAME, PLUGIN_NAMESPACE, PLUGIN_VERSION
from seq2trt.core.errors import ArtifactError, InputError
from seq2trt.core.atomic_files import atomic_write_bytes, atomic_write_text, refuse_existing, sha256_file
from seq2trt.core.swap import locked, staged_directory

from seq2trt.exporters.graph_files import graph_sha256
from seq2trt.exporters import fuse, spec
from seq2trt.exporters.artifact_checks import load_graph
from seq2trt.exporters import manifest as manifest_mod
from seq2trt.exporters.tensorrt.build import BuildSettings, build, deferred_interrupt
from seq2trt.exporters.tensorrt.child import BuildChild

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class EngineRequest:
    backend: str  # "tensorrt" | "tensorrt-rtx"
    targets: tuple  # parse_targets output
    dtype: str | None = None  # None: the export's dtype
    limits: spec.Limits | None = None  # None: the export's limits
    plugin: bool = True
    optimization_level: int = 3
    workspace_limit: int | None = None  # bytes; `build.BuildSettings.workspace_limit`
    force: bool = False
    timing_cache: Path | None = None  # enterprise TensorRT only


def engine_dir_name(backend: str, targets, dtype: str, plugin: bool = True) -> str:
    return layout.engine_dir_name(backend, trt_compat.target_tag(targets), dtype, plugin)


def source_graphs(out: Path, plugin: bool) -> dict[spec.GraphKind, tuple[Path, str]]:
    """Graph kind -> (ONNX path, its verified sha256): the export's graphs (manifest.json) for --no-plugin, else
    the fused TensorRT graphs (fusion.json, fused from this very export)."""
    out = Path(out)
    manifest = manifest_mod.verify(out, [graph.filename for graph in spec.GraphKind])
    if not plugin:
        return {graph: (out / graph.filename, graph_sha256(manifest.data["files"], graph.filename))
                for graph in spec.GraphKind}
    if not (fuse.fused_dir(out, fuse.Target.TRT) / fuse.FUSION_JSON).exists():
        raise ArtifactError(f"{out} has no fused TensorRT graphs: run `seq2trt fuse {out} --target trt` first, or "
                            "build the unfused graphs with --no-plugin")
    report = fuse.verify_fused(out, fuse.Target.TRT)
    folder = fuse.fused_dir(out, fuse.Target.TRT)
    return {graph: (folder / graph.filename, graph_sha256(report["files"], graph.filename)) for graph in spec.GraphKind}


def _check_limits(limits: spec.Limits, exported: spec.Limits, out: Path) -> None:
    """Engine profiles within the export's limits: the runners, validate and bench are sized by the export's."""
    beyond = [f"--{name.replace('_', '-')} {getattr(limits, name)} (the export's {name} is {getattr(exported, name)})"
              for name in ("max_batch", "max_src_len", "max_tgt_len") if getattr(limits, name) > getattr(exported, name)]
    if beyond:
        raise InputError(f"engine profiles beyond the export's limits: {'; '.join(beyond)}; lower them, or re-export "
                         f"{out} with larger limits (`seq2trt export ... --max-batch N --force`)")


def _seq2trt_version() -> str | None:
    try:
        return version("seq2trt")
    except PackageNotFoundError:
        return None


def _checked_request(out: Path, request: EngineRequest, manifest) -> tuple[str, spec.Limits, trt_compat.Flavour]:
    """(dtype, limits, flavour) of `request` on the export `out`, once they fit it and this machine: the export's
    dtype, limits within its own, the plugin's kernels for its head size, the flavour installed, a GPU for
    --target current."""
    dtype = request.dtype or manifest.dtype
    if dtype != manifest.dtype:
        raise InputError(f"{out} was exported as {manifest.dtype}; TensorRT networks are strongly typed, so a "
                         f"{dtype} engine needs a {dtype} export (`seq2trt export ... --dtype {dtype}`)")
    cfg = manifest.config
    limits = request.limits or manifest.limits
    _check_limits(limits, manifest.limits, out)
    limits.check_fits(cfg)
    if request.plugin:
        from seq2trt.plugins.kernels.launch_plan import kernel_head_dim_problem

        if problem := kernel_head_dim_problem(cfg.head_dim, out):
            raise InputError(problem)
    flavour = trt_compat.flavour_of(request.backend)
    trt_compat.load(flavour)  # a missing TensorRT says which extra to install before any work
    if trt_compat.CURRENT in request.targets and not trt_compat.has_gpu():  # TensorRT aborts the process on it
        raise InputError(f"--target current builds for the GPU of this machine, and none is visible; name the "
                         f"targets instead (e.g. --target sm_86: {flavour.value} builds them without a GPU"
                         + ("" if trt_compat.FLAVOURS[flavour].explicit_targets else
                            "; this flavour cannot: use --backend tensorrt-rtx") + ")")
    return dtype, limits, flavour


def _graph_record(out: Path, graph: spec.GraphKind, path: Path, digest: str, result, profiles: dict) -> dict:
    """build.json's entry of one graph: the graph it was built from, its plan, the build's time and profiles, and
    what TensorRT made of the network."""
    return {"source": str(path.relative_to(out)), "source_sha256": digest,
            "plan": f"{graph.value}.plan", "plan_bytes": len(result.plan),
            "plan_sha256": hashlib.sha256(result.plan).hexdigest(),
            "build_seconds": round(result.seconds, 3),
            "profiles": {n: [list(s) for s in p] for n, p in profiles.items()},
            **result.network.to_json()}


def build_engines(out: Path, request: EngineRequest, progress: Callable[[str, str, int], None] | None = None,
                  child: BuildChild | None = None) -> Path:
    """Build and write the engines of `out`; return the engine directory. `progress(graph, phase, graphs_done)`.
    TensorRT runs in `child`, or in a child process started for this call."""
    out = Path(out)
    manifest = manifest_mod.read_manifest(out)
    dtype, limits, flavour = _checked_request(out, request, manifest)
    cfg = manifest.config
    engine_dir = layout.engines_root(out) / engine_dir_name(flavour.value, request.targets, dtype, request.plugin)
    refuse_existing(engine_dir, request.force, "engine", kind=BUILD_JSON)  # before any work
    graphs = source_graphs(out, request.plugin)
    for graph, (path, _digest) in graphs.items():  # a damaged graph can crash TensorRT's parser, not just fail it
        load_graph(path, cfg, graph, manifest.dtype)
    profiles = spec.profiles(cfg, limits)
    if request.timing_cache is not None and not trt_compat.FLAVOURS[flavour].timing_cache:
        logger.warning("%s has no timing cache; --timing-cache is ignored", flavour.value)
    settings = BuildSettings(flavour, request.workspace_limit, request.optimization_level, request.timing_cache,
                             plugin=request.plugin)
    record = {"graphs": {}}
    lock = engine_dir.parent / f".{engine_dir.name}.lock"
    # Ctrl-C is held from the first TensorRT call to the last (TensorRT calls back into Python throughout) and
    # raised at the end; the staged directory is then removed and the old engines stay.
    # TensorRT runs in one child process for both graphs (`child`: starting one takes seconds).
    own_child = BuildChild() if child is None else contextlib.nullcontext(child)
    with locked(lock, str(engine_dir)), own_child as child, \
            staged_directory(engine_dir, request.force, "engine", kind=BUILD_JSON) as tmp, deferred_interrupt():
        for done, (graph, (path, digest)) in enumerate(graphs.items()):
            report = (lambda phase, _d, _t, g=graph, n=done: progress(g.value, phase, n)) if progress else None
            result = build(path, profiles[graph], request.targets, dtype, settings, report, child=child)
            atomic_write_bytes(tmp / f"{graph.value}.plan", result.plan)
            record["graphs"][graph.value] = _graph_record(out, graph, path, digest, result, profiles[graph])
            record["tensorrt_version"] = result.tensorrt_version
        if progress:
            progress("", "done", len(graphs))
        record.update({
            "flavour": flavour.value, "targets": list(request.targets),
            "compute_capabilities": trt_compat.resolve_targets(request.targets),
            "dtype": dtype, "limits": vars(limits),
            "plugin": {"name": PLUGIN_NAME, "version": PLUGIN_VERSION, "namespace": PLUGIN_NAMESPACE,
                       "used": request.plugin,
                       "layers": {k: g["plugin_layers"] for k, g in record["graphs"].items()}},
            "builder_optimization_level": request.optimization_level, "workspace_bytes": request.workspace_limit,
            "seq2trt_version": _seq2trt_version(), "spec_revision": spec.SPEC_REVISION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        })
        atomic_write_text(tmp / BUILD_JSON, json.dumps(record, indent=2) + "\n")
    logger.info("engines in %s", engine_dir)
    return engine_dir


def verify_engines(engine_dir: Path) -> dict:
    """build.json of `engine_dir` (under `<export>/engines/`) with every plan checked against it, and every plan
    built from the graphs the export holds now: each graph's `source_sha256` must be the sha256 of the verified
    graph it names (the fused TensorRT graphs, or the export's for --no-plugin engines). Engines edited, copied
    from another export or built before a re-export or re-fuse are an ArtifactError naming the fix."""
    engine_dir = Path(engine_dir)
    out = engine_dir.parent.parent
    info = read_build(engine_dir)
    plugin = info.get("plugin", {}).get("used", True) if isinstance(info.get("plugin"), dict) else True
    sources = source_graphs(out, bool(plugin))
    exported = manifest_mod.read_manifest(out)
    try:  # the runners size their checks by these: they must be what a build of this export can have written
        limits = spec.Limits(**info["limits"])
        _check_limits(limits, exported.limits, out)
        if info["dtype"] != exported.dtype:
            raise InputError(f"dtype {info['dtype']!r}, the export's is {exported.dtype!r}")
    except (KeyError, TypeError, ValueError) as exc:  # InputError and ConfigError are ValueErrors
        why = f"it lacks {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ArtifactError(f"{engine_dir / BUILD_JSON} does not fit the export it sits in ({why}); rebuild with "
                            f"`seq2trt build {out} --force`") from None
    stale = [kind.value for kind, (_path, digest) in sources.items()
             if not isinstance(info["graphs"].get(kind.value), dict)
             or info["graphs"][kind.value].get("source_sha256") != digest]
    if stale:
        raise ArtifactError(f"{engine_dir}: the {' and '.join(stale)} engine(s) were not built from the graphs of "
                            f"{out} as they are now (copied from another export, or built before a re-export or "
                            f"re-fuse); rebuild with `seq2trt build {out} --force`")
    return info


def read_build(engine_dir: Path, verify: bool = True) -> dict:
    """build.json of an engine directory; with `verify`, every plan's sha256 is checked."""
    path = Path(engine_dir) / BUILD_JSON
    if not path.exists():
        raise ArtifactError(f"{path} not found; build engines with `seq2trt build` first")
    rebuild = "rebuild with `seq2trt build --force`"
    try:
        info = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path} is not valid JSON ({exc}); {rebuild}") from None
    graphs = info.get("graphs") if isinstance(info, dict) else None
    if not isinstance(graphs, dict) or not all(
            isinstance(g, dict) and isinstance(g.get("plan"), str) and isinstance(g.get("plan_sha256"), str)
            for g in graphs.values()):
        raise ArtifactError(f"{path} is malformed: it needs a 'graphs' object whose entries name a 'plan' and its "
                            f"'plan_sha256'; {rebuild}")
    if verify:
        bad = [g["plan"] for g in graphs.values()
               if not (Path(engine_dir) / g["plan"]).is_file() or
               sha256_file(Path(engine_dir) / g["plan"]) != g["plan_sha256"]]
        if bad:
            raise ArtifactError(f"{engine_dir}: {bad} missing or modified since the build; {rebuild}")
    return info
