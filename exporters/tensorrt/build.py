"""Build one TensorRT engine from one ONNX graph: `build(onnx_path, profiles, targets, dtype) -> BuildResult`.

Load -> validate -> transform -> save, CTranslate2-converter style: register the attention plugin, parse the graph
into a strongly typed network (precision comes from the graph's own types, as TensorRT 11 requires), set one
optimization profile from `profiles` ({input name: (min, opt, max) shape}, from `exporters.spec`), the compute
capability targets, workspace limit and builder optimization level, then serialize. The plan bytes come back with a
description of the network (layer types, how many plugin layers) for build.json and the tests.

Flavour differences (targets, timing cache, the RTX parser's library) are `trt_compat`'s business.
`build` runs all of this in a child process (`child`): TensorRT-RTX can abort natively on a damaged graph.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Sequence

from seq2trt.exporters.tensorrt import trt_compat
from seq2trt.plugins.op import DOMAIN, PLUGIN_NAME
from seq2trt.core.errors import ArtifactError, InputError, Terminated, first_line

if TYPE_CHECKING:
    from seq2trt.exporters.tensorrt.child import BuildChild

logger = logging.getLogger(__name__)

Shape = tuple[int, ...]
Profiles = Mapping[str, tuple[Shape, Shape, Shape]]
Progress = Callable[[str, int, int], None]  # (phase name, steps done, steps in phase)

FLOAT_DTYPES = {"fp32": "FLOAT", "fp16": "HALF", "bf16": "BF16"}


@dataclass(frozen=True)
class BuildSettings:
    flavour: trt_compat.Flavour = trt_compat.Flavour.TENSORRT_RTX
    # TensorRT's cap on its workspace memory pool, in bytes (what every layer's workspace, the plugin's included, must
    # fit in); None: TensorRT's default (the device's memory).
    workspace_limit: int | None = None
    optimization_level: int = 3  # TensorRT's default; 0-5, higher searches longer for faster tactics
    timing_cache: Path | None = None  # enterprise TensorRT only; ignored by TensorRT-RTX
    plugin: bool = True  # register the attention plugin before parsing
    allow_tf32: bool = False  # fp32 graphs stay fp32 (TensorRT would otherwise run their matmuls in TF32)


@dataclass
class NetworkInfo:
    inputs: dict[str, dict]  # name -> {"dtype", "shape"} (-1 for a dynamic axis)
    outputs: dict[str, dict]
    layer_types: dict[str, int]  # TensorRT LayerType name -> count
    plugin_layers: int  # IPluginV3 layers of our attention plugin
    attention_layers: int  # TensorRT's own IAttention (standard ONNX `Attention` op)

    def to_json(self) -> dict:
        return {"inputs": self.inputs, "outputs": self.outputs, "layer_types": self.layer_types,
                "plugin_layers": self.plugin_layers, "attention_layers": self.attention_layers}


@dataclass
class BuildResult:
    plan: bytes
    network: NetworkInfo
    seconds: float
    tensorrt_version: str
    targets: tuple = field(default_factory=tuple)


# TensorRT messages that are expected here and only noise for a user.
_QUIET = ("has Int64 binding",  # our graphs take int64 ids and masks on purpose (the graph contract)
          "CUDA driver version is insufficient",  # TensorRT-RTX probing for a GPU on a CPU-only build machine
          "will not be queryable")  # node names repeat across inlined ONNX functions; we query no inner tensor


def _logger(trt):
    """TensorRT's messages into this module's logger (the CLI owns the terminal), expected noise at DEBUG."""
    levels = {trt.ILogger.Severity.INTERNAL_ERROR: logging.ERROR, trt.ILogger.Severity.ERROR: logging.ERROR,
              trt.ILogger.Severity.WARNING: logging.WARNING, trt.ILogger.Severity.INFO: logging.DEBUG,
              trt.ILogger.Severity.VERBOSE: logging.DEBUG}

    class Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)

        def log(self, severity, msg):
            level = logging.DEBUG if any(q in msg for q in _QUIET) else levels.get(severity, logging.INFO)
            logger.log(level, "TensorRT: %s", msg)

    return Logger()


def _progress_monitor(trt, progress: Progress | None):
    """Reports TensorRT's build phases to `progress`. It never cancels a build: a TensorRT-RTX build cancelled
    mid-way aborted the whole process once in CI (`malloc_consolidate(): invalid chunk size`)."""
    report = progress or (lambda phase, done, total: None)

    class Monitor(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self.totals: dict[str, int] = {}

        def phase_start(self, phase_name, parent_phase, num_steps):
            self.totals[phase_name] = num_steps
            report(phase_name, 0, num_steps)

        def step_complete(self, phase_name, step):
            report(phase_name, step + 1, self.totals.get(phase_name, 0))
            return True  # go on (False would cancel the build)

        def phase_finish(self, phase_name):
            report(phase_name, self.totals.get(phase_name, 0), self.totals.get(phase_name, 0))

    return Monitor()


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[threading.Event]:
    """Ctrl-C while TensorRT builds. Python callbacks run inside TensorRT (logger, progress monitor, plugin) and
    TensorRT swallows their exceptions, so a KeyboardInterrupt raised there would be lost and the build go on.
    Here SIGINT only sets the event; TensorRT finishes the graph it is building (seconds for the demo model)
    and the KeyboardInterrupt is raised once it has returned, before anything is renamed into place."""
    interrupted = threading.Event()
    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
        yield interrupted
        return
    received = []  # SIGTERM is held the same way and ends as `Terminated`
    previous = {sig: signal.signal(sig, lambda signum, frame: (received.append(signum), interrupted.set()))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield interrupted
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if interrupted.is_set():
            raise Terminated() if signal.SIGTERM in received else KeyboardInterrupt


def graph_has_plugin(model) -> bool:
    return any(n.op_type == PLUGIN_NAME and n.domain == DOMAIN for n in model.graph.node)


def plugin_workspace_bytes(model, profiles: Profiles) -> int:
    """The largest workspace any plugin node asks for at the profiles' largest batch (0 without plugin nodes)."""
    from seq2trt.plugins.kernels.launch_plan import workspace_bytes
    from seq2trt.plugins.op import attrs_from_node

    max_batch = max((hi[0] for _lo, _opt, hi in profiles.values() if len(hi)), default=1)
    return max((workspace_bytes(attrs_from_node(node), max_batch) for node in model.graph.node
                if node.op_type == PLUGIN_NAME and node.domain == DOMAIN), default=0)


