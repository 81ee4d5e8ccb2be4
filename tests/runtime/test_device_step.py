"""The GPU backend's step model (`DeviceStepModel`, backend ort-cuda) on the CPU provider, where it runs the same
code: the KV cache never crosses between host and device after the encoder ran (every crossing ONNX Runtime's
Python API offers is counted, not only the ones the model reports), and its tokens are the eager model's (fp32,
greedy and both beam searches) and, bit for bit, those of the host-array step model over the same graphs."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from seq2trt.exporters import spec
from seq2trt.exporters.manifest import verify
from seq2trt.reference_model.decoding import DecodeSettings, beam_search, greedy_decode, hf_beam_search
from seq2trt.reference_model.eager import EagerStepModel
from seq2trt.core.errors import DependencyError
from seq2trt.reference_model.vocab import pad_batch
from seq2trt.runtime.device_step import DeviceStepModel
from seq2trt.runtime.runners import OrtRunner
from seq2trt.runtime.step_model import RunnerStepModel

from helpers.sources import random_sources

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def fused(make_model, tmp_path_factory):
    """(a random float32 model, encoder and decoder runners of its fused ORT graphs on the CPU provider)."""
    from helpers.artifacts import checkpoint_and_export

    model = make_model(seed=2, dtype=torch.float32)
    _, out = checkpoint_and_export(tmp_path_factory.mktemp("device"), model, max_batch=8, fuse=("ort",))
    manifest = verify(out)
    runners = [OrtRunner(out / "fused" / "ort" / k.filename, manifest.config, k, manifest.dtype, manifest.limits)
               for k in spec.GraphKind]
    for r in runners:
        r.__enter__()
    yield model, runners
    for r in runners:
        r.__exit__(None, None, None)


class Crossings:
    """Every host<->device crossing ONNX Runtime's Python API can make, by direction and tensor rank: arrays made
    into OrtValues, OrtValues read back, numpy inputs bound or fed to `run`, outputs copied to the CPU."""

    def __init__(self, monkeypatch):
        import onnxruntime as ort

        self.seen: Counter = Counter()
        from_numpy, numpy = ort.OrtValue.ortvalue_from_numpy, ort.OrtValue.numpy
        bind_cpu, copy_out, run = ort.IOBinding.bind_cpu_input, ort.IOBinding.copy_outputs_to_cpu, \
            ort.InferenceSession.run

        def counted_from_numpy(array, *args, **kwargs):
            self.seen["to_device", np.asarray(array).ndim] += 1
            return from_numpy(array, *args, **kwargs)

        def counted_numpy(value):
            array = numpy(value)
            self.seen["to_host", array.ndim] += 1
            return array

        def counted_bind(binding, name, array):
            self.seen["to_device", np.asarray(array).ndim] += 1
            return bind_cpu(binding, name, array)

        def counted_copy(binding):
            arrays = copy_out(binding)
            for a in arrays:
                self.seen["to_host", np.asarray(a).ndim] += 1
            return arrays

        def counted_run(session, names, feed, *args, **kwargs):
            self.seen["run", max(np.asarray(v).ndim for v in feed.values())] += 1
            return run(session, names, feed, *args, **kwargs)

        monkeypatch.setattr(ort.OrtValue, "ortvalue_from_numpy", staticmethod(counted_from_numpy))
        monkeypatch.setattr(ort.OrtValue, "numpy", counted_numpy)
        monkeypatch.setattr(ort.IOBinding, "bind_cpu_input", counted_bind)
        monkeypatch.setattr(ort.IOBinding, "copy_outputs_to_cpu", counted_copy)
        monkeypatch.setattr(ort.InferenceSession, "run", counted_run)

    def cache(self) -> int:
        """Crossings of rank-4 tensors: (rows, heads, positions, head_dim), the KV cache's shape and no other's."""
        return sum(n for (_, rank), n in self.seen.items() if rank == 4)


@pytest.mark.parametrize("share", [True, False])
def test_the_cache_never_crosses_after_the_encoder(fused, monkeypatch, share):
    """Greedy, 6 steps at batch 4: per step one tokens array goes to the device (and, with shared buffers, the past
    length) and one logits array comes back; the mask goes once; nothing of rank 4 (the KV cache) crosses at all, and
    no plain session.run copies feeds. Shared: every step's present is written into the same preallocated buffers."""
    model, runners = fused
    cfg = model.cfg
    device = DeviceStepModel(*runners, share_buffers=share)
    ids, mask = pad_batch(random_sources(cfg, 4, seed=3), cfg.pad_id)
    crossings = Crossings(monkeypatch)
    state = device.encode(ids, mask)
    past = device.empty_past(len(ids))
    buffers = dict(past.values) if share else None
    tokens = np.full((len(ids), 1), cfg.bos_id)
    steps = 6
    for _ in range(steps):
        logits, past = device.step(tokens, mask, state, past)
        tokens = logits.argmax(-1)[:, None]
    assert crossings.cache() == 0
    assert not any(kind == "run" for kind, _ in crossings.seen)
    # to the device: the encoder's ids and mask, the decoder's mask once, each step's tokens (and past length); back:
    # each step's logits
    lengths = {("to_device", 1): steps} if share else {}
    assert crossings.seen == Counter({("to_device", 2): 3 + steps, ("to_host", 3): steps, **lengths})
    assert device.copies == Counter({("to_device", "source"): 2, ("to_device", "mask"): 1,
                                     ("to_device", "tokens"): steps, ("to_host", "logits"): steps,
                                     **({("to_device", "past length"): steps} if share else {})})
    if share:
        assert past.length == steps and all(past.values[n] is buffers[n] for n in buffers)  # written in place
        assert next(iter(past.values.values())).shape()[2] == runners[1].limits.max_tgt_len
    else:
        assert next(iter(past.values())).shape()[2] == steps  # the cache grew on the device


