"""CTranslate2 conversion against the eager model: greedy tokens exactly, logits closely, for every layout option."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("ctranslate2")

from seq2trt.core.errors import CheckFailed, ConfigError, DependencyError  # noqa: E402
from seq2trt.reference_model.vocab import pad_batch  # noqa: E402
from seq2trt.validation.bench import ct2_baseline as ct2_backend  # noqa: E402

from helpers.artifacts import numbers_model  # noqa: E402
from helpers.sources import random_sources  # noqa: E402


def _sources(cfg, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Padded random sources up to the model's length, eos last (as the training data has them)."""
    return pad_batch(random_sources(cfg, count, seed, max_len=cfg.max_src_len - 2), cfg.pad_id)


def _eager_logits(model, ids, mask, targets: list[list[int]]) -> list[np.ndarray]:
    """Teacher-forced logits (len + 1, V) of the float64 eager model: the independent reference."""
    reference = model.double()
    out = []
    with torch.no_grad():
        for row, (src, m) in enumerate(zip(ids, mask)):
            dec = torch.tensor([[model.cfg.bos_id] + targets[row]])
            out.append(reference(torch.tensor(src[None]), torch.tensor(m[None]), dec)[0].numpy())
    model.float()
    return out


VARIANTS = {
    "paper": {},
    "pre-norm, gelu": {"pre_norm": True, "activation": "gelu"},
    "tied, unscaled, eps": {"tie_embeddings": True, "scale_embeddings": False, "layer_norm_eps": 1e-6},
    "other special ids": {"pad_id": 5, "bos_id": 3, "eos_id": 7},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_teacher_forced_logits_match_float64_eager(make_model, tmp_path, variant):
    model = make_model(1, torch.float32, **VARIANTS[variant])
    cfg = model.cfg
    translator = ct2_backend.Ct2Translator(ct2_backend.convert(model, tmp_path / "ct2"), threads=1)
    ids, mask = _sources(cfg, 6, seed=2)
    rng = np.random.default_rng(3)
    targets = [[int(t) for t in rng.integers(0, cfg.tgt_vocab_size, n)] for n in (0, 1, 5, cfg.max_tgt_len - 2, 9, 3)]
    got = translator.forced_logits(ids, mask, [t or [cfg.eos_id] for t in targets])
    want = _eager_logits(model, ids, mask, [t or [cfg.eos_id] for t in targets])
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, atol=2e-4 * max(1.0, np.abs(w).max()), rtol=0)


@pytest.mark.parametrize("variant", ["paper", "pre-norm, gelu", "other special ids"])
def test_greedy_tokens_match_eager_exactly(make_model, tmp_path, variant):
    model = make_model(0, torch.float32, **VARIANTS[variant])
    cfg = model.cfg
    translator = ct2_backend.Ct2Translator(ct2_backend.convert(model, tmp_path / "ct2"), threads=1)
    ids, mask = _sources(cfg, 24, seed=5)
    tokens, logits = ct2_backend.eager_greedy(model, ids, mask, cfg.max_tgt_len - 1)
    assert len({tuple(t) for t in tokens}) > 5 and len({len(t) for t in tokens}) > 1, "want varied outputs"
    result = translator.greedy(ids, mask, cfg.max_tgt_len - 1, return_logits=True)
    assert result.tokens == tokens
    for got, want in zip(result.logits, logits):
        np.testing.assert_allclose(got, np.stack(want), atol=1e-4 * max(1.0, np.abs(want).max()), rtol=0)


def test_eos_first_and_length_limit_follow_the_shared_loop(make_model, tmp_path):
    model = make_model(0, torch.float32)
    cfg = model.cfg
    ids, mask = _sources(cfg, 6, seed=6)
    translator = ct2_backend.Ct2Translator(ct2_backend.convert(model, tmp_path / "ct2"), threads=1)
    want, _ = ct2_backend.eager_greedy(model, ids, mask, 3)
    assert translator.greedy(ids, mask, 3).tokens == want and {len(w) for w in want} == {3}
    with torch.no_grad():  # the last LayerNorm outputs its bias alone, and only eos's head row aligns with it
        norm = model.decoder_layers[-1].ffn_block.norm
        norm.weight.zero_()
        model.lm_head.weight[cfg.eos_id] = norm.bias * 100
    want, _ = ct2_backend.eager_greedy(model, ids, mask, 3)
    translator = ct2_backend.Ct2Translator(ct2_backend.convert(model, tmp_path / "eos"), threads=1)
    assert want == [[]] * 6 and translator.greedy(ids, mask, 3).tokens == want


