"""The speech bench's run (validation/bench/speech.py holds its backends and inputs): prepare the baselines, check
every backend's greedy tokens against the eager model on the bench features, time backends and front ends
round-robin, and write OUT/reports/latency.json and latency.md (benchmarks/README.md, the Whisper section).

latency.json (`"kind": "speech"`): settings, model, machine (load before/after), prompt, checks[backend] (greedy
agreement with the eager model on every clip length's largest batch; beam too for a beam bench), builds, front_end
[clip][batch] = {features_onnx_ms_per_clip, extractor_ms_per_clip: {p50, p90, p99}, max_abs_diff}, rows: one per
threads x backend x clip length x batch: tokens_per_s, decode_ms_p50/p90/p99, rtf (decode / audio seconds),
rtf_with_front_end (its own front end added: features.onnx for ours, the extractor for the baselines),
vs_<reference> (paired decode-time ratios, > 1 is faster) and vs_<reference>_with_front_end.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from seq2trt.core import layout
from seq2trt.core.errors import CheckFailed, InputError
from seq2trt.runtime import registry

from seq2trt.validation.bench import speech as sp
from seq2trt.validation.bench.backends import peak_rss_mb
from seq2trt.validation.bench.stats import paired_ratio, stats_ms

logger = logging.getLogger(__name__)


class SpeechBench:
    """One speech bench run over a Whisper export; `run()` measures and returns the latency.json document."""

    def __init__(self, out: Path, settings, manifest, checkpoint: Path | None = None, progress=None):
        from seq2trt.reference_model.speech import SpeechTokens

        from seq2trt.runtime.decode_jobs import generation_config
        from seq2trt.validation.bench import prepare as bench_prepare

        s = settings
        if s.src_len is not None:
            raise InputError("--src-len does not apply to a Whisper export (every source is 30 s of features); use "
                             "--clip-seconds")
        if s.search == "sample" or s.n_best > 1:
            raise InputError("a Whisper bench times greedy and beam search; drop --search sample and --n-best")
        sp.check_backends(s.backends)
        self.out, self.settings, self.manifest = Path(out), s, manifest
        self.progress = progress or (lambda message: None)
        self.cfg, self.limits = manifest.config, manifest.limits
        self.beam = s.beam if s.search == "beam" else 1
        rows = max(s.batch_sizes) * self.beam
        if rows > self.limits.max_batch:
            raise InputError(f"batch {max(s.batch_sizes)} x beam {self.beam} runs {rows} rows, over the export's "
                             f"max_batch {self.limits.max_batch}; re-export with a larger --max-batch or lower "
                             "--batch-sizes")
        self.clip_seconds = s.clip_seconds or sp.DEFAULT_CLIPS
        recorded = (manifest.data.get("source") or {}).get("checkpoint")
        self.checkpoint = Path(checkpoint) if checkpoint else Path(recorded)
        self.generation = generation_config(self.checkpoint) or {}
        speech = SpeechTokens.from_record(self.generation.get("speech"))
        codes = list(speech.languages)
        language = (speech.default_language or ("en" if "en" in codes else codes[0])) if speech.multilingual else None
        task = "transcribe" if speech.multilingual else None
        prompt = speech.prompt(language, task)
        room = self.limits.max_tgt_len - 1 - len(prompt)
        self.work = sp.Work(self.cfg.bos_id, self.cfg.eos_id, prompt, language, task, min(s.new_tokens, room),
                            self.beam, s.length_penalty)
        self.source = bench_prepare.imported_source(manifest, self.checkpoint, s.backends)
        wanted = [n for n in s.backends if n in sp.BASELINES]
        if wanted and self.source is None:
            raise InputError(f"{', '.join(wanted)}: a Whisper bench runs them on the Hugging Face directory the "
                             f"checkpoint was imported from, and {self.checkpoint} was not imported; drop them")
        self.model = None
        self.builds: dict = {}
        # The backends measured: the ones asked for, less a peer whose preparation failed (`unavailable`: name ->
        # why, in latency.json), which one line names while the rest is measured.
        self.backends = list(s.backends)
        self.unavailable: dict[str, str] = {}

    # -- inputs and backends --------------------------------------------------------------------------------
    def _front_ends(self, threads: int):
        from transformers import WhisperFeatureExtractor

        from seq2trt.runtime.transcription import FrontEnd, feature_params

        params = feature_params(self.checkpoint, self.cfg.n_mels, self.cfg.source_frames)
        graph = self.manifest.path(layout.FEATURES)
        extractor = WhisperFeatureExtractor.from_pretrained(str(self.source.path), local_files_only=True) \
            if self.source is not None else WhisperFeatureExtractor(feature_size=self.cfg.n_mels)
        onnx = FrontEnd(params, graph, threads)
        return {"features.onnx": lambda clips: np.stack(onnx(clips)),
                "extractor": lambda clips: extractor(list(clips), sampling_rate=sp.RATE,
                                                     return_tensors="np")["input_features"]}

    def _reference(self):
        if self.model is None:
            from seq2trt.runtime.reference_loader import load_reference

            self.model, _ = load_reference(self.manifest, self.checkpoint)
        return self.model

    def _prepare(self) -> None:
        """Optimum's export and CTranslate2's conversion of the source directory, once."""
        names = self.settings.backends
        if "optimum" in names:
            self.progress("exporting the source with Optimum")
            from seq2trt.validation.bench.hf_baselines import export_optimum

            self.builds["optimum"] = export_optimum(self.source, self.out / sp.OPTIMUM_DIR, sp.OPTIMUM_TASK)
        if any(registry.BACKENDS[n].runs == "ctranslate2" for n in names):
            from ctranslate2.converters import TransformersConverter

            from seq2trt.core.swap import staged_directory

            self.progress("converting the source with CTranslate2")
            start = time.perf_counter()
            try:
                with staged_directory(self.out / sp.CT2_DIR, force=True, what="CTranslate2 model") as tmp:
                    TransformersConverter(str(self.source.path)).convert(str(tmp), quantization="float32", force=True)
                    _check_ct2_prompt_tokens(Path(tmp))
            except Exception as exc:  # the peer's own converter on the user's source (one without tokenizer files
                # fails in WhisperTokenizer): that peer cannot run, the others are measured
                from seq2trt.core.errors import first_line

                peers = [n for n in self.backends if registry.BACKENDS[n].runs == "ctranslate2"]
                why = (f"CTranslate2's converter cannot convert {self.source.path} ({type(exc).__name__}: "
                       f"{first_line(exc)}; it needs the model's tokenizer files)")
                logger.warning("%s cannot run: %s; measuring the other backends", ", ".join(peers), why)
                self.unavailable.update(dict.fromkeys(peers, why))
                self.backends = [n for n in self.backends if n not in peers]
                return
            self.builds["ct2"] = {"convert_seconds": round(time.perf_counter() - start, 3),
                                  "converter": "CTranslate2's TransformersConverter",
                                  "model_bytes": (self.out / sp.CT2_DIR / "model.bin").stat().st_size}

    def _make(self, name: str, threads: int, stack: contextlib.ExitStack):
        b = registry.BACKENDS[name]
        threads = b.threads_for(threads)
        if b.module is not None:  # ours, opened by its kind's module (check_backends refused the whole searches)
            from seq2trt.runtime.backends import BenchContext

            opened = registry.bench_model(name, BenchContext(self.out, self.manifest, self.checkpoint,
                                                             self._reference, threads))
            stack.callback(opened.close)
            return sp.OursBackend(name, opened.model, self.cfg, self.generation, opened.threads)
        if b.runs == "ctranslate2":
            compute = "int8_float32" if name == "ct2-int8" else "float32"
            return sp.Ct2WhisperBackend(name, self.out / sp.CT2_DIR, threads, compute)
        import torch

        from seq2trt.validation.bench.hf_baselines import _transformers

        if name == "hf":
            model = _transformers().WhisperForConditionalGeneration.from_pretrained(
                str(self.source.path), local_files_only=True, dtype=torch.float32).eval()
            return sp.GenerateBackend(name, model, threads, set_threads=torch.set_num_threads)
        from optimum.onnxruntime import ORTModelForSpeechSeq2Seq

        from seq2trt.exporters.ort_session import session_options

        options, _, _ = session_options(None, threads, shared_pool=True)  # Optimum opens its sessions itself
        model = ORTModelForSpeechSeq2Seq.from_pretrained(str(self.out / sp.OPTIMUM_DIR), session_options=options,
                                                         provider="CPUExecutionProvider")
        return sp.GenerateBackend(name, model, threads)

    # -- checks ---------------------------------------------------------------------------------------------
    def _check(self, backends, features: dict[float, np.ndarray]) -> dict:
        """Every backend's greedy tokens (and beam tokens for a beam bench) on each clip length's largest batch
        against the eager model's; a float32 baseline that disagrees (near-ties aside) stops the bench."""
        from seq2trt.reference_model.decoding import greedy_decode
        from seq2trt.reference_model.eager import EagerStepModel

        from seq2trt.validation.ties import compare_greedy

        eager = sp.OursBackend("eager", EagerStepModel(self._reference()), self.cfg, self.generation,
                               self.settings.threads[0])
        settings = self.work.settings(self.cfg, self.generation)
        checks: dict = {}
        for seconds, feats in features.items():
            logits = [[] for _ in feats]

            def record(step, rows, step_logits):
                for row, row_logits in zip(rows, step_logits):
                    logits[row].append(np.asarray(row_logits, dtype=np.float64))

            mask = np.ones((len(feats), self.cfg.max_src_len), dtype=np.int64)
            want = greedy_decode(EagerStepModel(self._reference()), feats, mask, settings, on_step=record)
            want_beam = eager.decode(feats, self.work, self.beam)[1] if self.beam > 1 else None
            for b in backends:
                got = b.decode(feats, self.work, 1)[1]
                agreement = compare_greedy((want, logits), got, self.cfg.eos_id)
                entry = {"clip_seconds": seconds, "rows": len(feats), **agreement.to_dict()}
                if want_beam is not None:
                    beam = b.decode(feats, self.work, self.beam)[1]
                    entry["beam"] = {"beam": self.beam, "identical": sum(a == c for a, c in zip(want_beam, beam)),
                                     "sequences": len(beam)}
                checks.setdefault(b.name, []).append(entry)
                if not agreement and b.name in sp.FLOAT_BASELINES:
                    raise CheckFailed(f"{b.name} disagrees with the eager model on {seconds:g} s clips: "
                                      + "; ".join(agreement.mismatches[:3]) + "; its timings would not be comparable")
        return checks

    # -- measurement ----------------------------------------------------------------------------------------
    def run(self) -> dict:
        s = self.settings
        doc = {"kind": "speech", "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "artifact": str(self.out),
               "settings": {**asdict(s), "clip_seconds": list(self.clip_seconds), "new_tokens": self.work.new_tokens,
                            "forced_length": True},
               "prompt": {"ids": [self.work.bos_id, *self.work.prompt], "language": self.work.language,
                          "task": self.work.task},
               "model": {k: getattr(self.cfg, k) for k in ("d_model", "num_heads", "num_encoder_layers",
                                                           "num_decoder_layers", "d_ff", "tgt_vocab_size", "n_mels")},
               "dtype": self.manifest.dtype, "machine": _load("before"), "checks": {}, "front_end": {}, "rows": []}
        self._prepare()
        doc["builds"], doc["unavailable"] = self.builds, self.unavailable
        clips = {c: [sp.synthetic_clip(c, s.seed + i) for i in range(max(s.batch_sizes))] for c in self.clip_seconds}
        for threads in s.threads:
            self._run_threads(threads, clips, doc)
        doc["machine"].update(_load("after"))
        return doc

    def _run_threads(self, threads: int, clips: dict, doc: dict) -> None:
        s = self.settings
        fronts = self._front_ends(threads)
        features = {c: fronts["features.onnx"](v) for c, v in clips.items()}
        if not doc["front_end"]:
            for c, v in clips.items():
                diff = float(np.abs(fronts["extractor"](v) - features[c]).max())
                doc["front_end"][str(c)] = {"max_abs_diff_vs_extractor": round(diff, 7)}
        with contextlib.ExitStack() as stack:
            backends = []
            for name in self.backends:
                backends.append(self._make(name, threads, stack))
                stack.callback(backends[-1].close)
            if not doc["checks"]:
                self.progress("checking every backend's greedy tokens against the eager model")
                doc["checks"] = self._check(backends, features)
            raw: dict = {}
            for rep in range(s.warmup + s.repeats):
                self.progress(f"{threads} thread(s): repetition {rep + 1}/{s.warmup + s.repeats}"
                              + ("" if rep >= s.warmup else " (warm-up)"))
                order = backends[rep % len(backends):] + backends[:rep % len(backends)]
                names = list(fronts) if rep % 2 == 0 else list(fronts)[::-1]
                for c in self.clip_seconds:
                    for batch in s.batch_sizes:
                        timed = {}
                        for front in names:
                            start = time.perf_counter()
                            fronts[front](clips[c][:batch])
                            timed["front:" + front] = time.perf_counter() - start
                        for b in order:
                            b.activate()
                            timed[b.name] = b.decode(features[c][:batch], self.work, self.beam)[0]
                        if rep >= s.warmup:
                            for key, seconds in timed.items():
                                raw.setdefault((key, c, batch), []).append(seconds)
            doc.setdefault("threading", {})[str(threads)] = {b.name: f"{b.threads} thread(s)" for b in backends}
            doc.setdefault("memory", {})["peak_rss_mb"] = round(peak_rss_mb(), 1)
        self._summarise(threads, backends, raw, doc)

    def _summarise(self, threads: int, backends, raw: dict, doc: dict) -> None:
        s, n = self.settings, self.work.new_tokens
        for c in self.clip_seconds:
            for batch in s.batch_sizes:
                per_clip = {f: [x / batch for x in raw[("front:" + f, c, batch)]]
                            for f in ("features.onnx", "extractor")}
                doc["front_end"][str(c)].setdefault(str(threads), {})[str(batch)] = {
                    "features_onnx_ms_per_clip": stats_ms(per_clip["features.onnx"]),
                    "extractor_ms_per_clip": stats_ms(per_clip["extractor"])}
                audio = batch * c
                for b in backends:
                    decode = np.asarray(raw[(b.name, c, batch)])
                    front = np.asarray(raw[("front:" + b.front_end, c, batch)])
                    row = {"threads": threads, "backend": b.name, "clip_seconds": c, "batch": batch,
                           "search": "beam" if self.beam > 1 else "greedy", "beam": self.beam, "new_tokens": n,
                           "tokens_per_s": round(batch * n / float(np.median(decode)), 2),
                           **{f"decode_ms_{k}": v for k, v in stats_ms(decode).items()},
                           "rtf": round(float(np.median(decode)) / audio, 5),
                           "front_end": b.front_end,
                           "rtf_with_front_end": round(float(np.median(decode + front)) / audio, 5),
                           "repeats": len(decode)}
                    for ref in sp.REFERENCES:
                        if ref in self.backends and ref != b.name:
                            ref_b = next(x for x in backends if x.name == ref)
                            ref_decode = np.asarray(raw[(ref, c, batch)])
                            ref_front = np.asarray(raw[("front:" + ref_b.front_end, c, batch)])
                            row["vs_" + ref] = paired_ratio(ref_decode, decode)
                            row[f"vs_{ref}_with_front_end"] = paired_ratio(ref_decode + ref_front, decode + front)
                    doc["rows"].append(row)


