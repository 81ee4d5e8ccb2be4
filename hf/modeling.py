"""`Seq2TrtModelForSeq2SeqLM`: a seq2trt export as a transformers model, so transformers' own `generate()` and
`pipeline("translation" | "summarization" | "text2text-generation")` drive its graphs (as Optimum's
`ORTModelForSeq2SeqLM` does for Optimum's exports).

The graphs follow the contract of `exporters/spec.py`: the encoder gives `encoder_hidden_states` and every layer's
cross-attention K/V once per source; the decoder step takes the past self-attention K/V and the cross K/V and gives
the logits and the present self K/V. Here the cross K/V travel from the encoder to the first step inside the
encoder's output (`Seq2TrtEncoderOutput.cross_key_values`, batch first, so generate's beam expansion copies them per
beam), and from then on inside the cache: an `EncoderDecoderCache` of two `DynamicCache`s, self-attention K/V and
cross K/V, which generate's beam search reorders like any transformers model's.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import GenerationConfig, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput

from seq2trt.exporters import spec
from seq2trt.runtime.registry import HF_MODEL_BACKENDS
from seq2trt.core.errors import InputError

# The backends whose step model is a pair of graph runners (runtime/step_model.py): the ones this class can drive.
HF_BACKENDS = HF_MODEL_BACKENDS  # the backends with encoder and decoder graphs
# transformers 5 names the cache `cache` (in forward's arguments and the output); 4.x `past_key_values`
CACHE_FIELD = "cache" if "cache" in Seq2SeqLMOutput.__dataclass_fields__ else "past_key_values"


@dataclass
class Seq2TrtEncoderOutput(BaseModelOutput):
    """`last_hidden_state` (B, S, D) and `cross_key_values` (B, 2 x layers, H, S, Dh): every decoder layer's
    cross-attention key then value (spec.flatten_kv's order), computed once per source by the encoder graph."""

    cross_key_values: torch.Tensor | None = None


def _to_torch(array: np.ndarray) -> torch.Tensor:
    # torch has no numpy bfloat16 interchange: bf16 travels as float32, which holds every bf16 value exactly
    if array.dtype.name == "bfloat16":
        array = array.astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(array))


def _to_numpy(tensor: torch.Tensor, dtype: np.dtype) -> np.ndarray:
    return np.ascontiguousarray(tensor.detach().cpu().numpy().astype(dtype, copy=False))


class Seq2TrtEncoder(torch.nn.Module):
    """The encoder graph as the module `get_encoder()` returns: generate calls it once per batch of sources."""

    main_input_name = "input_ids"

    def __init__(self, runner):
        super().__init__()
        self.runner = runner

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                return_dict: bool = True, **kwargs: Any) -> Seq2TrtEncoderOutput:
        if not self.runner.is_active:
            raise InputError("this Seq2TrtModelForSeq2SeqLM is closed (its sessions released); load it again")
        if input_ids is None:  # generate(inputs_embeds=...): the graph embeds ids itself
            raise InputError("the export's encoder graph takes token ids, not inputs_embeds; pass input_ids")
        ids = _to_numpy(input_ids, np.dtype(np.int64))
        mask = np.ones_like(ids) if attention_mask is None else _to_numpy(attention_mask, np.dtype(np.int64))
        out = self.runner.infer({"input_ids": ids, "attention_mask": mask})
        cross = np.stack([out[name] for name in spec.kv_names(self.runner.cfg, "encoder", "present")], axis=1)
        return Seq2TrtEncoderOutput(last_hidden_state=_to_torch(out["encoder_hidden_states"]),
                                    cross_key_values=_to_torch(cross))


