"""TensorRT, one sub-package: the two flavours (enterprise TensorRT and TensorRT for RTX) and their differences
(`trt_compat`), one ONNX graph to one engine (`build`), the child process a build runs in (`child`), and an export's
engines with their build record (`engines`)."""
