"""CTranslate2 as an anchor backend: the reference weights in a CTranslate2 model, greedy decoding through
`Translator.translate_batch`, and the check that its greedy tokens agree with the eager model.

The conversion goes through CTranslate2's Python spec API (`TransformerSpec.from_config`), as its own
converters do. The mapping (docs/design.md, "Toolchain facts the code relies on"): post-LN when `pre_norm=False`; self-attention
`linear[0]` = q, k, v stacked, cross-attention `linear[0]` = q and `linear[1]` = k, v stacked; the
sqrt(d_model) factor is `scale_embeddings`; the position table is passed explicitly, because CTranslate2's
built-in sinusoid puts sin and cos in two halves, not interleaved as in the paper (and as our model does).

Tokens: CTranslate2 speaks token strings. The model's vocabularies are registered when they are known (so the
directory also translates text); otherwise each id gets a synthetic name. Sources go in with their own eos
(the training data carries it), bos is the decoder start token, eos the end token.

A checkpoint imported from a Hugging Face directory is converted from that directory by CTranslate2's own
converter instead (`convert_hf`): `to_spec` knows only our architecture's layout.

Timing runs in `ct2_worker.py`, one Translator per process (two in one process slow each other 10x here).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from seq2trt.validation.ties import GreedyComparison, compare_greedy  # noqa: F401  (re-exported)

from seq2trt.core.errors import CheckFailed, ConfigError, DependencyError, InputError
from seq2trt.core.atomic_files import atomic_write_text
from seq2trt.core.swap import staged_directory

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("float32", "int8")
TOKENS_FILE = "seq2trt_tokens.json"  # our id -> CTranslate2 token string, both sides, and the special ids


def import_ctranslate2():
    try:
        import ctranslate2
    except ImportError:
        raise DependencyError("the ct2 backend needs CTranslate2, which is not installed; "
                              "pip install 'seq2trt[ct2]' (or pip install ctranslate2)") from None
    return ctranslate2


def token_names(cfg, vocabs=None) -> tuple[list[str], list[str]]:
    """Source and target token strings indexed by id: the model's vocabularies, or `<id17>`-style names."""
    if vocabs is not None:
        names = [list(v.tokens) for v in vocabs]
        if [len(n) for n in names] == [cfg.src_vocab_size, cfg.tgt_vocab_size]:
            return names[0], names[1]
        logger.warning("vocabularies do not match the config's sizes; using synthetic token names")
    specials = {cfg.pad_id: "<pad>", cfg.bos_id: "<s>", cfg.eos_id: "</s>"}
    return tuple([specials.get(i, f"<id{i}>") for i in range(size)]
                 for size in (cfg.src_vocab_size, cfg.tgt_vocab_size))


def _np(t) -> np.ndarray:
    # A copy: CTranslate2's quantizer scales arrays in place, which would rewrite the model's own weights.
    return t.detach().float().cpu().numpy().copy()


def _linear(spec, module) -> None:
    spec.weight = _np(module.weight)
    if module.bias is not None:
        spec.bias = _np(module.bias)


def _layer_norm(spec, module) -> None:
    spec.gamma, spec.beta = _np(module.weight), _np(module.bias)


def _attention(spec, module, common_spec, fuse_linear, self_attention: bool) -> None:
    def linears(*modules):
        parts = [common_spec.LinearSpec() for _ in modules]
        for part, m in zip(parts, modules):
            _linear(part, m)
        return parts

    if self_attention:
        fuse_linear(spec.linear[0], linears(module.q_proj, module.k_proj, module.v_proj))  # q, k, v stacked
    else:
        _linear(spec.linear[0], module.q_proj)
        fuse_linear(spec.linear[1], linears(module.k_proj, module.v_proj))  # k, v stacked
    _linear(spec.linear[-1], module.out_proj)


