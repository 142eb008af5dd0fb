"""The docs show what the code does: the custom-handler example is the handler the integration
tests serve, the supported-models table is the one the registry writes, the configuration
reference is the settings table's, and every page the README links exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def between(text: str, begin: str, end: str) -> str:
    return text.split(begin, 1)[1].split(end, 1)[0]


def test_custom_handlers_page_shows_the_tested_model_py():
    page = (ROOT / "docs/custom-handlers.md").read_text()
    example = between(page, "```python\n", "```")
    tested = (ROOT / "tests/integration/custom_handler/model.py").read_text()
    assert example == tested


def test_supported_models_table_is_the_registrys():
    from lmserve.rolling_batch.model.architectures import supported_models_table

    page = (ROOT / "docs/models.md").read_text()
    table = between(page, "<!-- supported-models -->\n", "<!-- /supported-models -->")
    assert table == supported_models_table()


def test_configuration_reference_is_the_settings_table():
    from lmserve.properties import reference

    page = (ROOT / "docs/configuration.md").read_text()
    assert between(page, reference.BEGIN, reference.END) == reference.configuration_table()


def test_each_documented_environment_name_sets_its_key():
    """What the reference lists under `environment` is what the loader reads."""
    from lmserve.properties.config import load_config
    from lmserve.properties.reference import environment_names
    from lmserve.properties.settings import INFERRED, SETTINGS

    # A value each key accepts where its default is not one to write down.
    samples = {"engine": "MPI", "option.rolling_batch": "auto", "option.model_id": "/models/x",
               "option.revision": "main", "option.num_kv_blocks": "64",
               "option.max_model_len": "77", "option.entryPoint": "model.py",
               "option.enable_prefix_caching": "true", "option.quantize": "int8",
               "option.speculative_draft_model": "[ngram]", "option.max_cpu_loras": "4",
               "option.step_trace": "/tmp/lmserve-steps.jsonl",
               "option.tool_call_parser": "hermes", "option.reasoning_parser": "qwen3"}  # fmt: skip
    for setting in SETTINGS:
        default = setting.default
        if setting.key in samples:
            value = samples[setting.key]
        else:
            assert default not in (None, INFERRED), setting.key
            value = str(default).lower() if isinstance(default, bool) else str(default)
        for name in environment_names(setting):
            if name == "SAGEMAKER_MAX_PAYLOAD_IN_MB":
                value = "64"
            resolved = load_config(None, {name: value})
            assert resolved.sources[setting.key] == f"env {name}", (setting.key, name)


def test_every_setting_says_what_it_does():
    from lmserve.properties.settings import SETTINGS

    assert [s.key for s in SETTINGS if not s.doc] == []


def test_readme_links_reach_existing_pages_and_stays_a_short_guide():
    readme = (ROOT / "README.md").read_text()
    links = set(re.findall(r"\]\(([^)#]+)\)", readme))
    assert {"docs/configuration.md", "docs/architecture.md"} <= links
    assert [link for link in links if not (ROOT / link).exists()] == []
    assert len(readme.splitlines()) < 200
