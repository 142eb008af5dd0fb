"""The docs show what the code does: the custom-handler example is the handler the integration
tests serve, the supported-models table is the one the registry writes, the configuration
reference is the settings table's, every page the README links exists, and a clone stands
alone: no link leads outside it or to a result no longer kept."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

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
    assert {"docs/configuration.md", "docs/architecture.md", "docs/design.md"} <= links
    assert [link for link in links if not (ROOT / link).exists()] == []
    assert len(readme.splitlines()) < 200


def tracked_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    # A file deleted in the working tree but not yet from the index is not the clone's.
    return [name for name in listed.split("\0") if name and (ROOT / name).is_file()]


def test_no_tracked_file_points_outside_the_repository():
    """A user's clone has no shared folder beside it: the design is docs/design.md."""
    outside = ("../" + "shared/", "shared/" + "DESIGN.md")  # spelled apart: not a hit here
    pointing = []
    for name in tracked_files():
        try:
            text = (ROOT / name).read_text()
        except UnicodeDecodeError:
            continue  # plots
        if any(path in text for path in outside):
            pointing.append(name)
    assert pointing == []


def test_relative_links_in_the_guides_reach_existing_files():
    """README, docs/ and benchmarks/README.md: no link to a page or a result that is gone."""
    pages = [ROOT / "README.md", ROOT / "benchmarks/README.md", *(ROOT / "docs").glob("*.md")]
    broken = []
    for page in pages:
        for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in link and not (page.parent / link).exists():
                broken.append(f"{page.relative_to(ROOT)}: {link}")
    assert broken == []


def test_tracked_benchmark_results_stay_small():
    """benchmarks/results/ keeps the tables and plots the README shows, under 1 MB; raw JSON
    and the other plots are regenerated by the commands in benchmarks/README.md."""
    results = [name for name in tracked_files() if name.startswith("benchmarks/results/")]
    assert sum((ROOT / name).stat().st_size for name in results) < 1_000_000
