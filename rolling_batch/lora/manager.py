"""One rank's LoRA adapters: which are known (name -> folder), which are loaded in memory (at
most option.max_cpu_loras, least recently used dropped first and read again when asked for),
and which sit in the linears' slots (layers/lora.py) for the step at hand.

Every rank runs the same steps and so makes the same choices; each reads the adapters itself and
keeps its own shard in the slots. The scheduler on rank 0 keeps a step's adapters within
option.max_loras, so they always fit the slots.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

import torch

from ..core.step import SequenceChunk
from ..model.layers.lora import LoraStep
from .adapters import LoraAdapter, linear_shapes, load_adapter

log = logging.getLogger(__name__)


class LoraManager:
    def __init__(
        self,
        model,
        hf_config,
        sources: dict[str, Path],
        max_loras: int,
        max_rank: int,
        max_cpu_loras: int,
        dtype: torch.dtype,
    ):
        self.step = LoraStep()
        self.targets = model.enable_lora(max_loras, max_rank, self.step)
        self.shapes = linear_shapes(hf_config)
        self.sources = dict(sources)
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.dtype = dtype
        self.slots: list[str | None] = [None] * max_loras
        self.loaded: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        # The digest of each adapter's weights as last read: what a slot holds, or the loaded
        # copy (an adapter is read again only when it is in neither).
        self._digests: dict[str, str] = {}
        self._linears = list({id(lora): lora for lora, _ in self.targets.values()}.values())

    @property
    def slot_bytes(self) -> int:
        return sum(lora.num_bytes for lora in self._linears)

    @property
    def cache_bytes(self) -> int:
        """The most the loaded adapters may take: max_cpu_loras adapters of the largest rank
        on every linear."""
        per_rank = sum(out + inp for out, inp in self.shapes.values()) * self.dtype.itemsize
        return self.max_cpu_loras * self.max_rank * per_rank

    def load_all(self) -> None:
        """Reads every known adapter once (the last max_cpu_loras read stay loaded): an
        adapter lmserve cannot serve fails here, at start, with its name and the reason."""
        for name in self.sources:
            self.adapter(name)

    def add(self, name: str, folder: Path) -> None:
        """A new adapter, read now: one that cannot be served raises AdapterError and stays
        unknown."""
        self.sources[name] = folder
        try:
            self.adapter(name)
        except Exception:
            del self.sources[name]
            raise

    def weights_digest(self, name: str) -> str | None:
        """The digest of the weights a step would run `name` with now; None when the step
        would read them first (they may have changed on disk)."""
        if name in self.loaded or name in self.slots:
            return self._digests[name]
        return None

    def set_sources(self, sources: dict[str, str]) -> None:
        """The adapters known from now on (another rank registered or dropped some): those that
        left are dropped from memory and from the slots."""
        self.sources = {name: Path(folder) for name, folder in sources.items()}
        for name in [name for name in self.loaded if name not in self.sources]:
            del self.loaded[name]
        self.slots = [held if held in self.sources else None for held in self.slots]
        self._digests = {name: d for name, d in self._digests.items() if name in self.sources}

    def adapter(self, name: str) -> LoraAdapter:
        adapter = self.loaded.get(name)
        if adapter is not None:
            self.loaded.move_to_end(name)
            return adapter
        if name not in self.sources:
            raise KeyError(f"no adapter named {name!r}")
        adapter = load_adapter(name, self.sources[name], self.max_rank, self.shapes, self.dtype)
        if len(self.loaded) >= self.max_cpu_loras:
            dropped, _ = self.loaded.popitem(last=False)
            log.info("LoRA adapter %s unloaded (max_cpu_loras=%d)", dropped, self.max_cpu_loras)
        self.loaded[name] = adapter
        self._digests[name] = adapter.digest
        log.info(
            "LoRA adapter %s loaded: rank %d on %d linears, %.1f MiB",
            name,
            adapter.rank,
            len(adapter.modules),
            adapter.num_bytes / 2**20,
        )
        return adapter

    def prepare(self, chunks: list[SequenceChunk]) -> None:
        """Puts the step's adapters in slots and lists the segments of consecutive tokens of
        one adapter for every LoRA linear (LoraStep; none when no chunk names an adapter)."""
        step = self.step
        step.slots, step.token_starts, step.lengths = [], [], []
        names = list(dict.fromkeys(chunk.adapter for chunk in chunks if chunk.adapter))
        if not names:
            return
        slot_of = self._place(names)
        first, previous = 0, None
        for chunk in chunks:
            length = len(chunk.token_ids)
            if chunk.adapter and chunk.adapter == previous:
                step.lengths[-1] += length  # the chunk before had this adapter: one segment
            elif chunk.adapter:
                step.slots.append(slot_of[chunk.adapter])
                step.token_starts.append(first)
                step.lengths.append(length)
            previous = chunk.adapter
            first += length

    def _place(self, names: list[str]) -> dict[str, int]:
        """{adapter: slot} for this step's adapters: those already in a slot stay; the others
        take the free slots (or those of adapters this step does not use), lowest first."""
        if len(names) > len(self.slots):
            raise ValueError(f"{len(names)} adapters in one step; max_loras={len(self.slots)}")
        placed = {name: self.slots.index(name) for name in names if name in self.slots}
        # Empty slots first: an adapter another running request uses keeps its slot if it can.
        free = sorted(
            (slot for slot, held in enumerate(self.slots) if held not in placed),
            key=lambda slot: (self.slots[slot] is not None, slot),
        )
        for name in names:
            if name not in placed:
                placed[name] = slot = free.pop(0)
                self._install(slot, name)
        return placed

    def _install(self, slot: int, name: str) -> None:
        self.slots[slot] = None  # emptied first: a read that fails leaves no name on it
        adapter = self.adapter(name)
        for lora in self._linears:
            lora.clear(slot)
        for module, (a, b) in adapter.modules.items():
            lora, projection = self.targets[module]
            lora.load(slot, projection, a, b)
        self.slots[slot] = name
