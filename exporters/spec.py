"""The graph contract, declared once: tensor names, dtypes, axes, KV naming, profiles and the parity sweep.

Names follow Hugging Face Optimum's (docs/design.md, "Graph contract"). The exporter, the fuser, the builder, the
runners and the validators read this module; nobody else spells a tensor name.

Encoder graph: its inputs are the source kind's (`reference_model.sources`, `encoder_inputs`): token ids read
`input_ids`, `attention_mask` (B, S) int64; audio features read `input_features` (B, n_mels, 2 M) in the export's
float dtype, only the batch axis dynamic, the conv front end inside and no mask (Whisper masks nothing: its
self-attention gets an all-ones mask made inside the graph). Out: `encoder_hidden_states` (B, S, D) and, for every
decoder layer i, `present.{i}.encoder.key/value` (B, H, S, Dh); S is the fixed M = max_src_len (1500) for audio.
Decoder graph (every step, past_len 0 included): `input_ids` (B, T), `encoder_attention_mask` (B, S) int64,
`past_key_values.{i}.encoder.key/value` (B, H, S, Dh), `past_key_values.{i}.decoder.key/value` (B, H, P, Dh)
-> `logits` (B, T, V) and `present.{i}.decoder.key/value` (B, H, P + T, Dh).

Attention blocks are marked (the fuser relies on this): every attention block of a plain graph is ONE node in
domain `MARKED_DOMAIN` whose op_type names its kind (`MARKED_OP_TYPES`), whose inputs and outputs are exactly
the fused op's (`plugins.op.INPUTS` / `OUTPUTS`: query and new key/value (B, T, D) straight from the
projections, cached or cross K/V (B, H, L, Dh), key_padding_mask (B, S) int32), whose attributes are the fused
op's own (`kind`, `num_heads`, `head_dim`, `scale`: `AttentionAttrs.from_onnx` reads them), and whose name
is the block's module path, e.g. `encoder_layers.0.self_attn`, `decoder_layers.2.cross_attn`. The graph carries
one ONNX local function per op_type with a body of standard ops (softmax in fp32), so the plain graph runs
in ONNX Runtime and TensorRT's parser as it is. `expected_blocks` gives the count of every kind per graph.
Around a marked node: query/key/value are the projections' outputs (MatMul + Add), the mask is one Cast of the
int64 graph mask to int32 shared by the blocks, cross K/V are the decoder's `past_key_values.{i}.encoder.*`
inputs, and a decoder self-attention node's present K/V are the graph outputs `present.{i}.decoder.*`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping, Sequence, TypeVar

import numpy as np

from seq2trt.plugins.op import AttentionKind
from seq2trt.reference_model.config import Seq2SeqConfig
from seq2trt.core.errors import ConfigError, InputError
from seq2trt.reference_model.sources import source_kind

SPEC_REVISION = 1
DEFAULT_OPSET = 18  # the dynamo exporter's native opset; 18..23 are accepted
OPSETS = range(18, 24)


class GraphKind(enum.Enum):
    ENCODER = "encoder"
    DECODER = "decoder"

    @property
    def filename(self) -> str:
        return f"{self.value}.onnx"


# Axis names (ONNX dim_params). PRESENT_LEN is the exporter's expression for past_len + tgt_len.
BATCH, SRC_LEN, TGT_LEN, PAST_LEN = "batch", "src_len", "tgt_len", "past_len"
PRESENT_LEN = "past_len + tgt_len"

# dtype name -> (numpy dtype of float tensors, ONNX TensorProto elem type).
DTYPES: dict[str, tuple[str, int]] = {"fp32": ("float32", 1), "fp16": ("float16", 10), "bf16": ("bfloat16", 16)}

# Marked attention blocks (see the module docstring).
MARKED_DOMAIN = "seq2trt.marked"
MARKED_VERSION = 1
MARKED_OP_TYPES: dict[AttentionKind, str] = {
    AttentionKind.ENCODER_SELF: "EncoderSelfAttention",
    AttentionKind.DECODER_SELF: "DecoderSelfAttention",
    AttentionKind.CROSS: "CrossAttention",
}


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of float tensors; bf16 is ml_dtypes' bfloat16 (numpy has none)."""
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if dtype == "bf16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(DTYPES[dtype][0])


