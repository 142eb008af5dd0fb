"""The model's tokenizer on the front end: text <-> token ids (`Tokenizer`), the chat template
that turns messages into a prompt (`ChatTemplate`), and incremental detokenization with stop
sequences (`IncrementalDetokenizer`). Torch-free.

Text <-> token ids:
The `tokenizers` library reads the model's tokenizer.json directly: it encodes exactly like HF's
fast tokenizer and keeps torch out of the web workers. Models that ship only a slow
(sentencepiece) tokenizer fall back to transformers' AutoTokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .job import BadRequest


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


# The model's chat template, rendered by transformers' own Jinja renderer.
#
# `render_jinja_template` is what `apply_chat_template` calls, so its environment (the sandbox,
# `loopcontrols`, `strftime_now`, a `tojson` that keeps non-ASCII) cannot drift from HF's. Only
# the template string and the named special tokens are needed, so no tokenizer is loaded here;
# importing `transformers.utils.chat_template_utils` brings in numpy and jinja2, never torch.
#
# What this reproduces of `PreTrainedTokenizerBase` is how a model folder's template and
# special tokens are found: `chat_template.jinja` (and `chat_templates/*.jinja`) win over
# `tokenizer_config.json`, a dict of named templates picks `tool_use` when tools are given and
# `default` otherwise, and the template sees the named special tokens (`bos_token`, ...).

# PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES: the tokens apply_chat_template passes.
_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplate:
    """The model's Jinja chat template, rendered exactly as `tokenizer.apply_chat_template(
    messages, tools=tools, add_generation_prompt=True, tokenize=False)` renders it."""

    def __init__(self, model_path: str | Path):
        folder = Path(model_path)
        config = _read_json(folder / "tokenizer_config.json")
        self.templates = _find_templates(folder, config)
        legacy_map = _read_json(folder / "special_tokens_map.json")
        self.special_tokens = _special_tokens(config, legacy_map)

    def render(self, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> str:
        template = self._choose(tools)
        # Imported here so a web worker pays for it only when a chat request needs it.
        from jinja2 import TemplateError
        from transformers.utils.chat_template_utils import render_jinja_template

        # apply_chat_template drops None-valued keys: templates test `is defined`, not None.
        conversation = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            rendered, _ = render_jinja_template(
                conversations=[conversation],
                tools=tools,
                chat_template=template,
                add_generation_prompt=True,
                **self.special_tokens,
            )
        except (TemplateError, ValueError, TypeError) as error:
            # raise_exception() in a template is how it refuses a conversation (roles out of
            # order, a system message it does not support): the client's error, not ours.
            raise BadRequest("messages", str(error)) from None
        return rendered[0]

    def _choose(self, tools: list[dict] | None) -> str:
        if not self.templates:
            raise BadRequest("messages", "this model has no chat template; send `inputs` instead")
        if len(self.templates) == 1 and "default" in self.templates:
            return self.templates["default"]
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise BadRequest("messages", "the model has several chat templates and no default")


def _find_templates(folder: Path, config: dict) -> dict[str, str]:
    """Named templates, as transformers loads them: files override tokenizer_config.json."""
    files: dict[str, str] = {}
    if (folder / "chat_template.jinja").is_file():
        files["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if (folder / "chat_templates").is_dir():
        for path in sorted((folder / "chat_templates").glob("*.jinja")):
            files[path.stem] = path.read_text(encoding="utf-8")
    if files:
        return files
    inline = config.get("chat_template")
    if isinstance(inline, str):
        return {"default": inline}
    if isinstance(inline, list):  # [{"name": ..., "template": ...}, ...], the older form
        return {entry["name"]: entry["template"] for entry in inline}
    if isinstance(inline, dict):
        return dict(inline)
    return {}


def _special_tokens(config: dict, legacy_map: dict) -> dict[str, str]:
    # tokenizer_config.json wins; special_tokens_map.json only fills what it leaves out.
    tokens = {}
    for name in _SPECIAL_TOKEN_NAMES:
        value = _token_text(config.get(name)) or _token_text(legacy_map.get(name))
        if value is not None:
            tokens[name] = value
    # Named extra tokens ({"image_token": "<image>"}) become attributes too in transformers 5.
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        for name, value in extra.items():
            if _token_text(value) is not None:
                tokens[name] = _token_text(value)
    return tokens


def _token_text(token: Any) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


# Incremental detokenization for streaming, with stop sequences.
#
# Each token costs a decode of a few tokens, not of the whole text (which made a stream
# quadratic in its length): as in TGI and vLLM, `tokens[prefix_offset:]` is decoded and the text
# of `tokens[prefix_offset:read_offset]` (already released) is cut off its front. The window
# starts a token back, so a decoder that treats a sequence's first token specially (a
# sentencepiece leading space) sees the same context as in a full decode. The offsets only move
# when the window's text ends on a whole character: a trailing U+FFFD means its bytes are
# incomplete, and bytes decode the same once the decoder is back at a character boundary. So,
# for byte-level BPE tokenizers (SmolLM2, Llama 3, Qwen2), the pieces add up to exactly the full
# decode.
#
# A piece never shows text that could still turn out to be the start of a stop sequence (the
# last `max(len(stop)) - 1` characters are held back). Once a stop sequence appears, the text
# ends right before it.


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop_sequences: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop_sequences = stop_sequences
        self._holdback = max((len(s) for s in stop_sequences), default=1) - 1
        self.token_ids: list[int] = []
        self._released: list[str] = []  # pieces handed out so far
        # Decoded text not released yet: the held-back tail (no stop sequence in it).
        self._pending = ""
        self._prefix_offset = 0  # the window starts here ...
        self._read_offset = 0  # ... and its text up to here is in _released + _pending
        self.stopped = False

    @property
    def text(self) -> str:
        """Everything released so far."""
        return "".join(self._released)

    def add(self, token_id: int) -> str:
        """The new text this token releases (possibly empty)."""
        if self.stopped:
            return ""
        self.token_ids.append(token_id)
        new_text, complete = self._decode_window()
        # Stop sequences are looked for even in text that ends inside a character.
        candidate = self._pending + new_text
        stop = find_stop(candidate, self.stop_sequences)
        if stop is not None:
            self.stopped = True
            self._pending = ""
            return self._release(candidate[: stop[0]])
        if not complete:
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        keep = max(0, len(candidate) - self._holdback)
        self._pending = candidate[keep:]
        return self._release(candidate[:keep])

    def finish(self) -> str:
        """Whatever was held back, at the end of generation."""
        if self.stopped:
            return ""
        new_text, _ = self._decode_window()
        rest = self._pending + new_text
        self._pending = ""
        self._prefix_offset = self._read_offset = len(self.token_ids)
        return self._release(rest)

    def _decode_window(self) -> tuple[str, bool]:
        """(the text the tokens after read_offset add, whether it is some and ends on a whole
        character)."""
        window = self.token_ids[self._prefix_offset :]
        known = self._read_offset - self._prefix_offset
        prefix_text = self.tokenizer.decode(window[:known]) if known else ""
        new_text = self.tokenizer.decode(window)[len(prefix_text) :]
        # A token with no text of its own (a skipped special token) does not move the window
        # either: the next token then still decodes with real text before it.
        return new_text, bool(new_text) and not new_text.endswith("\ufffd")

    def _release(self, piece: str) -> str:
        if piece:
            self._released.append(piece)
        return piece


def find_stop(text: str, stop_sequences: tuple[str, ...]) -> tuple[int, int] | None:
    """(start, end) of the earliest stop sequence in `text` (the shortest of those starting
    there), or None. Streams and final answers both cut here, so they agree."""
    found = [(text.find(s), len(s)) for s in stop_sequences if s in text]
    if not found:
        return None
    start, length = min(found)
    return start, start + length
