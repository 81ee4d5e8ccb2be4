"""Tokens/s of seq2trt's GPU backend (ort-cuda: the fused ONNX Runtime graphs on the CUDA provider, the KV cache on
the GPU) against transformers' fp16 generate on the same GPU, and seq2trt's eager model there (issue 46's targets).

usage: python benchmarks/gpu_runtime.py [--dry-run] [--out DIR] [--shapes whisper-base,flan-t5-base]
                                        [--batches 1,32] [--new-tokens 32] [--repeats 5] [--device cuda]

Two shapes with random weights (built here from transformers' config classes: nothing is downloaded), each
imported into seq2trt (`load_hf_as_model`, transformers' own weights mapped), exported per dtype and fused for
ONNX Runtime. Greedy and beam search (Whisper 5 beams, T5 4), exactly `--new-tokens` new tokens a row (eos masked,
as `seq2trt bench` does), at each batch size; the routes run interleaved, round-robin, each repetition starting
with the next route, and each is timed with the GPU synchronised. Routes:
- `ort-cuda <dtype>`: the registry's ort-cuda backend on the export of that dtype (fp16 for Whisper; flan-t5's
  gated FFN overflows fp16, so bf16 for T5, as `seq2trt export` requires), and fp32 (judged token-equal to eager);
- `eager fp32`: seq2trt's PyTorch model on the GPU (EagerStepModel), the same search loops;
- `transformers fp16`: transformers' generate, the model in fp16 on the GPU (the issue's yardstick; T5: bf16).
It prints one line per (shape, search, batch, route): tokens/s and the ratio to transformers, and writes every
figure to OUT/gpu_runtime.json. Greedy fp32 tokens of ort-cuda are compared with the eager model's.

`--dry-run` resolves all of it on a CPU in seconds, running nothing: each shape's config converts to seq2trt's
(its family adapter), the model builds (on the meta device), each planned dtype passes the exporter's rules, the
export's limits hold every planned row count, the backends are declared with a module that has the backend
interface, and transformers has the model classes. It prints the plan and exits 1 naming anything that does not
resolve. No GPU has run this script yet (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

@dataclass(frozen=True)
class Shape:
    config_class: str  # transformers' config and model classes
    model_class: str
    config: dict  # the released checkpoint's sizes
    beams: int
    dtypes: tuple[str, ...]  # the reduced precision first, then fp32
    generation: dict | None = None  # a generation_config.json (Whisper's prompt tokens)


WHISPER_BASE_IDS = dict(pad_token_id=50257, bos_token_id=50257, eos_token_id=50257, decoder_start_token_id=50258)
SHAPES = {
    "whisper-base": Shape("WhisperConfig", "WhisperForConditionalGeneration", dict(
        vocab_size=51865, d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
        decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048, num_mel_bins=80,
        max_source_positions=1500, max_target_positions=448, begin_suppress_tokens=[220, 50257], suppress_tokens=[],
        **WHISPER_BASE_IDS), 5, ("fp16", "fp32"),
        generation=dict(WHISPER_BASE_IDS, max_length=448, no_timestamps_token_id=50363,
                        begin_suppress_tokens=[220, 50257], suppress_tokens=[], is_multilingual=False)),
    "flan-t5-base": Shape("T5Config", "T5ForConditionalGeneration", dict(
        vocab_size=32128, d_model=768, d_kv=64, num_heads=12, d_ff=2048, num_layers=12, num_decoder_layers=12,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, relative_attention_num_buckets=32,
        relative_attention_max_distance=128, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0),
        4, ("bf16", "fp32")),
}
BACKEND = "ort-cuda"
SRC_LEN = 32  # text sources: tokens a row (Whisper reads its fixed 30 s window of features)


def routes(shape: str) -> list[tuple[str, str]]:
    """(route name, dtype) in the order of a repetition's first turn."""
    reduced = SHAPES[shape].dtypes[0]
    return [(f"{BACKEND} {reduced}", reduced), (f"{BACKEND} fp32", "fp32"), ("eager fp32", "fp32"),
            (f"transformers {reduced}", reduced)]


def export_limits(cfg, rows: int, new_tokens: int):
    """The export's limits: every row a search runs, and the start token plus `new_tokens` positions (the model's
    full target length would put the logits at the limits past what a profile holds at B x K = 160)."""
    from seq2trt.exporters import spec

    return spec.Limits.for_model(cfg, rows, None, new_tokens + 1)


def save_source(shape: str, folder: Path, weights: bool) -> Path:
    """The shape as transformers' save_pretrained writes it (config only without `weights`)."""
    import transformers

    shape_spec = SHAPES[shape]
    config = getattr(transformers, shape_spec.config_class)(**shape_spec.config)
    folder.mkdir(parents=True, exist_ok=True)
    if weights:
        import torch

        torch.manual_seed(0)
        getattr(transformers, shape_spec.model_class)(config).eval().save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    if shape_spec.generation is not None:
        transformers.GenerationConfig(**shape_spec.generation).save_pretrained(folder)
    return folder


