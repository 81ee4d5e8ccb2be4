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
