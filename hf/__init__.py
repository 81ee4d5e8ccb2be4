"""Hugging Face compatibility: a seq2trt export that transformers' own `generate()` and `pipeline()` drive.

    from transformers import AutoTokenizer, pipeline
    from seq2trt.hf import Seq2TrtModelForSeq2SeqLM

    model = Seq2TrtModelForSeq2SeqLM.from_pretrained("out", backend="ort-fused")
    translate = pipeline("translation", model=model, tokenizer=AutoTokenizer.from_pretrained("ckpt/tokenizer"))

transformers is the `hf` extra: importing this package needs it. transformers 5 removed the translation,
summarization and text2text-generation pipelines; there, tokenize, `model.generate(...)` and `batch_decode`.
"""

from seq2trt.hf.modeling import HF_BACKENDS, Seq2TrtEncoderOutput, Seq2TrtModelForSeq2SeqLM

__all__ = ["Seq2TrtModelForSeq2SeqLM", "Seq2TrtEncoderOutput", "HF_BACKENDS"]
