"""`seq2trt bench`: latency and throughput of every backend, measured side by side, and the ratios between them.

Backends run round-robin within each repetition (the starting backend rotates), so a load spike on a shared machine
hits all of them; ratios are medians of per-repetition paired ratios. The baselines users run today (CTranslate2,
transformers, Optimum) are checked against the eager model before they are timed. What is measured and the layout of
`OUT/reports/latency.json`: docs/design.md, "Benchmarks"; what may be asked for: `settings.py`.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

import numpy as np

from seq2trt.core import layout
from seq2trt.exporters.manifest import Manifest, verify
from seq2trt.reference_model.decoding import DecodeSettings
from seq2trt.validation.bench.stats import paired_ratio, stats_ms
from seq2trt.core.errors import CheckFailed, DependencyError, InputError

from seq2trt.validation.bench import backends as bb
from seq2trt.validation.bench import prepare as bench_prepare
from seq2trt.runtime import registry
from seq2trt.validation.bench.settings import (TEXT_SRC_LEN, BenchSettings, Sampling, available_backends, runnable,
                                               unavailable)

logger = logging.getLogger(__name__)

REFERENCES = (*registry.names(runs="eager"), *registry.BASELINES)  # each gets a vs_<name> ratio when it ran
Progress = Callable[[str], None]


def _grid(maximum: int, start: int) -> list[int]:
    """start, then powers of two, then `maximum`: the lengths a latency curve is drawn through."""
    values = {start, maximum}
    v = 1
    while v < maximum:
        values.add(v)
        v *= 2
    return sorted(x for x in values if start <= x <= maximum)


def _sources(cfg, batch: int, length: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Seeded ids of real tokens (no specials: an imported Marian's pad is its last id), eos last; every row of the
    same length."""
    from seq2trt.reference_model.sources import source_kind

    ids, _ = source_kind(cfg).random_batch(rng, batch, length)
    ids[:, -1] = cfg.eos_id
    return ids, np.ones_like(ids)


