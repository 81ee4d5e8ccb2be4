"""Shared fixtures: tiny seeded models built in code, and the trained demo checkpoint (cached)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from seq2trt.reference_model import Seq2SeqTransformer, preset


def random_model(seed: int = 0, dtype: torch.dtype = torch.float64, **overrides) -> Seq2SeqTransformer:
    """A tiny model whose random weights give varied tokens (untied head, weights at unit gain)."""
    cfg = preset("tiny", **{"src_vocab_size": 13, "tgt_vocab_size": 17, "tie_embeddings": False, **overrides})
    torch.manual_seed(seed)
    model = Seq2SeqTransformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, p.shape[-1] ** -0.5)
            elif "norm" in name and name.endswith("weight"):
                p.normal_(1, 0.1)
            else:
                p.normal_(0, 0.1)
        if not cfg.tie_embeddings:
            model.lm_head.weight.mul_(3)  # sharper logits: fewer near-ties between tokens
    return model.to(dtype).eval()


@pytest.fixture(scope="session")
def make_model():
    return random_model


@pytest.fixture(scope="session")
def demo_checkpoint() -> Path:
    """The trained demo model (about 2 minutes on 2 cores the first time, then cached on disk)."""
    from seq2trt.reference_model.train import demo_checkpoint

    return demo_checkpoint(Path(os.environ["SEQ2TRT_CACHE"]) if "SEQ2TRT_CACHE" in os.environ else None)


HF_COMMON = dict(vocab_size=97, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)


def hf_model_dir(path: Path, family: str, config: dict | None = None, generation: dict | None = None,
                 seed: int = 0, std: float = 0.35) -> Path:
    """A random Hugging Face model of `family` built with the family's own config class, saved with
    save_pretrained. Weights are scaled up (std `std`, a non-zero logits bias): at the default init every family
    decodes one token over and over, and greedy and beam could not be told apart."""
    import transformers

    classes = {"marian": ("MarianConfig", "MarianMTModel"), "bart": ("BartConfig", "BartForConditionalGeneration"),
               "mbart": ("MBartConfig", "MBartForConditionalGeneration"),
               "m2m_100": ("M2M100Config", "M2M100ForConditionalGeneration")}
    config_class, model_class = (getattr(transformers, name) for name in classes[family])
    settings = {**HF_COMMON, **(dict(pad_token_id=96, decoder_start_token_id=96, eos_token_id=0)
                                if family == "marian" else {}), **(config or {})}
    torch.manual_seed(seed)
    model = model_class(config_class(**settings)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, std)
        if hasattr(model, "final_logits_bias"):
            model.final_logits_bias.normal_(0, 1)
    for key, value in (generation or {}).items():
        setattr(model.generation_config, key, value)
    model.save_pretrained(path)
    return Path(path)


@pytest.fixture(scope="session")
def make_hf_model():
    return hf_model_dir
