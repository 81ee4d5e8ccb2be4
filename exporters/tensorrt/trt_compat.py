"""Every difference between enterprise TensorRT (`tensorrt`) and TensorRT for RTX (`tensorrt_rtx`), in one module.

Nothing else in seq2trt imports either flavour directly: it asks `load(flavour)` for the module and this module
for what differs — which extra installs it, which compute capabilities it can target and how targets are set,
what its ONNX parser needs before it meets a plugin node, whether it has a timing cache, and whether a built
engine can run here.

TensorRT-RTX facts this relies on (measured, see docs/design.md, "Toolchain facts the code relies on"): it builds real engines with no
GPU for explicit targets (`IBuilderConfig.set_compute_capability`, SM75/80/86/89/120/121, no SM90); only
IPluginV3 + IPluginCreatorV3One plugins pass its ONNX parser; the parser dlopens the unversioned
`libtensorrt_rtx.so` that the wheel lacks (`ensure_rtx_parser_library`); its timing-cache APIs demand a GPU.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import ModuleType
from typing import Mapping, Sequence

from seq2trt.core.errors import ArtifactError, DependencyError, InputError

logger = logging.getLogger(__name__)

CURRENT = "current"  # the GPU of the building machine


class Flavour(str, Enum):
    TENSORRT = "tensorrt"
    TENSORRT_RTX = "tensorrt-rtx"


@dataclass(frozen=True)
class FlavourInfo:
    module: str
    extra: str
    pip_package: str
    # Explicit targets the builder can compile for without that GPU present; empty: only the current GPU.
    explicit_targets: tuple[int, ...]
    timing_cache: bool
    builds_without_gpu: bool


FLAVOURS: dict[Flavour, FlavourInfo] = {
    Flavour.TENSORRT: FlavourInfo("tensorrt", "trt", "tensorrt-cu13", (), True, False),
    Flavour.TENSORRT_RTX: FlavourInfo("tensorrt_rtx", "rtx", "tensorrt-rtx-cu13", (75, 80, 86, 89, 120, 121), False,
                                      True),
}


def flavour_of(name: str | Flavour) -> Flavour:
    try:
        return Flavour(name)
    except ValueError:
        raise InputError(f"unknown TensorRT backend {name!r}; expected one of "
                         f"{', '.join(f.value for f in Flavour)}") from None


def load(flavour: str | Flavour) -> ModuleType:
    """Import the flavour's module, or raise a DependencyError naming the extra that installs it."""
    info = FLAVOURS[flavour_of(flavour)]
    try:
        return importlib.import_module(info.module)
    except ImportError as exc:
        raise DependencyError(f"backend {Flavour(flavour).value} needs the `{info.module}` module, which is not "
                              f"importable ({exc}); install it with: pip install 'seq2trt[{info.extra}]'") from exc


def available(flavour: str | Flavour) -> bool:
    try:
        load(flavour)
    except DependencyError:
        return False
    return True


# --- targets -------------------------------------------------------------------------------------------------

def parse_targets(flavour: str | Flavour, text: str) -> tuple[int | str, ...]:
    """`"sm_86,sm_89"` -> (86, 89); `"current"` -> ("current",). Refuses what the flavour cannot target."""
    flavour = flavour_of(flavour)
    info = FLAVOURS[flavour]
    items = [t.strip().lower() for t in text.split(",") if t.strip()]
    if items == [CURRENT]:
        return (CURRENT,)
    supported = ", ".join(f"sm_{cc}" for cc in info.explicit_targets)
    if not info.explicit_targets:
        raise InputError(f"backend {flavour.value} builds only for the GPU it runs on: pass --target current, "
                         f"not {text!r}; use --backend tensorrt-rtx to build for named targets without a GPU")
    targets = []
    for item in items:
        digits = item.removeprefix("sm_").removeprefix("sm")
        if not digits.isdigit():
            raise InputError(f"target {item!r} is not of the form sm_86 (or 'current'); {flavour.value} supports "
                             f"{supported}")
        cc = int(digits)
        if cc not in info.explicit_targets:
            hint = "; Hopper (sm_90) needs --backend tensorrt" if cc == 90 else ""
            raise InputError(f"{flavour.value} cannot target sm_{cc}; it supports {supported}{hint}")
        if cc not in targets:
            targets.append(cc)
    if not targets:
        raise InputError(f"no target given; pass e.g. --target sm_86 or current ({flavour.value}: {supported})")
    return tuple(sorted(targets))


