"""The LoRA adapters of one worker group, as its scheduler tracks them: which ones requests may run under, and the
loads and unloads asked for while serving, which reach the worker as plan deltas (StepPlan.load_loras,
unload_loras) like everything else it does.

An adapter takes one of the worker's slots (DescribeResponse.max_loras) from its load's request until its unload
is planned. A load is planned at once; requests may run under it once the worker answered that step (a failed load
comes back in StepResult.failed_loras). An unload stops new requests under the adapter at once, and is planned once
no sequence of the group runs or waits under it (the worker drops finished sequences before the plan's unloads); the
scheduler then forgets the cached blocks no sequence holds (BlockManager.forget_free), among them all the adapter's.
Each request ends in one AdapterOutcome, taken by whoever drives the group (the engine answers its asker)."""
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
    def __init__(self, served: list[str], slots: int):
        """served: the adapters the worker holds (DescribeResponse.lora_adapters), in slots of `slots`."""
        self.served = list(served)  # requests may run under these
        self.slots = slots
        self._waiting: list[_Op] = []  # not planned yet
        self._planned: deque[tuple[int, list[_Op]]] = deque()  # (step, its loads and unloads), oldest first
        self.outcomes: list[AdapterOutcome] = []

    @property
    def pending(self) -> bool:
        """A load or unload is waiting for a plan or for its step's result."""
        return bool(self._waiting or self._planned)

    def _busy(self, name: str) -> bool:
        return any(op.name == name for op in self._waiting) or any(
            op.name == name for _, ops in self._planned for op in ops)

    def load(self, name: str, path: str, ticket: object = None) -> None:
        """Asks for the adapter at path (a folder on the worker's file system) under name. AdapterError:
        FAILED_PRECONDITION where the worker has no slots, ALREADY_EXISTS where the name is served or busy,
        RESOURCE_EXHAUSTED where every slot is taken."""
        if not self.slots:
            raise AdapterError("FAILED_PRECONDITION", "the worker has no LoRA slots (its --max-loras)")
        if name in self.served or self._busy(name):
            raise AdapterError("ALREADY_EXISTS", f"LoRA adapter {name!r} is loaded already (or being loaded or "
                                                 "unloaded)")
        taken = len(self.served) + len(self._waiting) + sum(
            1 for _, ops in self._planned for op in ops if op.path)
        if taken >= self.slots:
            raise AdapterError("RESOURCE_EXHAUSTED", f"every LoRA slot of the worker ({self.slots}, its --max-loras) "
                                                     "holds an adapter: unload one first")
        self._waiting.append(_Op(name, path, ticket))

    def unload(self, name: str, ticket: object = None) -> None:
        """Stops new requests under the adapter; it is dropped once none runs under it. AdapterError NOT_FOUND
        where it is not served."""
        if name not in self.served:
            raise AdapterError("NOT_FOUND", f"LoRA adapter {name!r} is not loaded")
        self.served.remove(name)
        self._waiting.append(_Op(name, "", ticket))

    def update(self, name: str, path: str, ticket: object = None) -> None:
        """load(name, path), or unload(name) where path is "": how the tree's messages carry both."""
        if path:
            self.load(name, path, ticket)
        else:
            self.unload(name, ticket)

    def take(self, step: int, holds: Callable[[str], bool]) -> tuple[list[str], list[tuple[str, str]]]:
        """The plan of `step`'s unloads (those no sequence holds: `holds(name)`) and loads, as planned."""
        ops = [op for op in self._waiting if op.path or not holds(op.name)]
        if not ops:
            return [], []
        self._waiting = [op for op in self._waiting if op not in ops]
        self._planned.append((step, ops))
        return [op.name for op in ops if not op.path], [(op.name, op.path) for op in ops if op.path]

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