def to_spec(model, vocabs=None):
    """A `ctranslate2.specs.TransformerSpec` holding `model`'s weights (float32), vocabularies registered."""
    ct2 = import_ctranslate2()
    from ctranslate2.converters.utils import fuse_linear
    from ctranslate2.specs import common_spec, transformer_spec

    cfg = model.cfg
    activation = {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU}[cfg.activation]
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.num_encoder_layers, cfg.num_decoder_layers), cfg.num_heads, pre_norm=cfg.pre_norm,
        activation=activation)
    positions = _np(model.positions)  # (L, D), interleaved sin/cos as in the paper
    for side, table in ((spec.encoder, model.src_embed), (spec.decoder, model.tgt_embed)):
        embeddings = side.embeddings[0] if isinstance(side.embeddings, list) else side.embeddings
        embeddings.weight = _np(table.weight)
        side.scale_embeddings = model.embed_scale != 1.0  # True: CTranslate2 multiplies by sqrt(d_model)
        side.position_encodings.encodings = positions
    for layer_spec, layer in zip(spec.encoder.layer, model.encoder_layers):
        _attention(layer_spec.self_attention, layer.self_attn, common_spec, fuse_linear, True)
        _layer_norm(layer_spec.self_attention.layer_norm, layer.attn_block.norm)
        _linear(layer_spec.ffn.linear_0, layer.ffn.fc1)
        _linear(layer_spec.ffn.linear_1, layer.ffn.fc2)
        _layer_norm(layer_spec.ffn.layer_norm, layer.ffn_block.norm)
    for layer_spec, layer in zip(spec.decoder.layer, model.decoder_layers):
        _attention(layer_spec.self_attention, layer.self_attn, common_spec, fuse_linear, True)
        _layer_norm(layer_spec.self_attention.layer_norm, layer.self_block.norm)
        _attention(layer_spec.attention, layer.cross_attn, common_spec, fuse_linear, False)
        _layer_norm(layer_spec.attention.layer_norm, layer.cross_block.norm)
        _linear(layer_spec.ffn.linear_0, layer.ffn.fc1)
        _linear(layer_spec.ffn.linear_1, layer.ffn.fc2)
        _layer_norm(layer_spec.ffn.layer_norm, layer.ffn_block.norm)
    if cfg.pre_norm:
        _layer_norm(spec.encoder.layer_norm, model.encoder_norm)
        _layer_norm(spec.decoder.layer_norm, model.decoder_norm)
    _linear(spec.decoder.projection, model.lm_head)
    src_tokens, tgt_tokens = token_names(cfg, vocabs)
    spec.register_source_vocabulary(src_tokens)
    spec.register_target_vocabulary(tgt_tokens)
    spec.config.bos_token = spec.config.decoder_start_token = tgt_tokens[cfg.bos_id]
    spec.config.eos_token = tgt_tokens[cfg.eos_id]
    spec.config.layer_norm_epsilon = cfg.layer_norm_eps
    logger.debug("CTranslate2 %s spec built", ct2.__version__)
    return spec


def convert(model, out: Path, quantization: str = "float32", vocabs=None, force: bool = False) -> Path:
    """Write a CTranslate2 model directory for `model` (weights in `quantization`) atomically; returns `out`."""
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"unknown CTranslate2 quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
    spec = to_spec(model, vocabs)
    spec.validate()
    spec.optimize(quantization=quantization)
    src_tokens, tgt_tokens = token_names(model.cfg, vocabs)
    cfg = model.cfg
    with staged_directory(out, force, "CTranslate2 model") as tmp:
        spec.save(str(tmp))
        atomic_write_text(tmp / TOKENS_FILE, json.dumps(
            {"source": src_tokens, "target": tgt_tokens, "quantization": quantization,
             "bos_id": cfg.bos_id, "eos_id": cfg.eos_id, "pad_id": cfg.pad_id}) + "\n")
    return Path(out)


class IdTokenizer:
    """What CTranslate2's Hugging Face loaders read from a tokenizer, for a source directory without one: ids named
    `<id17>`, pad `<pad>` even where it is also the decoder start (Marian's loader drops a last `<pad>`, as it drops
    the real one), eos `</s>`."""

    def __init__(self, cfg):
        specials = {cfg.bos_id: "<s>", cfg.pad_id: "<pad>", cfg.eos_id: "</s>"}
        self.names = [specials.get(i, f"<id{i}>") for i in range(cfg.tgt_vocab_size)]
        self.pad_token, self.eos_token, self.bos_token = (self.names[i] for i in (cfg.pad_id, cfg.eos_id, cfg.bos_id))
        self.unk_token, self.unk_token_id, self.special_tokens_map, self.num_madeup_words = "<unk>", None, {}, 0

    def get_vocab(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.names)}

    def convert_ids_to_tokens(self, index: int) -> str:
        return self.names[index]


def _vocabularies(model_dir: Path) -> tuple[list[str], list[str]]:
    """The source and target token lists a CTranslate2 converter wrote (index = id)."""
    if (model_dir / "shared_vocabulary.json").exists():
        shared = json.loads((model_dir / "shared_vocabulary.json").read_text())
        return shared, shared
    return tuple(json.loads((model_dir / f"{side}_vocabulary.json").read_text()) for side in ("source", "target"))


