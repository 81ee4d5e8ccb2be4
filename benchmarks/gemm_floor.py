"""The matrix-product floor of a decode on this CPU, and so the most any float32 ONNX Runtime backend can gain over
Optimum's export: whether a target such as issues 28 and 30's ">= 1.2x Optimum" is reachable at all in float32.

    python benchmarks/gemm_floor.py OUT [--batch-sizes 1,32] [--src-len 32] [--new-tokens 32] [--repeats 10]
        [--optimum DIR]

OUT is a `seq2trt export` directory with `fused/ort/` (`seq2trt fuse OUT --target ort`) and Optimum's export of the
same source, as `seq2trt bench OUT --backends optimum` leaves it: `OUT/optimum/` for a text model,
`OUT/optimum-speech/` for Whisper (whose encoder reads `input_features`, 3000 frames, so --src-len does not apply;
the step attends over its 1500 encoder positions). For each of the export's plain
graphs (`encoder.onnx`, and `decoder.onnx` at the middle step of the decode, past length new_tokens / 2), every
matrix product it computes -- MatMul, Gemm and Conv nodes, which in the plain graphs include the attention's score
and value products -- is run on its own: one ONNX Runtime session made of those nodes and nothing else, the weights
as constants (so MLAS prepacks them, as in the real graphs), the activations random, of the shapes the real graph
gives them (read by running it once). Two floors:

- `separate`: every product as the graph computes it;
- `joined`: products that read one activation through constant weights of one inner size (the q, k and v
  projections of a block; an FFN's gate and up projections) joined into one GEMM, the fewest GEMM calls the same
  arithmetic allows.

Timed interleaved, repetition by repetition, against our fused graphs (`fused/ort/`, ONNX Runtime's basic level, as
the ort-fused backend runs them) and Optimum's (`encoder_model.onnx`, `decoder_model_merged.onnx` at ONNX Runtime's
default level, as ORTModelForSeq2SeqLM runs them: its first step through the no-cache branch, which computes the
cross-attention keys and values that our encoder emits), each session with one thread and its inputs and outputs
bound once (no copies into Python). A whole decode of new_tokens steps is put together from the graphs' medians:

    ours    = encoder + new_tokens x step(P)
    optimum = encoder + first step + (new_tokens - 1) x step(P)
    floor   = encoder products + new_tokens x step products(P)

ceiling = optimum / floor (joined): what a backend that spent no time at all outside the matrix products would
reach. It leaves out the search itself (top-k, the beam's bookkeeping), which only lowers what a backend reaches.
A batch of B x K rows stands for beam K at batch B.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import onnx
import onnx.inliner
import onnxruntime as ort
from onnx import helper, numpy_helper

PRODUCTS = ("MatMul", "Gemm", "Conv")


def session(model: onnx.ModelProto | str, level: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    options.log_severity_level = 3
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def feeds(sess: ort.InferenceSession, dims: dict, rng: np.random.Generator) -> dict:
    """Inputs for a graph by dimension name: batch -> B, past -> P, encoder/src -> S, any other name -> 1."""
    out = {}
    for arg in sess.get_inputs():
        shape = []
        for d in arg.shape:
            if isinstance(d, int):
                shape.append(d)
                continue
            name = str(d).lower()
            shape.append(dims["B"] if "batch" in name else dims["P"] if "past" in name
                         else dims["S"] if ("encoder" in name or "src" in name) else 1)
        if arg.type == "tensor(int64)":
            out[arg.name] = (np.ones(shape, np.int64) if "mask" in arg.name
                             else rng.integers(3, 100, size=shape).astype(np.int64))
        elif arg.type == "tensor(bool)":
            out[arg.name] = np.array(dims.get("use_cache", True)).reshape(shape)
        else:
            out[arg.name] = rng.standard_normal(shape).astype(np.float32)
    return out


class Bound:
    """One session with its inputs and outputs bound once: run() is the graph's compute, no copies into Python."""

    def __init__(self, sess: ort.InferenceSession, inputs: dict, outputs: dict | None = None):
        self.sess, self.binding = sess, sess.io_binding()
        for name, value in inputs.items():
            self.binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value))
        for arg in sess.get_outputs():
            if outputs and arg.name in outputs:  # a buffer of the caller's (the floor models share theirs)
                self.binding.bind_ortvalue_output(arg.name, ort.OrtValue.ortvalue_from_numpy(outputs[arg.name]))
            else:
                self.binding.bind_output(arg.name, "cpu")

    def run(self) -> float:
        start = time.perf_counter()
        self.sess.run_with_iobinding(self.binding)
        return time.perf_counter() - start


