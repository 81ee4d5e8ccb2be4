"""A graph on disk: one `.onnx` file and, for a big graph, its weights in ONNX external data beside it.

An ONNX file is one protobuf, capped at 2 GiB (`PROTOBUF_LIMIT`). A graph whose tensors pass `threshold()` (1 GiB,
or `SEQ2TRT_EXTERNAL_DATA_THRESHOLD` bytes) is written as `<graph>.onnx` (the structure) + `<graph>.onnx.data` (every
tensor over 1 KiB, packed in one file: `data_name`), the layout torch.onnx, Optimum and TensorRT's parser read; a
smaller graph stays one file, as before. Half the cap leaves room for the graph's structure and for the copies the
int8 quantizer makes. Every writer saves through `save_graph` and every reader loads through `load_structure`, which
checks the data file is there and long enough before anything reads a weight (`check_data`); `file_record` and
`record_problems` put the data file under the same sha256 records as its graph, so a swapped data file (another
model's) is caught where a swapped graph is.

Weights are never copied to build a graph that can hold them: writers stream tensors into the data file (onnx_ir's
writer), and a graph loaded as structure keeps its tensors as references into the source's data file, read one at a
time when a pass needs a value (`tensor_array`).
"""

from __future__ import annotations

import logging
import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnx

from seq2trt.core.atomic_files import (atomic_write_bytes, current_umask, raise_write_error, sha256_file, write_error)
from seq2trt.core.errors import ArtifactError, ConfigError, first_line

logger = logging.getLogger(__name__)

PROTOBUF_LIMIT = 2**31  # bytes: protobuf's cap on one serialized message, hence on one .onnx file
THRESHOLD_ENV = "SEQ2TRT_EXTERNAL_DATA_THRESHOLD"
DEFAULT_THRESHOLD = 2**30
DATA_SUFFIX = ".data"
INLINE_TENSOR_BYTES = 1024  # tensors this small (shapes, scalars) stay in the graph, where passes read them freely


def threshold() -> int:
    """Tensor bytes above which a graph's weights go to external data (`SEQ2TRT_EXTERNAL_DATA_THRESHOLD`)."""
    raw = os.environ.get(THRESHOLD_ENV)
    if raw is None:
        return DEFAULT_THRESHOLD
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value < PROTOBUF_LIMIT:
        raise ConfigError(f"{THRESHOLD_ENV}={raw!r} must be a byte count from 0 to {PROTOBUF_LIMIT - 1} "
                          "(0: every graph's weights as external data); unset it for the default (1 GiB)")
    return value


def data_name(graph: Path | str) -> str:
    """The one name of a graph's data file: `encoder.onnx` -> `encoder.onnx.data`."""
    return Path(graph).name + DATA_SUFFIX


def data_path(graph: Path) -> Path:
    return Path(graph).with_name(data_name(graph))


def graph_files(graph: Path) -> list[Path]:
    """The graph file and its data file when it has one: what a copy, a hash record or a link must carry."""
    data = data_path(graph)
    return [Path(graph), data] if data.exists() else [Path(graph)]


def _external(tensor: onnx.TensorProto) -> dict[str, str] | None:
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return None
    return {e.key: e.value for e in tensor.external_data}


def _all_tensors(model: onnx.ModelProto):
    from onnx.external_data_helper import _get_all_tensors

    return _get_all_tensors(model)  # initializers and attribute tensors, subgraphs (BeamSearch's) included


def external_ranges(model: onnx.ModelProto) -> dict[str, int]:
    """Each data file a graph's tensors name -> the bytes it must hold (the furthest offset + length)."""
    ends: dict[str, int] = {}
    for tensor in _all_tensors(model):
        info = _external(tensor)
        if info is not None:
            end = int(info.get("offset", 0)) + int(info.get("length", 0))
            ends[info["location"]] = max(ends.get(info["location"], 0), end)
    return ends


def check_data(graph: Path, model: onnx.ModelProto, fix: str) -> None:
    """Raise ArtifactError (one line, naming the file and `fix`, the command that rewrites it) when a data file
    `model` (loaded from `graph`) reads is not `data_name(graph)`, is missing, or is shorter than its tensors."""
    for location, need in external_ranges(model).items():
        path = Path(graph).parent / location
        if location != data_name(graph):
            raise ArtifactError(f"{graph} reads its weights from {location!r}, not {data_name(graph)!r} (a graph "
                                f"copied or renamed without its data file?); {fix}")
        if not path.is_file():
            raise ArtifactError(f"{path} (the weights of {Path(graph).name}) is missing; {fix}")
        if (size := path.stat().st_size) < need:
            raise ArtifactError(f"{path} (the weights of {Path(graph).name}) is truncated: {size:,} bytes, its "
                                f"tensors need {need:,}; {fix}")


