"""What `bench` prepares before it times anything: the anchor backends built and proven on the model.

CTranslate2 is converted (from our reference weights, or for an imported checkpoint from its Hugging Face directory
by CTranslate2's own converter), `optimum` exported, and every anchor (ct2, ct2-int8, hf, optimum) decodes seeded
sources greedily against the eager reference model before its timings count: float32 anchors must agree token for
token (near-ties aside), int8's agreement is reported as its accuracy cost. The results become latency.json's
`checks` and `builds`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from seq2trt.reference_model.vocab import pad_batch
from seq2trt.runtime import registry

HF_BACKENDS = registry.names(needs_import=True)  # on the Hugging Face directory an imported checkpoint came from


@dataclass
class Prepared:
    checks: dict = field(default_factory=dict)  # backend -> its agreement with the eager model
    builds: dict = field(default_factory=dict)  # backend -> conversion/export seconds and size
    ct2_models: dict = field(default_factory=dict)  # ct2 backend -> {dir, compute_type, source_tokens}


def is_anchor(name: str) -> bool:
    """A backend that is not ours: prepared and checked here before it is timed."""
    return name in registry.BASELINES


def imported_source(manifest, checkpoint: Path | None, backends: tuple[str, ...]):
    """The checked Hugging Face source of the export's checkpoint when a requested backend loads it (hf, optimum:
    required, else a clear error; ct2: when there is one), else None."""
    from seq2trt.validation.bench import hf_baselines

    if not any(is_anchor(n) for n in backends):
        return None
    recorded = (manifest.data.get("source") or {}).get("checkpoint")
    checkpoint = Path(checkpoint) if checkpoint else (Path(recorded) if recorded else None)
    source = hf_baselines.imported_source(checkpoint) if checkpoint else None
    wanted = [n for n in backends if n in HF_BACKENDS]
    return hf_baselines.require_source(source, checkpoint, wanted) if wanted else source


def source_ids(cfg, task: str | None, source, samples: int, seed: int) -> tuple[list[list[int]], str]:
    """(sources, their origin): the task's held-out ones or random ids; for an imported model the seeded ids its
    import was judged on (no pad inside: CTranslate2's Marian vocabulary has none)."""
    from seq2trt.hf_import.proof import seeded_sources

    from seq2trt.runtime.reference_loader import e2e_sources

    if source is None:
        return e2e_sources(cfg, task, samples, seed)
    return seeded_sources(cfg, samples, seed), "seeded ids"


def check_sources(cfg, task: str | None, source, samples: int, seed: int) -> tuple[np.ndarray, np.ndarray, str]:
    """`source_ids`, padded: what every check decodes."""
    sources, origin = source_ids(cfg, task, source, samples, seed)
    return (*pad_batch(sources, cfg.pad_id), origin)


def prepare(backends: tuple[str, ...], out: Path, reference, task: str | None, source, samples: int, seed: int,
            max_new_tokens: int, progress: Callable[[str], None], beam: tuple[int, float, int] | None = None,
            sampling=None) -> Prepared:
    """Build and check every anchor among `backends` against the eager `reference` model; `beam` (K, length
    penalty, n-best) for a beam bench, whose hf and optimum are checked on beam tokens too (every hypothesis);
    `sampling` (settings.Sampling) for a sampling bench: hf and optimum must sample the eager model's tokens under the
    same seed, CTranslate2 (its own random stream) its first-token distribution
    (validation/sampling_distribution.py)."""
    done = Prepared()
    ids, mask, origin = check_sources(reference.cfg, task, source, samples, seed)
    want: dict = {}
    for name in backends:
        if name in HF_BACKENDS:
            from seq2trt.validation.bench import hf_baselines

            progress(f"preparing {name} and checking its tokens")
            want = want or _eager_outputs(reference, ids, mask, max_new_tokens, beam, sampling)
            check, build = hf_baselines.prepare(name, source, out, reference, ids, mask, max_new_tokens, want)
            done.checks[name] = {"sources": origin, **check}
            if build is not None:
                done.builds[name] = build
        elif registry.BACKENDS[name].runs == "ctranslate2":
            _prepare_ct2(name, out, reference, source, ids, mask, origin, max_new_tokens, progress, done, sampling)
    return done


def _eager_outputs(reference, ids: np.ndarray, mask: np.ndarray, max_new_tokens: int,
                   beam: tuple[int, float, int] | None, sampling=None) -> dict:
    """What hf and optimum must reproduce: the eager model's greedy (with logits) and, for a beam bench, beam
    tokens (Hugging Face's beam search, early_stopping=True, every one of the n-best), for a sampling bench its
    samples under the seed, the model's generation rules applied."""
    from dataclasses import replace

    from seq2trt.reference_model.decoding import DecodeSettings, greedy_decode, hf_beam_search
    from seq2trt.reference_model.eager import EagerStepModel

    from seq2trt.validation.bench.backends import sequences
    from seq2trt.validation.bench.ct2_baseline import eager_greedy

    want = {"greedy": eager_greedy(reference, ids, mask, max_new_tokens)}
    settings = DecodeSettings.for_model(reference.cfg, max_new_tokens)
    if beam is not None and beam[0] > 1:
        k, length_penalty, n = beam
        nbest = replace(settings, num_return_sequences=n, output_scores=n > 1)
        want["beam"] = (k, length_penalty, n, sequences(hf_beam_search(EagerStepModel(reference), ids, mask, nbest, k,
                                                                       length_penalty, True)))
    if sampling is not None:
        sampled = replace(settings, do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k,
                          top_p=sampling.top_p, seed=sampling.seed, num_return_sequences=sampling.n)
        want["sample"] = (sampling, sequences(greedy_decode(EagerStepModel(reference), ids, mask, sampled)))
    return want


def _prepare_ct2(name: str, out: Path, reference, source, ids, mask, origin: str, max_new_tokens: int,
                 progress: Callable[[str], None], done: Prepared, sampling=None) -> None:
    """Convert for one CTranslate2 variant, check its greedy tokens (and for a sampling bench the distribution of its
    sampled first tokens: float32 must pass), note where its model lies."""
    from seq2trt.validation.bench import ct2_baseline

    quantization = "int8" if name == "ct2-int8" else "float32"
    progress(f"converting to CTranslate2 {quantization} and checking its greedy tokens")
    start = time.perf_counter()
    folder = Path(out) / "ct2" / quantization
    model_dir = ct2_baseline.convert(reference, folder, quantization, force=True) if source is None else \
        ct2_baseline.convert_hf(source.path, reference.cfg, folder, quantization, force=True)
    seconds = time.perf_counter() - start
    translator = ct2_baseline.Ct2Translator(model_dir, threads=1)
    agreement = ct2_baseline.check_agreement(reference, translator, ids, mask, max_new_tokens,
                                            require=quantization == "float32")
    done.ct2_models[name] = {"dir": model_dir, "compute_type": ct2_baseline.compute_type(quantization),
                             "source_tokens": translator.source_tokens}
    done.checks[name] = {"sources": origin, **agreement.to_dict()}
    if sampling is not None:
        progress(f"checking CTranslate2 {quantization}'s sampled first tokens against the eager probabilities")
        done.checks[name]["sampling"] = ct2_baseline.check_sampling(reference, translator, ids, mask, sampling,
                                                                    require=quantization == "float32").to_dict()
    del translator  # one Translator per process while timing
    done.builds[name] = {"convert_seconds": round(seconds, 3), "model_bytes": (model_dir / "model.bin").stat().st_size,
                         "converter": "ours" if source is None else "CTranslate2's TransformersConverter"}