def constants(graph: onnx.GraphProto) -> set[str]:
    """Names whose values depend on initializers and Constant nodes only."""
    known = {t.name for t in graph.initializer}
    for node in graph.node:  # topological order
        if node.op_type == "Constant" or (node.input and all(not i or i in known for i in node.input)):
            known.update(node.output)
    return known


def products(path: Path, inputs: dict) -> tuple[list, dict, onnx.ModelProto]:
    """The product nodes of the graph at `path`, the value of every input they read (run once on `inputs`), and the
    model (weights loaded). The attention blocks of the plain graphs are ONNX local functions (exporters/spec.py,
    MARKED_DOMAIN): they are inlined first, so that their score and value products are counted."""
    model = onnx.inliner.inline_local_functions(onnx.load(str(path)))
    graph = model.graph
    nodes = [n for n in graph.node if n.op_type in PRODUCTS]
    init = {t.name for t in graph.initializer}
    wanted = sorted({i for n in nodes for i in n.input if i and i not in init and i not in inputs})
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    have = {o.name for o in probe.graph.output}
    probe.graph.output.extend(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
                              for name in wanted if name not in have)
    sess = session(probe, "ORT_DISABLE_ALL")
    names = [o.name for o in sess.get_outputs()]
    values = dict(zip(names, sess.run(None, {k: v for k, v in inputs.items()
                                             if k in {a.name for a in sess.get_inputs()}})))
    values.update({k: v for k, v in inputs.items() if any(k in n.input for n in nodes)})
    for t in graph.initializer:
        if any(t.name in n.input for n in nodes):
            values[t.name] = numpy_helper.to_array(t)
    return nodes, values, model


def floor_model(nodes: list, values: dict, const: set[str], opset, joined: bool, rng,
                buffers: dict) -> tuple[onnx.ModelProto, dict, dict]:
    """A model of the product nodes alone: constant inputs as initializers, the rest as random graph inputs; returns
    it with its feeds and an output buffer for each of its outputs. Activations and outputs of one shape share one
    buffer, from `buffers`, across the products and the models made from one graph: only the arithmetic is timed,
    and Whisper's attention scores and probabilities, 576 MB a layer at 8 rows, are then held once, not per layer."""
    new_nodes, inits, graph_inputs, feeds_, outputs = [], {}, {}, {}, []

    def activation(name: str) -> str:
        if name not in graph_inputs:
            key = f"x{len(graph_inputs)}"
            graph_inputs[name] = key
            shape, dtype = values[name].shape, values[name].dtype
            if ("in", shape, dtype) not in buffers:
                buffers["in", shape, dtype] = rng.standard_normal(shape).astype(dtype)
            feeds_[key] = buffers["in", shape, dtype]
        return graph_inputs[name]

    def weight(value: np.ndarray) -> str:
        key = f"w{len(inits)}"
        inits[key] = numpy_helper.from_array(np.ascontiguousarray(value), key)
        return key

    groups: dict = {}
    rest = []
    for node in nodes:
        a, b = node.input[0], node.input[1]
        if (joined and node.op_type == "MatMul" and a not in const and b in const and values[b].ndim == 2):
            groups.setdefault((a, values[b].shape[0]), []).append(b)
        else:
            rest.append(node)
    for (a, _), weights in groups.items():
        out = f"y{len(outputs)}"
        w = np.concatenate([values[b] for b in weights], axis=1) if len(weights) > 1 else values[weights[0]]
        new_nodes.append(helper.make_node("MatMul", [activation(a), weight(w)], [out]))
        outputs.append(out)
    for node in rest:
        ins = []
        for name in node.input:
            if not name:
                ins.append("")
            elif name in const:
                ins.append(weight(values[name]))
            else:
                ins.append(activation(name))
        out = f"y{len(outputs)}"
        copy = helper.make_node(node.op_type, ins, [out])
        copy.attribute.extend(node.attribute)
        new_nodes.append(copy)
        outputs.append(out)
    graph = helper.make_graph(
        new_nodes, "products",
        [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for k, v in feeds_.items()],
        [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None) for o in outputs],
        list(inits.values()))
    model = helper.make_model(graph, opset_imports=opset)
    out_buffers = {}
    for arg in onnx.shape_inference.infer_shapes(model, strict_mode=True).graph.output:
        shape = tuple(d.dim_value for d in arg.type.tensor_type.shape.dim)
        if not all(shape):
            raise RuntimeError(f"shape inference left {arg.name} of the floor model without a static shape: {shape}")
        dtype = helper.tensor_dtype_to_np_dtype(arg.type.tensor_type.elem_type)
        out_buffers[arg.name] = buffers.setdefault(("out", shape, dtype), np.empty(shape, dtype))
    return model, feeds_, out_buffers


