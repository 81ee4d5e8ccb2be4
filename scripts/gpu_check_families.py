"""T5 and Whisper end to end on one device: seq2trt's routes against transformers' own `generate` on the same device.

    python scripts/gpu_check_families.py OUT.json [--aot-index INDEX.json] [--device cuda|cpu] [--small]

Per family, a random model made with transformers' config class (tests/helpers/hf_models.py, the suite's
makers; wider on CUDA: head_dim 64, the kernels' T5 shape) is imported (`load_hf_as_model`), and each route decodes
seeded sources greedy and with beam 4; every row must equal transformers' `generate` on the same device (fp32, TF32
off), and each route's greedy tokens/s stands beside transformers'. Routes:
- `eager`: seq2trt's eager model on the device;
- `kernels_triton`, `kernels_cubin` (CUDA; cubin with --aot-index): every attention block through the plugin's
  kernels (T5's position bias included), by triton's JIT and by the AOT cubins as the TensorRT plugin launches them;
- ONNX Runtime's CUDA provider (the `ort-cuda` backend) is the `ort_cuda` step's, benchmarks/gpu_runtime.py:
  it times and judges the same two families there.
`--device cpu --small` runs the same code on a CPU in seconds (tests/test_gpu_check.py), so the check cannot rot
unseen. Exit 1 when a route's tokens differ from transformers'.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES, NEW_TOKENS, BEAM = 8, 16, 4
WIDE = {"t5": dict(vocab_size=512, d_model=512, d_kv=64, num_heads=8, d_ff=1024, num_layers=3, num_decoder_layers=3,
                   relative_attention_num_buckets=32, relative_attention_max_distance=128),
        "whisper": dict(d_model=256, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=512,
                        decoder_ffn_dim=512)}
SMALL_WIDTH = 32  # the makers' d_model; wider models get their init std scaled by sqrt(32 / d_model)


def _make(family: str, folder: Path, small: bool) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.hf_models import t5_model_dir, whisper_model_dir

    config = {} if small else WIDE[family]
    width = (SMALL_WIDTH / config.get("d_model", SMALL_WIDTH)) ** 0.5
    if family == "t5":
        return t5_model_dir(folder, "t5", config, seed=1, std=0.35 * width)
    return whisper_model_dir(folder, config, seed=1, std=0.3 * width)


def _decoders(family: str, src: Path, device: str):
    """(ours(step_model, beam) -> rows, theirs(beam) -> rows, the eager model)."""
    import numpy as np
    import torch

    from seq2trt.reference_model.decoding import DecodeSettings, greedy_decode, hf_beam_search
    from seq2trt.hf_import.importer import load_hf_as_model
    from seq2trt.hf_import.proof import load_transformers_model, seeded_sources
    from seq2trt.hf_import.speech_proof import whisper_generated
    from seq2trt.reference_model.sources import source_kind
    from seq2trt.reference_model.speech import SpeechTokens, transcribe_features
    from seq2trt.reference_model.vocab import pad_batch

    _, model, gen, _ = load_hf_as_model(src)
    model = model.to(device).eval()
    hf_model = load_transformers_model(src, speech=family == "whisper").to(device)
    cfg, lp, es = model.cfg, gen.get("length_penalty", 1.0), gen.get("early_stopping", False)
    if family == "whisper":
        features = np.stack(source_kind(cfg).random(np.random.default_rng(0), SOURCES))
        speech = SpeechTokens.from_record(gen["speech"])

        def ours(step, beam):
            return transcribe_features(step, cfg, speech, features, language="en", task="transcribe",
                                       beam_size=beam, length_penalty=lp, early_stopping=es,
                                       max_new_tokens=NEW_TOKENS, generation=gen)

        def theirs(beam):
            with torch.inference_mode():
                out = hf_model.generate(input_features=torch.as_tensor(features, device=device), language="en",
                                        task="transcribe", max_new_tokens=NEW_TOKENS, num_beams=beam,
                                        length_penalty=lp, early_stopping=es, return_dict_in_generate=True)
            return whisper_generated(out.sequences.cpu(), 3, cfg.eos_id)
        return ours, theirs, model
    ids, mask = pad_batch(seeded_sources(cfg, SOURCES, seed=0), cfg.pad_id)
    settings = DecodeSettings.for_model(cfg, NEW_TOKENS, gen)

    def ours(step, beam):
        return greedy_decode(step, ids, mask, settings) if beam == 1 else \
            hf_beam_search(step, ids, mask, settings, beam, lp, es)

    def theirs(beam):
        with torch.inference_mode():
            rows = hf_model.generate(input_ids=torch.as_tensor(ids, device=device),
                                     attention_mask=torch.as_tensor(mask, device=device), max_new_tokens=NEW_TOKENS,
                                     do_sample=False, num_beams=beam, length_penalty=lp, early_stopping=es,
                                     )[:, 1:].tolist()
        return [r[: r.index(cfg.eos_id)] if cfg.eos_id in r else r for r in rows]
    return ours, theirs, model


def _timed(fn) -> tuple[list, float]:
    """fn()'s rows and its generated tokens per second (each row's tokens plus its eos)."""
    import torch

    fn()  # warm-up: kernels compile, caches fill
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    rows = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return rows, sum(len(r) + 1 for r in rows) / (time.perf_counter() - start)


def routes(model, device: str, aot_index: Path | None) -> dict:
    """name -> a context manager under which the eager model is that route."""
    found = {"eager": contextlib.nullcontext}
    if device == "cuda":
        from seq2trt.plugins.eager_kernels import cubin_run, kernel_attention, triton_run

        found["kernels_triton"] = lambda: kernel_attention(model, triton_run)
        if aot_index is not None:
            import torch

            from seq2trt.plugins.cuda_launcher import CudaDriverLauncher

            major, minor = torch.cuda.get_device_capability()
            launcher = CudaDriverLauncher(aot_index, 10 * major + minor)
            found["kernels_cubin"] = lambda: kernel_attention(model, cubin_run(launcher))
    return found


def check_family(family: str, device: str, small: bool, aot_index: Path | None) -> dict:
    from seq2trt.reference_model.eager import EagerStepModel

    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs, model = _decoders(family, _make(family, Path(tmp) / family, small), device)
        want = {beam: _timed(lambda b=beam: theirs(b)) for beam in (1, BEAM)}
        doc = {"transformers": {"greedy_tokens_per_s": round(want[1][1], 1),
                                "beam_tokens_per_s": round(want[BEAM][1], 1),
                                "greedy_mean_tokens": sum(map(len, want[1][0])) / SOURCES},
               "heads": model.cfg.num_heads, "head_dim": model.cfg.head_dim, "sources": SOURCES}
        step = EagerStepModel(model, device=device)
        for name, context in routes(model, device, aot_index).items():
            try:
                with context():
                    got = {beam: _timed(lambda b=beam: ours(step, b)) for beam in (1, BEAM)}
                doc[name] = {"greedy_equal": sum(a == b for a, b in zip(got[1][0], want[1][0])),
                             "beam_equal": sum(a == b for a, b in zip(got[BEAM][0], want[BEAM][0])),
                             "greedy_tokens_per_s": round(got[1][1], 1), "beam_tokens_per_s": round(got[BEAM][1], 1)}
                doc[name]["ok"] = doc[name]["greedy_equal"] == doc[name]["beam_equal"] == SOURCES
            except Exception as exc:  # noqa: BLE001  recorded; the other routes still run
                doc[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return doc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--aot-index", type=Path, help="index.json of `python -m seq2trt.plugins.kernels.aot`")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--small", action="store_true", help="the test suite's tiny models (a CPU run in seconds)")
    parser.add_argument("--sources", type=int, default=SOURCES, help="sources decoded per family")
    return parser


def main(argv: list[str] | None = None) -> int:
    global SOURCES
    args = build_parser().parse_args(argv)
    SOURCES = args.sources
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device visible to torch; use --device cpu --small for a CPU run")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32 on both sides
    report = {family: check_family(family, args.device, args.small, args.aot_index) for family in ("t5", "whisper")}
    report["ok"] = all(r.get("ok") for family in ("t5", "whisper") for name, r in report[family].items()
                       if isinstance(r, dict) and "ok" in r)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for family in ("t5", "whisper"):
        r = report[family]
        print(f"{family} (H{r['heads']} d{r['head_dim']}): transformers {r['transformers']['greedy_tokens_per_s']} "
              f"tokens/s greedy")
        for name, route in r.items():
            if isinstance(route, dict) and "ok" in route:
                print(f"  {name:16s} " + (f"greedy {route['greedy_equal']}/{SOURCES} beam {route['beam_equal']}/"
                                          f"{SOURCES} equal, {route['greedy_tokens_per_s']} tokens/s greedy"
                                          if "error" not in route else route["error"]))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