def parse(trt, builder, onnx_path: Path, settings: BuildSettings):
    """A strongly typed network from the ONNX file; the parser's errors become one InputError."""
    import onnx

    from seq2trt.exporters.graph_files import check_data

    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError: not an ONNX file
        first = first_line(exc)
        raise ArtifactError(f"{onnx_path} is not a valid ONNX model ({first}); re-export (and re-fuse) it") from exc
    # the parser reads the weights from the graph's folder (parse_from_file); a missing or short data file would
    # fail inside it, or crash it
    check_data(Path(onnx_path), model, "re-export (and re-fuse) it")
    if graph_has_plugin(model):
        if not settings.plugin:
            raise InputError(f"{onnx_path} holds {PLUGIN_NAME} plugin nodes but the plugin is disabled; build the "
                             "unfused graph for --no-plugin")
        from seq2trt.plugins import tensorrt_plugin

        trt_compat.ensure_plugin_loading(trt, settings.flavour)
        tensorrt_plugin.register(trt)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, builder.logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i).desc()) for i in range(parser.num_errors))
        raise InputError(f"TensorRT's ONNX parser rejected {onnx_path}: {errors}")
    return network, parser, model


def mark_attention_decomposable(trt, network) -> int:
    """Let TensorRT decompose its IAttention layers where it has no fused kernel (fp32 has none); returns how many.

    Each IAttention ends in one ATTENTION_OUTPUT layer, which reaches it through `.attention`.
    """
    count = 0
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type == trt.LayerType.ATTENTION_OUTPUT:
            layer.__class__ = trt.IAttentionOutputLayer  # the bindings' documented downcast
            layer.attention.decomposable = True
            count += 1
    return count


