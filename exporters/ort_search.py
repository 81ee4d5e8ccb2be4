"""The whole search in one ONNX Runtime graph: `com.microsoft.BeamSearch` (model_type 1, the T5 layout) whose
encoder and decoder subgraphs are the fused ORT graphs (`seq2trt fuse --target ort`), unchanged inside.

`seq2trt ort-search OUT` writes OUT/generate/ort/generate.onnx and generate.json (the sha256 of the fused graphs it
was built from; `verify_generate` refuses stale or modified files). Only the I/O is adapted to ONNX Runtime's
contract (onnxruntime/transformers/convert_generation.py `verify_t5_*`, contrib_ops/cpu/transformers/
subgraph_t5_*.cc): int32 ids and masks (a Cast to our int64 inside), `encoder_hidden_states` dropped, KV tensors
renamed `past_key_self_{i}` / `past_key_cross_{i}` / `present_key_self_{i}` (and `value`), decoder `input_ids`
declared (batch, 1) — with a symbolic length ONNX Runtime feeds the whole sequence at every step.

Semantics (ONNX Runtime 1.32's CPU BeamSearch, read in beam_search_scorer.cc and logits_processor.cc, and tested
against `reference_model.decoding` in tests/exporters/test_ort_search.py):
- Hugging Face's beam search with `early_stopping=True` (`hf_beam_search(..., early_stopping=True)`): float32
  log-softmax, the 2K best continuations per source, an eos among the K best closes a hypothesis scored
  `sum_logprobs / length ** length_penalty`, length = generated tokens with eos; a source stops once K hypotheses
  closed. The graph is always built with early_stopping=1: ORT's early_stopping=0 heuristic is not Hugging
  Face's (it takes the best of the 2K candidates, eos included, read at offset batch x K instead of batch x 2K).
- max_length counts the decoder start token: max_length = max_new_tokens + 1.
- One difference remains, only for sources where fewer than K hypotheses closed with eos before the length limit:
  ORT scores the beams cut by the limit with length max_new_tokens + 1 (the start token counts) where Hugging
  Face uses max_new_tokens, and adds the K best live beams where Hugging Face adds the K best candidates. With
  length_penalty 0, or when the best hypothesis is one of the cut ones in both, the output is the same.
- min_length: ORT masks eos while the sequence, the start token included, is shorter than its min_length input
  (MinLengthLogitsProcessor, after the log-softmax as Hugging Face's processors run in beam search): Hugging Face's
  min_length exactly, and min_new_tokens N is min_length N + 1; both at once are their max.
- repetition_penalty (a runtime input): ORT's RepetitionPenaltyLogitsProcessor multiplies the (log-softmax, so
  negative) score of every id in the sequence so far, the start token included, by the penalty (divides a
  positive one): Hugging Face's RepetitionPenaltyLogitsProcessor over input_ids. Graphs built before it was an
  input (generate.json without semantics.repetition_penalty) run with penalty 1 and refuse another. With one beam
  (ORT's greedy search) the outputs differ from Hugging Face's greedy search, which penalises the raw logits
  (tested): the runner refuses repetition_penalty with num_beams 1.
- no_repeat_ngram_size is an attribute of the op, so a build-time setting: `seq2trt ort-search` takes the model's
  own (generation.json), or --no-repeat-ngram-size N; ORT bans every id that would repeat an n-gram of the
  sequence so far, the start token included, as Hugging Face's NoRepeatNGramLogitsProcessor over input_ids. A
  decode asking another value is refused (rebuild), as are graphs built before it was recorded (they hold 0).
- num_return_sequences (a runtime input, <= num_beams) returns the n best closed hypotheses of each source, best
  first, and `sequences_scores` their scores (Hugging Face's sequences_scores: sum_logprobs / length **
  length_penalty). ORT scores a hypothesis the length limit closed over its length with the start token
  (sum / (L + 1) ** lp); the runner rescales it to Hugging Face's sum / L ** lp (tested). Graphs built before
  these (generate.json without semantics.num_return_sequences) return one sequence and no score, and refuse more.
- num_beams 1 is greedy search (`greedy_decode`): the first eos closes the only hypothesis.
- pad_token_id is set to eos: ORT pads the sequences after the end with it (the hypothesis itself has no eos), so
  the output is cut at the first eos exactly even when the pad id is a real token; the encoder mask is an input
  (`attention_mask`), not derived from pad ids.
- The model's rules: suppressed ids -> `vocab_mask` (an initializer: ORT sets them to float's lowest after the
  log-softmax, as Hugging Face's -inf); a forced first token -> inside the decoder subgraph, at past length 0 the
  logits become 0 at the forced id and -inf elsewhere, so its log-probability is 0 as Hugging Face's
  ForcedBOSTokenLogitsProcessor makes it (ORT's prefix_vocab_mask would keep its log-probability and change the
  ranking under a length penalty). A forced last eos (Marian's forced_eos_token_id) likewise, at past length
  max_length - 2: the decoder subgraph reads the main graph's `max_length` from the outer scope.
- Exports for beam need max_batch >= B x K (the subgraphs run B x K rows): the runner refuses larger requests.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from seq2trt.reference_model.config import Seq2SeqConfig
from seq2trt.core.errors import ArtifactError, InputError
from seq2trt.core.atomic_files import atomic_write_text
from seq2trt.core.swap import staged_directory

from seq2trt.exporters import graph_files, spec
from seq2trt.reference_model.checkpoint import generation_config
from seq2trt.core.layout import GENERATE_JSON, generate_dir
from seq2trt.exporters.artifact_checks import load_graph
from seq2trt.exporters.fuse import Target, fused_dir, verify_fused
from seq2trt.exporters.fuse_ort import MS_DOMAIN
from seq2trt.exporters.manifest import Manifest, checkpoint_folder, verify

logger = logging.getLogger(__name__)

FILENAME = "generate.onnx"
EARLY_STOPPING = True  # the only setting whose semantics equal Hugging Face's (module docstring)
# The main graph's inputs, in the BeamSearch node's input order (ORT's names; "" = an unused optional input).
RUNTIME_INPUTS = ("input_ids", "max_length", "min_length", "num_beams", "num_return_sequences", "length_penalty",
                  "repetition_penalty", "vocab_mask", "", "attention_mask")
OUTPUTS = ("sequences", "sequences_scores")


def _source_graphs(out: Path, int8: bool, manifest: Manifest | None) -> tuple[Path, dict, str]:
    """(folder, its checked record, the command that remakes it) of the graphs generate.onnx is built from."""
    from seq2trt.exporters.quantize import quantized_dir, verify_quantized

    if int8:
        return quantized_dir(out), verify_quantized(out, manifest), f"seq2trt quantize {out}"
    fusion = verify_fused(out, Target.ORT, manifest)
    if not fusion.get("complete"):
        raise InputError(f"{fused_dir(out, Target.ORT)} is a partial fusion; re-run `seq2trt fuse {out} --target ort "
                         "--force`")
    return fused_dir(out, Target.ORT), fusion, f"seq2trt fuse {out} --target ort"


def ort_kv_name(name: str) -> str:
    """Our KV tensor name -> BeamSearch's: `past_key_values.{i}.decoder.key` -> `past_key_self_{i}`,
    `present.{i}.encoder.value` -> `present_value_cross_{i}`."""
    parts = spec.parse_kv_name(name)
    if parts is None:
        raise ValueError(f"{name!r} is not a KV tensor name")
    return f"{parts.io}_{parts.part}_{'cross' if parts.side == 'encoder' else 'self'}_{parts.layer}"


def _rename(graph: onnx.GraphProto, mapping: dict[str, str], outputs_too: bool = True) -> None:
    """Rename tensors in node inputs (and node outputs and graph inputs, outputs and value_info when `outputs_too`)."""
    for node in graph.node:
        node.input[:] = [mapping.get(n, n) for n in node.input]
        if outputs_too:
            node.output[:] = [mapping.get(n, n) for n in node.output]
    if outputs_too:
        for v in list(graph.input) + list(graph.output) + list(graph.value_info):
            v.name = mapping.get(v.name, v.name)


def _int32_inputs(graph: onnx.GraphProto, new_inputs: dict[str, tuple[str, list]]) -> list[onnx.NodeProto]:
    """Cast nodes from int32 graph inputs (name -> (our int64 tensor, axes)) to the tensors the graph reads."""
    for name, (_, axes) in new_inputs.items():
        graph.input.append(helper.make_tensor_value_info(name, TensorProto.INT32, axes))
    return [helper.make_node("Cast", [name], [inner], to=TensorProto.INT64, name=f"cast_{name}")
            for name, (inner, _) in new_inputs.items()]


def encoder_subgraph(model: onnx.ModelProto, cfg: Seq2SeqConfig) -> onnx.GraphProto:
    """Our fused encoder with BeamSearch's encoder I/O: (encoder_input_ids, encoder_attention_mask) int32 ->
    present_{key,value}_cross_{i}; `encoder_hidden_states` is dropped (the cross K/V carry everything)."""
    graph = onnx.GraphProto()
    graph.CopyFrom(model.graph)
    graph.name = "seq2trt encoder"
    del graph.input[:]
    # Internal names apart from the main graph's `input_ids` / `attention_mask` (one SSA scope with subgraphs).
    _rename(graph, {"input_ids": "input_ids.int64", "attention_mask": "attention_mask.int64"}, outputs_too=False)
    casts = _int32_inputs(graph, {"encoder_input_ids": ("input_ids.int64", [spec.BATCH, spec.SRC_LEN]),
                                  "encoder_attention_mask": ("attention_mask.int64", [spec.BATCH, spec.SRC_LEN])})
    _insert_front(graph, casts)
    keep = [o for o in graph.output if o.name != "encoder_hidden_states"]
    del graph.output[:]
    graph.output.extend(keep)
    _rename(graph, {n: ort_kv_name(n) for n in spec.kv_names(cfg, "encoder", "present")})
    return graph


def decoder_subgraph(model: onnx.ModelProto, cfg: Seq2SeqConfig, dtype: str) -> onnx.GraphProto:
    """Our fused decoder with BeamSearch's decoder I/O (module docstring); forced tokens are applied here."""
    graph = onnx.GraphProto()
    graph.CopyFrom(model.graph)
    graph.name = "seq2trt decoder"
    past = {s.name: s for s in spec.inputs(cfg, spec.GraphKind.DECODER)[2:]}
    _rename(graph, {"input_ids": "input_ids.int64", "encoder_attention_mask": "encoder_attention_mask.int64"},
            outputs_too=False)
    by_name = {v.name: v for v in graph.input}
    del graph.input[:]
    casts = _int32_inputs(graph, {"input_ids": ("input_ids.int64", [spec.BATCH, 1]),
                                  "encoder_attention_mask": ("encoder_attention_mask.int64", [spec.BATCH, spec.SRC_LEN])})
    for side in ("decoder", "encoder"):  # BeamSearch's order: every self K/V, then every cross K/V
        graph.input.extend(by_name[n] for n in spec.kv_names(cfg, side, "past") if n in past)
    _rename(graph, {n: ort_kv_name(n) for n in past} | {n: ort_kv_name(n) for n in spec.kv_names(cfg, "decoder", "present")})
    nodes = casts
    if cfg.forced_bos_id is not None or cfg.forced_eos:
        nodes += _forced_tokens(graph, cfg, dtype)
    _insert_front(graph, nodes)
    return graph


