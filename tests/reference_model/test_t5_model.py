"""T5, mT5 and UMT5 as configs of the one model, judged by transformers on small random models.

Our model is built from a config that describes each family (no class of its own) and given transformers' weights
through a rename map written here; its encoder states, its teacher-forced logits and its KV-cached steps are compared
with transformers' in float64 and fp32. Covered: tied relu v1.0 (logits scaled by d_model^-0.5), untied gated v1.1,
heads x d_kv wider and narrower than d_model, UMT5's table in every layer, sources and targets longer than
max_distance (the log-spaced and capped buckets), padded batches. The bucket lookup is checked against transformers'
`_relative_position_bucket` for every distance up to the lookup's length.
"""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from transformers.models.t5.modeling_t5 import T5Attention

from seq2trt.reference_model.checkpoint import canonical_state_dict, load_checkpoint, save_checkpoint
from seq2trt.reference_model.config import Seq2SeqConfig
from seq2trt.core.errors import ConfigError
from seq2trt.hf_import.families import transformers_major
from seq2trt.reference_model.model import Seq2SeqTransformer, distance_bias, relative_position_buckets

MAX_LEN = 160  # our limits in these tests: past T5's default max_distance of 128

# name -> (config class, its arguments). Lengths of source and target are chosen per case beyond max_distance.
FAMILIES = {
    "t5-v1.0-tied-relu": ("T5Config", dict(d_model=32, d_kv=8, num_heads=4, d_ff=48, num_layers=2, num_decoder_layers=2,
                                           feed_forward_proj="relu", tie_word_embeddings=True,
                                           relative_attention_num_buckets=8, relative_attention_max_distance=12)),
    "t5-v1.1-gated-wide": ("T5Config", dict(d_model=32, d_kv=8, num_heads=6, d_ff=40, num_layers=2,
                                            num_decoder_layers=3, feed_forward_proj="gated-gelu",
                                            tie_word_embeddings=False, relative_attention_num_buckets=10,
                                            relative_attention_max_distance=20)),
    "mt5-gated-narrow": ("MT5Config", dict(d_model=40, d_kv=8, num_heads=3, d_ff=56, num_layers=3, num_decoder_layers=2,
                                           relative_attention_num_buckets=16, relative_attention_max_distance=24)),
    "umt5-per-layer": ("UMT5Config", dict(d_model=24, d_kv=8, num_heads=4, d_ff=40, num_layers=2, num_decoder_layers=2,
                                          relative_attention_num_buckets=12, relative_attention_max_distance=16)),
    "t5-default-buckets": ("T5Config", dict(d_model=16, d_kv=4, num_heads=2, d_ff=24, num_layers=1,
                                            num_decoder_layers=1, feed_forward_proj="gated-gelu",
                                            tie_word_embeddings=True)),  # 32 buckets, max_distance 128
}
LENGTHS = {"t5-default-buckets": (150, 140)}  # (source, target); the others (40, 30): beyond their max_distance
VOCAB = 64


def hf_model(name: str, dtype: torch.dtype):
    """The family's transformers model with seeded random weights: norm weights near 1 and bias tables of unit
    scale, so that a wrong bucket, table or norm moves the outputs."""
    cls_name, kwargs = FAMILIES[name]
    config = getattr(transformers, cls_name)(vocab_size=VOCAB, dropout_rate=0.0, **kwargs)
    model_cls = {"T5Config": transformers.T5ForConditionalGeneration,
                 "MT5Config": transformers.MT5ForConditionalGeneration,
                 "UMT5Config": transformers.UMT5ForConditionalGeneration}[cls_name]
    torch.manual_seed(sum(map(ord, name)))
    model = model_cls(config)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith("layer_norm.weight"):
                p.normal_(1.0, 0.2)
            elif "relative_attention_bias" in key:
                p.normal_(0.0, 1.0)
    return model.to(dtype).eval()


