"""The Python half of `scripts/gpu_check.sh`: each GPU-only check as a subcommand writing one JSON file.

    python scripts/gpu_check.py env OUT.json
    python scripts/gpu_check.py eager CKPT OUT.json [AOT_INDEX]   # eager CUDA, and with the kernels
    python scripts/gpu_check.py pipeline CKPT EXPORT_DIR OUT.json
    python scripts/gpu_check.py bench CKPT EXPORT_DIR OUT.json    # seq2trt bench: eager CPU/CUDA, ORT, TRT
    python scripts/gpu_check.py tensorrt OUT.json
    python scripts/gpu_check.py checkpoint OUT_DIR                # here: the demo checkpoint, to carry

Every subcommand records what it could not do and why, rather than failing silently; it exits non-zero only
when a check ran and failed.
"""

from __future__ import annotations

import contextlib
import json
import platform
import sys
import time
import traceback
from pathlib import Path


def _write(path: str, doc: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(json.dumps(doc, default=str)[:2000])


def env(out: str) -> int:
    import torch

    from seq2trt.exporters.tensorrt import trt_compat

    doc = {"python": platform.python_version(), "torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        doc |= {"gpu": props.name, "compute_capability": f"{props.major}.{props.minor}",
                "memory_gib": round(props.total_memory / 2**30, 1), "torch_cuda": torch.version.cuda}
    for name in ("triton", "onnxruntime", "onnx", "cuda.bindings", "cupy"):
        try:
            module = __import__(name, fromlist=["__version__"])
            doc[name] = getattr(module, "__version__", "present")
        except Exception as exc:  # noqa: BLE001  an environment report records every failure
            doc[name] = f"unavailable: {exc}"
    try:
        doc |= _ort_cuda_probe()
    except ImportError:
        pass
    doc["tensorrt_flavours"] = {f.value: trt_compat.available(f) for f in trt_compat.Flavour}
    _write(out, doc)
    return 0


def _ort_cuda_probe() -> dict:
    """onnxruntime's providers, and whether a one-node graph runs on the CUDA provider (onnxruntime-gpu finds its
    CUDA libraries through the nvidia-* wheels torch installed: `preload_dlls`)."""
    import numpy as np
    import onnxruntime
    from onnx import TensorProto, helper

    doc = {"onnxruntime_file": onnxruntime.__file__}
    if hasattr(onnxruntime, "preload_dlls"):
        try:
            onnxruntime.preload_dlls()
        except Exception as exc:  # noqa: BLE001  recorded: the session below says whether it mattered
            doc["preload_dlls"] = f"{type(exc).__name__}: {exc}"
    doc["onnxruntime_providers"] = onnxruntime.get_available_providers()
    if "CUDAExecutionProvider" not in doc["onnxruntime_providers"]:
        return doc
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "probe", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    try:
        session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CUDAExecutionProvider"])
        got = session.run(None, {"x": np.array([1.0, 2.0], np.float32)})[0].tolist()
        doc["cuda_provider_session"] = {"providers": session.get_providers(), "ok": got == [2.0, 4.0]}
    except Exception as exc:  # noqa: BLE001
        doc["cuda_provider_session"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return doc


def _greedy_tokens_per_s(step_model, ids, mask, settings, repeats: int = 3) -> float:
    from seq2trt.reference_model.decoding import greedy_decode

    greedy_decode(step_model, ids, mask, settings)  # warm-up
    start, tokens = time.perf_counter(), 0
    for _ in range(repeats):
        tokens += sum(len(o) + 1 for o in greedy_decode(step_model, ids, mask, settings))
    return tokens / (time.perf_counter() - start)


def eager(checkpoint: str, out: str, aot_index: str | None = None) -> int:
    """The demo checkpoint on CUDA against the same model on the CPU: held-out exact match, sequence agreement and
    greedy tokens/s; then the same CUDA model with every attention block computed by the plugin's kernels
    (`plugins.eager_kernels`): through triton's JIT, and with `aot_index` through the AOT cubins launched as the
    TensorRT plugin's enqueue launches them — the kernels end to end where no TensorRT runs."""
    import torch

    from seq2trt.plugins.eager_kernels import cubin_run, kernel_attention, triton_run
    from seq2trt.reference_model.checkpoint import load_checkpoint
    from seq2trt.reference_model.decoding import DecodeSettings, beam_search, greedy_decode
    from seq2trt.reference_model.eager import EagerStepModel
    from seq2trt.reference_model.tasks import get_task
    from seq2trt.reference_model.vocab import pad_batch

    if not torch.cuda.is_available():
        _write(out, {"skipped": "no CUDA device"})
        return 1
    model, _ = load_checkpoint(Path(checkpoint))  # stays on the CPU
    gpu_model, _ = load_checkpoint(Path(checkpoint))
    metrics = json.loads((Path(checkpoint) / "metrics.json").read_text())
    task = get_task(metrics["task"])
    cfg = model.cfg
    settings = DecodeSettings.for_model(cfg)
    pairs = task.heldout(1000)
    ids, mask = pad_batch([task.source_vocab.encode(s) + [cfg.eos_id] for s, _ in pairs])
    cpu, gpu = EagerStepModel(model), EagerStepModel(gpu_model.cuda(), device="cuda")

    cpu_outputs = greedy_decode(cpu, ids, mask, settings)
    cpu_beam = beam_search(cpu, ids[:200], mask[:200], settings, beam_size=4)
    runs = {"eager": contextlib.nullcontext}
    runs["kernels_triton"] = lambda: kernel_attention(gpu_model, triton_run)
    if aot_index:
        from seq2trt.plugins.cuda_launcher import CudaDriverLauncher

        major, minor = torch.cuda.get_device_capability()
        launcher = CudaDriverLauncher(Path(aot_index), 10 * major + minor)
        runs["kernels_cubin"] = lambda: kernel_attention(gpu_model, cubin_run(launcher))
    doc = {"heldout_examples": len(pairs), "heldout_exact_match_cpu": task.exact_match(cpu_outputs, pairs),
           "beam_examples": len(cpu_beam)}
    ok = True
    for name, context in runs.items():
        try:
            with context():
                outputs = greedy_decode(gpu, ids, mask, settings)
                beam = beam_search(gpu, ids[:200], mask[:200], settings, beam_size=4)
                speed = {f"B{b}": _greedy_tokens_per_s(gpu, ids[:b], mask[:b], settings) for b in (1, 32)}
            doc[name] = {"heldout_exact_match": task.exact_match(outputs, pairs),
                         "greedy_sequence_match_vs_cpu": sum(a == b for a, b in zip(outputs, cpu_outputs)) / len(pairs),
                         "beam_sequence_match_vs_cpu": sum(a == b for a, b in zip(beam, cpu_beam)) / len(cpu_beam),
                         "greedy_tokens_per_s": speed}
            ok &= doc[name]["heldout_exact_match"] >= 0.95 and doc[name]["greedy_sequence_match_vs_cpu"] >= 0.99
        except Exception as exc:  # noqa: BLE001  recorded; the other routes still run
            doc[name], ok = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=6)}, False
    doc["cpu_greedy_tokens_per_s"] = {f"B{b}": _greedy_tokens_per_s(cpu, ids[:b], mask[:b], settings) for b in (1, 32)}
    _write(out, doc)
    return 0 if ok else 1