def _forced_tokens(graph: onnx.GraphProto, cfg: Seq2SeqConfig, dtype: str) -> list[onnx.NodeProto]:
    """Hugging Face's forced tokens inside the decoder: at past length 0 (forced bos) and at past length
    max_length - 2 (forced eos: the last position the limit allows; `max_length` is the main graph's input, read
    from the outer scope), the logits become 0 at the forced id and -inf elsewhere, so the log-softmax gives 0 and
    -inf as Hugging Face's processors set them. Eos wins when both fall on one step (as in DecodeSettings.constrain).
    The nodes read `logits.free`, the decoder's own logits, renamed here."""
    for node in graph.node:
        node.output[:] = ["logits.free" if n == "logits" else n for n in node.output]
    first_past = ort_kv_name(spec.kv_name(0, "decoder", "key", "past"))
    nodes = [helper.make_node("Shape", [first_past], ["past_shape"], name="forced_shape"),
             helper.make_node("Gather", ["past_shape", "past_len_axis"], ["past_len"], axis=0, name="forced_len")]
    constants = {"past_len_axis": np.array(2, np.int64), "first_len": np.array(0, np.int64),
                 "last_offset": np.array(2, np.int64)}
    logits = "logits.free"
    for name, token in (("first", cfg.forced_bos_id), ("last", cfg.eos_id if cfg.forced_eos else None)):
        if token is None:
            continue
        forced = np.full((1, 1, cfg.tgt_vocab_size), -np.inf, spec.numpy_dtype(dtype))
        forced[..., token] = 0
        constants[f"{name}_logits"] = forced
        if name == "last":
            nodes += [helper.make_node("Squeeze", ["max_length"], ["max_length_scalar"], name="forced_max_length"),
                      helper.make_node("Cast", ["max_length_scalar"], ["max_length_int64"], to=TensorProto.INT64,
                                       name="forced_max_length_int64"),
                      helper.make_node("Sub", ["max_length_int64", "last_offset"], ["last_len"], name="forced_last_len")]
        nodes += [helper.make_node("Equal", ["past_len", f"{name}_len"], [f"{name}_step"], name=f"forced_{name}_step"),
                  helper.make_node("Where", [f"{name}_step", f"{name}_logits", logits], [f"logits.{name}"],
                                   name=f"forced_{name}")]
        logits = f"logits.{name}"
    nodes[-1].output[:] = ["logits"]
    graph.initializer.extend(onnx.numpy_helper.from_array(v, k) for k, v in constants.items())
    return nodes


