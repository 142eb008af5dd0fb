"""Text <-> token ids for the front end.

The `tokenizers` library reads the model's tokenizer.json directly: it encodes exactly like HF's
fast tokenizer and keeps torch out of the web workers. Models that ship only a slow
(sentencepiece) tokenizer fall back to transformers' AutoTokenizer.
"""

from __future__ import annotations

from pathlib import Path


class Tokenizer:
    def __init__(self, model_path: str | Path, trust_remote_code: bool = False):
        tokenizer_json = Path(model_path) / "tokenizer.json"
        if tokenizer_json.is_file():
            from tokenizers import Tokenizer as FastTokenizer

            fast = FastTokenizer.from_file(str(tokenizer_json))
            self._encode = lambda text, special=True: (
                fast.encode(text, add_special_tokens=special).ids
            )
            self._decode = lambda ids, skip=True: fast.decode(ids, skip_special_tokens=skip)
            self.special_ids = frozenset(
                i for i, token in fast.get_added_tokens_decoder().items() if token.special
            )
        else:
            from transformers import AutoTokenizer

            slow = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
            self._encode = lambda text, special=True: slow(text, add_special_tokens=special)[
                "input_ids"
            ]
            self._decode = lambda ids, skip=True: slow.decode(ids, skip_special_tokens=skip)
            self.special_ids = frozenset(slow.all_special_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`add_special_tokens=False` for rendered chat templates, which carry their own."""
        return self._encode(text, add_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        return self._decode(token_ids)

    def token_text(self, token_id: int) -> str:
        """One token's own text; special tokens show as themselves (`<|im_end|>`), as in DJL's
        details, while `decode` leaves them out of generated text."""
        return self._decode([token_id], skip=False)
