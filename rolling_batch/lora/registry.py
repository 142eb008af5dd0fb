"""The record of the LoRA adapters an engine serves, for admission and the adapter management
API: `ServedAdapters`, shared by both engines (names, statuses, messages), and rank 0's
`AdapterRegistry` for the rolling batch.

Registering reads the adapter first (what cannot be served is refused then, by name). In the
rolling batch rank 0 then tells every other rank where it is, ahead of any step that uses it.
Unregistering stops new requests for the adapter at once; the engine drops it when no request
uses it anymore, so requests already queued or running finish with it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ..ipc import protocol
from .adapters import AdapterError

if TYPE_CHECKING:  # engine=Python imports this module without the rolling batch's layers
    from .manager import LoraManager

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class ServedAdapters:
    """The served adapters' names (a collection: `name in adapters`), and where each came
    from. How an adapter is loaded and dropped is the engine's: `_load` and `_drop`."""

    def __init__(self, srcs: dict[str, str]):
        self.srcs = dict(srcs)
        self.retiring: set[str] = set()  # unregistered, still used by requests

    def __contains__(self, name: object) -> bool:
        return name in self.srcs and name not in self.retiring

    def __iter__(self) -> Iterator[str]:
        return (name for name in self.srcs if name not in self.retiring)

    def __len__(self) -> int:
        return len(self.srcs) - len(self.retiring)

    def describe(self, name: str) -> dict[str, str]:
        return {"name": name, "src": self.srcs[name]}

    def register(self, name: str, path: str, src: str) -> None:
        """Raises AdapterError (the adapter cannot be served) or KeyError (the name is taken)."""
        if not _NAME.match(name):
            raise AdapterError(name, "a name is 1-128 letters, digits, '.', '_' or '-'")
        if name in self.srcs:
            raise KeyError(f"adapter {name!r} is already registered; unregister it first")
        self._load(name, Path(path))
        self.srcs[name] = src

    def unregister(self, name: str, in_use: set[str]) -> None:
        self.retiring.add(name)
        self.retire_unused(in_use)

    def retire_unused(self, in_use: set[str]) -> None:
        """Drops the unregistered adapters no request uses anymore."""
        gone = self.retiring - in_use
        if not gone:
            return
        for name in gone:
            del self.srcs[name]
        self.retiring -= gone
        self._drop(gone)

    def answer(self, command: protocol.AdapterCommand, in_use: set[str]) -> protocol.Event:
        """The engine's answer to a management command; `in_use`: the adapters of the requests
        queued or running."""
        name = command.name or ""
        if command.action == "list":
            return protocol.AdaptersEvent(command.id, [self.describe(n) for n in self])
        if command.action == "register":
            try:
                self.register(name, command.path or "", command.src or command.path or "")
            except AdapterError as error:
                return protocol.ErrorEvent(command.id, 400, str(error))
            except KeyError as error:
                return protocol.ErrorEvent(command.id, 409, error.args[0])
            return protocol.AdaptersEvent(command.id, [self.describe(name)])
        if command.action == "unregister":
            if name not in self:
                return protocol.ErrorEvent(command.id, 404, f"no LoRA adapter named {name!r}")
            described = self.describe(name)
            self.unregister(name, in_use)
            return protocol.AdaptersEvent(command.id, [described])
        return protocol.ErrorEvent(command.id, 400, f"unknown adapter action {command.action!r}")

    def _load(self, name: str, folder: Path) -> None:
        """Makes the adapter in `folder` servable as `name`, or raises AdapterError and changes
        nothing."""
        raise NotImplementedError

    def _drop(self, names: set[str]) -> None:
        """Forgets the adapters `names` (no request uses them)."""
        raise NotImplementedError


class AdapterRegistry(ServedAdapters):
    """Rank 0's: every rank knows the same adapters, each reading them itself."""

    def __init__(
        self,
        lora: LoraManager,
        share: Callable[[dict[str, str]], None],
        forget_cached: Callable[[str], None] = lambda name: None,
    ):
        super().__init__({name: str(path) for name, path in lora.sources.items()})
        self.lora = lora
        self.share = share  # sends the ranks the new {name: folder} of every adapter
        # Drops the prefix cache's blocks computed through an adapter that is gone: a new
        # adapter under its name never meets them (their root holds its weights' digest too).
        self.forget_cached = forget_cached

    def _load(self, name: str, folder: Path) -> None:
        self.lora.add(name, folder)
        self.share(self._folders())

    def _drop(self, names: set[str]) -> None:
        self.lora.set_sources({n: f for n, f in self._folders().items() if n not in names})
        self.share(self._folders())
        for name in names:
            self.forget_cached(name)

    def _folders(self) -> dict[str, str]:
        return {name: str(path) for name, path in self.lora.sources.items()}


def lora_off_answer(command: protocol.AdapterCommand) -> protocol.Event:
    """What an engine without LoRA answers the management API: no adapters, none taken."""
    if command.action == "list":
        return protocol.AdaptersEvent(command.id, [])
    message = "LoRA adapters are off for this model (option.enable_lora=false)"
    return protocol.ErrorEvent(command.id, 400, message)
