"""A step model whose KV cache never leaves the device: ONNX Runtime's IO binding over an encoder and a decoder
runner (`OrtRunner`, CPU or CUDA provider), for the searches of `reference_model.decoding`.

What crosses between host and device, and when (`copies` counts each crossing by what it carried):
- to the device: the source (ids or features) and its mask once per encode; each step's new tokens; the mask
  again only when the loops hand over another one (rows finished or beams expanded); a select's row indices;
- to the host: each step's logits (the row the search chooses from; at a one-token step that is all of them).
The encoder's cross K/V are computed once and stay on the device as OrtValues; every step's present K/V are bound
to device memory and fed back as the next past; beams are reordered on the device by a Gather session on the same
provider. The self-attention cache is preallocated on the device at the export's max_tgt_len positions and each step
writes its present K/V into it in place (`shared_kv.py`: MultiHeadAttention's past/present buffer sharing, the
decoder graph rewritten when opened); where the graph does not allow that, or the provider refuses it on the first
step, each present (past + new positions) is a new device buffer, as the graphs concatenate (docs/gpu.md).
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import numpy as np

from seq2trt.exporters import spec
from seq2trt.core.errors import InputError
from seq2trt.reference_model.sources import source_kind

from seq2trt.runtime.runners import OrtRunner, emulate_bf16
from seq2trt.runtime.shared_kv import PAST_LENGTH, shared_buffer_decoder

logger = logging.getLogger(__name__)

State = dict  # input name -> OrtValue on the device


class SharedPast:
    """The self-attention cache in shared buffers: input name -> (B, H, max_tgt_len, Dh) OrtValue, and how many
    positions are filled."""

    def __init__(self, values: State, length: int):
        self.values, self.length = values, length


class _NotShared(Exception):
    """The decoder graph reads its past otherwise than sharing allows."""

_ELEMENT = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(bfloat16)": 16,  # onnx BFLOAT16
            "tensor(int64)": np.int64}


class DeviceStepModel:
    """`StepModel` over two active `OrtRunner`s; states are OrtValues on the runners' device."""

    def __init__(self, encoder: OrtRunner, decoder: OrtRunner, share_buffers: bool = True):
        if encoder.kind is not spec.GraphKind.ENCODER or decoder.kind is not spec.GraphKind.DECODER:
            raise ValueError(f"need an encoder and a decoder runner, got {encoder.kind} and {decoder.kind}")
        self.encoder, self.decoder = encoder, decoder  # seq2trt.hf drives the runners themselves (host arrays)
        self.copies: Counter = Counter()  # (direction, what) -> crossings made by this model
        self._gathers: dict[tuple[int, str], object] = {}
        self._mask: tuple[np.ndarray, object] | None = None  # the last mask sent, and its device copy
        self._names: dict[str, dict[str, str]] = {}
        self._device: tuple[object, tuple[str, int]] | None = None
        self.share_buffers = share_buffers  # preallocated cache written in place, where the graph allows it
        self._shared: _Bound | None = None  # the rewritten decoder session, opened on first use

    # -- the device ----------------------------------------------------------------------------------------------
    @property
    def cfg(self):
        return self.decoder.cfg

    @property
    def device(self) -> tuple[str, int]:
        """(ONNX Runtime's device type, device id) of the decoder's session (looked up once per session: every
        crossing asks)."""
        session = self.decoder.session
        if self._device is None or self._device[0] is not session:
            cuda = session.get_providers()[0] == "CUDAExecutionProvider"
            self._device = (session, ("cuda", self.decoder.device_id) if cuda else ("cpu", 0))
        return self._device[1]

    def to_device(self, array: np.ndarray, what: str):
        import onnxruntime as ort

        self.copies["to_device", what] += 1
        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), *self.device)

    def to_host(self, value, what: str) -> np.ndarray:
        self.copies["to_host", what] += 1
        return value.numpy()

    def _side(self, side: str) -> dict[str, str]:
        names = self._names.get(side)
        if names is None:
            names = self._names[side] = spec.present_to_past(self.cfg, side)
        return names

    def _run(self, runner: OrtRunner, inputs: dict, host_outputs: tuple[str, ...] = ()) -> dict:
        """One run with every input an OrtValue and every output left on the device, except `host_outputs`."""
        binding = runner.session.io_binding()
        for name, value in inputs.items():
            binding.bind_ortvalue_input(name, value)
        kind, device_id = self.device
        for name in runner.output_names:
            if name in host_outputs:
                binding.bind_output(name, "cpu")
            else:
                binding.bind_output(name, kind, device_id)
        runner.session.run_with_iobinding(binding)
        return dict(zip(runner.output_names, binding.get_outputs()))

    # -- the StepModel -------------------------------------------------------------------------------------------
    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> State:
        feed = source_kind(self.cfg).feed(input_ids, attention_mask)
        metadata = self.encoder.input_metadata()
        feed = {name: np.asarray(value, dtype=metadata[name][0]) for name, value in feed.items()}
        spec.check_feed(self.cfg, spec.GraphKind.ENCODER, self.encoder.dtype, self.encoder.limits, feed)
        if self.encoder.emulated_bf16:  # the CPU provider's fp32 twin of a bf16 graph
            feed = {k: v.astype(np.float32) if v.dtype != np.int64 else v for k, v in feed.items()}
        out = self._run(self.encoder, {name: self.to_device(value, "source") for name, value in feed.items()})
        return {past: out[present] for present, past in self._side("encoder").items()}

    def empty_past(self, batch: int) -> State | SharedPast:
        """Allocated on the device, nothing crosses: the cache's buffers at max_tgt_len positions when shared (their
        contents beyond the filled positions are never read), else one empty (B, H, 0, Dh) value."""
        import onnxruntime as ort

        names = list(self._side("decoder").values())
        element = _ELEMENT[next(i.type for i in self.decoder.session.get_inputs() if i.name == names[0])]
        allocate = lambda positions: ort.OrtValue.ortvalue_from_shape_and_type(
            [batch, self.cfg.num_heads, positions, self.cfg.head_dim], element, *self.device)
        if self._shared_decoder() is not None:
            return SharedPast({name: allocate(self.decoder.limits.max_tgt_len) for name in names}, 0)
        return dict.fromkeys(names, allocate(0))

    def _shared_decoder(self) -> "_Bound | None":
        """The decoder session whose present is written into its past, opened once; None when sharing is off or the
        graph does not allow it."""
        if self.share_buffers and self._shared is None:
            self._shared = self._open_shared()
            self.share_buffers = self._shared is not None
        return self._shared if self.share_buffers else None

    def _open_shared(self) -> "_Bound | None":
        from seq2trt.exporters.ort_session import open_session

        source, runner = self.decoder._source, self.decoder
        if not isinstance(source, (str, Path)):
            return None
        names = self._side("decoder")
        rewrites = [f for f in (runner.prepare, emulate_bf16 if runner.emulated_bf16 else None) if f is not None]

        def rewrite(model: bytes) -> bytes:
            for f in rewrites:
                model = f(model)
            shared = shared_buffer_decoder(model, list(names.values()), list(names))
            if shared is None:
                raise _NotShared
            return shared

        kind, device_id = self.device
        try:
            session, _ = open_session(source, device=kind, device_id=device_id, threads=runner.intra_op_threads,
                                      shared_pool=True, optimization=runner.optimization,
                                      custom_op_libraries=runner.custom_op_libraries, rewrite=rewrite)
        except _NotShared:
            logger.info("%s reads its past otherwise than buffer sharing allows: presents are concatenated", source)
            return None
        return _Bound(session)

    def _mask_value(self, mask: np.ndarray):
        if self._mask is None or self._mask[0] is not mask:  # the loops pass the same array until rows change
            self._mask = (mask, self.to_device(np.asarray(mask, dtype=np.int64), "mask"))
        return self._mask[1]

    def step(self, input_ids: np.ndarray, encoder_attention_mask: np.ndarray, encoder_state: State,
             past: State | SharedPast) -> tuple[np.ndarray, State | SharedPast]:
        shared = isinstance(past, SharedPast)
        past_len = past.length if shared else next(iter(past.values())).shape()[2]
        batch, new = input_ids.shape
        limits = self.decoder.limits
        if past_len + new > limits.max_tgt_len:
            raise InputError(f"decoder: past_len + tgt_len = {past_len + new} exceeds max_tgt_len "
                             f"{limits.max_tgt_len}; lower --max-new-tokens or re-export with a larger --max-tgt-len")
        if batch > limits.max_batch:
            raise InputError(f"decoder: batch {batch} exceeds the export's max_batch {limits.max_batch}; decode "
                             "smaller batches or re-export with a larger --max-batch")
        inputs = {"input_ids": self.to_device(np.asarray(input_ids, dtype=np.int64), "tokens"),
                  "encoder_attention_mask": self._mask_value(encoder_attention_mask), **encoder_state}
        if shared:
            out = self._shared_step(inputs, past)
            if out is None:  # the provider refused sharing at the first step: concatenate from here on
                return self.step(input_ids, encoder_attention_mask, encoder_state, self.empty_past(batch))
            past = SharedPast(past.values, past_len + new)
        else:
            out = self._run(self.decoder, {**inputs, **past}, host_outputs=("logits",))
            past = {past_name: out[present] for present, past_name in self._side("decoder").items()}
        logits = self.to_host(out["logits"], "logits")[:, -1]  # (B, V)
        return (logits if logits.dtype == np.float32 else logits.astype(np.float64)), past

    def _shared_step(self, inputs: dict, past: SharedPast) -> dict | None:
        """One step writing present into the past's buffers; None when the provider refuses it at the first step."""
        session = self._shared.session
        binding = session.io_binding()
        inputs = {**inputs, **past.values,
                  PAST_LENGTH: self.to_device(np.array([past.length], dtype=np.int32), "past length")}
        for name, value in inputs.items():
            binding.bind_ortvalue_input(name, value)
        binding.bind_output("logits", "cpu")
        for present, past_name in self._side("decoder").items():
            binding.bind_ortvalue_output(present, past.values[past_name])  # in place
        try:
            session.run_with_iobinding(binding)
        except Exception as exc:  # ORT's own errors: a kernel without buffer sharing for this step
            if past.length:
                raise
            logger.warning("ONNX Runtime refused past/present buffer sharing (%s); presents are concatenated",
                           str(exc).strip().splitlines()[0][:200])
            self.share_buffers = False
            return None
        return {"logits": binding.get_outputs()[0]}

    def select(self, state: State | SharedPast, index: np.ndarray) -> State | SharedPast:
        """Rows `index` of every tensor of `state`, gathered on the device in one session run."""
        if isinstance(state, SharedPast):
            return SharedPast(self.select(state.values, index), state.length)
        names = list(state)
        values = [state[n] for n in names]
        unique = list({id(v): v for v in values}.values())  # an empty past holds one value under every name
        gather = self._gather(len(unique), self._element_type(unique[0]))
        feed = {f"x{i}": v for i, v in enumerate(unique)}
        feed["index"] = self.to_device(np.asarray(index, dtype=np.int64), "index")
        runner = _Bound(gather)
        out = self._run(runner, feed)
        picked = {id(v): out[f"y{i}"] for i, v in enumerate(unique)}
        return {n: picked[id(v)] for n, v in zip(names, values)}

    @staticmethod
    def _element_type(value) -> str:
        return value.data_type()

    def _gather(self, count: int, element: str):
        """A session gathering rows of `count` tensors of one element type along axis 0 (one run per select)."""
        key = (count, element)
        if key not in self._gathers:
            from onnx import TensorProto, helper

            from seq2trt.exporters.ort_session import open_session

            elem = {"tensor(float)": TensorProto.FLOAT, "tensor(float16)": TensorProto.FLOAT16,
                    "tensor(bfloat16)": TensorProto.BFLOAT16}[element]
            shape = ["rows", "heads", "positions", "head_dim"]
            graph = helper.make_graph(
                [helper.make_node("Gather", [f"x{i}", "index"], [f"y{i}"], axis=0) for i in range(count)],
                "select_rows",
                [helper.make_tensor_value_info(f"x{i}", elem, shape) for i in range(count)]
                + [helper.make_tensor_value_info("index", TensorProto.INT64, ["picked"])],
                [helper.make_tensor_value_info(f"y{i}", elem, None) for i in range(count)])
            model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
            model.ir_version = 8
            kind, device_id = self.device
            self._gathers[key], _ = open_session(model, device=kind, device_id=device_id, threads=1,
                                                 optimization="basic")
        return self._gathers[key]


class _Bound:
    """A bare session in the shape `DeviceStepModel._run` reads (a runner's session and output names)."""

    def __init__(self, session):
        self.session, self.output_names = session, [o.name for o in session.get_outputs()]
