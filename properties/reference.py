"""The configuration reference users read (docs/configuration.md), written from the settings
table so that it cannot drift from what the loader accepts: each key, its default, the
environment names that set it, what it accepts (its parser's own words) and what it does.

    python -m lmserve.properties.reference   # prints the table
"""

from __future__ import annotations

import re

from .settings import INFERRED, SETTINGS, EnvAlias, Setting

BEGIN = "<!-- configuration-reference -->\n"
END = "<!-- /configuration-reference -->"


def environment_names(setting: Setting) -> list[str]:
    """The variables that set the key, highest precedence first (properties/config.py)."""
    key = setting.key
    if key == "engine":
        own = "OPTION_ENGINE"
    elif key.startswith("option."):
        own = "OPTION_" + key.removeprefix("option.").upper()
    else:  # server keys: SERVING_ and the key in capitals, minWorkers as MIN_WORKERS
        own = "SERVING_" + re.sub(r"(?<!^)(?=[A-Z])", "_", key).upper()
    aliases = [a.name if isinstance(a, EnvAlias) else a for a in setting.env_aliases]
    return [own, *aliases]


def accepted(setting: Setting) -> str:
    """What the key's parser accepts, as its refusal says it."""
    try:
        setting.parse("\x00 not a value \x00")
    except ValueError as refusal:
        return str(refusal)
    return "text"


def default_text(setting: Setting) -> str:
    default = setting.default
    if default is INFERRED:
        return "inferred"
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return str(default).lower()
    return str(default)


def configuration_table() -> str:
    rows = [
        "| key | default | environment | accepts | what it does |",
        "|---|---|---|---|---|",
    ]
    for setting in SETTINGS:
        names = ", ".join(f"`{name}`" for name in environment_names(setting))
        cells = [
            f"`{setting.key}`",
            default_text(setting),
            names,
            accepted(setting).replace("|", "\\|"),
            setting.doc.replace("|", "\\|"),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(configuration_table(), end="")
