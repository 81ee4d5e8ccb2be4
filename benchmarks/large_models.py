"""The large-model figures of benchmarks/README.md ("Large models: external data and peak memory", issue 45).

    python benchmarks/large_models.py make VOCAB D_MODEL OUT     # a random Marian (one layer a side), save_pretrained
    python benchmarks/large_models.py greedy SRC IDS OUT NEW     # transformers' greedy tokens for IDS (JSON lines)
    python benchmarks/large_models.py whisper-large-v3 OUT       # a random Whisper of whisper-large-v3's shape

Each seq2trt stage is then timed on its own under `/usr/bin/time -v` (the README lists the commands).
"""

from __future__ import annotations

import json
import sys


def make(vocab: int, d_model: int, out: str) -> None:
    import torch
    import transformers

    cfg = transformers.MarianConfig(
        vocab_size=vocab, d_model=d_model, encoder_layers=1, decoder_layers=1, encoder_attention_heads=16,
        decoder_attention_heads=16, encoder_ffn_dim=4 * d_model, decoder_ffn_dim=4 * d_model,
        max_position_embeddings=64, pad_token_id=vocab - 1, decoder_start_token_id=vocab - 1, eos_token_id=0,
        scale_embedding=True, activation_function="swish")
    torch.manual_seed(0)
    model = transformers.MarianMTModel(cfg).eval()
    with torch.no_grad():  # std 0.1: varied tokens (the default init repeats one)
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
        model.final_logits_bias.normal_(0, 1)
    model.generation_config.num_beams = 1
    model.save_pretrained(out)


def whisper_large_v3(out: str) -> None:
    """whisper-large-v3's shape (32 + 32 layers, d_model 1280, 20 heads, 128 mel bins, 51,866 tokens; 1.55 B
    parameters, 6.2 GB in float32), random weights at transformers' own initialisation, with the prompt tokens of
    the released generation_config.json (lang_to_id, task_to_id, no_timestamps_token_id)."""
    import torch
    import transformers

    cfg = transformers.WhisperConfig(
        vocab_size=51866, num_mel_bins=128, d_model=1280, encoder_layers=32, decoder_layers=32,
        encoder_attention_heads=20, decoder_attention_heads=20, encoder_ffn_dim=5120, decoder_ffn_dim=5120,
        max_source_positions=1500, max_target_positions=448, decoder_start_token_id=50258, bos_token_id=50257,
        eos_token_id=50257, pad_token_id=50256)
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(cfg).eval()
    languages = {"en": 50259, "de": 50261, "fr": 50265}
    model.generation_config = transformers.GenerationConfig(
        decoder_start_token_id=50258, bos_token_id=50257, eos_token_id=50257, pad_token_id=50257, max_length=448,
        no_timestamps_token_id=50364, is_multilingual=True, begin_suppress_tokens=[220, 50257],
        lang_to_id={f"<|{c}|>": i for c, i in languages.items()}, task_to_id={"translate": 50359, "transcribe": 50360})
    model.save_pretrained(out)


def greedy(src: str, ids_file: str, out: str, new_tokens: int) -> None:
    import torch
    import transformers

    model = transformers.MarianMTModel.from_pretrained(src, dtype=torch.float32).eval()
    cfg, rows = model.config, []
    for line in open(ids_file):
        with torch.inference_mode():
            row = model.generate(input_ids=torch.tensor([json.loads(line)]), max_new_tokens=new_tokens,
                                 num_beams=1, do_sample=False)[0, 1:].tolist()
        row = row[: row.index(cfg.eos_token_id)] if cfg.eos_token_id in row else row
        rows.append([t for t in row if t != cfg.pad_token_id])
    with open(out, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "make":
        make(int(args[0]), int(args[1]), args[2])
    elif command == "whisper-large-v3":
        whisper_large_v3(args[0])
    else:
        greedy(args[0], args[1], args[2], int(args[3]))