def target_tag(targets: Sequence[int | str]) -> str:
    """Directory-name form: (86, 89) -> "sm_86+sm_89"."""
    return "+".join(t if isinstance(t, str) else f"sm_{t}" for t in targets)


def set_targets(trt: ModuleType, flavour: str | Flavour, config, targets: Sequence[int | str]) -> None:
    """Point the builder config at the targets (`parse_targets` output)."""
    if flavour_of(flavour) is Flavour.TENSORRT:
        if list(targets) != [CURRENT]:  # parse_targets already refused these; this guards direct callers
            raise InputError("enterprise TensorRT builds for the current GPU only")
        return
    config.num_compute_capabilities = len(targets)
    for i, target in enumerate(targets):
        cc = trt.ComputeCapability.CURRENT if target == CURRENT else getattr(trt.ComputeCapability, f"SM{target}")
        config.set_compute_capability(cc, i)


def has_gpu() -> bool:
    """Whether an NVIDIA GPU is visible (its driver's device nodes), without importing any CUDA library."""
    return Path("/dev/nvidiactl").exists() or Path("/dev/dxg").exists()  # /dev/dxg: WSL2


def current_compute_capability() -> int | None:
    """The compute capability of this machine's first GPU (via torch, a core dependency), or None."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return 10 * major + minor


def resolve_targets(targets: Sequence[int | str]) -> list[int]:
    """Targets as compute capabilities, "current" resolved on this machine (dropped when it has no GPU)."""
    resolved = [t if isinstance(t, int) else current_compute_capability() for t in targets]
    return sorted({cc for cc in resolved if cc is not None})


def builds_without_gpu(flavour: str | Flavour, targets: Sequence[int | str]) -> bool:
    return FLAVOURS[flavour_of(flavour)].builds_without_gpu and CURRENT not in targets


# --- plugin loading --------------------------------------------------------------------------------------------

def ensure_plugin_loading(trt: ModuleType, flavour: str | Flavour) -> None:
    """What a flavour needs before its ONNX parser may meet a plugin node."""
    if flavour_of(flavour) is Flavour.TENSORRT_RTX:
        ensure_rtx_parser_library()


_RTX_LIB = "libtensorrt_rtx.so"


def rtx_library_dir() -> Path:
    """The directory holding `libtensorrt_rtx.so.1` and the ONNX parser (the parser's RPATH is $ORIGIN)."""
    try:
        import tensorrt_rtx_libs
    except ImportError as exc:
        raise DependencyError(f"tensorrt_rtx_libs is not importable ({exc}); install it with: "
                              "pip install 'seq2trt[rtx]'") from exc
    return Path(tensorrt_rtx_libs.__file__).resolve().parent


def ensure_rtx_parser_library(lib_dir: Path | None = None) -> Path:
    """Make sure TensorRT-RTX's ONNX parser can dlopen `libtensorrt_rtx.so`; return the path it will load.

    The parser loads the unversioned name when it meets a plugin node, but the wheel ships only
    `libtensorrt_rtx.so.1`; without the unversioned name the process aborts inside the parser ("terminate called
    without an active exception"). This creates the symlink `libtensorrt_rtx.so -> libtensorrt_rtx.so.1` beside
    it. Idempotent: an existing correct link (or a real file) is kept; a link on LD_LIBRARY_PATH is honoured.
    Run `python -m seq2trt.exporters.tensorrt.trt_compat` once as a user who can write there, when site-packages is
    read-only.
    """
    lib_dir = Path(lib_dir) if lib_dir is not None else rtx_library_dir()
    link, target = lib_dir / _RTX_LIB, lib_dir / f"{_RTX_LIB}.1"
    if link.exists():  # follows the link: a dangling one is replaced below
        return link
    for entry in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep):
        if entry and (Path(entry) / _RTX_LIB).exists():
            return Path(entry) / _RTX_LIB
    if not target.exists():
        raise DependencyError(f"{target} is missing: the TensorRT-RTX install is incomplete; reinstall with "
                              "pip install --force-reinstall 'seq2trt[rtx]'")
    tmp = lib_dir / f".{_RTX_LIB}.{os.getpid()}.tmp"
    try:
        if tmp.is_symlink():
            tmp.unlink()
        tmp.symlink_to(target.name)  # relative, so the link survives a moved environment
        os.replace(tmp, link)  # atomic: two processes racing both end with the same link
    except OSError as exc:
        raise DependencyError(
            f"TensorRT-RTX's ONNX parser needs {link}, which its wheel does not ship, and seq2trt could not create "
            f"it ({exc.strerror or exc}). Create it once as a user who can write to {lib_dir}: "
            f"`ln -s {target.name} {link}` (or `python -m seq2trt.exporters.tensorrt.trt_compat`), or put such a "
            f"link in a directory listed in LD_LIBRARY_PATH before starting Python") from exc
    logger.info("created %s -> %s so that TensorRT-RTX's ONNX parser can load plugins", link, target.name)
    return link