def test_beam_reordering_stays_on_the_device(fused, monkeypatch):
    """A beam search's selects gather on the device: only row indices and past lengths (rank 1) go there."""
    model, runners = fused
    cfg = model.cfg
    device = DeviceStepModel(*runners)
    ids, mask = pad_batch(random_sources(cfg, 2, seed=4), cfg.pad_id)
    crossings = Crossings(monkeypatch)
    beam_search(device, ids, mask, DecodeSettings(cfg.bos_id, cfg.eos_id, cfg.pad_id, 8), beam_size=3)
    assert crossings.cache() == 0
    assert device.copies["to_device", "index"] > 1
    assert crossings.seen["to_device", 1] == device.copies["to_device", "index"] + device.copies[
        "to_device", "past length"]


def test_a_graph_that_reads_its_past_otherwise_concatenates(make_model, tmp_path):
    """The plain export's decoder concatenates past and new K/V itself (no attention node reads the past): buffer
    sharing does not apply, and the step model keeps growing presents, with the eager model's tokens."""
    from helpers.artifacts import checkpoint_and_export

    model = make_model(seed=2, dtype=torch.float32)
    _, out = checkpoint_and_export(tmp_path, model, max_batch=8)
    manifest = verify(out)
    runners = [OrtRunner(out / k.filename, manifest.config, k, "fp32", manifest.limits) for k in spec.GraphKind]
    for r in runners:
        r.__enter__()
    device, cfg = DeviceStepModel(*runners), model.cfg
    assert isinstance(device.empty_past(2), dict) and not device.share_buffers
    ids, mask = pad_batch(random_sources(cfg, 4, seed=7), cfg.pad_id)
    settings = DecodeSettings(cfg.bos_id, cfg.eos_id, cfg.pad_id, 10)
    assert greedy_decode(device, ids, mask, settings) == greedy_decode(EagerStepModel(model), ids, mask, settings)
    for r in runners:
        r.__exit__(None, None, None)


def test_tokens_equal_the_eager_model_and_the_host_step_model(fused):
    model, runners = fused
    cfg = model.cfg
    settings = DecodeSettings(cfg.bos_id, cfg.eos_id, cfg.pad_id, 12)
    ids, mask = pad_batch(random_sources(cfg, 8, seed=5), cfg.pad_id)
    device, host, eager = DeviceStepModel(*runners), RunnerStepModel(*runners), EagerStepModel(model)
    want = greedy_decode(eager, ids, mask, settings)
    assert len({tuple(w) for w in want}) > 3  # the model says different things to different sources
    assert greedy_decode(device, ids, mask, settings) == want == greedy_decode(host, ids, mask, settings)
    ids, mask = ids[:2], mask[:2]  # 2 sources x 4 beams: the export's max_batch 8
    assert beam_search(device, ids, mask, settings, beam_size=4) == beam_search(eager, ids, mask, settings, 4)
    hf = lambda m: hf_beam_search(m, ids, mask, settings, 4, 1.0, True)
    assert hf(device) == hf(eager) == hf(host)


