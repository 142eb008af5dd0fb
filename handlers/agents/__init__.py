"""What agents send and expect back, on every route: structured outputs (grammars), tool calls,
reasoning, and the assistant message they make together."""