def convert_hf(src: Path, cfg, out: Path, quantization: str = "float32", force: bool = False) -> Path:
    """CTranslate2's own converter (`TransformersConverter`) on the Hugging Face directory `src`, from local files:
    its weight mapping, not ours (`to_spec` builds only our architecture). The source's tokenizer names the
    tokens; a directory without one gets `IdTokenizer`'s names. `cfg` is the imported model's config."""
    import_ctranslate2()
    from ctranslate2.converters import TransformersConverter

    from seq2trt.hf_import.text import load_tokenizer

    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"unknown CTranslate2 quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
    if cfg.forced_bos_id is not None:
        raise InputError(f"{src} forces the first target token ({cfg.forced_bos_id}, a language code) and the bench "
                         "does not pass it to CTranslate2 as a target prefix; drop ct2 from --backends")

    class FromDirectory(TransformersConverter):
        def load_model(self, model_class, path, **kwargs):
            model = model_class.from_pretrained(path, local_files_only=True, **kwargs)
            if not hasattr(model.config, "normalize_before"):  # CTranslate2 4.8's BART/mBART loader reads this
                model.config.normalize_before = cfg.pre_norm  # field, which transformers 4.57's configs dropped
            return model

        def load_tokenizer(self, tokenizer_class, path, **kwargs):
            # CTranslate2 asks for AutoTokenizer with no options: seq2trt's one loader; none: ids named by number
            tokenizer = load_tokenizer(Path(path))
            return tokenizer if tokenizer is not None else IdTokenizer(cfg)

    with staged_directory(out, force, "CTranslate2 model") as tmp:
        FromDirectory(str(src)).convert(str(tmp), quantization=quantization, force=True)
        source, target = _vocabularies(tmp)
        atomic_write_text(tmp / TOKENS_FILE, json.dumps(
            {"source": source, "target": target, "quantization": quantization, "bos_id": cfg.bos_id,
             "eos_id": cfg.eos_id, "pad_id": cfg.pad_id, "converter": "TransformersConverter",
             "from": str(src)}) + "\n")
    return Path(out)


def compute_type(quantization: str) -> str:
    return "int8_float32" if quantization == "int8" else "float32"


@dataclass
class Ct2Result:
    tokens: list[list[int]]  # each source's ids without bos/eos
    logits: list[np.ndarray] | None  # each source's (steps, V) logits, when asked for