def describe(trt, network) -> NetworkInfo:
    def tensors(get, count):
        return {get(i).name: {"dtype": get(i).dtype.name, "shape": list(get(i).shape)} for i in range(count)}

    types = Counter(network.get_layer(i).type.name for i in range(network.num_layers))
    plugins = 0
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type == trt.LayerType.PLUGIN_V3:
            layer.__class__ = trt.IPluginV3Layer
            core = layer.plugin.get_capability_interface(trt.PluginCapabilityType.CORE)
            plugins += str(getattr(core, "plugin_name", "")) == PLUGIN_NAME
    return NetworkInfo(tensors(network.get_input, network.num_inputs), tensors(network.get_output, network.num_outputs),
                       dict(sorted(types.items())), int(plugins), types.get("ATTENTION_OUTPUT", 0))


def graph_dtype(trt, network) -> str:
    """The float type of the network's first float input (our graphs carry one float dtype throughout)."""
    names = {getattr(trt.DataType, v): k for k, v in FLOAT_DTYPES.items()}
    for tensors in ((network.get_input(i) for i in range(network.num_inputs)),
                    (network.get_output(i) for i in range(network.num_outputs))):
        for t in tensors:
            if t.dtype in names:
                return names[t.dtype]
    return "fp32"


def set_profile(builder, network, config, profiles: Profiles, onnx_path: Path) -> None:
    profile = builder.create_optimization_profile()
    inputs = {network.get_input(i).name: network.get_input(i) for i in range(network.num_inputs)}
    unknown = sorted(set(profiles) - set(inputs))
    if unknown:
        raise InputError(f"profiles name {unknown}, which {onnx_path.name} does not have; its inputs: {sorted(inputs)}")
    missing = [n for n, t in inputs.items() if -1 in tuple(t.shape) and n not in profiles]
    if missing:
        raise InputError(f"{onnx_path.name} has dynamic inputs {missing} without an optimization profile")
    for name, (lo, opt, hi) in profiles.items():
        rank = len(inputs[name].shape)
        if not (len(lo) == len(opt) == len(hi) == rank) or any(not a <= b <= c for a, b, c in zip(lo, opt, hi)):
            raise InputError(f"profile of {name} must be three rank-{rank} shapes with min <= opt <= max, got "
                             f"{lo}, {opt}, {hi}")
        profile.set_shape(name, tuple(lo), tuple(opt), tuple(hi))
    config.add_optimization_profile(profile)


def build(onnx_path: Path, profiles: Profiles, targets: Sequence[int | str] | str, dtype: str | None = None,
          settings: BuildSettings | None = None, progress: Progress | None = None,
          child: "BuildChild | None" = None) -> BuildResult:
    """Build a serialized engine of `onnx_path` for `targets` ((86, 89), "sm_86,sm_89" or "current").

    `dtype`, when given, must be the graph's own float type (strongly typed networks take precision from the
    graph; re-export for another dtype). TensorRT runs in a child process (`child`, or one started for this
    call): a graph that crashes it is a BuildError, and Ctrl-C or SIGTERM stop the build at once.
    """
    from seq2trt.exporters.tensorrt.child import BuildChild

    settings = settings or BuildSettings()
    onnx_path = _checked_path(onnx_path)
    trt_compat.load(settings.flavour)  # a missing TensorRT says which extra to install before a child starts
    if isinstance(targets, str):
        targets = trt_compat.parse_targets(settings.flavour, targets)
    job = {"function": f"{__name__}:run_build", "onnx_path": onnx_path, "profiles": profiles, "targets": targets,
           "dtype": dtype, "settings": settings}
    with contextlib.ExitStack() as stack:
        child = child or stack.enter_context(BuildChild())
        with deferred_interrupt() as interrupted:  # set: the child is killed, and the interrupt raised on leaving
            return child.run(onnx_path, job, progress, interrupted)


