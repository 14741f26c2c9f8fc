"""The child processes: tokenizers (`tokenizer_worker`) and inference, one per device
(`inference_worker`), with their engines and heads. They import only `infinity.shared`."""
