"""A check torch.export needs before it runs: a compile cache it can write (the ONNX exports of onnx_export and
whisper_features both trace with it)."""

from __future__ import annotations

from seq2trt.reference_model.errors import InputError


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
