"""The child processes: preprocessing (`preprocess`: the tokenizer processes) and
inference, one process per device (`inference`), with their engines and heads. They
import only `infinity.shared`."""