def _insert_front(graph: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> None:
    """Prepend `nodes`, except those that read tensors the graph computes (they go last, keeping topological order)."""
    produced = {o for n in graph.node for o in n.output}
    first, last = [], []
    for n in nodes:
        if produced & set(n.input):
            last.append(n)
            produced.update(n.output)
        else:
            first.append(n)
    body = list(graph.node)
    del graph.node[:]
    graph.node.extend(first + body + last)


def build_generate(encoder: onnx.ModelProto, decoder: onnx.ModelProto, cfg: Seq2SeqConfig,
                   dtype: str, no_repeat_ngram_size: int = 0) -> onnx.ModelProto:
    """One BeamSearch node around the fused encoder and decoder (checked graphs of the contract), banning repeated
    n-grams of `no_repeat_ngram_size` (0: off)."""
    if dtype != "fp32":
        raise InputError(f"generate.onnx runs ONNX Runtime's CPU BeamSearch, which takes float32 graphs; this export "
                         f"is {dtype}: export with --dtype fp32 into another folder")
    attrs = dict(eos_token_id=cfg.eos_id, pad_token_id=cfg.eos_id, decoder_start_token_id=cfg.bos_id,
                 early_stopping=int(EARLY_STOPPING), model_type=1, no_repeat_ngram_size=no_repeat_ngram_size,
                 encoder=encoder_subgraph(encoder, cfg), decoder=decoder_subgraph(decoder, cfg, dtype))
    initializers = []
    inputs = list(RUNTIME_INPUTS)
    if cfg.suppress_ids:
        mask = np.ones(cfg.tgt_vocab_size, np.int32)
        mask[list(cfg.suppress_ids)] = 0
        initializers.append(onnx.numpy_helper.from_array(mask, "vocab_mask"))
    else:
        inputs[inputs.index("vocab_mask")] = ""
    node = helper.make_node("BeamSearch", inputs, list(OUTPUTS), name="beam_search", domain=MS_DOMAIN, **attrs)
    i32 = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.INT32, shape)
    # min_length (eos masked while the sequence, start token included, is shorter): Hugging Face's min_length, or
    # min_new_tokens + 1; max_length for bench's forced-length runs. repetition_penalty, num_return_sequences:
    # runtime inputs.
    graph_inputs = [i32("input_ids", ["batch", "src_len"]), i32("max_length", [1]), i32("min_length", [1]),
                    i32("num_beams", [1]), i32("num_return_sequences", [1]),
                    helper.make_tensor_value_info("length_penalty", TensorProto.FLOAT, [1]),
                    helper.make_tensor_value_info("repetition_penalty", TensorProto.FLOAT, [1]),
                    i32("attention_mask", ["batch", "src_len"])]
    graph_outputs = [i32("sequences", ["batch", "num_return_sequences", "max_length"]),
                     helper.make_tensor_value_info("sequences_scores", TensorProto.FLOAT,
                                                   ["batch", "num_return_sequences"])]
    graph = helper.make_graph([node], "seq2trt beam search", graph_inputs, graph_outputs, initializers)
    opsets = {o.domain: o.version for o in list(encoder.opset_import) + list(decoder.opset_import)}
    opsets.setdefault(MS_DOMAIN, 1)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()],
                              producer_name="seq2trt")
    model.ir_version = decoder.ir_version
    return model


