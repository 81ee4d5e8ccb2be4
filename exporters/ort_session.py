"""The one way seq2trt opens an ONNX Runtime session: providers (CPU, or CUDA on a device id), threads, graph
optimization, custom-op libraries, and a rewrite of the graph before it loads.

ONNX Runtime opens a graph file from its path, so it finds the graph's ONNX external data beside it
(`exporters.graph_files`). A graph that is rewritten first (plugin nodes for the CPU, bf16 emulated in fp32) or built
in memory (a debug copy, an fp32 twin) is opened from the bytes of its structure alone — a graph past 2 GiB has no
bytes with its weights in — with the folder of its data files named to ONNX Runtime.

It lives with the exporters because the lowest layer that runs a graph is here (`whisper_features.run_features`);
the runtime's runners, the whole-search model, the transcriber's front end and the Triton Python models use it too.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Union

from seq2trt.core.errors import DependencyError

logger = logging.getLogger(__name__)

GPU_INSTALL = "pip install 'seq2trt[gpu]'"  # docs/gpu.md: onnxruntime-gpu in place of onnxruntime

# ONNX Runtime graph optimization: level and the optimizers left out. Basic suits the fused fp32 graphs (the extended
# level's SkipLayerNormalization is slower on CPU at decode sizes); extended without it suits the int8 graphs (it
# fuses DynamicQuantizeMatMul). None: ONNX Runtime's default (all). The measurements are in benchmarks/README.md,
# "ONNX Runtime settings".
OPTIMIZATION: dict[str, tuple[str, list[str]]] = {
    "basic": ("ORT_ENABLE_BASIC", []),
    "extended": ("ORT_ENABLE_EXTENDED", ["SkipLayerNormFusion"]),
}

Source = Union[str, Path, bytes, "onnx.ModelProto"]  # noqa: F821  (onnx is imported where it is needed)


def _ort():
    try:
        import onnxruntime as ort
    except ImportError:
        raise DependencyError("onnxruntime is not installed; pip install onnxruntime (or, for NVIDIA GPUs, "
                              f"{GPU_INSTALL})") from None
    return ort


def has_cuda() -> bool:
    """Whether the installed ONNX Runtime has its CUDA provider (onnxruntime-gpu)."""
    return "CUDAExecutionProvider" in _ort().get_available_providers()


def providers(device: str = "cpu", device_id: int = 0) -> list:
    """`cpu`, `cuda` (a DependencyError when ONNX Runtime has no CUDA provider) or `auto` (CUDA when present) ->
    ONNX Runtime's provider list; CUDA runs on `device_id` with the CPU provider behind it for what CUDA lacks."""
    if device == "cpu":
        return ["CPUExecutionProvider"]
    if has_cuda():
        return [("CUDAExecutionProvider", {"device_id": device_id}), "CPUExecutionProvider"]
    if device == "cuda":
        raise DependencyError(f"ONNX Runtime has no CUDA provider here (available: "
                              f"{', '.join(_ort().get_available_providers())}); {GPU_INSTALL} on a machine with an "
                              "NVIDIA GPU (docs/gpu.md)")
    return ["CPUExecutionProvider"]


_GLOBAL_POOL: list[int] = []  # intra-op size of this process's shared ONNX Runtime pool, once created


def configure_threads(options, threads: int) -> str:
    """Intra-op threading of one session; returns how it runs ("1 thread", "shared spinning pool of N threads").

    One thread: a session of its own, nothing to spin. More (0: ONNX Runtime's default, one per core): one pool
    shared by every session of the process, spinning between calls, so the encoder's and decoder's threads do not
    compete (benchmarks/README.md, "ONNX Runtime settings"). ONNX Runtime creates that pool once per process and
    then refuses sessions with threads of their own: every later session joins it, with a warning when it asked
    for another count.
    """
    if _GLOBAL_POOL:
        if threads != _GLOBAL_POOL[0]:
            logger.warning("ONNX Runtime allows one thread pool per process once a shared one exists: this session "
                           "runs on the shared pool of %s threads, not %s", _GLOBAL_POOL[0] or "default", threads)
        options.use_per_session_threads = False
        return f"shared spinning pool of {_GLOBAL_POOL[0] or 'default'} threads"
    if threads == 1:
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        return "1 thread"
    from onnxruntime.capi import _pybind_state

    _pybind_state.set_global_thread_pool_sizes(threads, 1)
    _GLOBAL_POOL.append(threads)
    options.use_per_session_threads = False
    return f"shared spinning pool of {threads or 'default'} threads"


def session_options(optimization: str | None = "basic", threads: int | None = None, shared_pool: bool = False,
                    custom_op_libraries: tuple[str, ...] = ()):
    """(SessionOptions, optimizers to disable, how it threads). `threads` None leaves ONNX Runtime's default;
    `shared_pool`: `configure_threads` (the step graphs), else `threads` intra-op threads of the session's own and
    one inter-op thread."""
    ort = _ort()
    options = ort.SessionOptions()
    disabled: list[str] = []
    if optimization is not None:
        if optimization not in OPTIMIZATION:
            raise ValueError(f"optimization must be one of {', '.join(OPTIMIZATION)}, got {optimization!r}")
        level, disabled = OPTIMIZATION[optimization]
        options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    options.log_severity_level = 3
    threading = "ONNX Runtime's default threads"
    if shared_pool and threads is not None:
        threading = configure_threads(options, threads)
    elif threads is not None:
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        threading = f"{threads} intra-op thread(s)"
    for library in custom_op_libraries:
        options.register_custom_ops_library(library)
    return options, list(disabled), threading


def _model(source: Source, rewrite: Callable[[bytes], bytes] | None,
           data_dir: Path | None) -> tuple[str | bytes, Path | None]:
    """What ONNX Runtime opens, and the folder of its external data when that is not the file's own: `source`
    itself when it is a path and nothing rewrites it; else the (rewritten) graph's bytes, its weights left in their
    data files (`exporters.graph_files`) — a graph past 2 GiB has no bytes of its own, and its structure is small."""
    if isinstance(source, (str, Path)) and rewrite is None:
        return str(source), None
    import onnx

    if isinstance(source, (str, Path)):
        data = onnx.load(str(source), load_external_data=False).SerializeToString()
        data_dir = data_dir or Path(source).parent
    else:
        data = source if isinstance(source, bytes) else source.SerializeToString()
    return (rewrite(data) if rewrite is not None else data), data_dir


def open_session(source: Source, *, device: str = "cpu", device_id: int = 0, threads: int | None = 1,
                 shared_pool: bool = False, optimization: str | None = "basic",
                 custom_op_libraries: tuple[str, ...] = (), rewrite: Callable[[bytes], bytes] | None = None,
                 data_dir: Path | None = None):
    """(InferenceSession, how it threads) of a graph file (or an in-memory model), on `device` (`cpu`, `cuda`,
    `auto`) and `device_id`. `rewrite` turns the serialized graph into the one to run (the plugin graphs' CPU
    nodes, bf16 emulation). `data_dir`: where the external data of a graph given as bytes lie. ONNX Runtime's own
    errors pass through: callers say which artifact failed."""
    ort = _ort()
    chosen = providers(device, device_id)
    options, disabled, threading = session_options(optimization, threads, shared_pool, custom_op_libraries)
    model, data_dir = _model(source, rewrite, data_dir)
    if data_dir is not None:  # bytes whose external data lie in a graph's folder
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(data_dir))
    session = ort.InferenceSession(model, options, providers=chosen, disabled_optimizers=disabled)
    return session, threading