def hf_config(cfg, folder: Path) -> PretrainedConfig:
    """The imported model's own Hugging Face config (`seq2trt import hf` copies config.json beside the tokenizer),
    else a minimal encoder-decoder config from the model's (a model trained here)."""
    from seq2trt.core.layout import TOKENIZER_DIR

    if (folder / TOKENIZER_DIR / "config.json").is_file():
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(folder / TOKENIZER_DIR))
    return PretrainedConfig(is_encoder_decoder=True, vocab_size=cfg.tgt_vocab_size, d_model=cfg.d_model,
                            encoder_layers=cfg.num_encoder_layers, decoder_layers=cfg.num_decoder_layers,
                            num_hidden_layers=cfg.num_decoder_layers, pad_token_id=cfg.pad_id,
                            eos_token_id=cfg.eos_id, bos_token_id=cfg.bos_id, decoder_start_token_id=cfg.bos_id,
                            max_position_embeddings=cfg.max_tgt_len)


def hf_generation_config(cfg, config: PretrainedConfig, folder: Path, limits: spec.Limits) -> GenerationConfig:
    """The generation settings the checkpoint records (an import's generation.json: beams, length penalty, limits,
    forced and suppressed tokens, the logits processors and sampling options seq2trt reproduces), over the defaults transformers derives from the config; a length limit no longer
    than the export's decoder holds."""
    from seq2trt.reference_model.decoding import GENERATION_OPTIONS
    from seq2trt.hf_import.importer import GENERATION

    gen = GenerationConfig.from_model_config(config)
    gen.decoder_start_token_id, gen.eos_token_id, gen.pad_token_id = cfg.bos_id, cfg.eos_id, cfg.pad_id
    if cfg.forced_eos:
        gen.forced_eos_token_id = cfg.eos_id
    if cfg.forced_bos_id is not None:
        gen.forced_bos_token_id = cfg.forced_bos_id
    if cfg.suppress_ids:
        gen.suppress_tokens = list(cfg.suppress_ids)
    recorded = json.loads((folder / GENERATION).read_text()) if (folder / GENERATION).is_file() else {}
    for key in ("num_beams", "length_penalty", "early_stopping", "max_length", "max_new_tokens",
                "forced_bos_token_id", *GENERATION_OPTIONS):
        if recorded.get(key) is not None:
            setattr(gen, key, recorded[key])
    if gen.max_new_tokens is None and (recorded.get("max_length") is None or gen.max_length > limits.max_tgt_len):
        gen.max_length = limits.max_tgt_len  # the decoder start token and max_tgt_len - 1 generated tokens
    gen._from_model_config = False
    return gen


