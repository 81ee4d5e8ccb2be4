"""Random small T5-family models saved with save_pretrained (transformers' own classes), for import tests."""

from __future__ import annotations

T5_CLASSES = {"t5": ("T5Config", "T5ForConditionalGeneration"), "mt5": ("MT5Config", "MT5ForConditionalGeneration"),
              "umt5": ("UMT5Config", "UMT5ForConditionalGeneration")}
T5_SMALL = dict(vocab_size=64, d_model=32, d_kv=8, num_heads=4, d_ff=48, num_layers=2, num_decoder_layers=2,
                relative_attention_num_buckets=8, relative_attention_max_distance=12, decoder_start_token_id=0)


def t5_model_dir(path, family: str, config: dict | None = None, seed: int = 0, std: float = 0.35):
    """A random transformers model of `family` saved with save_pretrained: matrices at std `std`, norm weights near 1
    and bias tables of unit scale, so that a wrong bucket, table, norm or activation moves the tokens."""
    import torch
    import transformers

    config_class, model_class = (getattr(transformers, name) for name in T5_CLASSES[family])
    torch.manual_seed(seed)
    model = model_class(config_class(**{**T5_SMALL, **(config or {})})).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith("layer_norm.weight"):
                p.normal_(1.0, 0.2)
            elif "relative_attention_bias" in key:
                p.normal_(0.0, 1.0)
            elif p.dim() > 1:
                p.normal_(0, std)
    model.save_pretrained(path)
    return path


# A tiny Whisper vocabulary: ordinary ids 0 .. 99, then the special tokens as a real checkpoint orders them
# (<|endoftext|>, <|startoftranscript|>, languages, tasks, <|notimestamps|>), and no timestamp tokens after it: a
# random model emits them freely, and transformers' generate then re-seeks inside the window (its long-form loop
# runs for short inputs too), which a test of short-form decoding must not depend on. `whisper_model_dir(...,
# timestamps=N)` appends N timestamp tokens (<|0.00|> at id 108, 0.02 s apart; a released checkpoint has 1501).
WHISPER_LANGUAGES = ("en", "de", "fr")
WHISPER_IDS = dict(eot=100, sot=101, languages={"en": 102, "de": 103, "fr": 104}, translate=105, transcribe=106,
                   no_timestamps=107)
WHISPER_SMALL = dict(vocab_size=108, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=80,
                     max_source_positions=1500, max_target_positions=448, pad_token_id=100, bos_token_id=100,
                     eos_token_id=100, decoder_start_token_id=101, begin_suppress_tokens=[7, 100],
                     suppress_tokens=[1, 2])


def whisper_model_dir(path, config: dict | None = None, seed: int = 0, std: float = 0.3, multilingual: bool = True,
                      generation: dict | None = None, timestamps: int = 0):
    """A random transformers Whisper saved with save_pretrained, with a generation_config.json naming its prompt
    tokens as released checkpoints do (lang_to_id, task_to_id, no_timestamps_token_id, is_multilingual); matrices at
    std `std` and norm weights near 1, so that a wrong front end, table or prompt moves the tokens. `timestamps`:
    that many timestamp tokens after <|notimestamps|> (the vocabulary grows by as many)."""
    import torch
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    ids = WHISPER_IDS
    torch.manual_seed(seed)
    sizes = {**WHISPER_SMALL, "vocab_size": WHISPER_SMALL["vocab_size"] + timestamps}
    model = WhisperForConditionalGeneration(WhisperConfig(**{**sizes, **(config or {})})).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "layer_norm.weight" in key:
                p.normal_(1.0, 0.2)
            elif "embed_positions" in key:
                continue  # the encoder's stored sinusoids; the decoder's learned table stays as initialised
            elif p.dim() > 1:
                p.normal_(0, std)
    gen = dict(decoder_start_token_id=ids["sot"], bos_token_id=ids["eot"], eos_token_id=ids["eot"],
               pad_token_id=ids["eot"], max_length=448, no_timestamps_token_id=ids["no_timestamps"],
               begin_suppress_tokens=model.config.begin_suppress_tokens, suppress_tokens=model.config.suppress_tokens,
               is_multilingual=multilingual)
    if multilingual:
        gen.update(lang_to_id={f"<|{c}|>": i for c, i in ids["languages"].items()},
                   task_to_id={"translate": ids["translate"], "transcribe": ids["transcribe"]})
    model.generation_config = GenerationConfig(**{**gen, **(generation or {})})
    model.save_pretrained(path)
    return path


