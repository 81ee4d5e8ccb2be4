"""The float32 logit judge shared by the import's proof (hf_import/proof.py: our eager model against
transformers' own) and `validate` (validation/parity.py and end_to_end.py: the graphs against the eager model), so
that an export the import proved is not failed by validate for the same size of error.

Both bound the largest |difference| by FP32_LOGIT_TOLERANCE times the reference's magnitude, max(1, max |ref|):
float32 rounding is relative, so a model with large activations (logits in the thousands) differs by as much more.
The figure: a float32 dot product of n terms is off by at most about n * u (u = 2**-24 ~ 6e-8, the unit roundoff)
of the magnitude of its terms; 1e-4 is n ~ 1,700, room for a d_model of 1,024 and the few sums in series that a
logit passes through (about 1e-6 of the magnitude is measured on the models tested here).
"""

from __future__ import annotations

import numpy as np

FP32_LOGIT_TOLERANCE = 1e-4


def magnitude(reference: np.ndarray) -> float:
    """max(1, max |reference|) over its finite entries: what a float32 error is measured against."""
    finite = np.abs(np.asarray(reference, dtype=np.float64))
    finite = finite[np.isfinite(finite)]
    return max(1.0, float(finite.max()) if finite.size else 1.0)


def scaled_error(ours: np.ndarray, theirs: np.ndarray) -> tuple[float, float]:
    """(max |ours - theirs|, that over the magnitude of `theirs`)."""
    err = float(np.abs(np.asarray(ours, np.float64) - np.asarray(theirs, np.float64)).max()) if np.size(ours) else 0.0
    return err, err / magnitude(theirs)