KV_SIDES = ("encoder", "decoder")  # cross-attention K/V (from the encoder) and self-attention K/V (the decoder's)
KV_PARTS = ("key", "value")
_KV_PREFIX = {"past": "past_key_values", "present": "present"}
T = TypeVar("T")


def kv_name(layer: int, side: str, part: str, io: str) -> str:
    """`past_key_values.{layer}.{side}.{part}` (io='past') or `present.{layer}.{side}.{part}` (io='present')."""
    if side not in KV_SIDES or part not in KV_PARTS or io not in _KV_PREFIX:
        raise ValueError(f"bad KV name parts {(side, part, io)}")
    return f"{_KV_PREFIX[io]}.{layer}.{side}.{part}"


@dataclass(frozen=True)
class KVName:
    """The parts of a KV tensor name (`kv_name`'s arguments)."""

    layer: int
    side: str
    part: str
    io: str


def parse_kv_name(name: str) -> KVName | None:
    """The parts of a KV tensor name, or None for any other tensor name."""
    prefix, _, rest = name.partition(".")
    layer, _, rest = rest.partition(".")
    side, _, part = rest.partition(".")
    io = next((io for io, p in _KV_PREFIX.items() if p == prefix), None)
    if io is None or not layer.isdigit() or side not in KV_SIDES or part not in KV_PARTS:
        return None
    return KVName(int(layer), side, part, io)


def flatten_kv(kv: Sequence[tuple[T, T]]) -> list[T]:
    """Per-layer (key, value) pairs -> one flat list in graph order: layer-major, key before value."""
    return [x for key, value in kv for x in (key, value)]


def unflatten_kv(flat: Sequence[T]) -> list[tuple[T, T]]:
    """The inverse of `flatten_kv`."""
    if len(flat) % 2:
        raise ValueError(f"a flat KV list holds (key, value) pairs, got {len(flat)} items")
    return [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]


def kv_names(cfg: Seq2SeqConfig, side: str, io: str) -> list[str]:
    """The K/V tensor names of one side of every decoder layer, in the flatten order."""
    return flatten_kv([(kv_name(i, side, "key", io), kv_name(i, side, "value", io))
                       for i in range(cfg.num_decoder_layers)])


def present_to_past(cfg: Seq2SeqConfig, side: str) -> dict[str, str]:
    """Output name -> the decoder input it feeds: side 'encoder', the encoder's `present.{i}.encoder.*` -> the
    decoder's `past_key_values.{i}.encoder.*`; side 'decoder', a step's `present.{i}.decoder.*` -> the next step's
    `past_key_values.{i}.decoder.*`."""
    return {name: present_to_past_name(name) for name in kv_names(cfg, side, "present")}


def kv_feed(cfg: Seq2SeqConfig, side: str, outputs: Mapping[str, T]) -> dict[str, T]:
    """The decoder inputs of one side taken from a graph's outputs (`present_to_past`)."""
    return {past: outputs[present] for present, past in present_to_past(cfg, side).items()}


# Per-layer debug outputs (validation/localize.py): every sub-block of every layer, named after its module path in
# the eager model (`Residual` modules of reference_model/model.py), in execution order. A layer's output is its last
# sub-block's output. A debug copy of a graph marks each as an extra graph output `debug.<module path>`.
SUB_BLOCKS: dict[GraphKind, tuple[str, ...]] = {GraphKind.ENCODER: ("attn_block", "ffn_block"),
                                                GraphKind.DECODER: ("self_block", "cross_block", "ffn_block")}
DEBUG_PREFIX = "debug."


def sub_block_paths(cfg: Seq2SeqConfig, kind: GraphKind) -> list[str]:
    """Module paths of every layer's sub-blocks, e.g. `encoder_layers.1.ffn_block`, in execution order."""
    stack, layers = (("encoder_layers", cfg.num_encoder_layers) if kind is GraphKind.ENCODER
                     else ("decoder_layers", cfg.num_decoder_layers))
    return [f"{stack}.{i}.{block}" for i in range(layers) for block in SUB_BLOCKS[kind]]


def debug_output_name(module_path: str) -> str:
    """The graph output name a debug copy gives a sub-block's output: `debug.<module path>`."""
    return DEBUG_PREFIX + module_path


def parse_debug_name(name: str) -> str | None:
    """The module path of a debug output name, or None for any other tensor name."""
    return name.removeprefix(DEBUG_PREFIX) if name.startswith(DEBUG_PREFIX) else None


