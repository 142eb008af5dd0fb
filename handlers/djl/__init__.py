"""DJL's and TGI's dialect: `{"inputs": ..., "parameters": ...}` bodies in, DJL/TGI JSON and
jsonlines/SSE out, SageMaker's custom attributes."""