def stored_no_repeat_ngram_size(out: Path, manifest: Manifest) -> int:
    """The model's own no_repeat_ngram_size: an imported model's generation settings (those of the checkpoint the
    export was made from, as translate reads them), else 0."""
    value = (generation_config(checkpoint_folder(out, manifest)) or {}).get("no_repeat_ngram_size")
    return 0 if value is None else value


def generate_artifacts(out: Path, force: bool = False, int8: bool = False,
                       no_repeat_ngram_size: int | None = None) -> dict:
    """Write generate.onnx and generate.json into `generate_dir(out, int8)` from the checked fused ORT graphs (or the
    int8 graphs); returns the record. `no_repeat_ngram_size` None: the model's own (`stored_no_repeat_ngram_size`)."""
    import onnxruntime

    out = Path(out)
    manifest = verify(out, [kind.filename for kind in spec.GraphKind])
    cfg = manifest.config
    if spec.audio_source(cfg):
        raise InputError(f"{out} is a speech model (its encoder reads audio features) and generate.onnx wraps an "
                         "encoder of token ids (BeamSearch's model_type 1); decode it through the step graphs: "
                         "--backend ort-fused, ort or ort-int8")
    ngram = stored_no_repeat_ngram_size(out, manifest) if no_repeat_ngram_size is None else no_repeat_ngram_size
    if not isinstance(ngram, int) or isinstance(ngram, bool) or ngram < 0:
        where = ("--no-repeat-ngram-size" if no_repeat_ngram_size is not None
                 else "the model's generation settings: no_repeat_ngram_size")
        raise InputError(f"{where} must be an integer >= 0 (0: off), got {ngram!r}")
    folder, fusion, _ = _source_graphs(out, int8, manifest)
    graphs = {kind: load_graph(folder / kind.filename, cfg, kind, manifest.dtype) for kind in spec.GraphKind}
    model = build_generate(graphs[spec.GraphKind.ENCODER], graphs[spec.GraphKind.DECODER], cfg, manifest.dtype,
                           ngram)
    record = {"op": "com.microsoft.BeamSearch", "model_type": 1, "onnxruntime": onnxruntime.__version__,
              "semantics": {"length_penalty": "sum_logprobs / length ** length_penalty (Hugging Face's)",
                            "early_stopping": EARLY_STOPPING, "max_length": "max_new_tokens + 1 (the start token)",
                            "min_length": "max(min_length, min_new_tokens + 1) (the start token counts)",
                            "repetition_penalty": "runtime input: log-prob * p (< 0) over the ids of the sequence, "
                                                  "start token included (Hugging Face's)",
                            "no_repeat_ngram_size": ngram,
                            "num_return_sequences": "runtime input, <= num_beams: the n best hypotheses, best first",
                            "sequences_scores": "sum_logprobs / length ** length_penalty (Hugging Face's)",
                            "eos_id": cfg.eos_id, "pad_token_id": cfg.eos_id, "decoder_start_token_id": cfg.bos_id,
                            "forced_bos_id": cfg.forced_bos_id, "forced_eos": cfg.forced_eos,
                            "suppress_ids": list(cfg.suppress_ids)},
              "graphs": "int8" if int8 else "fused", "max_rows": manifest.limits.max_batch, "max_length": manifest.limits.max_tgt_len,
              "sources": {kind.filename: graph_files.graph_sha256(fusion["files"], kind.filename)
                          for kind in spec.GraphKind}}
    with staged_directory(generate_dir(out, int8), force, "generation graph") as tmp:
        # the subgraphs' weights stay references into the fused graphs' data files until written (graph_files)
        graph_files.save_graph(model, tmp / FILENAME, base_dir=folder)
        record["files"] = graph_files.file_records(tmp / FILENAME)
        atomic_write_text(tmp / GENERATE_JSON, json.dumps(record, indent=2) + "\n")
    return record