def dry_run(shapes: list[str], batches: list[int], new_tokens: int) -> list[str]:
    """The plan, resolved without running anything; raises naming what does not resolve."""
    import torch
    import transformers

    from seq2trt.exporters import spec
    from seq2trt.exporters.onnx_export import export_copy
    from seq2trt.hf_import.importer import config_from_hf
    from seq2trt.reference_model.model import Seq2SeqTransformer
    from seq2trt.runtime import registry

    declared = registry.declared(BACKEND, registry.DECODE_BACKENDS)
    module = registry.kind(BACKEND)
    missing = [a for a in ("open", "check", "unavailable", "bench", "step_model") if not hasattr(module, a)]
    if missing or declared.graphs != "fused-ort" or declared.device != "cuda":
        raise SystemExit(f"{BACKEND} is not declared as the fused graphs on CUDA with a full module ({missing})")
    plan = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            beams, dtypes = SHAPES[shape].beams, SHAPES[shape].dtypes
            getattr(transformers, SHAPES[shape].model_class)
            family, cfg, _ = config_from_hf(save_source(shape, Path(tmp) / shape, weights=False))
            with torch.device("meta"):
                model = Seq2SeqTransformer(cfg)
            for dtype in dtypes:
                export_copy(model, dtype)  # the exporter's dtype rules (flan-t5 refuses fp16)
            rows = max(batches) * beams
            limits = export_limits(cfg, rows, new_tokens)
            params = sum(p.numel() for p in model.parameters())
            plan.append(f"{shape}: {family}, {params / 1e6:.0f} M parameters, export max_batch {rows}, "
                        f"max_tgt_len {limits.max_tgt_len}, dtypes {', '.join(dtypes)}")
            for search, k in (("greedy", 1), (f"beam {beams}", beams)):
                for batch in batches:
                    for route, dtype in routes(shape):
                        plan.append(f"  {search:7} B={batch:<3} {route:22} {new_tokens} new tokens")
    return plan


class Runs:
    """One shape's models and inputs on the GPU, and a timed decode per route."""

    def __init__(self, shape: str, root: Path, batches: list[int], new_tokens: int, device: str = "cuda"):
        import torch
        import transformers

        from seq2trt.exporters import spec
        from seq2trt.exporters.fuse import Target, fuse_artifacts
        from seq2trt.exporters.onnx_export import export
        from seq2trt.hf_import.importer import load_hf_as_model

        self.shape, self.new_tokens, self.device = shape, new_tokens, device
        model_class, self.beams, dtypes = SHAPES[shape].model_class, SHAPES[shape].beams, SHAPES[shape].dtypes
        src = save_source(shape, root / f"{shape}-src", weights=True)
        _, model, _, _ = load_hf_as_model(src)
        self.cfg, self.exports = model.cfg, {}
        limits = export_limits(model.cfg, max(batches) * self.beams, new_tokens)
        for dtype in dtypes:
            out = export(model, root / f"{shape}-{dtype}", dtype=dtype, limits=limits, force=True)
            fuse_artifacts(out, Target.ORT, force=True)
            self.exports[dtype] = out
        self.eager = model.float().to(device)
        reduced = torch.bfloat16 if dtypes[0] == "bf16" else torch.float16
        self.hf = getattr(transformers, model_class).from_pretrained(src, dtype=reduced).to(device).eval()
        self.stack, self.opened = __import__("contextlib").ExitStack(), {}

    def inputs(self, batch: int):
        import numpy as np

        from seq2trt.reference_model.sources import source_kind

        rng = np.random.default_rng(batch)
        if self.cfg.audio:
            features = rng.standard_normal((batch, self.cfg.n_mels, self.cfg.source_frames)).astype(np.float32)
            return features, np.ones((batch, self.cfg.max_src_len), np.int64)
        ids, _ = source_kind(self.cfg).random_batch(rng, batch, SRC_LEN)
        ids[:, -1] = self.cfg.eos_id
        return ids, np.ones_like(ids)

    def step_model(self, route: str, dtype: str):
        from seq2trt.reference_model.eager import EagerStepModel
        from seq2trt.runtime.registry import open_step_model

        if route not in self.opened:
            if route.startswith(BACKEND):
                self.opened[route], _ = self.stack.enter_context(open_step_model(self.exports[dtype], BACKEND))
            else:
                self.opened[route] = EagerStepModel(self.eager, device=self.device)
        return self.opened[route]

    def decode(self, route: str, dtype: str, ids, mask, beams: int):
        """(seconds, tokens) of one forced-length decode."""
        import torch

        from seq2trt.reference_model.decoding import DecodeSettings, greedy_decode, hf_beam_search

        self.sync()
        start = time.perf_counter()
        if route.startswith("transformers"):
            source = torch.as_tensor(ids).to(self.device)
            kwargs = ({"input_features": source.to(self.hf.dtype)} if self.cfg.audio
                      else {"input_ids": source, "attention_mask": torch.as_tensor(mask).to(self.device)})
            with torch.inference_mode():
                tokens = self.hf.generate(**kwargs, max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens,
                                          num_beams=beams, do_sample=False).tolist()
        else:
            model = self.step_model(route, dtype)
            settings = DecodeSettings(self.cfg.bos_id, -1, self.cfg.pad_id, self.new_tokens)  # eos never ends a row
            tokens = (greedy_decode(model, ids, mask, settings) if beams == 1
                      else hf_beam_search(model, ids, mask, settings, beams, 1.0, True))
        self.sync()
        return time.perf_counter() - start, tokens

    def sync(self) -> None:
        """Wait for the GPU's queued work (a timed decode ends when its last kernel does)."""
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()


