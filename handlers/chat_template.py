"""The model's chat template, rendered by transformers' own Jinja renderer.

`render_jinja_template` is what `apply_chat_template` calls, so its environment (the sandbox,
`loopcontrols`, `strftime_now`, a `tojson` that keeps non-ASCII) cannot drift from HF's. Only
the template string and the named special tokens are needed, so no tokenizer is loaded here;
importing `transformers.utils.chat_template_utils` brings in numpy and jinja2, never torch.

What this module reproduces of `PreTrainedTokenizerBase` is how a model folder's template and
special tokens are found: `chat_template.jinja` (and `chat_templates/*.jinja`) win over
`tokenizer_config.json`, a dict of named templates picks `tool_use` when tools are given and
`default` otherwise, and the template sees the named special tokens (`bos_token`, ...).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .job import BadRequest

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