@pytest.mark.parametrize("share", [True, False])
def test_logits_and_cache_equal_the_host_step_model_bit_for_bit(fused, share):
    model, runners = fused
    cfg = model.cfg
    ids, mask = pad_batch(random_sources(cfg, 3, seed=6), cfg.pad_id)
    device, host = DeviceStepModel(*runners, share_buffers=share), RunnerStepModel(*runners)
    tokens = np.full((3, 2), cfg.bos_id)  # a two-token prompt first: the causal prefill writes two positions
    d_state, h_state = device.encode(ids, mask), host.encode(ids, mask)
    d_past, h_past = device.empty_past(3), host.empty_past(3)
    for _ in range(4):
        d_logits, d_past = device.step(tokens, mask, d_state, d_past)
        h_logits, h_past = host.step(tokens, mask, h_state, h_past)
        np.testing.assert_array_equal(d_logits, h_logits)
        tokens = h_logits.argmax(-1)[:, None]
    values = d_past.values if share else d_past
    for name, value in values.items():
        np.testing.assert_array_equal(value.numpy()[:, :, :5], h_past[name])  # 2 + 3 positions filled


@pytest.mark.parametrize("verb", [("translate", "{out}", "7", "--backend", "ort-cuda"),
                                  ("translate", "{out}", "7", "--backend", "ort-generate-cuda"),
                                  ("validate", "{out}", "--backend", "ort-cuda"),
                                  ("bench", "{out}", "--backends", "eager,ort-cuda"),
                                  ("serve", "{out}", "--backend", "ort-cuda")])
def test_gpu_backends_without_a_cuda_provider_are_refused_in_one_line(numbers_export, tmp_path, verb):
    """This machine's ONNX Runtime has no CUDA provider: every verb offering a GPU backend refuses it with one line
    naming the extra that installs the provider, and writes nothing."""
    import onnxruntime as ort
    import shutil

    from click.testing import CliRunner

    from seq2trt.cli.main import cli

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu is installed here: the refusal is for machines without it")
    root, _, _ = numbers_export
    out = shutil.copytree(root / "out", tmp_path / "out")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    result = CliRunner().invoke(cli, [a.format(out=out) for a in verb])
    assert result.exit_code != 0
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "ONNX Runtime has no CUDA provider here" in errors[0], result.output
    assert "pip install 'seq2trt[gpu]'" in errors[0]
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def test_the_registry_opener_refuses_ort_cuda_with_a_typed_error(numbers_export):
    import onnxruntime as ort

    from seq2trt.runtime.registry import open_step_model

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu is installed here: the refusal is for machines without it")
    root, _, _ = numbers_export
    with pytest.raises(DependencyError, match=r"^backend ort-cuda: ONNX Runtime has no CUDA provider here .*"
                                              r"pip install 'seq2trt\[gpu\]'$"):
        with open_step_model(root / "out", "ort-cuda"):
            pass


@pytest.fixture
def cuda_on_the_cpu(monkeypatch):
    """A CUDA provider reported, its sessions placed on the CPU provider (which runs the same code)."""
    from seq2trt.exporters import ort_session
    from seq2trt.exporters.tensorrt import trt_compat

    cpu_providers = ort_session.providers
    monkeypatch.setattr(ort_session, "has_cuda", lambda: True)
    monkeypatch.setattr(trt_compat, "has_gpu", lambda: True)
    monkeypatch.setattr(ort_session, "providers", lambda device="cpu", device_id=0: cpu_providers("cpu"))


