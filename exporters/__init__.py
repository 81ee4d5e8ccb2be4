"""seq2trt.exporters."""
