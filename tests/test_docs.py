"""The README's custom-handler example is the handler the integration tests serve; its table
of supported models is the one the registry writes."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_shows_the_tested_model_py():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Custom handlers", 1)[1]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    tested = (ROOT / "tests/integration/custom_handler/model.py").read_text()
    assert example == tested


def test_readme_supported_models_table_is_the_registrys():
    from lmserve.rolling_batch.architectures import supported_models_table

    readme = (ROOT / "README.md").read_text()
    table = readme.split("<!-- supported-models -->\n", 1)[1].split("<!-- /supported-models -->")[0]
    assert table == supported_models_table()
