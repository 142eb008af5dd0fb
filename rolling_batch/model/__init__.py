"""The model runtime on every rank: which path serves an architecture (architectures.py), the
families (families/) over shared layers (layers/), weights (weights/), the KV cache, and the
ModelRunner that runs one packed step."""