# Pegasus and FSMT at the sizes of conftest's HF_COMMON; FSMT with vocabularies of their own sizes per side.
PEGASUS_SMALL = dict(vocab_size=97, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)
FSMT_SMALL = dict({k: v for k, v in PEGASUS_SMALL.items() if k != "vocab_size"}, langs=["en", "de"],
                  src_vocab_size=71, tgt_vocab_size=83)


def bart_like_model_dir(path, family: str, config: dict | None = None, generation: dict | None = None, seed: int = 0,
                        std: float = 0.35):
    """A random transformers Pegasus or FSMT saved with save_pretrained: matrices at std `std`, layer norms near 1, a
    logits bias of unit scale (Pegasus), the sinusoid tables left as the class builds them (they are not weights);
    `generation`: settings set on its generation config."""
    import torch
    import transformers

    config_class, model_class = {"pegasus": ("PegasusConfig", "PegasusForConditionalGeneration"),
                                 "fsmt": ("FSMTConfig", "FSMTForConditionalGeneration")}[family]
    small = PEGASUS_SMALL if family == "pegasus" else FSMT_SMALL
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**{**small, **(config or {})}))
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "embed_positions" in key:
                continue
            if "layer_norm.weight" in key:
                p.normal_(1.0, 0.2)
            elif p.dim() > 1:
                p.normal_(0, std)
        if hasattr(model, "final_logits_bias"):
            model.final_logits_bias.normal_(0, 1)
    for key, value in (generation or {}).items():
        setattr(model.generation_config, key, value)
    model.eval().save_pretrained(path)
    return path


def hf_generate(hf_model, ids, mask, new_tokens: int, eos: int, **kwargs):
    """transformers' `generate` on padded source ids, the judge of our searches: (each returned row's tokens after the
    decoder start, up to eos; generate's own output, for its scores). `kwargs` go to generate as they are."""
    import torch

    with torch.inference_mode():
        out = hf_model.generate(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                                max_new_tokens=new_tokens, return_dict_in_generate=True, **kwargs)
    return [r[: r.index(eos)] if eos in r else r for r in out.sequences[:, 1:].tolist()], out


def hf_rows(hf_model, ids, mask, new_tokens: int, eos: int, **kwargs) -> list[list[int]]:
    """`hf_generate`'s rows of a deterministic search (no sampling), one row a source unless `kwargs` say otherwise."""
    return hf_generate(hf_model, ids, mask, new_tokens, eos, **{"do_sample": False, "num_return_sequences": 1,
                                                                 **kwargs})[0]


def import_watching_models(src, out, monkeypatch):
    """`import_hf(src, out)` with each model transformers loads watched: (the import record, for each time our model
    started loading, whether each transformers model loaded so far was still alive)."""
    import gc
    import weakref

    from seq2trt.hf_import import importer as hf_import, proof as hf_verify

    loaded, alive = [], []
    real_transformers, real_ours = hf_verify.load_transformers_model, hf_import.load_hf_as_model

    def transformers_model(*args, **kwargs):
        model = real_transformers(*args, **kwargs)
        loaded.append(weakref.ref(model))
        return model

    def ours(*args, **kwargs):
        gc.collect()
        alive.append([ref() is not None for ref in loaded])
        return real_ours(*args, **kwargs)

    monkeypatch.setattr(hf_verify, "load_transformers_model", transformers_model)
    monkeypatch.setattr(hf_import, "load_hf_as_model", ours)
    return hf_import.import_hf(src, out), alive