def pipeline(checkpoint: str, export_dir: str, out: str) -> int:
    """Export, fuse and validate the demo checkpoint with ONNX Runtime's CUDA provider. Without onnxruntime-gpu
    this is the CPU path CI already covers on every commit, so the check records that and spends no GPU time."""
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        _write(out, {"skipped": "onnxruntime here has no CUDAExecutionProvider (no onnxruntime-gpu); the CPU "
                                "provider's validation is what CI runs",
                     "providers": onnxruntime.get_available_providers()})
        return 0
    from seq2trt.exporters.fuse import Target, fuse_artifacts
    from seq2trt.exporters.onnx_export import export
    from seq2trt.reference_model.checkpoint import load_checkpoint, source_record
    from seq2trt.core.errors import Seq2TrtError
    from seq2trt.validation.validate import ValidateSettings, run_validation

    model, _ = load_checkpoint(Path(checkpoint))
    export(model, Path(export_dir), force=True, source=source_record(Path(checkpoint)))
    for target in Target:
        fuse_artifacts(Path(export_dir), target, force=True)
    doc, failed = {}, 0
    for graphs in ("plain", "fused-ort", "fused-trt"):
        try:
            result = run_validation(Path(export_dir), ValidateSettings(graphs=graphs, samples=200, device="auto",
                                                                       threads=0))
            doc[graphs] = {"passed": result["passed"], "end_to_end": result["end_to_end"]}
        except Seq2TrtError as exc:
            doc[graphs], failed = {"passed": False, "error": str(exc)}, 1
    doc["provider"] = "cuda"
    _write(out, doc)
    return failed


