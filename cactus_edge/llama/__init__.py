"""The llama.cpp layer: models, GGUF files, RPC workers. The only layer that imports llama_cpp.

Importing this package loads no model library; its modules do."""

DEFAULT_N_CTX = 4096  # tokens of context per model unless asked otherwise