def test_task_vocabularies_are_the_token_strings(make_model, tmp_path):
    model, task = numbers_model(make_model, seed=2)
    out = ct2_backend.convert(model, tmp_path / "ct2", vocabs=(task.source_vocab, task.target_vocab))
    assert json.loads((out / "source_vocabulary.json").read_text()) == list(task.source_vocab.tokens)
    assert json.loads((out / "target_vocabulary.json").read_text()) == list(task.target_vocab.tokens)
    ids, mask = pad_batch([task.source_vocab.encode(s) + [2] for s in ("40213", "7", "999999999")])
    want, _ = ct2_backend.eager_greedy(model, ids, mask, 20)
    assert ct2_backend.Ct2Translator(out).greedy(ids, mask, 20).tokens == want


def test_int8_leaves_the_model_intact_and_stays_close(make_model, tmp_path):
    model = make_model(1, torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = ct2_backend.convert(model, tmp_path / "int8", "int8")
    for key, value in model.state_dict().items():  # the quantizer scales arrays in place: it must get copies
        assert torch.equal(value, before[key]), key
    assert (out / "model.bin").stat().st_size < 0.5 * (ct2_backend.convert(model, tmp_path / "f32") / "model.bin").stat().st_size
    ids, mask = _sources(model.cfg, 4, seed=7)
    targets = [[3, 4, 5, 6]] * 4
    got = ct2_backend.Ct2Translator(out, threads=1).forced_logits(ids, mask, targets)
    want = _eager_logits(model, ids, mask, targets)
    for g, w in zip(got, want):
        cosine = (g * w).sum(-1) / np.linalg.norm(g, axis=-1) / np.linalg.norm(w, axis=-1)
        assert cosine.min() > 0.99


def test_check_agreement_fails_on_a_different_model(make_model, tmp_path):
    model = make_model(4, torch.float32)
    translator = ct2_backend.Ct2Translator(ct2_backend.convert(model, tmp_path / "ct2"), threads=1)
    ids, mask = _sources(model.cfg, 12, seed=8)
    assert ct2_backend.check_agreement(model, translator, ids, mask, 31)
    with torch.no_grad():
        model.decoder_layers[0].ffn.fc2.weight.mul_(-1)
    with pytest.raises(CheckFailed, match="disagrees with the eager model"):
        ct2_backend.check_agreement(model, translator, ids, mask, 31)


def test_compare_greedy_counts_near_ties():
    logits = [[np.array([0.0, 0.0, 0.0, 1.0, 1.0 - 1e-6])]]
    agreement = ct2_backend.compare_greedy(([[3]], logits), [[4]], eos_id=2)
    assert agreement and agreement.ties == 1 and agreement.identical == 0
    decisive = ct2_backend.compare_greedy(([[3]], [[np.array([0.0, 0, 0, 1.0, 0.5])]]), [[4]], eos_id=2)
    assert not decisive and "diverges at step 0" in decisive.mismatches[0]


def test_unknown_quantization_and_missing_dependency(make_model, tmp_path, monkeypatch):
    model = make_model(0, torch.float32)
    with pytest.raises(ConfigError, match="float32, int8"):
        ct2_backend.convert(model, tmp_path / "x", "int4")
    monkeypatch.setitem(sys.modules, "ctranslate2", None)
    with pytest.raises(DependencyError, match=r"seq2trt\[ct2\]"):
        ct2_backend.convert(model, tmp_path / "y")


def test_a_tie_is_judged_by_the_candidates_own_error():
    """A divergence is a tie when the eager margin is within twice the candidate's measured logit error on that
    source (here 3e-4 on logits near 10: float32 territory, so a 5e-4 margin is a tie although over the 1e-4 used
    without logits), and never when the candidate's error is beyond the fp32 bound (a wrong candidate is no tie)."""
    eager = np.array([0.0, 0.0, 0.0, 10.0, 10.0 - 5e-4])
    close = eager + np.array([0, 0, 0, -3e-4, 0])
    tied = ct2_backend.compare_greedy(([[3]], [[eager]]), [[4]], eos_id=2, candidate_logits=[[close]])
    assert tied and tied.ties == 1
    wrong = eager + np.array([0.5, 0, 0, -3e-4, 0])
    refused = ct2_backend.compare_greedy(([[3]], [[eager]]), [[4]], eos_id=2, candidate_logits=[[wrong]])
    assert not refused and refused.ties == 0