def verify_generate(out: Path, manifest: Manifest | None = None, int8: bool = False) -> dict:
    """Check generate.onnx against generate.json, and that it was built from the current fused (or int8) graphs (and
    those from the current export); returns the record. Anything missing, modified or stale is an ArtifactError."""
    out = Path(out)
    folder, fix = generate_dir(out, int8), f"seq2trt ort-search {out}" + (" --int8" if int8 else "")
    path = folder / GENERATE_JSON
    if not path.exists():
        raise ArtifactError(f"{path} not found; run `{fix}` first")
    _, fusion, _ = _source_graphs(out, int8, manifest)
    try:
        record = json.loads(path.read_text())
        _, sources = record["files"][FILENAME]["sha256"], dict(record["sources"])
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ArtifactError(f"{path} is malformed ({exc!r}); re-run `{fix} --force`") from None
    problems = graph_files.record_problems(folder, record["files"], FILENAME, GENERATE_JSON, "it was written")
    stale = [k.filename for k in spec.GraphKind
             if sources.get(k.filename) != graph_files.graph_sha256(fusion["files"], k.filename)]
    if stale:
        problems.append(f"it was built from older {'int8' if int8 else 'fused'} graphs ({', '.join(stale)} changed "
                        "since)")
    if problems:
        raise ArtifactError(f"{folder} failed its check: " + "; ".join(problems) + f"; re-run `{fix} --force`")
    return record
