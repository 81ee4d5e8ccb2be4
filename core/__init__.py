"""The ground floor every other package stands on: the typed errors (`errors`), the names of a checkpoint's and an
export's files (`layout`), crash-safe file writes (`atomic_files`) and directory replacements (`swap`), the float
element types (`dtypes`) and the float32 logit judge (`numerics`). Nothing here imports another seq2trt package."""
