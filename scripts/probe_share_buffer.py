"""Does ONNX Runtime's BeamSearch (model_type 1) share past/present KV buffers on CPU? (benchmarks/README.md)

usage: python scripts/probe_share_buffer.py OUT
Rewrites copies of OUT/generate/ort/generate.onnx (in a temporary folder) so that the decoder subgraph runs
self-attention as com.microsoft.DecoderMaskedMultiHeadAttention with past_present_share_buffer=1 and has the inputs
`past_sequence_length`, `beam_width`, `cache_indirection` (BeamSearch shares the buffers when the decoder has a
`past_sequence_length` input: subgraph_base.cc, Subgraph::Setup), then prints:
1. the past_sequence_length BeamSearch feeds at each step: the probe graph's logits are one-hot at
   past_sequence_length + 3, so greedy search writes the fed values + 3 as its tokens (advanced: 3, 4, 5, ...);
2. the same graph at beam 4, where DecoderMaskedMultiHeadAttention also reads `cache_indirection`;
3. the demo's tokens when the past length is taken from the sequence instead (the decoder's input_ids declared
   (batch, cur_len): BeamSearch then feeds every token so far), against generate.onnx, greedy, held-out sources.
ONNX Runtime 1.32 CPU, 2026-11-30: 1. prints 3, 3, 3, ... (never advanced: the CPU UpdateDecoderFeeds ignores
past_present_share_buffer and need_cache_indir); 2. fails with a garbage past length or cache indirection (the CPU
path neither initialises nor updates them), or returns tokens; 3. tokens differ from generate.onnx on most sources
and some runs fail with a past length that the graph computed and something overwrote.
"""
import sys, tempfile
import numpy as np, onnx, onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from pathlib import Path
from seq2trt.exporters.manifest import verify
from seq2trt.reference_model.vocab import pad_batch
from seq2trt.runtime.reference_loader import e2e_sources

out = Path(sys.argv[1])
src_path = out / "generate/ort/generate.onnx"
folder = Path(tempfile.mkdtemp())
m = verify(out)