def block_name(kind: AttentionKind, layer: int) -> str:
    """The module path of an attention block, which is also its node name in a plain graph."""
    if kind is AttentionKind.ENCODER_SELF:
        return f"encoder_layers.{layer}.self_attn"
    return f"decoder_layers.{layer}.{'self_attn' if kind is AttentionKind.DECODER_SELF else 'cross_attn'}"


def expected_blocks(cfg: Seq2SeqConfig, kind: GraphKind) -> dict[AttentionKind, int]:
    if kind is GraphKind.ENCODER:
        return {AttentionKind.ENCODER_SELF: cfg.num_encoder_layers}
    return {AttentionKind.DECODER_SELF: cfg.num_decoder_layers, AttentionKind.CROSS: cfg.num_decoder_layers}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # "int64" or "float" (the export's float dtype)
    axes: tuple[str | int, ...]  # axis names or fixed sizes


def audio_source(cfg: Seq2SeqConfig) -> bool:
    """Whether the encoder graph reads audio features (the source kind's `input_features`) rather than token ids."""
    return "input_features" in source_kind(cfg).encoder_inputs


def encoder_positions(cfg: Seq2SeqConfig) -> str | int:
    """The encoder positions' axis: `src_len` for token ids; the fixed max_src_len for audio (30 s of features)."""
    return cfg.max_src_len if audio_source(cfg) else SRC_LEN


_ENCODER_INPUTS = {  # the encoder graph input of each name a source kind reads
    "input_ids": lambda cfg: TensorSpec("input_ids", "int64", (BATCH, SRC_LEN)),
    "attention_mask": lambda cfg: TensorSpec("attention_mask", "int64", (BATCH, SRC_LEN)),
    "input_features": lambda cfg: TensorSpec("input_features", "float", (BATCH, cfg.n_mels, cfg.source_frames)),
}


def inputs(cfg: Seq2SeqConfig, kind: GraphKind) -> list[TensorSpec]:
    kv = (cfg.num_heads,), (cfg.head_dim,)
    if kind is GraphKind.ENCODER:
        return [_ENCODER_INPUTS[name](cfg) for name in source_kind(cfg).encoder_inputs]
    specs = [TensorSpec("input_ids", "int64", (BATCH, TGT_LEN)), TensorSpec("encoder_attention_mask", "int64", (BATCH, SRC_LEN))]
    for side, length in (("encoder", SRC_LEN), ("decoder", PAST_LEN)):
        specs += [TensorSpec(name, "float", (BATCH, *kv[0], length, *kv[1])) for name in kv_names(cfg, side, "past")]
    return specs


def outputs(cfg: Seq2SeqConfig, kind: GraphKind) -> list[TensorSpec]:
    if kind is GraphKind.ENCODER:
        src = encoder_positions(cfg)
        return [TensorSpec("encoder_hidden_states", "float", (BATCH, src, cfg.d_model))] + [
            TensorSpec(name, "float", (BATCH, cfg.num_heads, src, cfg.head_dim))
            for name in kv_names(cfg, "encoder", "present")]
    return [TensorSpec("logits", "float", (BATCH, TGT_LEN, cfg.tgt_vocab_size))] + [
        TensorSpec(name, "float", (BATCH, cfg.num_heads, PRESENT_LEN, cfg.head_dim))
        for name in kv_names(cfg, "decoder", "present")]


def present_to_past_name(name: str) -> str:
    """The decoder input a `present.{i}.{side}.*` output feeds: `past_key_values.{i}.{side}.*` (the encoder's cross
    K/V feed every decoder step; a decoder step's self-attention K/V feed the next step)."""
    parts = parse_kv_name(name)
    if parts is None or parts.io != "present":
        raise ValueError(f"{name!r} is not a present.{{i}}.{{side}}.{{key|value}} output name")
    return kv_name(parts.layer, parts.side, parts.part, "past")