def our_config(hf) -> Seq2SeqConfig:
    """The config that describes a T5-family model (what the import adapter will derive)."""
    c = hf.config
    gated = c.feed_forward_proj.startswith("gated-")
    return Seq2SeqConfig(
        src_vocab_size=c.vocab_size, tgt_vocab_size=c.vocab_size, d_model=c.d_model, num_heads=c.num_heads,
        d_kv=c.d_kv, num_encoder_layers=c.num_layers, num_decoder_layers=c.num_decoder_layers, d_ff=c.d_ff,
        dropout=0.0, max_src_len=MAX_LEN, max_tgt_len=MAX_LEN,
        activation={"relu": "relu", "gelu_new": "gelu_tanh"}[c.dense_act_fn], gated_ffn=gated, norm="rms",
        pre_norm=True, scale_embeddings=False, tie_embeddings=c.tie_word_embeddings, share_vocab=True,
        layer_norm_eps=c.layer_norm_epsilon, positions="none", bias=False, scale_attention=False,
        # transformers 4.x scales when tied; 5.x reads its own scale_decoder_outputs (mT5: never)
        scale_logits=getattr(c, "scale_decoder_outputs", c.tie_word_embeddings and transformers_major() < 5),
        relative_bias="per_layer" if c.model_type == "umt5" else "shared",
        relative_buckets=c.relative_attention_num_buckets, relative_max_distance=c.relative_attention_max_distance,
        # The decoder starts with pad: T5Config leaves decoder_start_token_id unset, MT5/UMT5 set it to pad (0).
        pad_id=c.pad_token_id, bos_id=c.pad_token_id if getattr(c, "decoder_start_token_id", None) is None
        else c.decoder_start_token_id,
        eos_id=c.eos_token_id)