def time_routes(runs: Runs, order: list[tuple[str, str]], ids, mask, beams: int, repeats: int):
    """(seconds per route, its last tokens, route -> error) of `repeats` interleaved rounds after a warm-up round;
    a route that fails (a provider, a kernel, memory) is dropped with its error and the others go on."""
    seconds, tokens, failed = {r: [] for r, _ in order}, {}, {}
    for rep in range(repeats + 1):  # the first round warms up (sessions, kernels, allocators)
        for route, dtype in order[rep % len(order):] + order[:rep % len(order)]:
            if route in failed:
                continue
            try:
                took, tokens[route] = runs.decode(route, dtype, ids, mask, beams)
            except Exception as exc:  # noqa: BLE001  (recorded with the figures; the exit status says so)
                failed[route] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc) else ''}"
                print(f"{runs.shape} {route}: failed: {failed[route]}", file=sys.stderr)
                continue
            if rep:
                seconds[route].append(took)
    return seconds, tokens, failed


def measure(shape: str, root: Path, batches: list[int], new_tokens: int, repeats: int, device: str = "cuda"
            ) -> list[dict]:
    """One row per (search, batch, route): tokens/s, the ratio to transformers, the timings, and any error."""
    import numpy as np

    runs, rows = Runs(shape, root, batches, new_tokens, device), []
    order, hf = routes(shape), f"transformers {SHAPES[shape].dtypes[0]}"
    for search, beams in (("greedy", 1), (f"beam {runs.beams}", runs.beams)):
        for batch in batches:
            ids, mask = runs.inputs(batch)
            seconds, tokens, failed = time_routes(runs, order, ids, mask, beams, repeats)
            rate = {r: batch * new_tokens / float(np.median(s)) for r, s in seconds.items() if r not in failed}
            fp32 = (f"{BACKEND} fp32", "eager fp32")
            same = tokens[fp32[0]] == tokens[fp32[1]] if beams == 1 and set(fp32) <= set(tokens) else None
            for route, _ in order:
                ratio = rate[route] / rate[hf] if route in rate and hf in rate else None
                rows.append({"shape": shape, "search": search, "batch": batch, "route": route,
                             "tokens_per_s": round(rate[route], 1) if route in rate else None,
                             "vs_transformers": round(ratio, 3) if ratio is not None else None,
                             "seconds": [round(t, 5) for t in seconds[route]], "error": failed.get(route),
                             "fp32_tokens_equal_eager": same})
                shown = (f"{rate[route]:9.1f} tokens/s" if route in rate else "   failed") + (
                    f" {ratio:6.2f}x transformers" if ratio is not None else "")
                note = f"  (fp32 = eager: {same})" if same is not None and route == fp32[0] else ""
                print(f"{shape:13} {search:7} B={batch:<3} {route:22} {shown}{note}")
    runs.stack.close()
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The arguments (also resolved by the GPU check's dry run, scripts/gpu_check_plan.py)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="resolve the plan on a CPU; run nothing")
    parser.add_argument("--out", type=Path, default=Path("gpu-runtime"))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: the torch routes on the CPU (a smoke run of the script, not a measurement)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        print(f"unknown shape(s) {unknown}; choose from {', '.join(SHAPES)}", file=sys.stderr)
        return 1
    batches = [int(b) for b in args.batches.split(",")]
    try:
        plan = dry_run(shapes, batches, args.new_tokens)
    except Exception as exc:  # anything that does not resolve: one line naming it
        print(f"the plan does not resolve: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print("\n".join(plan))
    if args.dry_run:
        return 0
    from seq2trt.runtime.registry import unavailable

    why = unavailable((BACKEND,)).get(BACKEND)
    if why:
        print(f"{BACKEND} cannot run here: {why}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [row for shape in shapes
            for row in measure(shape, args.out, batches, args.new_tokens, args.repeats, args.device)]
    (args.out / "gpu_runtime.json").write_text(json.dumps(rows, indent=1))
    unequal = [r for r in rows if r["fp32_tokens_equal_eager"] is False]
    return 1 if any(r["error"] for r in rows) or unequal else 0


if __name__ == "__main__":
    sys.exit(main())
