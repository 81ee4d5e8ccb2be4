"""Triton kernels of the fused attention op (`plugins.op`), their launch plans and their ahead-of-time compiler.

- `attention`: the kernels (flash attention with online softmax, flash-decoding split + reduce, KV append);
- `launch`: the launch plan of an op call (kernels, grids, arguments, block sizes), run on torch tensors through
  triton (GPU, or CPU under TRITON_INTERPRET=1) or packed for cuLaunchKernel (`launch_plan`, for the TensorRT plugin);
- `aot`: PTX/cubin for each variant and target, without a GPU (`python -m seq2trt.plugins.kernels.aot`).

Importing this package does not import triton: only `attention`, launching on tensors and compiling need it.
"""

from __future__ import annotations

from pathlib import Path

from .launch import launch_plan, workspace_bytes


def index_path() -> Path:
    """The ahead-of-time index the plugin loads: `$SEQ2TRT_KERNEL_DIR/index.json`, by default under ~/.cache."""
    from .aot import default_dir

    return default_dir() / "index.json"


__all__ = ["index_path", "launch_plan", "workspace_bytes"]
