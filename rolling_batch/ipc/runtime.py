"""What `lmserve serve` hands to the processes it starts: one JSON file in the private IPC
directory (config, resolved model, socket paths) and the engine's state file beside it."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from lmserve.properties.config import ServingConfig

from .protocol import ENGINE_SOCKET, STATE_FILE, EngineState

RUNTIME_FILE = "runtime.json"


@dataclass(frozen=True)
class Runtime:
    config: ServingConfig
    model_name: str
    model_path: str  # a local HF directory; with a user's handler, the model dir as it is
    model_source: str  # where it came from, for logs and /models
    ipc_dir: str
    # The user's handler (engine=Python): a .py file's path or a dotted module name; None when
    # lmserve's LLM handler serves.
    entry_point: str | None = None
    # A model.py (or entryPoint) without handle(): its formatters wrap the LLM handler.
    formatters: str | None = None
    user_dir: str | None = None  # the model dir the user's code lives in (on its sys.path)
    adapters_dir: str | None = None  # where the LoRA adapters are (option.enable_lora)
    # engine=MPI over several hosts: [address, ranks] each, the leader (this machine) first.
    hosts: list[list] | None = None

    @property
    def engine_address(self) -> str:
        return f"ipc://{Path(self.ipc_dir) / ENGINE_SOCKET}"

    @property
    def state_path(self) -> Path:
        return Path(self.ipc_dir) / STATE_FILE

    def write(self) -> Path:
        path = Path(self.ipc_dir) / RUNTIME_FILE
        write_atomically(path, self.to_json())
        return path

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "config": self.config.to_dict()})

    @classmethod
    def read(cls, path: str | os.PathLike) -> Runtime:
        """From the file at `path`, or from `path` itself when it is the JSON (ranks on other
        hosts, which do not see the leader's files, get it so)."""
        text = str(path)
        payload = json.loads(text if text.startswith("{") else Path(path).read_text())
        payload["config"] = ServingConfig.from_dict(payload["config"])
        return cls(**payload)


def write_state(runtime: Runtime, state: EngineState, reason: str = "", **details) -> None:
    record = {"state": state, "reason": reason, "since": time.time(), **details}
    write_atomically(runtime.state_path, json.dumps(record))


def read_state(runtime: Runtime) -> dict:
    try:
        return json.loads(runtime.state_path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {"state": EngineState.LOADING, "reason": "engine starting"}


def write_atomically(path: Path, text: str) -> None:
    # Readers poll these files; a rename never shows them a half-written one.
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