FFN = {"wi": "fc1", "wi_0": "fc1", "wi_1": "fc1_linear", "wo": "fc2"}  # v1.0's wi; v1.1's gate wi_0, linear wi_1
RENAMES = [  # transformers' key -> ours, for T5, mT5 and UMT5 alike
    (r"shared\.weight", "tgt_embed.weight"),
    (r"(encoder|decoder)\.block\.(\d+)\.layer\.0\.SelfAttention\.relative_attention_bias\.weight",
     r"\1_layers.\2.self_attn.relative_bias.weight"),
    (r"(encoder|decoder)\.block\.(\d+)\.layer\.0\.SelfAttention\.([qkv])\.weight",
     r"\1_layers.\2.self_attn.\3_proj.weight"),
    (r"(encoder|decoder)\.block\.(\d+)\.layer\.0\.SelfAttention\.o\.weight", r"\1_layers.\2.self_attn.out_proj.weight"),
    (r"decoder\.block\.(\d+)\.layer\.1\.EncDecAttention\.([qkv])\.weight",
     r"decoder_layers.\1.cross_attn.\2_proj.weight"),
    (r"decoder\.block\.(\d+)\.layer\.1\.EncDecAttention\.o\.weight", r"decoder_layers.\1.cross_attn.out_proj.weight"),
    (r"encoder\.block\.(\d+)\.layer\.0\.layer_norm\.weight", r"encoder_layers.\1.attn_block.norm.weight"),
    (r"encoder\.block\.(\d+)\.layer\.1\.layer_norm\.weight", r"encoder_layers.\1.ffn_block.norm.weight"),
    (r"decoder\.block\.(\d+)\.layer\.0\.layer_norm\.weight", r"decoder_layers.\1.self_block.norm.weight"),
    (r"decoder\.block\.(\d+)\.layer\.1\.layer_norm\.weight", r"decoder_layers.\1.cross_block.norm.weight"),
    (r"decoder\.block\.(\d+)\.layer\.2\.layer_norm\.weight", r"decoder_layers.\1.ffn_block.norm.weight"),
    (r"encoder\.block\.(\d+)\.layer\.1\.DenseReluDense\.(wi|wi_0|wi_1|wo)\.weight",
     lambda m: f"encoder_layers.{m[1]}.ffn.{FFN[m[2]]}.weight"),
    (r"decoder\.block\.(\d+)\.layer\.2\.DenseReluDense\.(wi|wi_0|wi_1|wo)\.weight",
     lambda m: f"decoder_layers.{m[1]}.ffn.{FFN[m[2]]}.weight"),
    (r"(encoder|decoder)\.final_layer_norm\.weight", r"\1_norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
]


def our_model(hf) -> Seq2SeqTransformer:
    """Our model of `hf`'s config, holding its weights (every one of ours filled, each exactly once)."""
    cfg = our_config(hf)
    model = Seq2SeqTransformer(cfg).to(next(hf.parameters()).dtype)
    ours = canonical_state_dict(model)
    state = {}
    for key, tensor in hf.state_dict().items():
        if key.endswith("embed_tokens.weight") or (key == "lm_head.weight" and cfg.tie_embeddings):
            continue  # the same tensor as shared.weight
        for pattern, repl in RENAMES:
            new, n = re.subn(f"^{pattern}$", repl, key)
            if n:
                break
        else:
            raise AssertionError(f"no rename for {key}")
        assert new in ours and new not in state, (key, new)
        state[new] = tensor
    assert sorted(state) == sorted(ours)
    model.load_state_dict(state, strict=False)
    return model.eval()


def batch(name: str, seed: int = 0):
    """A padded source batch (rows of 4 lengths, pad id 0 after each) and decoder inputs starting with the
    decoder start id (pad, 0)."""
    S, T = LENGTHS.get(name, (40, 30))
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(2, VOCAB, (4, S), generator=g)
    lengths = torch.tensor([S, S - 3, S // 2, 5])
    mask = (torch.arange(S)[None, :] < lengths[:, None]).long()
    src = src * mask
    tgt = torch.randint(2, VOCAB, (4, T), generator=g)
    tgt[:, 0] = 0
    return src, mask, tgt


def float64_judge(monkeypatch, hf) -> None:
    """transformers' T5 takes the norms' variance and the attention softmax in fp32 whatever the model's dtype
    (`.to(torch.float32)`, `scores.float()`); ours keeps a float64 model in float64. For the float64 comparison
    transformers computes those in float64 too (its norms take the variance in their input's dtype, `.float()` leaves
    a float64 tensor as it is), so the tight bound measures everything else. The fp32 comparison runs it unchanged."""
    def norm(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    for cls in {type(m) for m in hf.modules() if type(m).__name__.endswith("LayerNorm")}:
        monkeypatch.setattr(cls, "forward", norm)
    to_float = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float",
                        lambda self, *args, **kwargs: self if self.dtype == torch.float64 else to_float(self, *args,
                                                                                                        **kwargs))


def run_both(hf, model, src, mask, tgt):
    """(theirs, ours) of: encoder states, teacher-forced logits, the logits of one-token cached steps."""
    with torch.no_grad():
        theirs_enc = hf.encoder(input_ids=src, attention_mask=mask).last_hidden_state
        theirs = hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        enc = model.encode(src, mask)
        full = model(src, mask, tgt)
        cross, past, steps = model.cross_kv(enc), model.empty_past(src.shape[0]), []
        for t in range(tgt.shape[1]):
            logits, past = model.decode_step(tgt[:, t:t + 1], mask, cross, past)
            steps.append(logits)
    return (theirs_enc, theirs), (enc, full, torch.cat(steps, 1))


def scaled_errors(theirs, ours) -> dict[str, float]:
    (theirs_enc, theirs_logits), (enc, full, steps) = theirs, ours
    scale = lambda x: max(1.0, x.abs().max().item())
    return {"encoder": (enc - theirs_enc).abs().max().item() / scale(theirs_enc),
            "logits": (full - theirs_logits).abs().max().item() / scale(theirs_logits),
            "cached steps": (steps - theirs_logits).abs().max().item() / scale(theirs_logits)}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_float64_equals_transformers(name, monkeypatch):
    hf = hf_model(name, torch.float64)
    float64_judge(monkeypatch, hf)
    model = our_model(hf)
    errors = scaled_errors(*run_both(hf, model, *batch(name)))
    assert all(e < 1e-12 for e in errors.values()), errors


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_float32_equals_transformers(name):
    hf = hf_model(name, torch.float32)
    model = our_model(hf)
    errors = scaled_errors(*run_both(hf, model, *batch(name, seed=1)))
    assert all(e < 1e-4 for e in errors.values()), errors


def test_cached_steps_equal_transformers_cached_steps():
    """transformers' own KV-cached steps (its bias row from the cache position) against ours, step by step."""
    hf = hf_model("umt5-per-layer", torch.float64)
    model = our_model(hf)
    src, mask, tgt = batch("umt5-per-layer", seed=2)
    with torch.no_grad():
        enc = hf.encoder(input_ids=src, attention_mask=mask)
        out, theirs = None, []
        for t in range(tgt.shape[1]):
            out = hf(encoder_outputs=enc, attention_mask=mask, decoder_input_ids=tgt[:, t:t + 1], use_cache=True,
                     past_key_values=None if out is None else out.past_key_values)
            theirs.append(out.logits)
        cross, past, ours = model.cross_kv(model.encode(src, mask)), model.empty_past(4), []
        for t in range(tgt.shape[1]):
            logits, past = model.decode_step(tgt[:, t:t + 1], mask, cross, past)
            ours.append(logits)
    theirs, ours = torch.cat(theirs, 1), torch.cat(ours, 1)
    assert (ours - theirs).abs().max() < 1e-6 * theirs.abs().max()  # transformers' fp32 norm variance


def test_a_wrong_bias_is_caught():
    """Controls: the comparison sees a bias computed in the wrong direction or left out."""
    hf = hf_model("t5-v1.1-gated-wide", torch.float64)
    src, mask, tgt = batch("t5-v1.1-gated-wide")
    model = our_model(hf)
    causal_encoder = model.tgt_buckets.clone()
    model.tgt_buckets = model.src_buckets.clone()  # decoder read bidirectionally
    assert scaled_errors(*run_both(hf, model, src, mask, tgt))["logits"] > 1e-3
    model = our_model(hf)
    model.src_buckets = causal_encoder  # encoder read causally
    assert scaled_errors(*run_both(hf, model, src, mask, tgt))["encoder"] > 1e-3


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (8, 12), (10, 20), (16, 24), (64, 256), (4, 3)])
def test_bucket_lookup_equals_transformers(bidirectional, num_buckets, max_distance):
    """Every signed distance up to the lookup's length (beyond max_distance too) lands in transformers' bucket."""
    for max_len in (1, 2, 7, max_distance, max_distance + 1, 1024):
        lookup = relative_position_buckets(max_len, bidirectional, num_buckets, max_distance)
        distances = torch.arange(-(max_len - 1), max_len)
        theirs = T5Attention._relative_position_bucket(distances, bidirectional, num_buckets, max_distance)
        assert lookup.dtype == torch.int64 and lookup.shape == (2 * max_len - 1,)
        assert torch.equal(lookup, theirs), (max_len, (lookup != theirs).nonzero()[:5].tolist())
        assert lookup.min() >= 0 and lookup.max() < num_buckets


def test_bucket_lookup_gathers_transformers_bias():
    """The (1, H, T, L) bias gathered from the lookup by distance is transformers' compute_bias, the cached step's
    rows (query position = past length) included."""
    hf = hf_model("t5-default-buckets", torch.float64)
    for stack, bidirectional in ((hf.encoder, True), (hf.decoder, False)):
        attn = stack.block[0].layer[0].SelfAttention
        lookup = relative_position_buckets(MAX_LEN, bidirectional, 32, 128)
        by_distance = attn.relative_attention_bias(lookup).t()  # (H, 2M - 1)
        with torch.no_grad():
            for past, T in ((0, 150), (139, 1), (150, 10)):
                theirs = (attn.compute_bias(T, past + T, past_seen_tokens=past) if transformers_major() >= 5  # 5.x's
                          else attn.compute_bias(past + T, past + T, cache_position=torch.arange(past, past + T)))
                torch.testing.assert_close(distance_bias(by_distance, past, T, past + T), theirs, rtol=0, atol=0)


def test_t5_config_checks_and_json(tmp_path):
    hf = hf_model("t5-v1.1-gated-wide", torch.float32)
    cfg = our_config(hf)
    assert (cfg.head_dim, cfg.inner_dim) == (8, 48) and cfg.d_model == 32  # 6 x 8 = 48 against d_model 32
    cfg.save(tmp_path / "config.json")
    assert Seq2SeqConfig.load(tmp_path / "config.json") == cfg
    assert Seq2SeqConfig(d_model=30, num_heads=4, d_kv=8).inner_dim == 32  # d_kv lifts divisibility
    for bad, message in (({"d_kv": 0}, "d_kv"), ({"d_kv": "8"}, "d_kv must be an integer or null"),
                         ({"norm": "batch"}, "norm must be one of"), ({"relative_bias": "yes"}, "relative_bias"),
                         ({"positions": "rotary"}, "positions"), ({"relative_buckets": 2}, "relative_buckets"),
                         ({"relative_buckets": 32, "relative_max_distance": 16}, "relative_max_distance"),
                         ({"gated_ffn": 1}, "gated_ffn must be true or false")):
        with pytest.raises(ConfigError, match=message):
            Seq2SeqConfig(**bad)


def test_t5_checkpoint_round_trip(tmp_path):
    """Saved and loaded: the shared table is in layer 0 only, the tied head and shared embeddings are one tensor,
    and the loaded model computes what transformers does."""
    hf = hf_model("t5-v1.0-tied-relu", torch.float32)
    model = our_model(hf)
    keys = set(canonical_state_dict(model))
    assert {k for k in keys if "relative_bias" in k} == {"encoder_layers.0.self_attn.relative_bias.weight",
                                                          "decoder_layers.0.self_attn.relative_bias.weight"}
    assert "lm_head.weight" not in keys and "src_embed.weight" not in keys and not any("positions" in k for k in keys)
    save_checkpoint(tmp_path / "ckpt", model)
    loaded, _ = load_checkpoint(tmp_path / "ckpt")
    errors = scaled_errors(*run_both(hf, loaded, *batch("t5-v1.0-tied-relu")))
    assert all(e < 1e-4 for e in errors.values()), errors


def test_earlier_families_keep_their_weights_and_modules():
    """A BART-shaped config (and the paper's) without the new fields: the same state-dict keys, in the same order,
    as before T5's fields existed, LayerNorms, 1/sqrt(d_k), no bias tables or bucket lookups."""
    attn = lambda side, block: [f"{side}_layers.0.{block}.{p}.{w}" for p in ("q_proj", "k_proj", "v_proj", "out_proj")
                                for w in ("weight", "bias")]
    ffn_norms = lambda side, blocks: (
        [f"{side}_layers.0.ffn.{p}.{w}" for p in ("fc1", "fc2") for w in ("weight", "bias")]
        + [f"{side}_layers.0.{b}.norm.{w}" for b in blocks for w in ("weight", "bias")])
    layers = (attn("encoder", "self_attn") + ffn_norms("encoder", ("attn_block", "ffn_block"))
              + attn("decoder", "self_attn") + attn("decoder", "cross_attn")
              + ffn_norms("decoder", ("self_block", "cross_block", "ffn_block")))
    paper = Seq2SeqConfig(d_model=32, num_heads=4, num_encoder_layers=1, num_decoder_layers=1, d_ff=64,
                          src_vocab_size=40, tgt_vocab_size=40, max_src_len=16, max_tgt_len=16)
    bart = Seq2SeqConfig(**{**paper.to_dict(), "positions": "learned", "position_offset": 2, "embed_norm": True,
                            "activation": "gelu", "logits_bias": True, "scale_embeddings": False, "share_vocab": True})
    want = {paper: ["tgt_embed.weight", "src_embed.weight", *layers, "lm_head.weight"],
            bart: ["logits_bias", "tgt_embed.weight", "src_embed.weight", *layers, "src_embed_norm.weight",
                   "src_embed_norm.bias", "tgt_embed_norm.weight", "tgt_embed_norm.bias", "lm_head.weight",
                   "src_positions.weight", "tgt_positions.weight"]}
    for cfg, keys in want.items():
        model = Seq2SeqTransformer(cfg)
        assert list(model.state_dict()) == keys
        assert {n for n, _ in model.named_buffers()} <= {"positions"}
        norms = [m for m in model.modules() if "Norm" in type(m).__name__]
        assert norms and all(type(m) is torch.nn.LayerNorm for m in norms)
        assert model.encoder_layers[0].self_attn.scale == 1 / 8 ** 0.5  # head_dim 8
