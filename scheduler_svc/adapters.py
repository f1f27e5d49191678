"""The LoRA adapters of one worker group, as its scheduler tracks them: which ones requests may run under, which of
them sit in the worker's slots, and the loads and unloads asked for while serving. All reach the worker as plan
deltas (StepPlan.load_loras, unload_loras, lora_slots) like everything else it does.

The worker holds up to `capacity` adapters in host memory (DescribeResponse.max_cpu_loras) and copies one into a
slot (max_loras) when the scheduler places it there: a sequence runs under an adapter in a slot, so a step runs
under at most as many adapters as there are slots, and more may be served. A sequence is admitted once its adapter
has a slot: a free one, else the least recently used one that no running sequence needs (`place`); a sequence
whose adapter finds none waits, and so do the adapter sequences behind it, so that a stream of requests under
the placed adapters cannot starve another adapter's. An adapter moved out of a slot keeps its cached KV: its
weights are the same when it comes back.

A load is planned at once; requests may run under it once the worker answered that step (a failed load comes back
in StepResult.failed_loras). An unload stops new requests under the adapter at once, and is planned once no sequence
of the group runs or waits under it (the worker drops finished sequences before the plan's unloads); the scheduler
then forgets the cached blocks no sequence holds (BlockManager.forget_free), among them all the adapter's, since a
later load under the name may bring other weights. Each request ends in one AdapterOutcome, taken by whoever drives
the group (the engine answers its asker)."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


class AdapterError(ValueError):
    """A load or unload refused at once; `code` names its gRPC status."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class AdapterOutcome:
    name: str
    ticket: object   # the asker's, handed back
    error: str = ""  # empty: done
    code: str = ""   # the error's gRPC status name


@dataclass(slots=True)
class _Op:
    name: str
    path: str        # empty: an unload
    ticket: object


class Adapters:
    def __init__(self, served: list[str], slots: list[str], capacity: int = 0):
        """served: the adapters the worker holds (DescribeResponse.lora_adapters); slots: the adapter in each of its
        slots, "" where free (lora_slots); capacity: how many it may hold (max_cpu_loras; 0: as many as slots)."""
        self.served = list(served)  # requests may run under these
        self.slots = list(slots)    # as the plans so far leave them
        self.capacity = max(capacity, len(slots))
        self.num_placements = 0     # adapters copied into a slot for a sequence
        self._used: dict[str, int] = {}  # adapter -> the last step that admitted a sequence under it
        self._placing: list[tuple[int, str]] = []  # this plan's
        self._waiting: list[_Op] = []  # not planned yet
        self._planned: deque[tuple[int, list[_Op]]] = deque()  # (step, its loads and unloads), oldest first
        self.outcomes: list[AdapterOutcome] = []

    @property
    def pending(self) -> bool:
        """A load or unload is waiting for a plan or for its step's result, or a placement for its plan."""
        return bool(self._waiting or self._planned or self._placing)

    def _busy(self, name: str) -> bool:
        return any(op.name == name for op in self._waiting) or any(
            op.name == name for _, ops in self._planned for op in ops)

    def load(self, name: str, path: str, ticket: object = None) -> None:
        """Asks for the adapter at path (a folder on the worker's file system) under name. AdapterError:
        FAILED_PRECONDITION where the worker has no slots, ALREADY_EXISTS where the name is served or busy,
        RESOURCE_EXHAUSTED where the worker holds all it may."""
        if not self.slots:
            raise AdapterError("FAILED_PRECONDITION", "the worker has no LoRA slots (its --max-loras)")
        if name in self.served or self._busy(name):
            raise AdapterError("ALREADY_EXISTS", f"LoRA adapter {name!r} is loaded already (or being loaded or "
                                                 "unloaded)")
        held = len(self.served) + len(self._waiting) + sum(
            1 for _, ops in self._planned for op in ops if op.path)
        if held >= self.capacity:
            raise AdapterError("RESOURCE_EXHAUSTED", f"the worker holds {self.capacity} LoRA adapters (its "
                                                     "--max-cpu-loras): unload one first")
        self._waiting.append(_Op(name, path, ticket))

    def unload(self, name: str, ticket: object = None) -> None:
        """Stops new requests under the adapter; it is dropped once none runs under it. AdapterError NOT_FOUND
        where it is not served."""
        if name not in self.served:
            raise AdapterError("NOT_FOUND", f"LoRA adapter {name!r} is not loaded")
        self.served.remove(name)
        self._waiting.append(_Op(name, "", ticket))

    def place(self, name: str, step: int, needed: Callable[[], set[str]]) -> bool:
        """Whether the adapter has a slot in `step`'s plan for a sequence about to be admitted under it: the one it
        is in, a free one, or the least recently used one of an adapter no running sequence needs (`needed()`:
        the adapters of the running sequences, those admitted into this plan among them)."""
        self._used[name] = step
        if name in self.slots:
            return True
        if "" in self.slots:
            slot = self.slots.index("")
        else:
            busy = needed()
            idle = [i for i, held in enumerate(self.slots) if held not in busy]
            if not idle:
                return False
            slot = min(idle, key=lambda i: self._used.get(self.slots[i], -1))
        self.slots[slot] = name
        self._placing.append((slot, name))
        self.num_placements += 1
        return True

    def update(self, name: str, path: str, ticket: object = None) -> None:
        """load(name, path), or unload(name) where path is "": how the tree's messages carry both."""
        if path:
            self.load(name, path, ticket)
        else:
            self.unload(name, ticket)

    def take(self, step: int, holds: Callable[[str], bool]) -> tuple[list[str], list[tuple[str, str]],
                                                                    list[tuple[int, str]]]:
        """The plan of `step`'s unloads (those no sequence holds: `holds(name)`), loads and placements."""
        placing, self._placing = self._placing, []
        ops = [op for op in self._waiting if op.path or not holds(op.name)]
        if not ops:
            return [], [], placing
        self._waiting = [op for op in self._waiting if op not in ops]
        self._planned.append((step, ops))
        unloads = [op.name for op in ops if not op.path]
        for name in unloads:
            if name in self.slots:
                self.slots[self.slots.index(name)] = ""
            self._used.pop(name, None)
        return unloads, [(op.name, op.path) for op in ops if op.path], placing

    def answered(self, step: int, failed: dict[str, str]) -> None:
        """The worker answered `step`: its loads serve unless `failed` names them (with why)."""
        if not self._planned or self._planned[0][0] != step:
            return
        for op in self._planned.popleft()[1]:
            error = failed.get(op.name, "") if op.path else ""
            if op.path and not error:
                self.served.append(op.name)
            self.outcomes.append(AdapterOutcome(op.name, op.ticket, error, "INVALID_ARGUMENT" if error else ""))

    def take_outcomes(self) -> list[AdapterOutcome]:
        outcomes, self.outcomes = self.outcomes, []
        return outcomes
