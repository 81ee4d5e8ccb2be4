"""seq2trt.cli."""