def load_structure(graph: Path, fix: str) -> onnx.ModelProto:
    """The graph without its external data (tensors stay references into `data_name(graph)`, checked present
    and long enough): what every reader loads, whatever the graph's size."""
    try:
        model = onnx.load(str(graph), load_external_data=False)
    except OSError:
        raise
    except Exception as exc:  # protobuf's DecodeError and the like: the file is not a valid model
        raise ArtifactError(f"{graph} is not a valid ONNX model ({first_line(exc)}); {fix}") from exc
    check_data(graph, model, fix)
    return model


def tensor_array(tensor: onnx.TensorProto, base_dir: Path | str | None) -> np.ndarray:
    """One tensor's value, read from its graph's data file (in `base_dir`) when it is external."""
    from onnx import numpy_helper

    return numpy_helper.to_array(tensor, str(base_dir or ""))


def widen_external(graph: onnx.GraphProto, types: set[int]) -> set[str]:
    """For a graph's fp32 twin: each external initializer of an element type in `types` stays as stored (renamed
    `<name>.stored`) and a Cast to float32 at the graph's start makes `<name>` (exact widening, done by the session
    rather than by a second, wider copy of the weights here). Returns the names so handled."""
    from onnx import helper

    names, casts = set(), []
    for init in graph.initializer:
        if init.data_type in types and init.data_location == onnx.TensorProto.EXTERNAL:
            names.add(init.name)
            casts.append(helper.make_node("Cast", [f"{init.name}.stored"], [init.name], to=onnx.TensorProto.FLOAT,
                                          name=f"{init.name}.widen"))
            init.name = f"{init.name}.stored"
    nodes = casts + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    return names


def tensor_bytes(model: onnx.ModelProto, largest: bool = False) -> int:
    """Bytes of every tensor of the graph, stored inline or external (subgraphs included); `largest`: of its
    largest tensor."""
    sizes = [int(info.get("length", 0)) if (info := _external(tensor)) is not None
             else len(tensor.raw_data) or _field_bytes(tensor) for tensor in _all_tensors(model)]
    return (max(sizes, default=0) if largest else sum(sizes))


def _field_bytes(tensor: onnx.TensorProto) -> int:
    """A tensor held in typed fields (float_data, int64_data, ...) rather than raw_data: its element count times
    its element size."""
    from onnx import helper

    elements = int(np.prod(tensor.dims)) if tensor.dims else 1
    return elements * np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize


def save_graph(model: onnx.ModelProto, path: Path, base_dir: Path | None = None) -> list[Path]:
    """Write `model` to `path`, its tensors to `data_path(path)` when they pass `threshold()`; returns the files
    written. `base_dir`: the folder of the graph `model` was loaded from as structure (its external tensors are
    read from there, one at a time). The path must not be the graph `model` references (write to a new folder)."""
    path = Path(path)
    external = external_ranges(model)
    size = tensor_bytes(model)
    if not external and size <= threshold():
        atomic_write_bytes(path, model.SerializeToString())  # the common, small case: one file, as before
        return [path]
    if external and base_dir is None:
        raise ValueError("save_graph: the model references external data; pass base_dir, the folder it was read from")
    if base_dir is not None and Path(base_dir).resolve() == path.parent.resolve():
        raise ValueError(f"save_graph: {path} would overwrite the data file its own tensors are read from")
    import onnx_ir as ir

    ir_model = ir.serde.deserialize_model(model)  # tensors wrap the proto's bytes: no copy
    if base_dir is not None:
        ir.external_data.set_base_dir(ir_model.graph, str(base_dir))
    if size <= threshold():
        ir.external_data.load_to_model(ir_model)
        return _atomic_save(path, lambda staged: ir.save(ir_model, str(staged)))
    logger.info("writing %s with %.2f GiB of weights in %s", path.name, size / 2**30, data_name(path))
    return _atomic_save(path, lambda staged: ir.save(ir_model, str(staged), external_data=data_name(path),
                                                     size_threshold_bytes=INLINE_TENSOR_BYTES))