def bench(checkpoint: str, export_dir: str, out: str) -> int:
    """`seq2trt bench` of the demo export on this machine: eager on the CPU and on CUDA, ONNX Runtime (the export and
    the fused graphs), and TensorRT where engines were built; exports and fuses first when `export_dir` has no
    export yet. Writes the tokens/s, ratios and threading to OUT.json, and latency.md beside it."""
    import shutil

    from seq2trt.exporters.fuse import Target, fuse_artifacts, fused_dir
    from seq2trt.exporters.onnx_export import export
    from seq2trt.reference_model.checkpoint import load_checkpoint, source_record
    from seq2trt.validation.bench.measure import run_bench
    from seq2trt.validation.bench.settings import BenchSettings, available_backends

    export_path = Path(export_dir)
    if not (export_path / "manifest.json").exists():
        model, _ = load_checkpoint(Path(checkpoint))
        export(model, export_path, force=True, source=source_record(Path(checkpoint)))
    if not fused_dir(export_path, Target.ORT).is_dir():
        fuse_artifacts(export_path, Target.ORT)
    wanted = ("eager", "eager-cuda", "ort", "ort-fused", "tensorrt", "tensorrt-rtx")
    here = available_backends(export_path)
    backends = tuple(b for b in wanted if b in here and (not b.startswith("tensorrt") or
                                                          any((export_path / "engines").glob(f"{b}-*"))))
    start = time.perf_counter()
    doc = run_bench(export_path, BenchSettings(backends=backends, batch_sizes=(1, 32), repeats=5, warmup=1))
    shutil.copy(export_path / "reports" / "latency.md", Path(out).with_suffix(".md"))
    tokens_per_s = {t: {b: {n: r["tokens_per_s"] for n, r in by_batch.items()} for b, by_batch in res.items()}
                    for t, res in doc["results"].items()}
    summary = {"backends": backends, "not_run": [b for b in wanted if b not in backends],
               "seconds": round(time.perf_counter() - start, 1), "machine": doc["machine"],
               "threading": doc["threading"], "tokens_per_s": tokens_per_s, "ratios": doc["ratios"]}
    _write(out, summary)
    return 0


def tensorrt(out: str) -> int:
    """Per flavour: does it load, can it target this GPU; where both, build the demo-sized tiny export's engines
    and compare one encoder and one decoder call against ONNX Runtime on the same graphs."""
    from seq2trt.exporters.tensorrt import trt_compat

    cc = trt_compat.current_compute_capability()
    doc, failed = {"compute_capability": cc}, 0
    for flavour in trt_compat.Flavour:
        targets = trt_compat.FLAVOURS[flavour].explicit_targets
        if not trt_compat.available(flavour):
            doc[flavour.value] = "not installed: no engine can be built or run here"
        elif cc is None:
            doc[flavour.value] = "loads, but there is no GPU to run an engine on"
        elif targets and cc not in targets:
            doc[flavour.value] = f"loads, but cannot target this GPU (sm_{cc}); its targets: {list(targets)}"
        else:
            try:
                doc[flavour.value] = _engines_vs_ort(flavour)
                failed |= not doc[flavour.value]["passed"]
            except Exception as exc:  # noqa: BLE001  recorded, and the step fails
                doc[flavour.value], failed = {"passed": False, "error": repr(exc)}, 1
    _write(out, doc)
    return failed


def _engines_vs_ort(flavour) -> dict:
    """`seq2trt validate --backend <flavour>` on the engines of a tiny model: graph-level parity over the spec's
    sweep and end-to-end decoding against the float64 eager model, judged as every other backend is."""
    import tempfile

    import torch

    from seq2trt.exporters.fuse import Target, fuse_artifacts
    from seq2trt.exporters.onnx_export import export
    from seq2trt.exporters.tensorrt.engines import EngineRequest, build_engines
    from seq2trt.exporters.tensorrt import trt_compat
    from seq2trt.reference_model import Seq2SeqTransformer, preset
    from seq2trt.reference_model.checkpoint import save_checkpoint, source_record
    from seq2trt.core.errors import CheckFailed
    from seq2trt.validation.validate import ValidateSettings, run_validation

    torch.manual_seed(0)
    model = Seq2SeqTransformer(preset("tiny", src_vocab_size=13, tgt_vocab_size=17)).eval()
    root = Path(tempfile.mkdtemp())
    checkpoint = save_checkpoint(root / "ckpt", model)
    out = export(model, root / "tiny", source=source_record(checkpoint))
    fuse_artifacts(out, Target.TRT)
    engine_dir = build_engines(out, EngineRequest(flavour.value, trt_compat.parse_targets(flavour, "current")))
    try:
        doc = run_validation(out, ValidateSettings(backend=flavour.value, samples=64, localize_budget_s=0))
    except CheckFailed as exc:
        return {"engines": str(engine_dir), "passed": False, "failures": str(exc)}
    return {"engines": str(engine_dir), "passed": doc["passed"], "graphs": doc["graphs"],
            "end_to_end": doc["end_to_end"]}


def checkpoint(out: str) -> int:
    """Copy the demo checkpoint (trained once and cached here) to `out`, for carrying to the GPU machine."""
    import shutil

    from seq2trt.reference_model.train import demo_checkpoint

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(demo_checkpoint(), out)
    print(f"demo checkpoint -> {out}")
    return 0


COMMANDS = {"env": env, "eager": eager, "pipeline": pipeline, "bench": bench, "tensorrt": tensorrt,
            "checkpoint": checkpoint}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(__doc__)
        return 2
    try:
        return COMMANDS[argv[0]](*argv[1:])
    except Exception:  # noqa: BLE001  the check script logs every failure and goes on to the next step
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
