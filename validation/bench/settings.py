"""What a bench run may be asked for: the backends it knows, the searches, its settings (checked when made), and
which backends can run on this machine for a given export (`unavailable`, `available_backends`). bench.py measures.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from seq2trt.reference_model.decoding import GNMT_ALPHA
from seq2trt.core.errors import DependencyError, InputError

from seq2trt.runtime.decode_jobs import check_threads
from seq2trt.runtime.registry import (BACKENDS, BENCH_DEFAULT, graph_set,  # noqa: F401  (unavailable: re-exported)
                                      unavailable)

KNOWN_BACKENDS = tuple(BACKENDS)
TEXT_SRC_LEN = 32  # the source length of a text bench without --src-len
SEARCHES = ("greedy", "beam", "sample")


def parse_backends(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in KNOWN_BACKENDS]
    if unknown or not names:
        raise InputError(f"unknown backend(s) {unknown or [text]}; known backends: {', '.join(KNOWN_BACKENDS)}")
    return names


def parse_ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise InputError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise InputError(f"{what} must be integers >= 1, got {text!r}")
    return tuple(sorted(set(values)))


def parse_seconds(text: str, what: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise InputError(f"{what} must be comma-separated numbers of seconds, got {text!r}") from None
    return tuple(sorted(set(values)))


@dataclass(frozen=True)
class BenchSettings:
    backends: tuple[str, ...] = BENCH_DEFAULT
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    threads: tuple[int, ...] = (1,)
    repeats: int = 10
    warmup: int = 2
    src_len: int | None = None  # None: TEXT_SRC_LEN; clipped to the export's limits (a Whisper export refuses it)
    new_tokens: int = 32  # clipped to the export's limits
    step_calls: int = 2  # decoder calls per past length per repetition
    curves: bool = True  # encoder by source length and step by past length (a big vocabulary's prefills are slow)
    check_samples: int = 40  # sources of each anchor's agreement check (ct2, hf, optimum)
    seed: int = 0
    # --search beam: a real search on the task's held-out sources (eos stops; Hugging Face's length penalty,
    # early_stopping=True: ort-generate's semantics; CTranslate2 stops at beam finished hypotheses too), timed per batch.
    search: str = "greedy"
    beam: int = 4
    length_penalty: float = GNMT_ALPHA
    # --search sample: forced length like greedy (every backend samples exactly new_tokens a row), Hugging Face's
    # warpers (CTranslate2's sampling_temperature / sampling_topk / sampling_topp), and each backend's greedy decode of
    # the same rows timed in the same turn: sampling's extra cost per step, side by side.
    temperature: float = 1.0
    top_k: int = 50  # Hugging Face's default; 0: the whole vocabulary
    top_p: float = 1.0
    # --n-best N: N sequences a source with their scores, from beam search (N <= --beam-size) or N samples a source.
    n_best: int = 1
    fast_sampling: bool = False  # --search sample: our loops draw by the inverse CDF (decoding._Sampler)
    # A Whisper export: the lengths of the synthetic clips (None: speech.DEFAULT_CLIPS, 10 s and 30 s); a text
    # export refuses them.
    clip_seconds: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        parse_backends(",".join(self.backends))
        if self.repeats < 1 or self.warmup < 0 or self.step_calls < 1 or self.check_samples < 1:
            raise InputError(f"repeats, step_calls and check_samples must be >= 1 and warmup >= 0, got "
                             f"{self.repeats}, {self.step_calls}, {self.check_samples} and {self.warmup}")
        for count in self.threads:
            check_threads(count)
        multi = [t for t in self.threads if t != 1]
        if len(multi) > 1 and any(b.startswith("ort") or b == "optimum" for b in self.backends):
            raise InputError(f"--threads {','.join(map(str, self.threads))}: ONNX Runtime runs one shared thread pool "
                             "per process, so one bench run measures 1 and at most one other count; run the bench "
                             "once per count (e.g. --threads 1,2 then --threads 4 into another copy)")
        if self.search not in SEARCHES or self.beam < 1:
            raise InputError(f"--search must be one of {', '.join(SEARCHES)} and --beam-size >= 1, got "
                             f"{self.search!r} and {self.beam}")
        if not (self.temperature > 0 and self.top_k >= 0 and 0 < self.top_p <= 1 and self.n_best >= 1):
            raise InputError(f"--temperature must be > 0, --top-k >= 0, --top-p in (0, 1] and --n-best >= 1, got "
                             f"{self.temperature}, {self.top_k}, {self.top_p} and {self.n_best}")
        if self.fast_sampling and self.search != "sample":
            raise InputError("--fast-sampling sets how --search sample draws; add --search sample or drop it")
        if self.n_best > 1 and self.search == "greedy":
            raise InputError(f"--n-best {self.n_best}: greedy search returns one sequence a source; use --search beam "
                             "or --search sample")
        if self.search == "beam" and self.n_best > self.beam:
            raise InputError(f"--n-best {self.n_best} is more than the {self.beam} beams; ask for at most --beam-size")
        whole = [b for b in self.backends if BACKENDS[b].runs == "ort-search"]  # beam search only (n-best too)
        if whole and self.search == "sample":
            raise InputError(f"{', '.join(whole)}: generate.onnx runs beam search and does not sample (ONNX Runtime's "
                             "Sampling operator refuses encoder-decoder models); drop it from --backends for "
                             "--search sample")
        if (self.src_len is not None and self.src_len < 1) or self.new_tokens < 1:
            raise InputError(f"--src-len and --new-tokens must be >= 1, got {self.src_len} and {self.new_tokens}")
        if self.clip_seconds is not None and (not self.clip_seconds or not all(0 < c <= 30 for c in self.clip_seconds)):
            raise InputError(f"--clip-seconds must be lengths in (0, 30] s (one 30 s window a clip), got "
                             f"{self.clip_seconds}")


@dataclass(frozen=True)
class Sampling:
    """What `--search sample` asks of every backend: Hugging Face's warpers, N samples a source, one seed."""

    temperature: float
    top_k: int  # 0: the whole vocabulary (CTranslate2's sampling_topk 0 too)
    top_p: float
    n: int
    seed: int
    vocab_size: int | None = None  # the target vocabulary: a top-k at least this large keeps every token
    fast: bool = False  # our loops' --fast-sampling (the baselines sample their own way)

    @classmethod
    def of(cls, settings: "BenchSettings", vocab_size: int | None = None) -> "Sampling":
        return cls(settings.temperature, settings.top_k, settings.top_p, settings.n_best, settings.seed, vocab_size,
                   settings.fast_sampling)

    def ct2(self) -> dict:
        """translate_batch's options: CTranslate2 applies top-k, then temperature, then top-p; the kept set is the
        same as Hugging Face's temperature -> top-k -> top-p (a temperature keeps the order of the logits). A top-k
        of the whole vocabulary or more is its 0 (CTranslate2 refuses one above its vocabulary size; Hugging Face
        keeps min(k, V))."""
        whole = self.vocab_size is not None and self.top_k >= self.vocab_size
        return {"sampling_topk": 0 if whole else self.top_k, "sampling_temperature": self.temperature, "sampling_topp": self.top_p,
                "num_hypotheses": self.n, "return_scores": self.n > 1, "seed": self.seed}

    def hf(self) -> dict:
        """generate's options (the seed goes to torch.manual_seed)."""
        return {"do_sample": True, "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "num_return_sequences": self.n}


def runnable(settings: BenchSettings) -> tuple[BenchSettings, dict[str, str]]:
    """`settings` without the requested peers (what users run today, timed beside ours: transformers, Optimum,
    CTranslate2) that cannot run here, and {peer: why}: a bench measures the rest and says so. Optimum's export pins
    a transformers older than the one seq2trt may run beside (docs/families.md), so it is often absent."""
    missing = unavailable(settings.backends)
    skipped = {name: why for name, why in missing.items() if not BACKENDS[name].ours}
    if skipped and len(skipped) == len(settings.backends):
        raise DependencyError("cannot bench " + "; ".join(f"{n}: {why}" for n, why in skipped.items()))
    return replace(settings, backends=tuple(n for n in settings.backends if n not in skipped)), skipped


def available_backends(out: Path) -> tuple[str, ...]:
    """The backends `bench` can time here for the export in `out` (what the demo asks for): hf and optimum when the
    checkpoint its manifest names was imported."""
    from seq2trt.core import layout

    try:
        checkpoint = json.loads((Path(out) / layout.MANIFEST).read_text())["source"]["checkpoint"]
        imported = (Path(checkpoint) / layout.IMPORT_RECORD).is_file()
    except (OSError, ValueError, KeyError, TypeError):
        imported = False
    names = [n for n, b in BACKENDS.items() if (b.graphs is None or graph_set(b.graphs).folder(Path(out)).is_dir())
             and (imported or not b.needs_import)]  # a graph set's folder: what the stage that writes it made
    return tuple(n for n in names if n not in unavailable(tuple(names)))