def test_validate_ort_cuda_judges_the_device_step_model(numbers_export, tmp_path, cuda_on_the_cpu, monkeypatch):
    """validate --backend ort-cuda reads the fused-ort graphs by default and decodes end to end through the
    device-resident step model, judged against the float64 eager model."""
    import shutil

    from seq2trt.runtime import device_step
    from seq2trt.validation.validate import ValidateSettings, run_validation

    opened = []
    real = device_step.DeviceStepModel.__init__
    monkeypatch.setattr(device_step.DeviceStepModel, "__init__",
                        lambda self, e, d: (opened.append((e.device, d.device, d.kind)), real(self, e, d))[1])
    root, _, _ = numbers_export
    out = shutil.copytree(root / "out", tmp_path / "out")
    doc = run_validation(out, ValidateSettings(backend="ort-cuda", samples=16, beam_size=2, localize_budget_s=0))
    assert doc["passed"] and doc["graphs_set"] == "fused-ort" and doc["settings"]["device"] == "cuda"
    assert opened == [("cuda", "cuda", spec.GraphKind.DECODER)]
    assert doc["end_to_end"]["token_agreement"] == 1.0


def test_ort_cuda_is_one_declaration_over_the_device_step_model(numbers_export, cuda_on_the_cpu):
    """With a CUDA provider reported, the registry opens ort-cuda as the device-resident step model over the verified
    fused graphs, and the Translator translates with it as with ort-fused."""
    import seq2trt
    from seq2trt.runtime.registry import open_step_model

    root, _, task = numbers_export
    with open_step_model(root / "out", "ort-cuda") as (model, manifest):
        assert isinstance(model, DeviceStepModel) and model.decoder.device == "cuda"
        assert model.decoder.name == "ort-cuda"
    texts = ["40213", "7", "999999", "120", "5550", "31"]
    with seq2trt.Translator(root / "out", backend="ort-cuda") as cuda, \
            seq2trt.Translator(root / "out", backend="ort-fused") as fused:
        for beam in (1, 3):
            got = [h.ids for h in cuda.translate(texts, beam_size=beam)]
            assert got == [h.ids for h in fused.translate(texts, beam_size=beam)]
            assert len(set(map(tuple, got))) > 1


def test_whisper_transcribes_through_the_device_step_model(tmp_path, cuda_on_the_cpu):
    """A Whisper export's audio features go through the device-resident model (language detection, prompt, greedy
    and beam) to the same transcriptions as ort-fused's host-array model on the same graphs."""
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    import seq2trt
    from helpers.audio import synthetic, whisper_checkpoint, whisper_source
    from helpers.cli import invoke_ok

    src = whisper_source(tmp_path / "hf", seed=3, std=1.0, suppress_timestamps=True)
    ckpt = whisper_checkpoint(src, tmp_path / "ckpt")
    invoke_ok("export", ckpt, "-o", tmp_path / "out")
    invoke_ok("fuse", tmp_path / "out", "--target", "ort")
    clips = [synthetic(kind, seconds=s) for kind, s in (("tone", 1.5), ("noise", 2.0), ("clipping", 1.0))]
    with seq2trt.Translator(tmp_path / "out", backend="ort-cuda") as cuda, \
            seq2trt.Translator(tmp_path / "out", backend="ort-fused") as fused:
        assert isinstance(cuda._opened.model, DeviceStepModel)
        for beam in (1, 3):
            got = [r.tokens for r in cuda.transcribe(clips, 16000, beam_size=beam, max_new_tokens=10)]
            assert got == [r.tokens for r in fused.transcribe(clips, 16000, beam_size=beam, max_new_tokens=10)]
            assert all(got)


def test_bench_times_ort_cuda_beside_ort_fused(numbers_export, tmp_path, cuda_on_the_cpu):
    """bench --backends ort-fused,ort-cuda: the registry's bench adapter opens the device step model; its decode, step
    and curve timings (a past built once, then stepped on repeatedly: the shared buffers rewritten at the same
    positions) are measured, round-robin with ort-fused's."""
    import shutil

    from seq2trt.validation.bench import measure
    from seq2trt.validation.bench.settings import BenchSettings

    root, _, _ = numbers_export
    out = shutil.copytree(root / "out", tmp_path / "out", ignore=shutil.ignore_patterns("reports"))
    settings = BenchSettings(backends=("ort-fused", "ort-cuda"), batch_sizes=(1, 2), repeats=1, warmup=0, src_len=6,
                             new_tokens=4, step_calls=1)
    doc = measure.Bench(out, settings).run()
    for batch in ("1", "2"):
        assert doc["results"]["1"]["ort-cuda"][batch]["tokens_per_s"] > 0
    assert doc["step_ms_by_past"]["1"]["ort-cuda"]  # the curve by past length was timed
    assert doc["threading"]["1"]["ort-cuda"]