def macs(nodes: list, values: dict) -> int:
    total = 0
    for node in nodes:
        a, b = values[node.input[0]], values[node.input[1]]
        if node.op_type == "MatMul":
            total += int(np.prod(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) or (1,))) * a.shape[-2] * a.shape[-1] \
                * b.shape[-1]
        elif node.op_type == "Gemm":
            trans_a = any(x.name == "transA" and x.i for x in node.attribute)
            trans_b = any(x.name == "transB" and x.i for x in node.attribute)
            m, k = a.shape[::-1] if trans_a else a.shape
            total += m * k * (b.shape[0] if trans_b else b.shape[1])
        else:  # Conv: output elements x (in channels / groups) x kernel
            group = next((x.i for x in node.attribute if x.name == "group"), 1)
            strides = next((list(x.ints) for x in node.attribute if x.name == "strides"), [1] * (b.ndim - 2))
            pads = next((list(x.ints) for x in node.attribute if x.name == "pads"), [0] * 2 * (b.ndim - 2))
            spatial = [(a.shape[2 + i] + pads[i] + pads[i + b.ndim - 2] - b.shape[2 + i]) // strides[i] + 1
                       for i in range(b.ndim - 2)]
            total += a.shape[0] * b.shape[0] * int(np.prod(spatial)) * (a.shape[1] // group) * int(np.prod(b.shape[2:]))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--src-len", type=int, default=32, help="source tokens (text encoders; Whisper's is fixed)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--optimum", type=Path, help="Optimum's export (default: OUT/optimum-speech for Whisper, "
                        "else OUT/optimum)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    out, n = args.out, args.new_tokens
    optimum_dir = args.optimum or next((out / d for d in ("optimum-speech", "optimum") if (out / d).is_dir()), None)
    if optimum_dir is None or not (optimum_dir / "decoder_model_merged.onnx").is_file():
        parser.error(f"no Optimum export with decoder_model_merged.onnx under {optimum_dir or out}: run "
                     f"`seq2trt bench {out} --backends optimum` once, or pass --optimum DIR")
    rng = np.random.default_rng(0)
    results = []
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        p = n // 2
        enc_dims = {"B": b, "P": 0, "S": args.src_len}
        ours_enc = session(str(out / "fused/ort/encoder.onnx"), "ORT_ENABLE_BASIC")
        enc_in = feeds(ours_enc, enc_dims, rng)
        s = ours_enc.run(["encoder_hidden_states"], enc_in)[0].shape[1]  # Whisper: 1500 frames, whatever --src-len
        dims = {"B": b, "P": p, "S": s}
        ours_dec = session(str(out / "fused/ort/decoder.onnx"), "ORT_ENABLE_BASIC")
        dec_in = feeds(ours_dec, dims, rng)
        opt_enc = session(str(optimum_dir / "encoder_model.onnx"), "ORT_ENABLE_ALL")
        opt_dec = session(str(optimum_dir / "decoder_model_merged.onnx"), "ORT_ENABLE_ALL")
        runs = {"ours encoder": Bound(ours_enc, enc_in), "ours step": Bound(ours_dec, dec_in),
                "optimum encoder": Bound(opt_enc, {a.name: enc_in[a.name] for a in opt_enc.get_inputs()}),
                "optimum first step": Bound(opt_dec, feeds(opt_dec, {"B": b, "P": 1, "S": s, "use_cache": False}, rng)),
                "optimum step": Bound(opt_dec, feeds(opt_dec, {**dims, "use_cache": True}, rng))}
        arithmetic = {}
        for graph, inputs in (("encoder", enc_in), ("step", feeds(session(str(out / "decoder.onnx"), "ORT_DISABLE_ALL"),
                                                                   dims, rng))):
            nodes, values, model = products(out / f"{graph if graph == 'encoder' else 'decoder'}.onnx", inputs)
            const = constants(model.graph)
            arithmetic[graph] = {"products": len(nodes), "gmac": macs(nodes, values) / 1e9}
            # activations: their shape and dtype are what the floor needs, not their values
            values = {k: v if k in const else np.broadcast_to(np.zeros((), v.dtype), v.shape) for k, v in values.items()}
            buffers: dict = {}
            for joined in (False, True):
                fm, ff, fo = floor_model(nodes, values, const, model.opset_import, joined, rng, buffers)
                runs[f"floor {graph} {'joined' if joined else 'separate'}"] = Bound(session(fm, "ORT_ENABLE_BASIC"), ff,
                                                                                    fo)
            del model, values
        for bound in runs.values():  # warm-up: first-run allocations and prepacking
            bound.run()
        times = {k: [] for k in runs}
        for _ in range(args.repeats):
            for key, bound in runs.items():
                times[key].append(bound.run())
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        ours = med["ours encoder"] + n * med["ours step"]
        optimum = med["optimum encoder"] + med["optimum first step"] + (n - 1) * med["optimum step"]
        floors = {j: med[f"floor encoder {j}"] + n * med[f"floor step {j}"] for j in ("separate", "joined")}
        row = {"batch_rows": b, "src_len": s, "past": p, "new_tokens": n, "median_ms": med, "arithmetic": arithmetic,
               "decode_ms": {"ours": ours, "optimum": optimum, **{f"floor {j}": v for j, v in floors.items()}},
               "ours_vs_optimum": optimum / ours, "ceiling_vs_optimum": optimum / floors["joined"],
               "step_ceiling_vs_optimum": med["optimum step"] / med["floor step joined"],
               "encoder_ceiling_vs_optimum": (med["optimum encoder"] + med["optimum first step"] - med["optimum step"])
               / med["floor encoder joined"]}
        results.append(row)
        print(f"\nB x K = {b} rows, source {s}, step at past {p}, {n} new tokens; median of {args.repeats}, ms")
        for key, value in med.items():
            print(f"  {key:28s} {value:10.3f}")
        for graph, figures in arithmetic.items():
            gflops = 2 * figures["gmac"] / (med[f"floor {graph} joined"] / 1e3)
            print(f"  {graph} products: {figures['products']}, {figures['gmac']:.3f} GMAC, "
                  f"{gflops:.1f} GFLOP/s joined")
        print(f"  decode: ours {ours:.1f}, optimum {optimum:.1f}, floor separate {floors['separate']:.1f}, "
              f"joined {floors['joined']:.1f}")
        print(f"  ours / optimum speed {row['ours_vs_optimum']:.3f}x; ceiling (optimum / joined floor) "
              f"{row['ceiling_vs_optimum']:.3f}x; step ceiling {row['step_ceiling_vs_optimum']:.3f}x; "
              f"encoder ceiling {row['encoder_ceiling_vs_optimum']:.3f}x")
        del runs
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