# --- timing cache (enterprise only) ---------------------------------------------------------------------------

def attach_timing_cache(flavour: str | Flavour, config, path: Path | None):
    """Load (or start) a timing cache on enterprise TensorRT; TensorRT-RTX's timing-cache calls need a GPU, so
    there this does nothing and returns None."""
    if path is None or not FLAVOURS[flavour_of(flavour)].timing_cache:
        return None
    data = Path(path).read_bytes() if Path(path).exists() else b""
    cache = config.create_timing_cache(data)
    config.set_timing_cache(cache, ignore_mismatch=False)
    return cache


def save_timing_cache(flavour: str | Flavour, config, path: Path | None) -> None:
    if path is None or not FLAVOURS[flavour_of(flavour)].timing_cache:
        return
    from seq2trt.core.atomic_files import atomic_write_bytes

    atomic_write_bytes(Path(path), bytes(config.get_timing_cache().serialize()))


# --- engine validity -------------------------------------------------------------------------------------------

def check_engine(build_info: Mapping, flavour: str | Flavour, runtime_version: str, device_cc: int) -> None:
    """Refuse, with a message saying how to rebuild, an engine that cannot run here.

    `build_info` is the engine's build.json (`flavour`, `tensorrt_version`, `targets`, `compute_capabilities`).
    TensorRT-RTX engines run on any GPU of a target compute capability and need the same major.minor; enterprise
    engines need the compute capability they were built on and the exact release (major.minor.patch).
    """
    flavour = flavour_of(flavour)
    built_flavour = build_info.get("flavour")
    rebuild = f"rebuild with `seq2trt build OUT --backend {flavour.value} --target {_target_hint(flavour, device_cc)}`"
    if built_flavour != flavour.value:
        raise ArtifactError(f"engine was built by {built_flavour}, but this runner is {flavour.value}; {rebuild}")
    built_version = str(build_info.get("tensorrt_version", ""))
    parts = 3 if flavour is Flavour.TENSORRT else 2  # enterprise plans are tied to the exact release
    if built_version.split(".")[:parts] != runtime_version.split(".")[:parts]:
        raise ArtifactError(f"engine was built by {flavour.value} {built_version}, but {runtime_version} is "
                            f"installed; engines do not move across versions; {rebuild}")
    targets = build_info.get("targets", [])
    compute = build_info.get("compute_capabilities", [t for t in targets if isinstance(t, int)]
                             if isinstance(targets, list) else None)
    if not isinstance(targets, list) or not isinstance(compute, list):
        raise ArtifactError(f"build.json's targets / compute_capabilities are not lists (malformed); {rebuild}")
    if device_cc not in compute:
        raise ArtifactError(f"engine targets {target_tag(targets)}, but this GPU is sm_{device_cc}; {rebuild}")


def _target_hint(flavour: Flavour, device_cc: int) -> str:
    if flavour is Flavour.TENSORRT_RTX and device_cc in FLAVOURS[flavour].explicit_targets:
        return f"sm_{device_cc}"
    return CURRENT


def main() -> None:
    """`python -m seq2trt.exporters.tensorrt.trt_compat`: the one-time TensorRT-RTX parser setup, for read-only
    installs."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(ensure_rtx_parser_library())
    except DependencyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