def build_in_process(onnx_path: Path, profiles: Profiles, targets: Sequence[int | str] | str,
                     dtype: str | None = None, settings: BuildSettings | None = None,
                     progress: Progress | None = None) -> BuildResult:
    """`build` in this process: a graph that crashes TensorRT ends the caller (for tests that look inside)."""
    settings = settings or BuildSettings()
    onnx_path = _checked_path(onnx_path)
    with deferred_interrupt():  # TensorRT calls back into Python from parse to serialize
        return run_build(onnx_path, profiles, targets, dtype, settings, progress)


def _checked_path(onnx_path: Path) -> Path:
    onnx_path = Path(onnx_path)
    if not onnx_path.is_file():
        raise ArtifactError(f"ONNX graph {onnx_path} does not exist; run `seq2trt export` (and `seq2trt fuse`) first")
    return onnx_path


def run_build(onnx_path: Path, profiles: Profiles, targets, dtype: str | None, settings: BuildSettings,
              progress: Progress | None) -> BuildResult:
    """The build itself, in this process (what the child runs for `build`)."""
    trt = trt_compat.load(settings.flavour)
    if isinstance(targets, str):
        targets = trt_compat.parse_targets(settings.flavour, targets)
    builder = builder_for(trt)
    network, _parser, model = parse(trt, builder, onnx_path, settings)
    found = graph_dtype(trt, network)
    if dtype is not None and dtype != found:
        raise InputError(f"{onnx_path.name} is a {found} graph, not {dtype}: TensorRT networks are strongly typed, "
                         f"so precision comes from the export; re-export with --dtype {dtype}")
    need = plugin_workspace_bytes(model, profiles) if settings.workspace_limit is not None else 0
    if need and need > settings.workspace_limit:  # TensorRT-RTX can abort instead of failing cleanly
        raise InputError(f"the attention plugin needs {need / 2**20:.1f} MiB of workspace at batch "
                         f"{max(hi[0] for _l, _o, hi in profiles.values())}; raise the workspace limit to at least "
                         f"{-(-need // 2**20)} MiB or lower the maximum batch")
    mark_attention_decomposable(trt, network)
    config = builder.create_builder_config()
    trt_compat.set_targets(trt, settings.flavour, config, targets)
    set_profile(builder, network, config, profiles, onnx_path)
    config.builder_optimization_level = settings.optimization_level
    if found == "fp32" and not settings.allow_tf32:
        config.clear_flag(trt.BuilderFlag.TF32)
    if settings.workspace_limit is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, settings.workspace_limit)
    trt_compat.attach_timing_cache(settings.flavour, config, settings.timing_cache)
    info = describe(trt, network)
    start = time.perf_counter()
    config.progress_monitor = _progress_monitor(trt, progress)
    plan = builder.build_serialized_network(network, config)
    seconds = time.perf_counter() - start
    if plan is None:
        raise ArtifactError(f"TensorRT could not build {onnx_path} for {trt_compat.target_tag(targets)} (see the "
                            "TensorRT errors logged above)")
    trt_compat.save_timing_cache(settings.flavour, config, settings.timing_cache)
    logger.info("built %s in %.2f s: %d bytes, %d plugin layer(s)", onnx_path.name, seconds, plan.nbytes,
                info.plugin_layers)
    return BuildResult(bytes(plan), info, seconds, trt.__version__, tuple(targets))


_builders: dict = {}


def builder_for(trt):
    """One Builder per TensorRT module and process: creating one loads the builder resources (seconds)."""
    if trt.__name__ not in _builders:
        trt_logger = _logger(trt)
        builder = trt.Builder(trt_logger)
        _builders[trt.__name__] = (builder, trt_logger)  # the logger must outlive the builder
    return _builders[trt.__name__][0]
