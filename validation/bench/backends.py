"""The backends `seq2trt bench` times, behind one small timing interface.

In-process backends (eager, ORT, TensorRT) are `StepModel`s driven by the shared greedy loop of
`reference_model.decoding`, so every one pays the same Python loop. CTranslate2 runs in a worker process of its
own (`ct2_worker.py`, one Translator per process) and is timed inside that process.

Every backend answers: `sample` (`bench --search sample`: forced length too, N samples a source), `search`
(`--search beam`), `decode` (greedy, exactly `new_tokens` tokens per source: eos never stops a row, so each
backend does the same work whatever its model predicts), `encode_seconds`, `step_seconds(past_len)` and
`memory()` and `threading()`. A backend that cannot time something returns None.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from seq2trt.reference_model.decoding import DecodeSettings, Hypothesis, greedy_decode, hf_beam_search
from seq2trt.core.errors import DependencyError

NEVER = -1  # an eos id no argmax returns: forced-length decoding


def rss_mb() -> float:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    """VmHWM, the peak RSS of this process."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def settle(threads: int = 1) -> None:
    """An idle gap before each turn: the previous backend's thread pools spin-wait for a while after their last
    call, and on 2 cores that spinning would be charged to whichever backend runs next. One thread: 5 ms. More:
    50 ms, past the spinning of libgomp (GOMP_SPINCOUNT 300,000 pauses, a few ms: CTranslate2 and PyTorch) and of
    ONNX Runtime's shared pool; with 5 ms, CTranslate2 at 2 threads lost 2x at batch 1 in a 6-backend round."""
    time.sleep(0.005 if threads == 1 else 0.05)


def start_turn(threads: int, set_threads=None) -> None:
    """Before an in-process backend's turn: settle, then set its process-wide thread count (torch's) if it has one."""
    settle(threads)
    if set_threads is not None:
        set_threads(threads)


def sequences(outputs: list) -> list[list[int]]:
    """Every returned sequence, in order: a search's token lists, or its n-best lists of Hypothesis flattened."""
    flat = []
    for o in outputs:
        if o and isinstance(o[0], Hypothesis):
            flat += [h.tokens for h in o]
        else:
            flat.append(o)
    return flat


class TimedSteps:
    """A `StepModel` proxy that records the wall time of every `step` call."""

    def __init__(self, model):
        self.model, self.times = model, []

    def encode(self, input_ids, attention_mask):
        return self.model.encode(input_ids, attention_mask)

    def empty_past(self, batch):
        return self.model.empty_past(batch)

    def step(self, input_ids, encoder_attention_mask, encoder_state, past):
        start = time.perf_counter()
        out = self.model.step(input_ids, encoder_attention_mask, encoder_state, past)
        self.times.append(time.perf_counter() - start)
        return out

    def select(self, state, index):
        return self.model.select(state, index)