class Bench:
    """One bench run over an export directory; `run()` measures and returns the latency.json document."""

    def __init__(self, out: Path, settings: BenchSettings, checkpoint: Path | None = None,
                 progress: Progress | None = None):
        self.out, self.settings, self.progress = Path(out), settings, progress or (lambda message: None)
        if settings.clip_seconds is not None:
            raise InputError("--clip-seconds applies to a Whisper export; give a text model --src-len")
        missing = unavailable(settings.backends)
        if missing:
            raise DependencyError("cannot bench " + "; ".join(f"{n}: {why}" for n, why in missing.items()) +
                                  f". Drop them from --backends (available here: {', '.join(available_backends(out))})")
        self.manifest: Manifest = verify(self.out, ["encoder.onnx", "decoder.onnx"])
        self.cfg, self.limits = self.manifest.config, self.manifest.limits
        too_big = [b for b in settings.batch_sizes if b > self.limits.max_batch]
        if too_big:
            raise InputError(f"batch sizes {too_big} exceed the export's max_batch {self.limits.max_batch}; "
                             "re-export with a larger --max-batch or lower --batch-sizes")
        rows = [b * settings.beam for b in settings.batch_sizes if settings.search == "beam"]
        if rows and max(rows) > self.limits.max_batch:
            raise InputError(f"--search beam --beam-size {settings.beam} at batch {max(settings.batch_sizes)} runs "
                             f"{max(rows)} rows, over the export's max_batch {self.limits.max_batch}: exports for beam "
                             "need max_batch >= B x K; re-export with a larger --max-batch or lower --batch-sizes")
        rows = max(settings.batch_sizes) * settings.n_best
        if settings.search == "sample" and rows > self.limits.max_batch:
            raise InputError(f"--search sample --n-best {settings.n_best} at batch {max(settings.batch_sizes)} runs "
                             f"{rows} rows, over the export's max_batch {self.limits.max_batch}; re-export with a larger "
                             "--max-batch or lower --batch-sizes")
        self.src_len = min(settings.src_len or TEXT_SRC_LEN, self.limits.max_src_len)
        self.new_tokens = min(settings.new_tokens, self.limits.max_tgt_len - 1)
        self.checkpoint = checkpoint
        self.source = bench_prepare.imported_source(self.manifest, checkpoint, settings.backends)
        self.model = self.task = None
        self.ct2_models: dict[str, dict] = {}
        self.doc: dict = {}
        self.sampling = Sampling.of(settings, self.cfg.tgt_vocab_size) if settings.search == "sample" else None
        self._turns = 0  # --search sample: which of sampling and greedy runs first in a turn alternates

    # -- preparation ----------------------------------------------------------------------------------------
    def _reference(self):
        if self.model is None:
            from seq2trt.runtime.reference_loader import load_reference

            self.model, self.task = load_reference(self.manifest, self.checkpoint)
        return self.model

    def _make(self, name: str, threads: int):
        """The bench's timing interface over `name`: our backends as their kind's module opens them (the registry's
        bench adapter: every graph verified), the baselines users run today as prepared here."""
        b = registry.BACKENDS[name]
        if b.module is None:
            return self._baseline(name, b.threads_for(threads))
        from seq2trt.runtime.backends import BenchContext

        opened = registry.bench_model(name, BenchContext(self.out, self.manifest, self.checkpoint, self._reference,
                                                         threads))
        if b.whole_search:
            from seq2trt.validation.bench.ort_search import OrtSearchBackend

            return OrtSearchBackend(name, opened.model, self.cfg, opened.threads, opened.close)
        return bb.StepModelBackend(name, opened.model, self.cfg, opened.threads, closers=[opened.close],
                                   set_threads=opened.set_threads, sync=opened.sync)

    def _baseline(self, name: str, threads: int):
        if registry.BACKENDS[name].runs == "ctranslate2":
            info = self.ct2_models[name]
            return bb.Ct2Backend(name, info["dir"], info["source_tokens"], threads, info["compute_type"])
        from seq2trt.validation.bench.hf_baselines import open_backend

        return open_backend(name, self.source, self.out, threads)

    # -- measurement ----------------------------------------------------------------------------------------
    def run(self) -> dict:
        s = self.settings
        self.doc = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "artifact": str(self.out), "settings": {**asdict(s), "src_len": self.src_len,
                                                            "new_tokens": self.new_tokens,
                                                            "forced_length": s.search != "beam"},
                    "model": {k: getattr(self.cfg, k) for k in ("d_model", "num_heads", "num_encoder_layers",
                                                                "num_decoder_layers", "d_ff", "tgt_vocab_size")},
                    "dtype": self.manifest.dtype, "machine": _machine("before"), "builds": _engine_builds(self.out)}
        self.doc["checks"] = {}
        if any(bench_prepare.is_anchor(n) for n in s.backends):
            prepared = bench_prepare.prepare(s.backends, self.out, self._reference(), self.task, self.source,
                                             s.check_samples, s.seed, self.limits.max_tgt_len - 1, self.progress,
                                             (s.beam, s.length_penalty, s.n_best) if s.search == "beam" else None,
                                             self.sampling)
            self.doc["checks"], self.ct2_models = prepared.checks, prepared.ct2_models
            self.doc["builds"].update(prepared.builds)
        for key in ("results", "encoder_ms", "step_ms_by_past", "ratios", "memory"):
            self.doc[key] = {}
        for threads in s.threads:
            self._run_threads(threads)
        self.doc["machine"].update(_machine("after"))
        return self.doc

    def _run_threads(self, threads: int) -> None:
        s = self.settings
        rng = np.random.default_rng(s.seed)
        t = str(threads)
        self.progress(f"{threads} thread(s): starting {', '.join(s.backends)}")
        backends = []
        try:
            for name in s.backends:
                before = bb.rss_mb()
                backends.append(self._make(name, threads))
                self.doc["memory"].setdefault(name, {})["load_rss_delta_mb"] = round(bb.rss_mb() - before, 1)
            inputs = {b: _sources(self.cfg, b, self.src_len, rng) if s.search != "beam" else self._held_out(b)
                      for b in s.batch_sizes}
            raw = {"decode": {}, "steps": {}, "encoder": {}, "by_past": {}, "tokens": {}, "greedy": {}}
            for rep in range(s.warmup + s.repeats):
                self.progress(f"{threads} thread(s): repetition {rep + 1}/{s.warmup + s.repeats}"
                              + ("" if rep >= s.warmup else " (warm-up)"))
                order = backends[rep % len(backends):] + backends[:rep % len(backends)]
                for batch in s.batch_sizes:
                    self._measure_batch(order, batch, *inputs[batch], raw if rep >= s.warmup else None, rng)
            self.doc.setdefault("threading", {})[t] = {b.name: b.threading() for b in backends}
            for b in backends:
                self.doc["memory"][b.name].update(b.memory())
                if b.threads != threads:
                    self.doc["memory"][b.name]["threads_used"] = b.threads
        finally:
            for b in backends:
                b.close()
        self._summarise(t, raw)

    def _held_out(self, batch: int) -> tuple[np.ndarray, np.ndarray]:
        """The first `batch` held-out sources of the checkpoint's task (seeded ids without one), padded."""
        from seq2trt.reference_model.vocab import pad_batch

        self._reference()
        sources, _ = bench_prepare.source_ids(self.cfg, self.task, self.source, batch, self.settings.seed)
        return pad_batch([src[: self.src_len - 1] + [self.cfg.eos_id] if len(src) > self.src_len else src
                          for src in sources], self.cfg.pad_id)

    def _measure_batch(self, order: list, batch: int, ids: np.ndarray, mask: np.ndarray, raw: dict | None,
                       rng: np.random.Generator) -> None:
        """One repetition at one batch size, each backend in turn: decoding, encoder by length, step by past.
        `raw` is None during warm-up."""
        def record(table: str, key: tuple, values: list[float]) -> None:
            if raw is not None and values:
                raw[table].setdefault(key, []).extend(values)

        for b in order:
            b.activate()
            if self.settings.search == "beam":
                settings = DecodeSettings.for_model(self.cfg, self.new_tokens)
                if self.settings.n_best > 1:
                    settings = replace(settings, num_return_sequences=self.settings.n_best, output_scores=True)
                seconds, outputs = b.search(ids, mask, settings, self.settings.beam, self.settings.length_penalty)
                record("tokens", (b.name, batch), [sum(len(o) + 1 for o in outputs)])  # eos counted, every hypothesis
                steps = None
            elif self.settings.search == "sample":
                seconds, steps = self._sample_turn(b, batch, ids, mask, record)
            else:
                seconds, steps = b.decode(ids, mask, self.new_tokens)
            record("decode", (b.name, batch), [seconds])
            record("steps", (b.name, batch), steps or [])
        if not self.settings.curves or self.settings.search != "greedy":  # curves do not depend on the search
            return
        for length in _grid(self.limits.max_src_len, 1):
            src = _sources(self.cfg, batch, length, rng)
            for b in order:
                b.activate()
                seconds = b.encode_seconds(*src)
                record("encoder", (b.name, batch, length), [] if seconds is None else [seconds])
        pasts = _grid(self.limits.max_tgt_len - 1, 0)
        for b in order:
            b.activate()
            for past in pasts:
                record("by_past", (b.name, batch, past), b.step_seconds(ids, mask, past, self.settings.step_calls) or [])
            ct2_steps = b.steps_by_past(ids, mask, self.limits.max_tgt_len)  # its last step has past max - 1
            for past in pasts if ct2_steps else ():
                if 1 <= past <= len(ct2_steps):
                    record("by_past", (b.name, batch, past), [ct2_steps[past - 1]])

    def _sample_turn(self, b, batch: int, ids: np.ndarray, mask: np.ndarray, record) -> tuple[float, list[float]]:
        """One backend's `--search sample` turn: sampling, and its greedy decode of the same rows (each source n
        times) right before or after it (alternating), both forced-length. Returns the sampling's times."""
        n, rows = self.sampling.n, batch * self.sampling.n
        self._turns += 1
        greedy_first = self._turns % 2 == 0
        if greedy_first:
            greedy_s, _ = b.decode(np.repeat(ids, n, 0), np.repeat(mask, n, 0), self.new_tokens)
            b.activate()
        seconds, steps, outputs = b.sample(ids, mask, self.new_tokens, self.sampling)
        if not greedy_first:
            b.activate()
            greedy_s, _ = b.decode(np.repeat(ids, n, 0), np.repeat(mask, n, 0), self.new_tokens)
        if len(outputs) != rows or any(len(o) != self.new_tokens for o in outputs):
            raise CheckFailed(f"{b.name} returned {len(outputs)} samples of lengths {sorted({len(o) for o in outputs})} "
                              f"for {batch} sources x {n}, not {rows} of {self.new_tokens} tokens; its time would not "
                              "be comparable")
        record("greedy", (b.name, batch), [greedy_s])
        return seconds, steps

    def _summarise(self, t: str, raw: dict) -> None:
        results = self.doc["results"].setdefault(t, {})
        s = self.settings
        for (name, batch), seconds in raw["decode"].items():
            generated = raw["tokens"].get((name, batch))  # beam: what it generated; greedy, sample: forced length
            tokens = float(np.median(generated)) if generated else \
                batch * self.new_tokens * (s.n_best if s.search == "sample" else 1)
            decode = stats_ms(seconds)
            steps = stats_ms(raw["steps"].get((name, batch), []))
            results.setdefault(name, {})[str(batch)] = {
                "tokens_per_s": round(tokens / float(np.median(seconds)), 2),
                **{f"step_ms_{k}": v for k, v in steps.items()}, **{f"decode_ms_{k}": v for k, v in decode.items()},
                "repeats": len(seconds), "search": s.search, **({"beam": s.beam} if s.search == "beam" else {}),
                **({"n_best": s.n_best} if s.n_best > 1 else {}),
                **(self._sampling_cost(seconds, raw["greedy"][name, batch]) if s.search == "sample" else {})}
        for key, table in (("encoder", "encoder_ms"), ("by_past", "step_ms_by_past")):
            if not raw[key]:  # --no-curves
                continue
            out = self.doc[table].setdefault(t, {})
            for (name, batch, length), seconds in raw[key].items():
                out.setdefault(name, {}).setdefault(str(batch), {})[str(length)] = stats_ms(seconds)
        ratios = self.doc["ratios"].setdefault(t, {})
        for (name, batch), seconds in raw["decode"].items():
            ratios.setdefault(name, {})[str(batch)] = {
                "vs_" + ref.replace("-", "_"): paired_ratio(raw["decode"].get((ref, batch)), seconds)
                for ref in REFERENCES if ref in self.settings.backends}
        logger.debug("summarised %d decode series for %s thread(s)", len(raw["decode"]), t)


    def _sampling_cost(self, seconds: list[float], greedy: list[float]) -> dict:
        """The warpers, and sampling's extra cost over greedy: per step (ms, and as a share of a greedy step), the
        median over repetitions of the two decodes timed in the same turn on the same rows."""
        sample, greedy = np.asarray(seconds), np.asarray(greedy)
        s = self.sampling
        return {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "seed": s.seed,
                "fast_sampling": s.fast,
                **{f"greedy_decode_ms_{k}": v for k, v in stats_ms(list(greedy)).items()},
                "sampling_extra_ms_per_step": round(float(np.median(sample - greedy)) / self.new_tokens * 1e3, 5),
                "sampling_extra_fraction": round(float(np.median(sample / greedy - 1)), 4)}


