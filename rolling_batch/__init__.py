"""The rolling-batch engine and the native model runtime.

`from lmserve.rolling_batch import LLM` is the offline API. It is imported lazily: the front
end imports this package's torch-free modules (protocol, runtime) and must not pay for torch.
"""


def __getattr__(name: str):
    if name in ("LLM", "GenerationResult"):
        from . import llm

        return getattr(llm, name)
    raise AttributeError(name)
