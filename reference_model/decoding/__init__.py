"""Greedy and beam-search decoding, written once for every backend.

A backend is a `StepModel`: it encodes a padded source batch once (its state holds the cross-attention
K/V), runs one decoder call on new tokens with the past K/V, and gathers its states along the batch axis
(beam reordering, dropping finished rows). The loops below only see numpy logits and token ids, so the same
code drives the eager model, ONNX Runtime and TensorRT, and their outputs are comparable token for token.

The loops live by concept: `options` (every decoding option a caller sets, declared once: names, types, rules),
`settings` (DecodeSettings, the StepModel protocol), `greedy` (greedy
and sampling), `beam` (GNMT's and Hugging Face's beam searches), `topk` (the arithmetic they share). Everything is
importable from here, as before the split.
"""

from seq2trt.reference_model.decoding.options import (DECODE_OPTIONS, GNMT_ALPHA, MIN_TEMPERATURE,  # noqa: F401
                                                      OPTION_RULES, OPTIONS, SEED_LIMIT, DecodeOption,
                                                      length_penalty_problem, option_problem, spelling)
from seq2trt.reference_model.decoding.settings import (GENERATION_OPTIONS, DecodeSettings, Hypothesis,  # noqa: F401
                                                       StepModel, seeded_generator)
from seq2trt.reference_model.decoding.topk import (_chosen, _log_softmax32, _top, _top_n, _top_wide,  # noqa: F401
                                                   length_penalty, log_softmax)
from seq2trt.reference_model.decoding.greedy import ChoiceHook, StepHook, _Sampler, greedy_decode  # noqa: F401
from seq2trt.reference_model.decoding.beam import beam_search, hf_beam_search  # noqa: F401