class StepModelBackend:
    """Any `StepModel` in this process: eager, ONNX Runtime, TensorRT."""

    scope = "process"

    def __init__(self, name: str, model, cfg, threads: int, closers=(), set_threads=None, sync=None):
        self.name, self.model, self.cfg, self.threads = name, model, cfg, threads
        self._closers, self._set_threads = list(closers), set_threads
        self._sync = sync or (lambda: None)  # waits for a device's queued work (eager CUDA: encode returns early)
        self._pasts: dict[tuple, Any] = {}

    def activate(self) -> None:
        """Called before each of its turns: eager's thread count is process-wide."""
        start_turn(self.threads, self._set_threads)

    def decode(self, input_ids: np.ndarray, attention_mask: np.ndarray, new_tokens: int
               ) -> tuple[float, list[float]]:
        timed = TimedSteps(self.model)
        settings = DecodeSettings(self.cfg.bos_id, NEVER, self.cfg.pad_id, new_tokens)
        start = time.perf_counter()
        greedy_decode(timed, input_ids, attention_mask, settings)
        return time.perf_counter() - start, timed.times

    def sample(self, input_ids: np.ndarray, attention_mask: np.ndarray, new_tokens: int, sampling
               ) -> tuple[float, list[float], list[list[int]]]:
        """`bench --search sample`: the shared loop sampling exactly `new_tokens` a row (eos never ends one),
        `sampling.n` samples a source (with their scores when n > 1). Returns (seconds, step seconds, every sample)."""
        timed = TimedSteps(self.model)
        settings = DecodeSettings(self.cfg.bos_id, NEVER, self.cfg.pad_id, new_tokens, do_sample=True,
                                  temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                  seed=sampling.seed, num_return_sequences=sampling.n, output_scores=sampling.n > 1,
                                  fast_sampling=sampling.fast)
        start = time.perf_counter()
        outputs = greedy_decode(timed, input_ids, attention_mask, settings)
        return time.perf_counter() - start, timed.times, sequences(outputs)

    def search(self, input_ids: np.ndarray, attention_mask: np.ndarray, settings: DecodeSettings, beam: int,
               length_penalty: float) -> tuple[float, list[list[int]]]:
        """`bench --search beam`: a real search (eos stops), Hugging Face's with early_stopping=True (ort-generate's);
        `settings.num_return_sequences` hypotheses a source (with scores when more than one)."""
        start = time.perf_counter()
        if beam == 1:
            outputs = greedy_decode(self.model, input_ids, attention_mask, settings)
        else:
            outputs = hf_beam_search(self.model, input_ids, attention_mask, settings, beam, length_penalty, True)
        return time.perf_counter() - start, sequences(outputs)

    def encode_seconds(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> float:
        start = time.perf_counter()
        self.model.encode(input_ids, attention_mask)
        self._sync()
        return time.perf_counter() - start

    def step_seconds(self, input_ids: np.ndarray, attention_mask: np.ndarray, past_len: int, calls: int
                     ) -> list[float]:
        """Decoder calls of one new token on a past of `past_len` (built once by a prefill, then reused)."""
        key = (input_ids.shape, past_len)
        if key not in self._pasts:
            state = self.model.encode(input_ids, attention_mask)
            past = self.model.empty_past(len(input_ids))
            if past_len:
                prefix = np.full((len(input_ids), past_len), self.cfg.bos_id, dtype=np.int64)
                _, past = self.model.step(prefix, attention_mask, state, past)
            self._pasts = {key: (state, past)}  # one cached past at a time keeps memory flat
        state, past = self._pasts[key]
        token = np.full((len(input_ids), 1), self.cfg.bos_id, dtype=np.int64)
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            self.model.step(token, attention_mask, state, past)
            times.append(time.perf_counter() - start)
        return times

    def steps_by_past(self, input_ids, attention_mask, new_tokens):
        return None

    def memory(self) -> dict:
        return {"peak_rss_mb": round(peak_rss_mb(), 1), "scope": "process (shared by the in-process backends)"}

    def threading(self) -> str:
        """How its threads run: ONNX Runtime's own description (`OrtRunner.threading`), else the count."""
        runners = [getattr(self.model, side, None) for side in ("encoder", "decoder")]
        described = {getattr(r, "threading", None) for r in runners} - {None}
        if described:
            return ", ".join(sorted(described))
        device = getattr(self.model, "device", None)  # eager: a torch.device
        if getattr(device, "type", "cpu") != "cpu":
            return f"{device} (host: {self.threads} thread(s))"
        return f"{self.threads} thread(s)"

    def close(self) -> None:
        self._pasts.clear()
        for close in self._closers:
            close()


# CTranslate2's worker runs with its own defaults (OpenMP threads spin between parallel regions): its best on an idle
# machine. On a loaded machine spinning threads wait for preempted partners; set OMP_WAIT_POLICY=PASSIVE in the
# environment for such runs (benchmarks/README.md, "CTranslate2"): the worker inherits it and latency.json records it.
CT2_ENV_KEYS = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "KMP_BLOCKTIME", "CT2_USE_MKL", "CT2_FORCE_CPU_ISA")


