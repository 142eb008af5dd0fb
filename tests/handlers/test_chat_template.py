"""ChatTemplate renders exactly what HF's `apply_chat_template` renders (both go through
transformers' own `render_jinja_template`): SmolLM2's template (the fixture's own) and templates
written here for what real families' templates use: a system prompt, `tools` rendered with
`tojson`, loop controls, `strftime_now`, `raise_exception`, named templates.

The reference is transformers' tokenizer loaded from a model folder (SmolLM2's tokenizer.json
with the template and special tokens), so where the template and the tokens are read from is
checked along with the rendering."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lmserve.handlers.job import BadRequest
from lmserve.handlers.openai.chat import parse_chat
from lmserve.handlers.tokenizer import ChatTemplate

REPO_ROOT = Path(__file__).resolve().parents[2]

# In the manner of Llama 3.1's and Qwen2.5's templates: a system block, the tools as JSON, the
# turns between the family's tokens, and a refusal of roles the template does not know.
TOOL_TEMPLATE = """{{ bos_token }}{% for message in messages %}
{%- if message.role not in ['system', 'user', 'assistant'] %}
{{- raise_exception('Conversation roles must be system, user or assistant') }}
{%- endif %}
{%- if loop.first and message.role == 'system' %}<|system|>{{ message.content }}
{%- if tools %} Tools: {% for tool in tools %}{{ tool | tojson }}{% endfor %}{% endif %}
{%- else %}<|{{ message.role }}|>{{ message.content }}{{ eos_token }}{% endif %}
{%- endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"""
SPECIAL_TOKENS = {"bos_token": "<|begin|>", "eos_token": "<|end|>"}

CONVERSATION = [
    {"role": "system", "content": "Réponds brièvement — en français, s'il te plaît."},
    {"role": "user", "content": "Grüße aus Köln! Wie ist das Wetter in 東京? 🌤"},
    {"role": "assistant", "content": "Il fait beau à Tōkyō, 23 °C."},
    {"role": "user", "content": "Et demain à Zürich ?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Le temps qu'il fait dans une ville (°C)",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "Nom, p. ex. Zürich"}},
                "required": ["city"],
            },
        },
    }
]


def model_folder(root: Path, smollm2_dir: Path, template, special_tokens: dict) -> Path:
    """A model folder as a Hub checkout has it: tokenizer.json plus tokenizer_config.json."""
    root.mkdir()
    shutil.copy(smollm2_dir / "tokenizer.json", root / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template}
    (root / "tokenizer_config.json").write_text(json.dumps({**config, **special_tokens}))
    return root


def hf_render(folder: Path, messages, tools=None) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )


def test_system_prompt_and_tools_render_as_hf(tmp_path, smollm2_dir):
    folder = model_folder(tmp_path / "m", smollm2_dir, TOOL_TEMPLATE, SPECIAL_TOKENS)
    for tools in (None, TOOLS):
        ours = ChatTemplate(folder).render(CONVERSATION, tools)
        assert ours == hf_render(folder, CONVERSATION, tools)
        assert ours.startswith("<|begin|><|system|>") and "東京" in ours and "🌤" in ours
    # tojson keeps non-ASCII as HF's does (Jinja's own filter would write \u00b0).
    assert "(°C)" in ChatTemplate(folder).render(CONVERSATION, TOOLS)


def test_smollm2_template_renders_as_hf(smollm2_dir):
    # The fixture's template lives in chat_template.jinja, which wins over tokenizer_config.json.
    for messages in (CONVERSATION, CONVERSATION[1:2]):
        assert ChatTemplate(smollm2_dir).render(messages) == hf_render(smollm2_dir, messages)


def test_hf_jinja_extensions_render_as_hf(tmp_path, smollm2_dir):
    # What the old hand-made environment lacked: loop controls, strftime_now, tojson's ASCII.
    template = (
        "{% for message in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% if message.role == 'system' %}{% continue %}{% endif %}"
        "{{ message | tojson }}\n{% endfor %}{{ strftime_now('%Y') }}{{ eos_token }}"
    )
    folder = model_folder(tmp_path / "m", smollm2_dir, template, {"eos_token": "<|im_end|>"})
    ours = ChatTemplate(folder).render(CONVERSATION)
    assert ours == hf_render(folder, CONVERSATION)
    assert "Köln" in ours and "Tōkyō" not in ours


def test_named_templates_pick_tool_use_when_tools_are_given(tmp_path, smollm2_dir):
    named = [
        {"name": "default", "template": "plain:{{ messages[0].content }}"},
        {"name": "tool_use", "template": "tools:{{ tools | length }}:{{ messages[0].content }}"},
    ]
    folder = model_folder(tmp_path / "m", smollm2_dir, named, {})
    template = ChatTemplate(folder)
    messages = CONVERSATION[1:2]
    assert template.render(messages) == hf_render(folder, messages)
    assert template.render(messages, TOOLS) == hf_render(folder, messages, TOOLS)
    assert template.render(messages, TOOLS).startswith("tools:1:")


def test_a_template_refusing_the_conversation_is_a_bad_request(tmp_path, smollm2_dir):
    folder = model_folder(tmp_path / "m", smollm2_dir, TOOL_TEMPLATE, SPECIAL_TOKENS)
    with pytest.raises(BadRequest, match="roles must be system, user or assistant"):
        ChatTemplate(folder).render([{"role": "tool", "content": "42"}])


def test_a_model_without_template_refuses_chat(tmp_path):
    with pytest.raises(BadRequest, match="no chat template"):
        ChatTemplate(tmp_path).render(CONVERSATION)


def test_parse_chat_passes_tools_through():
    body = {"messages": CONVERSATION, "tools": TOOLS}
    assert parse_chat(body).tools == TOOLS
    assert parse_chat({"messages": CONVERSATION}).tools is None
    with pytest.raises(BadRequest, match="tools"):
        parse_chat({"messages": CONVERSATION, "tools": {"name": "get_weather"}})


def test_rendering_does_not_import_torch(smollm2_dir):
    # Web workers render templates; they must stay free of torch (its import alone costs
    # seconds and memory in every worker).
    script = (
        "import sys\n"
        "from lmserve.handlers.tokenizer import ChatTemplate\n"
        f"ChatTemplate({str(smollm2_dir)!r}).render([{{'role': 'user', 'content': 'hi'}}])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, check=True)


# In the manner of Qwen2.5's and Llama 3.1's templates: an assistant's tool calls written out
# with their arguments as JSON, a tool's answer under its call id.
TOOL_CALL_TEMPLATE = """{% for message in messages %}<|{{ message.role }}|>
{%- if message.tool_calls %}{% for call in message.tool_calls %}<call id={{ call.id }}>
{{- {"name": call.function.name, "arguments": call.function.arguments} | tojson }}</call>
{%- endfor %}{% elif message.role == 'tool' %}<result id={{ message.tool_call_id }}>
{{- message.content }}</result>{% else %}{{ message.content }}{% endif %}{{ eos_token }}
{%- endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"""


def test_tool_calls_and_tool_results_render_as_hf(tmp_path, smollm2_dir):
    """An OpenAI conversation with a tool call (arguments as a JSON string, OpenAI's shape)
    renders as HF renders it with the arguments as an object, which templates expect."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}  # fmt: skip
    openai_messages = [
        CONVERSATION[3],
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 °C"},
    ]
    chat = parse_chat({"messages": openai_messages, "tools": TOOLS})
    folder = model_folder(tmp_path / "m", smollm2_dir, TOOL_CALL_TEMPLATE, SPECIAL_TOKENS)
    hf_messages = json.loads(json.dumps(openai_messages))
    hf_messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Zürich"}
    ours = ChatTemplate(folder).render(chat.messages, chat.tools)
    assert ours == hf_render(folder, hf_messages, TOOLS)
    assert '"arguments": {"city": "Zürich"}' in ours and "<result id=call_1>12 °C" in ours


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ({"role": "user", "content": "x", "tool_calls": []}, "messages[0].tool_calls"),
        ({"role": "assistant", "tool_calls": {"id": 1}}, "messages[0].tool_calls"),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
        ({"role": "assistant", "tool_calls": [{"id": "x"}]}, "messages[0].tool_calls[0].function"),
        ({"role": "tool", "content": "1", "tool_call_id": 5}, "messages[0].tool_call_id"),
        ({"role": "assistant", "content": None}, "messages[0].content"),
    ],
)
def test_malformed_tool_messages_name_their_field(message, field):
    with pytest.raises(BadRequest) as error:
        parse_chat({"messages": [message]})
    assert error.value.field == field
