"""seq2trt.validation."""