def _load(when: str) -> dict:
    info = {f"loadavg_{when}": [round(x, 2) for x in os.getloadavg()]}
    if when == "before":
        from importlib.metadata import PackageNotFoundError, version

        info["cpus"] = os.cpu_count()
        for package in ("onnxruntime", "torch", "ctranslate2", "transformers", "optimum-onnx"):
            try:
                info[package] = version(package)
            except PackageNotFoundError:
                pass
    return info


def markdown(doc: dict) -> str:
    """latency.md: one table row per threads x backend x clip x batch."""
    s = doc["settings"]
    lines = [f"# Whisper bench ({doc['created']})", "",
             f"{doc['artifact']}: {s['new_tokens']} new tokens a clip (forced), prompt {doc['prompt']['ids']}, "
             f"repeats {s['repeats']}, warm-up {s['warmup']}; load {doc['machine'].get('loadavg_before')} -> "
             f"{doc['machine'].get('loadavg_after')}", "",
             "| threads | backend | clip s | B | search | tokens/s | decode p50 ms | RTF | RTF + front end "
             "| vs optimum | vs optimum (+front end) | vs hf | vs ct2 |", "|" + "---|" * 13]
    fmt = lambda v: "" if v is None else f"{v:.2f}x"  # noqa: E731
    for r in doc["rows"]:
        search = "greedy" if r["beam"] == 1 else f"beam {r['beam']}"
        lines.append(f"| {r['threads']} | {r['backend']} | {r['clip_seconds']:g} | {r['batch']} | {search} | "
                     f"{r['tokens_per_s']:.1f} | {r['decode_ms_p50']:.1f} | {r['rtf']:.4f} | "
                     f"{r['rtf_with_front_end']:.4f} | {fmt(r.get('vs_optimum'))} | "
                     f"{fmt(r.get('vs_optimum_with_front_end'))} | {fmt(r.get('vs_hf'))} | {fmt(r.get('vs_ct2'))} |")
    lines += ["", "| clip s | threads | B | features.onnx ms/clip p50 | extractor ms/clip p50 | max abs diff |",
              "|---|---|---|---|---|---|"]
    for c, by in doc["front_end"].items():
        diff = by.get("max_abs_diff_vs_extractor")
        for t, by_batch in by.items():
            if t == "max_abs_diff_vs_extractor":
                continue
            for batch, f in by_batch.items():
                lines.append(f"| {float(c):g} | {t} | {batch} | {f['features_onnx_ms_per_clip']['p50']:.2f} | "
                             f"{f['extractor_ms_per_clip']['p50']:.2f} | {diff:.2e} |")
    lines += ["", "Checks (greedy tokens against the eager model):", ""]
    for name, entries in doc["checks"].items():
        parts = [f"{e['clip_seconds']:g} s: {e['identical']}/{e['sequences']} identical, {e['ties']} near-ties"
                 + (f", beam {e['beam']['identical']}/{e['beam']['sequences']}" if "beam" in e else "")
                 for e in entries]
        lines.append(f"- {name}: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


def write_reports(reports: Path, doc: dict) -> None:
    from seq2trt.core.atomic_files import atomic_write_text

    atomic_write_text(Path(reports) / "latency.json", json.dumps(doc, indent=2) + "\n")
    atomic_write_text(Path(reports) / "latency.md", markdown(doc))


def _check_ct2_prompt_tokens(folder: Path) -> None:
    """CTranslate2's Whisper finds its prompt by token text in the converted vocabulary: a source without tokenizer
    files converts under transformers 5 (4.x fails in WhisperTokenizer), but with no <|startoftranscript|> the model
    then fails at its first generate. Raise here, so the bench names the peer that cannot run before timing any."""
    files = [folder / "vocabulary.json", folder / "vocabulary.txt"]
    found = next((f for f in files if f.is_file()), None)
    if found is None:
        raise ValueError(f"the converted model has no vocabulary file in {folder}")
    text = found.read_text(encoding="utf-8", errors="replace")
    tokens = json.loads(text) if found.suffix == ".json" else text.splitlines()
    if "<|startoftranscript|>" not in tokens:
        raise ValueError("its converted vocabulary has no <|startoftranscript|> token, which CTranslate2's Whisper "
                         "needs to find the prompt")
