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