@dataclass(frozen=True)
class Limits:
    """The user's serving limits: they size the TensorRT profiles and bound what the runners accept."""

    max_batch: int
    max_src_len: int
    max_tgt_len: int

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_src_len", "max_tgt_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 2:
                raise ConfigError(f"{name} must be an integer >= 2 (dynamic axes need room), got {value!r}")

    @classmethod
    def for_model(cls, cfg: Seq2SeqConfig, max_batch: int = 32, max_src_len: int | None = None,
                  max_tgt_len: int | None = None) -> "Limits":
        """Limits no larger than the model's position table allows (None: the model's length; 0 is refused, not
        read as "default"), whose largest tensor fits a TensorRT profile."""
        src = cfg.max_src_len if max_src_len is None else max_src_len
        tgt = cfg.max_tgt_len if max_tgt_len is None else max_tgt_len
        limits = cls(max_batch, src, tgt)
        if audio_source(cfg) and src != cfg.max_src_len:
            raise ConfigError(f"an audio model's encoder always gives its max_src_len {cfg.max_src_len} positions "
                              f"(30 s of features), so its limit cannot be {src}; drop --max-src-len")
        if src > cfg.max_src_len or tgt > cfg.max_tgt_len:
            raise ConfigError(f"limits src {src} / tgt {tgt} exceed the model's max_src_len {cfg.max_src_len} / "
                              f"max_tgt_len {cfg.max_tgt_len}; lower --max-src-len / --max-tgt-len")
        limits.check_fits(cfg)
        return limits

    def check_fits(self, cfg: Seq2SeqConfig) -> None:
        """The largest activation at these limits (logits, the FFN's hidden layer) must have fewer than 2**31
        elements: TensorRT's dimensions and volumes are 32-bit, and a larger profile aborts its builder."""
        length = max(self.max_src_len, self.max_tgt_len)
        tensors = {"logits": self.max_batch * self.max_tgt_len * cfg.tgt_vocab_size,
                   "feed-forward activations": self.max_batch * length * max(cfg.d_ff, cfg.d_model)}
        name, size = max(tensors.items(), key=lambda item: item[1])
        if size >= 2 ** 31:
            largest = (2 ** 31 - 1) // (size // self.max_batch)
            raise ConfigError(f"max_batch {self.max_batch} is too large for this model: its {name} at the limits "
                              f"would hold {size:,} elements, more than a TensorRT profile can (2**31 - 1); use "
                              f"--max-batch {largest} or less")

    def axis_ranges(self) -> dict[str, tuple[int, int, int]]:
        """(min, opt, max) of every dynamic axis. opt: a mid-sized batch, one new token, half-full lengths."""
        return {BATCH: (1, min(8, self.max_batch), self.max_batch),
                SRC_LEN: (1, max(1, self.max_src_len // 2), self.max_src_len),
                TGT_LEN: (1, 1, self.max_tgt_len),
                PAST_LEN: (0, self.max_tgt_len // 2, self.max_tgt_len - 1)}


def profiles(cfg: Seq2SeqConfig, limits: Limits) -> dict[GraphKind, dict[str, tuple[tuple[int, ...], ...]]]:
    """TensorRT optimization profiles: per graph, input name -> (min, opt, max) shapes. An audio model's decoder
    always reads max_src_len encoder positions, so its src_len is that one size."""
    ranges = limits.axis_ranges()
    if audio_source(cfg):
        ranges[SRC_LEN] = (limits.max_src_len,) * 3

    def shape(spec: TensorSpec, which: int) -> tuple[int, ...]:
        return tuple(a if isinstance(a, int) else ranges[a][which] for a in spec.axes)

    return {kind: {s.name: tuple(shape(s, w) for w in range(3)) for s in inputs(cfg, kind)} for kind in GraphKind}


@dataclass(frozen=True)
class ShapeCase:
    """One point of the parity sweep. `padded`: row 0 keeps every source token, the others lose some."""

    batch: int
    src_len: int
    tgt_len: int
    past_len: int
    padded: bool

    @property
    def label(self) -> str:
        return f"B{self.batch}-S{self.src_len}-T{self.tgt_len}-P{self.past_len}{'-pad' if self.padded else ''}"


def sweep(limits: Limits, batches: tuple[int, ...] | None = None, cfg: Seq2SeqConfig | None = None
          ) -> list[ShapeCase]:
    """Batch 1 and > 1; src_len min/opt/max; past_len 0, 1, opt, max - 1 (one new token); a prefill; padding.
    An audio model (`cfg`) has one source length, max_src_len, and no padding: only batch sizes are swept there."""
    b_opt = limits.axis_ranges()[BATCH][1]
    batches = batches or (1, max(2, min(b_opt, 4)))
    _, s_opt, s_max = limits.axis_ranges()[SRC_LEN]
    _, p_opt, p_max = limits.axis_ranges()[PAST_LEN]
    audio = cfg is not None and audio_source(cfg)
    if audio:
        s_opt = s_max
    cases = []
    for b in batches:
        for s in sorted({1, s_opt, s_max} - ({1} if audio else set())):
            for p in sorted({0, 1, p_opt, p_max}):
                cases.append(ShapeCase(b, s, 1, p, padded=b > 1 and s > 1 and not audio))
        cases.append(ShapeCase(b, s_opt, min(4, limits.max_tgt_len), 0, padded=b > 1 and not audio))  # prefill
        cases.append(ShapeCase(b, s_max, 2, limits.max_tgt_len - 2, padded=b > 1 and not audio))  # ends at max
    return cases


def check_feed(cfg: Seq2SeqConfig, kind: GraphKind, dtype: str, limits: Limits,
               feed: Mapping[str, np.ndarray]) -> None:
    """Raise one InputError listing every way `feed` breaks the graph contract (names, dtypes, shapes, limits)."""
    specs = inputs(cfg, kind)
    problems = []
    missing = [s.name for s in specs if s.name not in feed]
    unexpected = sorted(set(feed) - {s.name for s in specs})
    if missing:
        problems.append(f"missing inputs {missing}")
    if unexpected:
        problems.append(f"unexpected inputs {unexpected}")
    float_dtype = numpy_dtype(dtype)
    sizes: dict[str, tuple[int, str]] = {}
    for spec in specs:
        if spec.name not in feed:
            continue
        array = feed[spec.name]
        want = np.dtype(np.int64) if spec.dtype == "int64" else float_dtype
        if getattr(array, "dtype", None) != want:
            problems.append(f"{spec.name}: expected dtype {want}, got {getattr(array, 'dtype', type(array).__name__)}")
        shape = tuple(getattr(array, "shape", ()))
        if len(shape) != len(spec.axes):
            problems.append(f"{spec.name}: expected rank {len(spec.axes)} {spec.axes}, got shape {shape}")
            continue
        for axis, size in zip(spec.axes, shape):
            if isinstance(axis, int) and size != axis:
                problems.append(f"{spec.name}: expected size {axis} on a fixed axis, got shape {shape}")
            elif isinstance(axis, str):
                seen = sizes.setdefault(axis, (size, spec.name))
                if seen[0] != size:
                    problems.append(f"{spec.name}: {axis} is {size} but {seen[1]} says {seen[0]}")
    problems += _value_problems(cfg, kind, specs, feed)
    lo_hi = {a: (r[0], r[2]) for a, r in limits.axis_ranges().items()}
    for axis, (size, name) in sizes.items():
        if not lo_hi[axis][0] <= size <= lo_hi[axis][1]:
            problems.append(f"{name}: {axis} = {size} is outside [{lo_hi[axis][0]}, {lo_hi[axis][1]}]")
    if PAST_LEN in sizes and TGT_LEN in sizes and sizes[PAST_LEN][0] + sizes[TGT_LEN][0] > limits.max_tgt_len:
        problems.append(f"past_len + tgt_len = {sizes[PAST_LEN][0] + sizes[TGT_LEN][0]} exceeds max_tgt_len "
                        f"{limits.max_tgt_len}")
    if problems:
        raise InputError(f"{kind.value} feed does not match the graph contract: " + "; ".join(problems))


def _value_problems(cfg: Seq2SeqConfig, kind: GraphKind, specs: list[TensorSpec],
                    feed: Mapping[str, np.ndarray]) -> list[str]:
    """Token ids outside the vocabulary and masks other than 0/1: an engine would read out of bounds silently."""
    vocab = cfg.src_vocab_size if kind is GraphKind.ENCODER else cfg.tgt_vocab_size
    problems = []
    for s in specs:
        array = feed.get(s.name)
        if s.dtype != "int64" or getattr(array, "dtype", None) != np.int64 or not array.size:
            continue
        lo, hi = int(array.min()), int(array.max())
        if s.name == "input_ids" and (lo < 0 or hi >= vocab):
            problems.append(f"{s.name}: token ids must lie in [0, {vocab}) (the vocabulary), got {lo}..{hi}")
        elif s.name != "input_ids" and (lo < 0 or hi > 1):
            problems.append(f"{s.name}: a mask holds 0 (pad) and 1 (token) only, got values {lo}..{hi}")
    return problems
