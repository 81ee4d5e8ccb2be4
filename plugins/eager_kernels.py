"""The attention kernels inside the eager model: every attention block computed by the fused op's kernels.

`kernel_attention(model, run)` has `model` compute every attention block — the span between the projections that
the exporter marks and the fuser turns into one plugin node — by a call of the op through `run(attrs, inputs) -> outputs`:
- `triton_run` (default): triton's launcher (`kernels.launch_plan.attention`) on a GPU, or on CPU tensors in triton's
  interpreter (TRITON_INTERPRET=1 set before triton is first imported);
- `cubin_run(launcher)`: the ahead-of-time cubins through a `kernel_launch.KernelLauncher`, exactly as the
  TensorRT plugin's enqueue launches them (cuda-python, no triton), on CUDA tensors.

The shared decoding loops then run on that model (`reference_model.eager.EagerStepModel`), so the kernels are
checked end to end — token agreement with the eager model on the demo task — where no TensorRT can run an engine
(the GPU test machine: `python3 scripts/gpu_check.py eager`), and on CPU in the interpreter in tests.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from seq2trt.reference_model.model import KV, MultiHeadAttention, Seq2SeqTransformer

from seq2trt.plugins.op import INPUTS, AttentionAttrs, AttentionKind, pack_inputs

Run = Callable[[AttentionAttrs, tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]


def triton_run(attrs: AttentionAttrs, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    from seq2trt.plugins.kernels.launch_plan import attention

    return attention(attrs, *inputs)


def prepare_cubin(launcher, attrs: AttentionAttrs, inputs: tuple[torch.Tensor, ...]) -> Callable[[], tuple]:
    """launch() -> outputs: one op call through the AOT cubins on the current CUDA stream, as the TensorRT plugin's
    enqueue makes it (an `AttentionCall` of device pointers; no synchronization), into outputs (the op's `OUTPUTS`,
    as TensorRT would bind them) and a workspace of `kernels.launch_plan.workspace_bytes`, allocated here once."""
    from seq2trt.plugins.cuda_launcher import AttentionCall
    from seq2trt.plugins.kernels.launch_plan import dtype_name, workspace_bytes

    inputs = tuple(x.contiguous() for x in inputs)
    query = inputs[0]
    n = len(INPUTS[attrs.kind])
    if len(inputs) > n:  # the position bias in the op's dtype, as the plugin binds it
        inputs = inputs[:n] + (inputs[n].to(query.dtype).contiguous(),)
    outputs = [torch.empty_like(query)]
    if attrs.kind is AttentionKind.DECODER_SELF:
        B, H, P, Dh = inputs[3].shape
        outputs += [query.new_empty((B, H, P + query.shape[1], Dh)) for _ in range(2)]
    workspace = torch.empty(workspace_bytes(attrs, query.shape[0]), dtype=torch.uint8, device=query.device)
    shapes, pointers = tuple(tuple(x.shape) for x in inputs), tuple(x.data_ptr() for x in inputs)

    def launch() -> tuple[torch.Tensor, ...]:
        launcher.launch(AttentionCall(attrs, dtype_name(query.dtype), shapes, pointers,
                                      tuple(x.data_ptr() for x in outputs), workspace.data_ptr(),
                                      torch.cuda.current_stream().cuda_stream))
        return tuple(outputs)

    return launch


def cubin_run(launcher) -> Run:
    """run(attrs, inputs) through the AOT cubins (`prepare_cubin`, fresh outputs per call)."""
    return lambda attrs, inputs: prepare_cubin(launcher, attrs, inputs)()


def op_core(run: Run):
    """An implementation of `reference_model.model.attention_core`'s signature that computes the block with the op."""

    def core(kind: AttentionKind, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, scale: float,
             key_padding_mask: torch.Tensor | None = None, past: KV | None = None,
             position_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, KV]:
        attrs = AttentionAttrs(kind, num_heads, q.shape[-1] // num_heads, scale)
        outputs = run(attrs, pack_inputs(kind, q, k, v, key_padding_mask, past, position_bias))
        if kind is AttentionKind.DECODER_SELF:  # appends the new K/V, causal
            out, present_k, present_v = outputs
            return out, (present_k, present_v)
        return outputs[0], (k, v)  # besides the output, attention_core's K/V serve decoder self-attention only

    return core


@contextlib.contextmanager
def kernel_attention(model: Seq2SeqTransformer, run: Run = triton_run) -> Iterator[Seq2SeqTransformer]:
    """Within the block, every attention block of `model` computes attention with the fused op via `run`."""
    blocks = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    originals = [m.core for m in blocks]
    model.use_attention(op_core(run))
    try:
        yield model
    finally:
        for block, core in zip(blocks, originals):
            block.core = core
