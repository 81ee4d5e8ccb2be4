"""The Hugging Face import: a transformers encoder-decoder directory -> a seq2trt checkpoint (`importer`), proven
equal to transformers' own model and `generate` (`proof`; a speech model's, `speech_proof`), one adapter per model
family (`families`), and the text codec of a checkpoint, its imported tokenizer or its own vocabulary (`text`). It
stands on the reference model and core alone; transformers is the `hf` extra, imported only when a function needs
it."""