def _atomic_save(path: Path, write) -> list[Path]:
    """atomic_write_bytes for a graph that a writer streams to disk (with its data file): `write(staged)` writes it
    into a hidden folder beside `path` under the same name(s), then each file is synced and renamed into place (the
    data file first, so the graph never names weights that are not there). A failed or interrupted write removes
    what was staged and leaves the previous graph as it was; a full disk, a quota or a read-only folder is one
    WriteError naming `path`. Returns the files written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    except OSError as exc:
        raise (write_error(exc, path) or exc) from exc
    try:
        staged = stage / path.name
        write(staged)
        files = graph_files(staged)
        for file in files:
            with open(file, "rb") as f:
                os.fsync(f.fileno())
            os.chmod(file, 0o666 & ~current_umask())
        for file in files[::-1]:  # the data file first
            os.replace(file, path.parent / file.name)
        return [path.parent / file.name for file in files]
    except BaseException as exc:
        raise_write_error(exc, path)
        raise
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(stage)


def check_model_file(path: Path, full_check: bool = False) -> None:
    """onnx's checker on the file, so that a graph with external data (or past 2 GiB) is checked at all; raises
    onnx's ValidationError."""
    onnx.checker.check_model(str(path), full_check=full_check)


def file_records(graph: Path, **extra) -> dict[str, dict]:
    """A written graph's entries in its stage's record (manifest.json's, fusion.json's ... "files"): its sha256
    (with `extra`), and its data file's sha256 and size as an entry of its own when it has one."""
    records = {Path(graph).name: {"sha256": sha256_file(graph), **extra}}
    data = data_path(graph)
    if data.exists():
        records[data.name] = {"sha256": sha256_file(data), "bytes": data.stat().st_size}
    return records


def graph_sha256(files: dict, name: str) -> str:
    """What identifies graph `name` of a record's "files": its sha256, and its data file's after it when it has one
    (a graph of structure only is the same file for two models of one shape; its weights are in the data file)."""
    data = files.get(data_name(name))
    return files[name]["sha256"] + (f"+{data['sha256']}" if isinstance(data, dict) else "")


def record_problems(folder: Path, files: dict, name: str, record: str, stage: str) -> list[str]:
    """What no longer matches graph `name`'s entries in `files` (`file_records`', kept in `record`): the graph or its
    data file missing, modified or truncated since `stage`; a data file beside it the record does not list."""
    graph, data = Path(folder) / name, data_path(Path(folder) / name)
    if not graph.is_file():
        return [f"{name} is missing"]
    if sha256_file(graph) != files[name].get("sha256"):
        return [f"{name} does not match its sha256 in {record} (modified since {stage})"]
    want = files.get(data.name)
    if want is None:
        return [f"{data.name} beside {name} is not in {record} (another graph's data file?)"] if data.exists() else []
    if not isinstance(want, dict) or not data.is_file():
        return [f"{data.name} (the weights of {name}) is missing"]
    if data.stat().st_size != want.get("bytes"):
        return [f"{data.name} (the weights of {name}) has {data.stat().st_size:,} bytes, {want.get('bytes')} when "
                f"{stage} wrote it (truncated or replaced)"]
    if sha256_file(data) != want.get("sha256"):
        return [f"{data.name} (the weights of {name}) does not match its sha256 in {record} (another model's, or "
                f"modified since {stage})"]
    return []


def copy_graph(graph: Path, dest: Path, link: bool = False) -> list[Path]:
    """Copy (or hard-link, where the filesystem allows) a graph and its data file to `dest`, the data file renamed
    by the rule for `dest`'s name; the graph's reference is rewritten when the name changes. Returns the files."""
    graph, dest = Path(graph), Path(dest)
    data = data_path(graph)
    if not data.exists():
        _copy(graph, dest, link)
        return [dest]
    if dest.name == graph.name:
        _copy(graph, dest, link)
    else:  # the reference names the file: rewrite it for the new name (the structure only, small)
        model = onnx.load(str(graph), load_external_data=False)
        for tensor in _all_tensors(model):
            for entry in tensor.external_data:
                if entry.key == "location" and entry.value == data.name:
                    entry.value = data_name(dest)
        onnx.save(model, str(dest))
    _copy(data, data_path(dest), link)
    return [dest, data_path(dest)]


def _copy(src: Path, dst: Path, link: bool) -> None:
    if link:
        try:
            os.link(src, dst)
            return
        except OSError:  # another filesystem, or links not allowed: copy
            pass
    shutil.copyfile(src, dst)
