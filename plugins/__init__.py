"""seq2trt.plugins."""