class Ct2Backend:
    """CTranslate2 in its own worker process; sources go over a pipe as token strings, timing stays inside."""

    scope = "worker"

    def __init__(self, name: str, model_dir: Path, source_tokens: list[str], threads: int, compute_type: str):
        self.name, self.threads, self.source_tokens = name, threads, source_tokens
        worker = Path(__file__).with_name("ct2_worker.py")
        self.env = {k: os.environ[k] for k in CT2_ENV_KEYS if k in os.environ}
        self.process = subprocess.Popen([sys.executable, str(worker), str(model_dir), str(threads), compute_type],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)
        self.load_seconds = self._reply()["load_s"]

    def _reply(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            err = self.process.stderr.read()[-2000:]
            raise DependencyError(f"the CTranslate2 worker ({self.name}) exited: {err.strip() or 'no message'}")
        return json.loads(line)

    def _ask(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._reply()

    def _sources(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> list[list[str]]:
        return [[self.source_tokens[int(i)] for i in row[m != 0]] for row, m in zip(input_ids, attention_mask)]

    def activate(self) -> None:
        settle(self.threads)

    def decode(self, input_ids, attention_mask, new_tokens):
        """End-to-end time without a callback; step times from a second run with one (it costs a Python call per row)."""
        sources = self._sources(input_ids, attention_mask)
        plain = self._ask({"op": "decode", "sources": sources, "new_tokens": new_tokens, "forced": True,
                           "step_times": False})
        timed = self._ask({"op": "decode", "sources": sources, "new_tokens": new_tokens, "forced": True,
                           "step_times": True})
        return plain["seconds"], timed["step_s"]

    def sample(self, input_ids, attention_mask, new_tokens, sampling):
        """`bench --search sample`: CTranslate2's random sampling (beam 1, `sampling.ct2()`: its own random stream,
        seeded), exactly `new_tokens` a row, `num_hypotheses` samples a source (scores when more than one)."""
        reply = self._ask({"op": "decode", "sources": self._sources(input_ids, attention_mask), "forced": True,
                           "new_tokens": new_tokens, "step_times": False, **sampling.ct2()})
        return reply["seconds"], [], reply["tokens"]

    def search(self, input_ids, attention_mask, settings, beam, length_penalty):
        """`bench --search beam`: CTranslate2's beam search, same beam size, length penalty (score / length **
        penalty) and max length; eos stops, and a source ends once `beam` hypotheses ended (its default patience 1), as
        Hugging Face's early_stopping=True (the loops' and ort-generate's) ends it. `num_return_sequences` of the
        settings is its num_hypotheses (return_scores with it)."""
        n = settings.num_return_sequences
        reply = self._ask({"op": "decode", "sources": self._sources(input_ids, attention_mask), "forced": False,
                           "new_tokens": settings.max_new_tokens, "step_times": False, "beam_size": beam,
                           "length_penalty": length_penalty, "num_hypotheses": n, "return_scores": n > 1})
        return reply["seconds"], reply["tokens"]

    def encode_seconds(self, input_ids, attention_mask):
        return None  # a Translator has no encoder-only call

    def step_seconds(self, input_ids, attention_mask, past_len, calls):
        return None

    def steps_by_past(self, input_ids, attention_mask, new_tokens) -> list[float]:
        """Seconds of decoding steps with past length 1 .. new_tokens - 1 (step 0 is inseparable from encoding)."""
        return self._ask({"op": "decode", "sources": self._sources(input_ids, attention_mask), "new_tokens": new_tokens,
                          "forced": True, "step_times": True})["step_s"]

    def threading(self) -> str:
        return f"{self.threads} intra-op thread(s), OpenMP " + \
            (", ".join(f"{k}={v}" for k, v in self.env.items()) if self.env else "defaults")

    def memory(self) -> dict:
        return {"peak_rss_mb": round(self._ask({"op": "memory"})["peak_rss_mb"], 1),
                "scope": "worker process (CTranslate2 and Python only)", **({"env": self.env} if self.env else {})}

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.process.stdin.flush()
                self.process.wait(timeout=10)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()