class Ct2Translator:
    """One `ctranslate2.Translator` on a directory written by `convert`, speaking our token ids."""

    def __init__(self, model_dir: Path, threads: int = 1, quantization: str | None = None):
        ct2 = import_ctranslate2()
        self.model_dir = Path(model_dir)
        meta_path = self.model_dir / TOKENS_FILE
        if not meta_path.exists():
            raise InputError(f"{meta_path} not found; {model_dir} was not written by seq2trt's CTranslate2 converter")
        meta = json.loads(meta_path.read_text())
        self.source_tokens, self.target_tokens = meta["source"], meta["target"]
        self.target_ids = {t: i for i, t in enumerate(self.target_tokens)}
        self.eos_id = meta["eos_id"]
        self.quantization = quantization or meta["quantization"]
        self.translator = ct2.Translator(str(self.model_dir), device="cpu", compute_type=compute_type(self.quantization),
                                         inter_threads=1, intra_threads=threads)

    def sources(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> list[list[str]]:
        return [[self.source_tokens[int(i)] for i in row[mask != 0]] for row, mask in zip(input_ids, attention_mask)]

    def greedy(self, input_ids: np.ndarray, attention_mask: np.ndarray, max_new_tokens: int,
               return_logits: bool = False, callback: Callable | None = None) -> Ct2Result:
        """Greedy search as `decoding.greedy_decode` does it: eos may come first, `max_new_tokens` counts eos."""
        results = self.translator.translate_batch(
            self.sources(input_ids, attention_mask), beam_size=1, max_decoding_length=max_new_tokens,
            min_decoding_length=0, max_input_length=0, return_logits_vocab=return_logits, callback=callback)
        tokens = [[self.target_ids[t] for t in r.hypotheses[0]] for r in results]
        logits = [np.stack([np.asarray(x, dtype=np.float64) for x in r.logits[0]]) for r in results] \
            if return_logits else None
        return Ct2Result(tokens, logits)

    def forced_logits(self, input_ids: np.ndarray, attention_mask: np.ndarray, targets: list[list[int]]
                      ) -> list[np.ndarray]:
        """Teacher forcing: logits (len(target) + 1, V) after bos and after each token of each target."""
        results = self.translator.translate_batch(
            self.sources(input_ids, attention_mask), [[self.target_tokens[i] for i in t] for t in targets],
            beam_size=1, max_decoding_length=max(len(t) for t in targets) + 1, min_decoding_length=0,
            max_input_length=0, return_logits_vocab=True)
        return [np.stack([np.asarray(x, dtype=np.float64) for x in r.logits[0]])[: len(t) + 1]
                for r, t in zip(results, targets)]


def eager_greedy(model, input_ids: np.ndarray, attention_mask: np.ndarray, max_new_tokens: int,
                 forced_eos: bool | None = None) -> tuple[list[list[int]], list[list[np.ndarray]]]:
    """The eager model's greedy tokens with the model's decoding rules (forced bos/eos, suppressed ids) and, per
    source, the logits (V,) of every step it decoded. `forced_eos=False` drops the forced eos at the length limit."""
    import dataclasses

    from seq2trt.reference_model.decoding import DecodeSettings, greedy_decode
    from seq2trt.reference_model.eager import EagerStepModel

    settings = DecodeSettings.for_model(model.cfg, max_new_tokens)
    if forced_eos is not None:
        settings = dataclasses.replace(settings, forced_eos=forced_eos)
    logits: list[list[np.ndarray]] = [[] for _ in range(len(input_ids))]

    def record(step, rows, step_logits):
        for row, row_logits in zip(rows, step_logits):
            logits[row].append(row_logits)

    tokens = greedy_decode(EagerStepModel(model), input_ids, attention_mask, settings, on_step=record)
    return tokens, logits


def check_agreement(model, translator: Ct2Translator, input_ids: np.ndarray, attention_mask: np.ndarray,
                    max_new_tokens: int, require: bool = True) -> GreedyComparison:
    """Decode the same sources with both; raise `CheckFailed` (when `require`) unless every sequence agrees.
    CTranslate2 has no forced eos at the length limit (Hugging Face's forced_eos_token_id): the reference decodes
    without it."""
    reference = eager_greedy(model, input_ids, attention_mask, max_new_tokens, forced_eos=False)
    result = translator.greedy(input_ids, attention_mask, max_new_tokens, return_logits=True)
    agreement = compare_greedy(reference, result.tokens, model.cfg.eos_id, result.logits)
    if require and not agreement:
        raise CheckFailed(f"CTranslate2 ({translator.quantization}) disagrees with the eager model on "
                          f"{agreement.sequences - agreement.identical - agreement.ties} of {agreement.sequences} "
                          "greedy sequences: " + "; ".join(agreement.mismatches[:5]) +
                          "; its timings would not be comparable")
    return agreement


def first_token_counts(translator: Ct2Translator, input_ids: np.ndarray, attention_mask: np.ndarray, sampling,
                       draws: int, vocab_size: int) -> np.ndarray:
    """(S, V): `draws` first tokens of each source sampled by CTranslate2 (one decoding step, eos allowed: an empty
    hypothesis), seeded with `sampling.seed`, in our ids."""
    import_ctranslate2().set_random_seed(sampling.seed)
    options = {k: v for k, v in sampling.ct2().items() if k not in ("seed", "num_hypotheses", "return_scores")}
    counts = np.zeros((len(input_ids), vocab_size), np.int64)
    for s, source in enumerate(translator.sources(input_ids, attention_mask)):
        results = translator.translator.translate_batch([source] * draws, beam_size=1, max_decoding_length=1,
                                                        min_decoding_length=0, max_input_length=0, **options)
        picked = [translator.target_ids[r.hypotheses[0][0]] if r.hypotheses[0] else translator.eos_id for r in results]
        np.add.at(counts[s], picked, 1)
    return counts


def check_sampling(model, translator: Ct2Translator, input_ids: np.ndarray, attention_mask: np.ndarray, sampling,
                   sources: int = 4, draws: int = 2000, require: bool = True):
    """CTranslate2's sampling (its own random stream) against the eager model's first-token probabilities with the
    same warpers: the chi-square test of validation/sampling_distribution.py on the first `sources` sources, `draws`
    each; raise `CheckFailed` (when `require`) if it fails."""
    from dataclasses import replace

    from seq2trt.reference_model.decoding import DecodeSettings
    from seq2trt.reference_model.eager import EagerStepModel

    from seq2trt.validation import sampling_distribution as judge

    settings = replace(DecodeSettings.for_model(model.cfg, 1), do_sample=True, temperature=sampling.temperature,
                       top_k=sampling.top_k, top_p=sampling.top_p)
    ids, mask = input_ids[:sources], attention_mask[:sources]
    trimmed = [row[m != 0].tolist() for row, m in zip(ids, mask)]
    probs = judge.first_token_probs(EagerStepModel(model), trimmed, settings)
    result = judge.chi_square(first_token_counts(translator, ids, mask, sampling, draws, probs.shape[1]), probs)
    if require and not result:
        raise CheckFailed(f"CTranslate2 ({translator.quantization}) samples another distribution than the eager model: "
                          + result.failures()[0] + "; its timings would not be comparable")
    return result
