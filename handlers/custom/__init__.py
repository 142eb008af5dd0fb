"""A user's model.py: the djl_python-compatible API (Input, Output, ...), its input and output
formatters around lmserve's LLM handler, and the handler that forwards to its handle()."""
