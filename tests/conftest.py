"""Shared fixtures: tiny seeded models built in code, the numbers model's checkpoint and export, the trained demo
checkpoint (cached), and the speech tests' Whisper and audio. Shared code that is not a fixture lives in tests/helpers
(imported as `helpers`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from seq2trt.reference_model import Seq2SeqTransformer, preset

sys.path.append(str(Path(__file__).parent))  # `import helpers`: importlib mode puts no test folder on sys.path
pytest.register_assert_rewrite("helpers")  # their asserts explain themselves as a test's do


def pytest_configure(config):
    """Under pytest-xdist (pyproject's addopts run two workers): one torch thread per worker, and for the commands
    it runs, so the two workers share the cores instead of four spinning threads contending over two.

    Outside CI, the fuzz's run seed (tests/reliability/conftest.py) is drawn here, once, before the workers start
    (they inherit it), and printed in the header: a fuzz case that kills its worker natively, before any failure
    report can name the seed, can still be replayed."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    elif not os.environ.get("CI") and not os.environ.get("SEQ2TRT_FUZZ_SEED"):
        os.environ["SEQ2TRT_FUZZ_SEED"] = str(int.from_bytes(os.urandom(4), "little"))


def pytest_report_header(config):
    seed = os.environ.get("SEQ2TRT_FUZZ_SEED")
    return f"fuzz run seed: {seed} (replay with SEQ2TRT_FUZZ_SEED={seed})" if seed else "fuzz run seed: CI's fixed one"


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
def numbers_export(make_model, tmp_path_factory):
    """(root, model, task): a random model (seed 5) on the numbers task's vocabularies saved as root/ckpt, exported to
    root/out (max batch 8) with fused ORT graphs. Shared by the session, read only: copy it before changing it."""
    from helpers.artifacts import checkpoint_and_export, numbers_model

    model, task = numbers_model(make_model, seed=5)
    root = tmp_path_factory.mktemp("numbers")
    checkpoint_and_export(root, model, task, max_batch=8, fuse=("ort",))
    return root, model, task


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`): tiny models' calls are
    microseconds of work that two threads on a shared 2-core machine only contend over (70-100x slower a step,
    measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


def _sentencepiece(path: Path, vocab_size: int, special: dict | None = None) -> list[str]:
    """Train a unigram sentencepiece model (path/sp.model) on generated text; return its pieces after unk and eos.
    `special`: other sentencepiece ids (unk_id, eos_id, pad_id, bos_id) than unk 0, eos 1, no pad, no bos."""
    import random

    import sentencepiece as spm

    rng = random.Random(0)
    syllables = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "de", "an", "el", "or"]
    lines = [" ".join("".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(rng.randint(3, 9)))
             for _ in range(400)]
    path.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(path / "sp"), vocab_size=vocab_size,
                                   model_type="unigram", character_coverage=1.0, minloglevel=2,
                                   **{**dict(bos_id=-1, eos_id=1, unk_id=0, pad_id=-1), **(special or {})})
    processor = spm.SentencePieceProcessor(model_file=str(path / "sp.model"))
    return [processor.id_to_piece(i) for i in range(processor.get_piece_size()) if i > 1]


def _drop_training_files(path: Path) -> None:
    for name in ("sp.model", "sp.vocab"):
        (path / name).unlink()


def marian_tokenizer_dir(path: Path, vocab_size: int = 80) -> tuple[Path, int]:
    """A Marian tokenizer (sentencepiece trained here on generated text, vocab.json with Marian's ids: eos 0,
    unk 1, pad last) saved into `path`; returns (path, vocabulary size)."""
    import json

    from transformers import MarianTokenizer

    pieces = _sentencepiece(path, vocab_size - 2)
    vocab = {"</s>": 0, "<unk>": 1, **{p: i + 2 for i, p in enumerate(pieces)}}
    vocab["<pad>"] = len(vocab)
    (path / "vocab.json").write_text(json.dumps(vocab))
    MarianTokenizer(str(path / "sp.model"), str(path / "sp.model"), str(path / "vocab.json")).save_pretrained(path)
    _drop_training_files(path)
    return path, len(vocab)


def m2m100_tokenizer_dir(path: Path) -> tuple[Path, int]:
    """An M2M100 tokenizer (sentencepiece trained here, fairseq ids: bos 0, pad 1, eos 2, unk 3, then the 100
    language codes `__xx__` and 8 made-up words after the pieces); returns (path, model vocabulary size)."""
    import json

    from transformers import M2M100Tokenizer

    pieces = _sentencepiece(path, 60)
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, **{p: i + 4 for i, p in enumerate(pieces)}}
    (path / "vocab.json").write_text(json.dumps(vocab))
    tokenizer = M2M100Tokenizer(str(path / "vocab.json"), str(path / "sp.model"), src_lang="en", tgt_lang="de")
    tokenizer.save_pretrained(path)
    _drop_training_files(path)
    return path, len(vocab) + len(tokenizer.lang_code_to_id) + 8


def t5_tokenizer_dir(path: Path, vocab_size: int = 70, extra_ids: int = 3) -> tuple[Path, int]:
    """A T5 tokenizer as old checkpoints hold it (sentencepiece trained here with T5's ids: pad 0, eos 1, unk 2;
    `extra_ids` sentinel tokens after the pieces): spiece.model and tokenizer_config.json, no tokenizer.json, written
    as transformers 4.x's slow T5Tokenizer saved them (5.x has no slow T5 tokenizer to save them); returns (path,
    model vocabulary size)."""
    import json
    import shutil

    _sentencepiece(path, vocab_size, dict(pad_id=0, eos_id=1, unk_id=2))
    shutil.copyfile(path / "sp.model", path / "spiece.model")
    _drop_training_files(path)
    (path / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="T5Tokenizer", extra_ids=extra_ids, eos_token="</s>", unk_token="<unk>", pad_token="<pad>")))
    # the pieces, then the sentinels (not loaded through transformers: 4.x's fast T5 class converts the model with
    # protobuf, which the serve extra's pin breaks; its slow class, which seq2trt falls back to, does not)
    return path, vocab_size + extra_ids


def t5_fast_tokenizer_dir(path: Path, vocab_size: int = 70, extra_ids: int = 3) -> tuple[Path, int]:
    """The same T5 tokenizer as `t5_tokenizer_dir` plus its tokenizer.json, converted by transformers from the
    sentencepiece model and saved beside it; returns (path, vocab size)."""
    from transformers import AutoTokenizer

    t5_tokenizer_dir(path, vocab_size, extra_ids)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.save_pretrained(path)
    assert (path / "tokenizer.json").is_file() and (path / "spiece.model").is_file()
    return path, len(tokenizer)


@pytest.fixture(scope="session")
def make_t5_fast_tokenizer():
    return t5_fast_tokenizer_dir


@pytest.fixture(scope="session")
def make_t5_tokenizer():
    return t5_tokenizer_dir


@pytest.fixture(scope="session")
def make_marian_tokenizer():
    return marian_tokenizer_dir


@pytest.fixture(scope="session")
def make_m2m100_tokenizer():
    return m2m100_tokenizer_dir


@pytest.fixture(scope="session")
def whisper_imported(tmp_path_factory) -> tuple[Path, Path]:
    """(source directory, checkpoint) of the transcribe tests' Whisper, read only: a small random transformers Whisper
    (helpers.audio.whisper_source: a tiny tokenizer and the default feature extractor beside it) imported with its
    proof. Seed 3 at unit std: varied tokens, more than one language detected; timestamps suppressed where none are
    asked for, so that transformers' generate decodes a short clip in one window."""
    from helpers.audio import whisper_checkpoint, whisper_source

    root = tmp_path_factory.mktemp("whisper")
    src = whisper_source(root / "hf", seed=3, std=1.0, suppress_timestamps=True)
    return src, whisper_checkpoint(src, root / "ckpt")


@pytest.fixture(scope="session")
def speech_files(tmp_path_factory) -> dict[str, Path]:
    """The speech tests' audio, made here, read only: espeak-ng's speech at 22.05 kHz ("fox", "speech", "numbers":
    helpers.audio.SENTENCES 0, 1, 2, as WAV; "numbers-flac" the same as FLAC), a 440 Hz tone at 8 kHz ("tone-8k" WAV,
    "tone-ogg" OGG Vorbis) and noise + tone at 44.1 kHz stereo ("stereo", FLAC)."""
    import numpy as np
    import soundfile as sf

    from helpers.audio import SENTENCES, speak, synthetic

    root = tmp_path_factory.mktemp("audio")
    files = {name: speak(root, text, f"{name}.wav") for name, text in zip(("fox", "speech", "numbers"), SENTENCES)}
    samples, rate = sf.read(str(files["numbers"]), dtype="float32")
    sf.write(root / "numbers.flac", samples, rate)
    tone = synthetic("tone", rate=8000, seconds=1.5)
    sf.write(root / "tone-8k.wav", tone, 8000)
    sf.write(root / "tone-8k.ogg", tone, 8000, format="OGG", subtype="VORBIS")
    stereo = np.stack([synthetic("noise", rate=44100), synthetic("tone", rate=44100)], axis=1)
    sf.write(root / "stereo-44k.flac", stereo, 44100)
    return {**files, "numbers-flac": root / "numbers.flac", "tone-8k": root / "tone-8k.wav",
            "tone-ogg": root / "tone-8k.ogg", "stereo": root / "stereo-44k.flac"}
