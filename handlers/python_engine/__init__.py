"""engine=Python: the engine process that serves dynamic batches of HF `generate`, or a user's
handle() (`python -m lmserve.handlers.python_engine.process RUNTIME_JSON`). It imports torch;
the rest of handlers/ runs in the gunicorn workers and does not."""
