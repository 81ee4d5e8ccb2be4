"""A check torch.export needs before it runs: a compile cache it can write (the ONNX exports of onnx_export and
whisper_features both trace with it)."""

from __future__ import annotations

from seq2trt.core.errors import InputError


def check_torch_cache() -> None:
    """torch.export writes into torch's compile cache (TORCHINDUCTOR_CACHE_DIR, else a folder in the temporary
    directory) as it loads; a cache it cannot create or write fails deep inside it with a traceback."""
    import os
    import tempfile

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    where = "TORCHINDUCTOR_CACHE_DIR " + folder if os.environ.get("TORCHINDUCTOR_CACHE_DIR") else folder
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise InputError(f"torch's compile cache {where} is not a folder it can write ({exc.strerror}), and the ONNX "
                         "export needs it; point TORCHINDUCTOR_CACHE_DIR at a writable folder") from None


_REGISTRIES: dict[int, dict] = {}


def reused_torchlib_registry():
    """A context in which torch.onnx.export builds its registry of ATen -> ONNX functions from one copy made per
    opset rather than anew on every call (1.6 s of each graph's export on 2 cores, torch 2.13: the torchlib
    overloads are looked up one by one). Each export gets a registry of its own (the functions' lists copied), so
    the custom translations one registers do not leak into the next; the graphs are the same
    (tests/exporters/test_onnx_export.py). Where torch's private registry is not as expected, nothing changes."""
    import contextlib

    try:
        from torch.onnx._internal.exporter import _registration
        original = _registration.ONNXRegistry.__dict__["from_torchlib"]
        build = original.__func__
    except (ImportError, KeyError, AttributeError):
        return contextlib.nullcontext()

    def from_torchlib(cls, opset_version=None):
        opset = _registration._constants.TORCHLIB_OPSET if opset_version is None else opset_version
        if opset not in _REGISTRIES:
            _REGISTRIES[opset] = build(cls, opset).functions
        registry = cls()
        registry._opset_version = opset
        registry.functions = {target: list(metas) for target, metas in _REGISTRIES[opset].items()}
        return registry

    @contextlib.contextmanager
    def patched():
        _registration.ONNXRegistry.from_torchlib = classmethod(from_torchlib)
        try:
            yield
        finally:
            _registration.ONNXRegistry.from_torchlib = original
    return patched()