def shared_buffer_graph(past_from_sequence: bool, probe: bool) -> Path:
    model = onnx.load(src_path)
    dec = next(a.g for a in model.graph.node[0].attribute if a.name == "decoder")
    past_len = "past_sequence_length"
    consts = {"probe.one": np.array([1], np.int64), "probe.last": np.array([-1], np.int64),
              "probe.end": np.array([1 << 30], np.int64), "probe.three": np.array([3], np.int32),
              "probe.depth": np.array(m.config.tgt_vocab_size, np.int64), "probe.values": np.array([0, 50], np.float32),
              "probe.zero": np.array(0, np.float32)}
    head = []
    if past_from_sequence:  # (batch, cur_len) ids: past length = cur_len - 1, the step's token = the last one
        dim = dec.input[0].type.tensor_type.shape.dim[1]
        dim.ClearField("dim_value"); dim.dim_param = "cur_len"
        for n in dec.node:
            n.input[:] = ["probe.ids_last" if i == "input_ids" else i for i in n.input]
        head = [helper.make_node("Slice", ["input_ids", "probe.last", "probe.end", "probe.one"], ["probe.ids_last"]),
                helper.make_node("Shape", ["input_ids"], ["probe.cur_len"], start=1, end=2),
                helper.make_node("Sub", ["probe.cur_len", "probe.one"], ["probe.past64"]),
                helper.make_node("Cast", ["probe.past64"], ["probe.past32"], to=TensorProto.INT32)]
        past_len = "probe.past32"
    for n in dec.node:
        if n.op_type == "MultiHeadAttention" and len(n.input) > 6 and n.input[6].startswith("past_key_self"):
            q, k, v, bias, _, _, past_k, past_v = n.input
            cache = ["", ""] if past_from_sequence else ["beam_width", "cache_indirection"]
            n.input[:] = [q, k, v, "", "", past_k, past_v, past_len, *cache, bias]
            n.op_type = "DecoderMaskedMultiHeadAttention"
            keep = [a for a in n.attribute if a.name != "unidirectional"]
            del n.attribute[:]
            n.attribute.extend(keep + [helper.make_attribute("past_present_share_buffer", 1)])
        elif n.op_type == "Shape" and n.input[0].startswith("past_key_self"):  # positions: from the past length
            n.op_type, n.input[:] = "Cast", [past_len]
            del n.attribute[:]
            n.attribute.extend([helper.make_attribute("to", TensorProto.INT64)])
    dec.input.extend([helper.make_tensor_value_info("past_sequence_length", TensorProto.INT32, [1]),
                      helper.make_tensor_value_info("beam_width", TensorProto.INT32, [1]),
                      helper.make_tensor_value_info("cache_indirection", TensorProto.INT32, ["batch", "beams", "max_length"])])
    tail = []
    if probe:  # logits = one-hot(past length + 3), everything else multiplied by 0
        for n in dec.node:
            n.output[:] = ["probe.logits" if o == "logits" else o for o in n.output]
        tail = [helper.make_node("Add", [past_len, "probe.three"], ["probe.idx32"]),
                helper.make_node("Cast", ["probe.idx32"], ["probe.idx"], to=TensorProto.INT64),
                helper.make_node("OneHot", ["probe.idx", "probe.depth", "probe.values"], ["probe.onehot"]),
                helper.make_node("Mul", ["probe.logits", "probe.zero"], ["probe.zeros"]),
                helper.make_node("Add", ["probe.zeros", "probe.onehot"], ["logits"])]
    body = list(dec.node)
    del dec.node[:]
    dec.node.extend(head + body + tail)
    dec.initializer.extend(numpy_helper.from_array(v, k) for k, v in consts.items())
    del dec.value_info[:]  # past/present are max_length long now
    path = folder / f"shared_{int(past_from_sequence)}{int(probe)}.onnx"
    onnx.save(model, path)
    return path


def session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 4
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def feed(rows, beams: int, max_new: int) -> dict:
    ids, mask = pad_batch(rows, m.config.pad_id)
    return {"input_ids": ids.astype(np.int32), "attention_mask": mask.astype(np.int32),
            "max_length": np.array([max_new + 1], np.int32), "min_length": np.array([0], np.int32),
            "num_beams": np.array([beams], np.int32), "length_penalty": np.array([0.6], np.float32),
            "repetition_penalty": np.array([1.0], np.float32), "num_return_sequences": np.array([1], np.int32)}


src, _ = e2e_sources(m.config, (m.data.get("source") or {}).get("task"), 64, 0)
probe = session(shared_buffer_graph(past_from_sequence=False, probe=True))
print("1. greedy tokens (= fed past_sequence_length + 3):", probe.run(None, feed(src[:1], 1, 8))[0][0, 0, 1:].tolist())
try:
    print("2. beam 4 tokens:", probe.run(None, feed(src[:1], 4, 8))[0][0, 0, 1:].tolist())
except Exception as exc:  # ORT's Fail / InvalidArgument
    print("2. beam 4 fails:", str(exc).strip().splitlines()[-1][-200:])
reference, shared = session(src_path), session(shared_buffer_graph(past_from_sequence=True, probe=False))
same, failed = 0, []
for row in src:
    try:
        same += np.array_equal(*(s.run(None, feed([row], 1, 32))[0] for s in (reference, shared)))
    except Exception as exc:  # ORT's InvalidArgument: a past length the graph computed, overwritten
        failed.append(str(exc).strip().splitlines()[-1][-160:])
print(f"3. past length from the sequence, greedy, B=1: tokens equal to generate.onnx on {same}/{len(src)} sources, "
      f"{len(failed)} runs failed" + (f" (first: {failed[0]})" if failed else ""))