class Seq2TrtModelForSeq2SeqLM(PreTrainedModel, GenerationMixin):
    """A seq2trt export directory as a transformers sequence-to-sequence LM.

    `Seq2TrtModelForSeq2SeqLM.from_pretrained(out, backend="ort-fused", threads=1)` opens the export's graphs
    (checked against its manifest and records, as every seq2trt command does); `model.generate(...)` and
    `pipeline("translation", model=model, tokenizer=tokenizer)` then run as over the original model. The graphs
    run on ONNX Runtime's CPU provider (or TensorRT engines); torch only carries tensors between steps.
    `close()` (or `with model:`) releases the sessions. ONNX Runtime sessions may run from several threads at once.
    """

    main_input_name = "input_ids"
    base_model_prefix = "seq2trt"
    _is_stateful = False
    _supports_cache_class = True

    def __init__(self, config: PretrainedConfig, step_model=None, manifest=None, backend: str = "ort-fused",
                 stack: contextlib.ExitStack | None = None):
        super().__init__(config)
        self.encoder = Seq2TrtEncoder(step_model.encoder)
        self._decoder, self.manifest, self.backend = step_model.decoder, manifest, backend
        self._stack, self._closed = stack or contextlib.ExitStack(), False
        cfg = manifest.config
        self._cross_names = spec.kv_names(cfg, "encoder", "past")
        self._past_names = spec.kv_names(cfg, "decoder", "past")
        self._present_names = spec.kv_names(cfg, "decoder", "present")
        self._float = self._decoder.input_metadata()[self._past_names[0]][0]

    @classmethod
    def from_pretrained(cls, out: str | Path, backend: str = "ort-fused", threads: int = 1,
                        checkpoint: str | Path | None = None, **kwargs: Any) -> "Seq2TrtModelForSeq2SeqLM":
        """Open the export in `out` through `backend` (one of HF_BACKENDS) with `threads` intra-op threads.
        `checkpoint`: the checkpoint it was exported from, if it moved (its tokenizer config and generation
        settings are read there)."""
        from seq2trt.runtime.registry import open_step_model
        from seq2trt.runtime.decode_jobs import check_threads, checkpoint_folder

        if kwargs:
            raise InputError(f"unknown argument(s) {', '.join(sorted(kwargs))} for Seq2TrtModelForSeq2SeqLM."
                             "from_pretrained; it takes backend, threads and checkpoint")
        if backend not in HF_BACKENDS:
            raise InputError(f"backend {backend!r} cannot drive transformers' generate (it needs the encoder and "
                             f"decoder graphs); choose one of {', '.join(HF_BACKENDS)}")
        check_threads(threads, "threads")
        out = Path(out)
        if not (out / "manifest.json").is_file():
            raise InputError(f"{out} is not an export directory (no manifest.json); export the checkpoint first "
                             f"(`seq2trt export CHECKPOINT -o {out}`)")
        from seq2trt.exporters.manifest import read_manifest

        if read_manifest(out).config.audio:  # refused here, not at the first generate
            raise InputError(f"{out} is the export of a speech model (it reads audio, not token ids); transcribe "
                             "with seq2trt.Translator(out).transcribe or `seq2trt transcribe`")
        stack = contextlib.ExitStack()
        try:
            step_model, manifest = stack.enter_context(open_step_model(out, backend, checkpoint and Path(checkpoint),
                                                                       threads))
            folder = checkpoint_folder(out, manifest, checkpoint and Path(checkpoint))
            config = hf_config(manifest.config, folder)
            config.name_or_path = str(out)
            model = cls(config, step_model, manifest, backend, stack)
        except BaseException:
            stack.close()
            raise
        model.generation_config = hf_generation_config(manifest.config, config, folder, manifest.limits)
        return model.eval()

    def close(self) -> None:
        """Release the graph sessions; the model cannot run after."""
        self._closed = True
        self._stack.close()

    def __enter__(self) -> "Seq2TrtModelForSeq2SeqLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def save_pretrained(self, *args: Any, **kwargs: Any) -> None:
        raise InputError("a Seq2TrtModelForSeq2SeqLM runs an export's graphs and holds no weights, so it cannot be "
                         f"saved; copy the export directory ({self.config.name_or_path}) instead, or save the "
                         "original transformers model")

    def to(self, *args: Any, **kwargs: Any) -> "Seq2TrtModelForSeq2SeqLM":
        """The graphs run where their backend runs (ONNX Runtime's CPU provider, TensorRT's GPU); tensors stay on
        the CPU. A CUDA device is refused where there is none (it was a silent no-op); any other move changes
        nothing."""
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None and device.type == "cuda" and not torch.cuda.is_available():
            raise InputError(f"CUDA is not available here, so the model cannot move to {device}; its graphs run on "
                             f"the {self.backend} backend, on the CPU for ONNX Runtime")
        return self

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # tensors cross to the graphs through numpy

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def get_encoder(self) -> Seq2TrtEncoder:
        return self.encoder

    def get_output_embeddings(self) -> None:
        return None

    def _init_weights(self, module: torch.nn.Module) -> None:
        pass  # the weights live in the graphs

    def _cache_arrays(self, cache: EncoderDecoderCache, side: str) -> list[np.ndarray]:
        layers = (cache.self_attention_cache if side == "decoder" else cache.cross_attention_cache).layers
        return [_to_numpy(t, self._float) for layer in layers for t in (layer.keys, layer.values)]

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                decoder_input_ids: torch.Tensor | None = None,
                encoder_outputs: Seq2TrtEncoderOutput | None = None,
                past_key_values: EncoderDecoderCache | None = None, use_cache: bool | None = None,
                return_dict: bool | None = None, **kwargs: Any) -> Seq2SeqLMOutput:
        """One decoder run: logits (B, T, V) for `decoder_input_ids` (B, T) after the cached past, and the cache
        holding the past plus these T tokens. Without `encoder_outputs` the encoder runs on `input_ids` first."""
        if self._closed:
            raise InputError("this Seq2TrtModelForSeq2SeqLM is closed (its sessions released); load it again")
        past_key_values = kwargs.pop("cache", None) if past_key_values is None else past_key_values  # 5.x's name
        if decoder_input_ids is None:
            raise InputError("Seq2TrtModelForSeq2SeqLM.forward needs decoder_input_ids (the target so far, starting "
                             "with the decoder start token); generate() passes them")
        if encoder_outputs is None:
            if input_ids is None:
                raise InputError("Seq2TrtModelForSeq2SeqLM.forward needs input_ids or encoder_outputs")
            encoder_outputs = self.encoder(input_ids, attention_mask)
        hidden = encoder_outputs[0]
        if isinstance(past_key_values, tuple):
            if not hasattr(EncoderDecoderCache, "from_legacy_cache"):  # transformers 5 dropped the tuple format
                raise InputError("the cache must be an EncoderDecoderCache (transformers 5 takes no tuples); pass the "
                                 "one the previous call returned")
            past_key_values = EncoderDecoderCache.from_legacy_cache(past_key_values)
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        batch, new = decoder_input_ids.shape
        limit = self.manifest.limits.max_tgt_len
        if past_len + new > limit:
            raise InputError(f"the decoder would hold {past_len + new} tokens, over the export's max_tgt_len {limit}; "
                             f"generate at most {limit - 1} tokens (max_new_tokens, or max_length <= {limit}), or "
                             "re-export with a larger --max-tgt-len")
        if past_len:
            cross = self._cache_arrays(past_key_values, "encoder")
            past = self._cache_arrays(past_key_values, "decoder")
        else:
            stacked = getattr(encoder_outputs, "cross_key_values", None)
            if stacked is None:
                raise InputError("encoder_outputs carry no cross-attention K/V; take them from model.get_encoder()")
            cross = [_to_numpy(stacked[:, i], self._float) for i in range(stacked.shape[1])]
            empty = np.zeros((batch, *cross[0].shape[1:2], 0, cross[0].shape[-1]), dtype=self._float)  # (B, H, 0, Dh)
            past = [empty] * len(self._past_names)
        mask = (np.ones(hidden.shape[:2], dtype=np.int64) if attention_mask is None
                else _to_numpy(attention_mask, np.dtype(np.int64)))
        feed = {"input_ids": _to_numpy(decoder_input_ids, np.dtype(np.int64)), "encoder_attention_mask": mask,
                **dict(zip(self._cross_names, cross)), **dict(zip(self._past_names, past))}
        out = self._decoder.infer(feed)
        logits = _to_torch(out["logits"].astype(np.float32, copy=False))
        cache = None
        if use_cache is not False:
            self_cache, cross_cache = DynamicCache(), DynamicCache()
            present = [out[name] for name in self._present_names]
            for layer, (key, value) in enumerate(spec.unflatten_kv(present)):
                self_cache.update(_to_torch(key), _to_torch(value), layer)
            for layer, (key, value) in enumerate(spec.unflatten_kv(cross)):
                cross_cache.update(_to_torch(key), _to_torch(value), layer)
            cache = EncoderDecoderCache(self_cache, cross_cache)
        return Seq2SeqLMOutput(logits=logits, encoder_last_hidden_state=hidden, **{CACHE_FIELD: cache})
