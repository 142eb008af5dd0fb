"""Checkpoints into this rank's shards: safetensors, GGUF, AWQ/GPTQ and load-time quantization."""
