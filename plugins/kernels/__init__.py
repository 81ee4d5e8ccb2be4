"""Triton kernels of the fused attention op (`plugins.op`), their launch plans and their ahead-of-time compiler.

- `attention`: the kernels (flash attention with online softmax, flash-decoding split + reduce, KV append);
- `launch`: the launch plan of an op call (kernels, grids, arguments, block sizes, each kernel's parameter order,
  the workspace size), run on torch tensors through triton (GPU, or CPU under TRITON_INTERPRET=1); the TensorRT
  plugin packs the same plan for cuLaunchKernel in `plugins.cuda_launcher`;
- `aot`: PTX/cubin for each variant and target, without a GPU (`python -m seq2trt.plugins.kernels.aot`), and the
  index that lists them (`aot.index_path`, written by `aot.compile_all`, read by `aot.read_index`).

Importing this package does not import triton: only `attention`, launching on tensors and compiling need it.
"""