def _machine(when: str) -> dict:
    load = os.getloadavg()
    info = {f"loadavg_{when}": [round(x, 2) for x in load]}
    if when == "before":
        info.update({"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                     "processor": platform.processor() or platform.machine()})
        for package in ("onnxruntime", "torch", "ctranslate2"):
            try:
                from importlib.metadata import version

                info[package] = version(package)
            except Exception:  # not installed: nothing to record
                pass
    return info


def _engine_builds(out: Path) -> dict:
    """build seconds and plan sizes of every engine directory's build.json."""
    builds = {}
    for path in sorted(layout.engines_root(out).glob(f"*/{layout.BUILD_JSON}")):
        try:
            info = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        builds[path.parent.name] = {name: {"build_seconds": g.get("build_seconds"), "plan_bytes": g.get("plan_bytes")}
                                    for name, g in info.get("graphs", {}).items()}
    return builds


def run_bench(out: Path, settings: BenchSettings, checkpoint: Path | None = None,
              progress: Progress | None = None) -> dict:
    """Measure, then write OUT/reports/latency.json, latency.md and the PNG plots; returns the document."""
    from seq2trt.exporters.manifest import generation, writing_into

    from seq2trt.validation.reports.bench_table import write_reports

    started = generation(out)  # the figures must describe the export measured, not one that replaced it
    settings, skipped = runnable(settings)  # doc["not_measured"]: the peers that cannot run here, and why
    if _is_speech(out):
        return _run_speech(out, settings, checkpoint, progress, started, skipped)
    doc = Bench(out, settings, checkpoint, progress).run()
    doc["not_measured"] = skipped
    with writing_into(out, started, "bench"):
        write_reports(layout.reports_dir(out), doc)
    return doc


def _is_speech(out: Path) -> bool:
    from seq2trt.exporters.manifest import read_manifest

    from seq2trt.validation.bench.speech import is_speech

    return is_speech(read_manifest(out).config)


def _run_speech(out: Path, settings: BenchSettings, checkpoint: Path | None, progress: Progress | None,
                started, skipped: dict[str, str]) -> dict:
    """A Whisper export: validation/bench/speech_bench.py measures and writes its reports."""
    from seq2trt.exporters.manifest import writing_into

    from seq2trt.validation.bench import speech_bench

    missing = unavailable(settings.backends)
    if missing:
        raise DependencyError("cannot bench " + "; ".join(f"{n}: {why}" for n, why in missing.items()))
    manifest = verify(out, ["encoder.onnx", "decoder.onnx", layout.FEATURES])
    doc = speech_bench.SpeechBench(out, settings, manifest, checkpoint, progress).run()
    doc["not_measured"] = skipped
    with writing_into(out, started, "bench"):
        speech_bench.write_reports(layout.reports_dir(out), doc)
    return doc
