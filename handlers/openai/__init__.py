"""OpenAI's dialect: chat completions and completions, and vLLM's /tokenize and /detokenize."""
