"""Triton kernels of the fused attention op (`plugins.op`), their launchers and their ahead-of-time compiler.

- `attention`: the kernels (flash attention with online softmax, flash-decoding split + reduce, KV append);
- `launch`: Python launchers on torch tensors (CPU under TRITON_INTERPRET=1, or a GPU);
- `aot`: PTX/cubin for each variant and target, without a GPU (`python -m seq2trt.plugins.kernels.aot`).

Nothing here imports triton at package import: only `attention` (and what imports it) needs it.
"""
