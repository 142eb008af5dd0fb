"""Runs a command (the image build) with this machine's pip configuration made usable inside it.

    python3 pip_passthrough.py WORK -- docker build --network host \
        --secret id=pip.conf,src=WORK/pip.conf --secret id=pip-cert.pem,src=WORK/pip-cert.pem ...

The configuration is read now, as `pip config list` reports it (files and PIP_* variables, the
later overriding the earlier, as pip itself applies them), and written to WORK/pip.conf for the
build's RUN steps to mount as a secret: nothing of it lands in a layer, a build argument or the
image's history. Local places it names are translated, since the build sees none of this
machine's files:

- `file:` URLs and absolute paths (indexes, find-links folders, constraint files) are served over
  HTTP on 127.0.0.1 for as long as the command runs (the build shares the host's network), at the
  same path: file:///opt/pypi/simple -> http://127.0.0.1:PORT/opt/pypi/simple/. An index's
  parent folder is served too, where PEP 503 pages usually link their files (../../files/...).
- `cert` (a CA bundle, e.g. a TLS-intercepting proxy's) is copied to WORK/pip-cert.pem, the
  second secret, and named by the path the build mounts it at.
- Options that name a place on this machine to write to (cache-dir, log, target, ...) are left
  out: inside the build they would write into a layer.

Everything else (index URLs on the network, timeouts, trusted hosts) passes unchanged. Standard
library only: it runs before any environment exists.
"""

from __future__ import annotations

import ast
import configparser
import functools
import http.server
import re
import shutil
import subprocess
import sys
import threading
import urllib.parse
import urllib.request
from pathlib import Path

# Where the Dockerfile's RUN steps mount the two secrets (--mount=type=secret,id=...).
SECRETS = Path("/run/secrets")
CONFIG_NAME = "pip.conf"
CERT_NAME = "pip-cert.pem"

# Options whose values are places to fetch from: translated when local.
LOCATIONS = {"index-url", "extra-index-url", "find-links", "constraint", "requirement"}
INDEXES = {"index-url", "extra-index-url"}
# Places on this machine to write to: never into the build.
DROPPED = {"cache-dir", "log", "log-file", "target", "prefix", "root", "src", "report", "user"}
_LINE = re.compile(r"^(?P<section>[^.]*)\.(?P<option>[^=]+)=(?P<value>.*)$")


def pip_config(python: str = sys.executable) -> dict[str, dict[str, str]]:
    """section -> option -> value, as pip applies them: PIP_* variables (`:env:`) win over every
    file and every section."""
    listing = subprocess.run(
        [python, "-m", "pip", "config", "list"], check=True, capture_output=True, text=True
    ).stdout
    return parse_config_list(listing)


def parse_config_list(listing: str) -> dict[str, dict[str, str]]:
    config: dict[str, dict[str, str]] = {}
    from_env: dict[str, str] = {}
    for line in listing.splitlines():
        match = _LINE.match(line.strip())
        if match is None:
            continue
        section, option = match["section"], match["option"]
        value = ast.literal_eval(match["value"])  # pip prints repr(value)
        if section == ":env:":
            from_env[option] = value
        else:
            config.setdefault(section, {})[option] = value
    for option, value in from_env.items():
        for options in config.values():
            options.pop(option, None)
        config.setdefault("global", {})[option] = value
    return config


def local_path(value: str) -> Path | None:
    """The file or folder `value` names on this machine, or None when it is not local."""
    if value.startswith("file:"):
        return Path(urllib.request.url2pathname(urllib.parse.urlparse(value).path))
    if value.startswith("/"):
        return Path(value)
    return None


class Translation:
    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.served: set[Path] = set()  # folders and files the HTTP server exposes
        self.notes: list[str] = []

    def config(self, config: dict[str, dict[str, str]], base_url: str) -> configparser.ConfigParser:
        out = configparser.ConfigParser(interpolation=None)
        for section, options in config.items():
            out.add_section(section)
            for option, value in options.items():
                translated = self.option(option, value, base_url)
                if translated is not None:
                    out[section][option] = translated
        return out

    def option(self, option: str, value: str, base_url: str) -> str | None:
        if option in DROPPED:
            self.notes.append(f"left out: {option} (a place on this machine)")
            return None
        if option == "client-cert":
            raise SystemExit("pip's client-cert cannot be passed into the build")
        if option == "cert":
            shutil.copyfile(value, self.workdir / CERT_NAME)
            return str(SECRETS / CERT_NAME)
        if option not in LOCATIONS:
            return value
        return " ".join(self.location(option, item, base_url) for item in value.split())

    def location(self, option: str, value: str, base_url: str) -> str:
        path = local_path(value)
        if path is None:
            return value
        path = path.resolve()
        self.served.add(path.parent if option in INDEXES else path)
        url = base_url + urllib.parse.quote(str(path))
        return url + "/" if path.is_dir() else url


def serve_tree(root: Path, served: set[Path]) -> None:
    """Links each served place into `root` at its own absolute path; a place inside another
    served one needs no link of its own."""
    for place in sorted(served, key=lambda p: len(p.parts)):
        if any(place.is_relative_to(other) for other in served if other != place):
            continue
        link = root / place.relative_to("/")
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(place)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's name)
        pass


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") != 1:
        raise SystemExit(__doc__)
    workdir, command = Path(argv[0]), argv[2:]
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / CERT_NAME).write_bytes(b"")  # the secret exists even when no cert is set
    tree = workdir / "served"
    tree.mkdir(exist_ok=True)
    handler = functools.partial(_QuietHandler, directory=str(tree))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    translation = Translation(workdir)
    config = translation.config(pip_config(), f"http://127.0.0.1:{server.server_port}")
    serve_tree(tree, translation.served)
    with open(workdir / CONFIG_NAME, "w") as file:
        config.write(file)
    for note in translation.notes:
        print(f"pip_passthrough: {note}", file=sys.stderr)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        return subprocess.run(command).returncode
    finally:
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
